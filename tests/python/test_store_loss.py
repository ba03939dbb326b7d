"""Proves that a shared store that lost its state admits nothing until the writes it was
keeping in flight can no longer commit (G3 at its bounds, docs/design.md section 6, "A store
that lost its state").

Replica A has handed token 5's body over to the upstream, which commits it at D minus 50 ms
after it arrived (the bound of fencegate's one timing assumption). Redis then loses everything,
A's registration with it: a `FLUSHALL`, or a restart without its data. Replica B, which wrote on
the same slot before (so it knew the store's epoch mark), writes token 6 on another object of
the same resource and retries while refused. The bound: B's write may be admitted only once
A's registration would have expired, so

    commit(token 5) <= arrival + D - 50 ms < admission(token 6),

and in moto's commit order no token-5 write comes after a token-6 write.
"""

from __future__ import annotations

import subprocess
import threading
import time

import pytest
from botocore.exceptions import ClientError

from fencegate_testlib import bin_path, code_of, metric_samples, signed_raw_request, status_of, unique
from holding_upstream import HELD_PREFIX, HoldingUpstream
from test_bounds import COMMIT_AFTER_S, D_MS, committed, start_replica

QUIET_S = D_MS * 11 / 8 / 1000  # a registration's time to live: how long nothing is admitted


def lose_everything(redis_server, how: str, replica):
    if how in ("flushall", "flushall_then_init_store"):
        assert redis_server.command(b"FLUSHALL").startswith(b"+OK")
        if how == "flushall_then_init_store":
            # The operator's mistake: the store is marked anew after the loss. The replicas knew
            # another mark: the quiet period starts all the same.
            subprocess.run([str(bin_path()), "init-store", "--config", str(replica.config_path)], check=True,
                           capture_output=True, timeout=60)
        return
    redis_server.kill9()  # and it comes back without its append-only file
    for path in redis_server.dir.iterdir():
        if path.name.startswith(("appendonly", "dump")):
            if path.is_dir():
                for f in path.iterdir():
                    f.unlink()
                path.rmdir()
            else:
                path.unlink()
    redis_server.start()


@pytest.mark.parametrize("how", ["flushall", "restart_empty", "flushall_then_init_store"])
def test_a_store_that_lost_its_state_admits_nothing_until_older_writes_are_settled(
        fencegate, redis_server, moto_server, how):
    up = HoldingUpstream(moto_server.url).start()
    try:
        bucket = unique("loss")
        moto_server.client().create_bucket(Bucket=bucket)
        a = start_replica(fencegate, redis_server.url, up, moto_server, bucket, "a")
        b = start_replica(fencegate, redis_server.url, up, moto_server, bucket, "b")
        b.client(token=4).put_object(Bucket=bucket, Key=f"{HELD_PREFIX}c", Body=b"four")

        hold = up.hold_next("PUT", f"/{bucket}/{HELD_PREFIX}a", commit_after_s=COMMIT_AFTER_S)
        result: dict = {}

        def five():
            result["five"] = signed_raw_request(a, "PUT", f"/{bucket}/{HELD_PREFIX}a", {"Fencing-Token": "5"},
                                                b"A's data", timeout=D_MS / 1000 + 15)


        t = threading.Thread(target=five, daemon=True)
        t.start()
        assert hold.wait_arrived(10), "token 5's body never reached the upstream"
        arrived = time.monotonic()
        lose_everything(redis_server, how, b)

        client = b.client(token=6, read_timeout=30)
        refusals = []
        deadline = time.monotonic() + 3 * D_MS / 1000 + 10
        while True:
            assert time.monotonic() < deadline, f"token 6 never admitted: {refusals[-3:]}"
            try:
                client.put_object(Bucket=bucket, Key=f"{HELD_PREFIX}b", Body=b"B's data")
                admitted = time.monotonic()
                break
            except ClientError as exc:
                refusals.append((status_of(exc), code_of(exc)))
                retry_after = int(exc.response["ResponseMetadata"]["HTTPHeaders"].get("retry-after", "0"))
                assert 1 <= retry_after <= -(-QUIET_S // 1), f"Retry-After {retry_after} s: not the quiet period's"
                assert (status_of(exc), code_of(exc)) == (503, "FenceStoreUnavailable"), refusals
            time.sleep(0.05)
        t.join(timeout=20)

        order = committed(up, bucket)
        assert [tok for _, _, tok in order] == [4, 5, 6], order
        assert admitted - arrived > COMMIT_AFTER_S, (admitted - arrived, refusals)
        assert refusals, "token 6 was admitted at once after the store lost its state"
        lost = sum(v for (name, _), v in metric_samples(b).items() if name == "fencegate_store_state_lost_total")
        assert lost >= 1, "the replica did not report the lost state"
    finally:
        up.close()
