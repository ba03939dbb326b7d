"""Proves the Redis fence store: fences shared by replicas, G3 across replicas, and G5 (fail closed) when Redis is down."""

from __future__ import annotations

import threading
import time

import pytest
from botocore.exceptions import ClientError

from fencegate_testlib import (
    code_of,
    header_of,
    merge,
    read_object,
    status_of,
    unique,
    wait_until,
)
from holding_upstream import HELD_PREFIX, HELD_RESOURCE
from test_race import assert_holds_new, run_race

# `redis_server` (conftest.py): a redis-server of the test's own, fsync-always, restartable.


def redis_store(redis_server) -> dict:
    return {"store": {"kind": "redis", "url": redis_server.url, "path": None}}


def with_redis(fencegate, redis_server, **kw):
    config = merge(redis_store(redis_server), kw.pop("config", {}))
    return fencegate(config=config, **kw)


def assert_stale(exc_info, current: int):
    exc = exc_info.value
    assert status_of(exc) == 409, exc.response
    assert code_of(exc) == "FencingTokenStale", exc.response
    assert header_of(exc, "Fencing-Token-Current") == str(current), exc.response


def local_with_redis(fencegate, redis_server, bucket):
    """Local upstream + Redis store: a shared store wants a bucket to probe at start-up."""
    return with_redis(
        fencegate, redis_server, local_buckets=(bucket,),
        config={"upstream": {"probe_bucket": bucket}},
    )


@pytest.mark.parametrize("setting", [("--appendonly", "no"), ("--appendfsync", "everysec")])
def test_a_redis_that_can_lose_an_answered_change_is_refused_unless_accepted(tmp_path, fencegate, setting):
    """Redis at its package's defaults (`appendonly no`), or with `appendfsync everysec`: fencegate
    refuses to start, naming the setting; `store.accept_unsynced_changes = true` starts it with a
    `risk:` line in the log and in check-config. Before: it started silently, and a Redis restarted
    from its snapshot let a newer token commit before an older write still in flight."""
    import subprocess

    from fencegate_testlib import RedisServer, base_config, bin_path, seed_local_buckets, to_toml

    d = tmp_path / "redis-defaults"
    d.mkdir()
    redis = RedisServer(d).start(*setting)
    try:
        config = merge(base_config(tmp_path), {"store": {"kind": "redis", "url": redis.url, "path": None},
                                               "upstream": {"probe_bucket": "probe"}})
        seed_local_buckets(tmp_path / "objects", ["probe"])  # nothing else to refuse
        path = tmp_path / "refused.toml"
        path.write_text(to_toml(config))
        out = subprocess.run([str(bin_path()), "serve", "--config", str(path)], capture_output=True, text=True,
                             timeout=30)
        assert out.returncode != 0 and "fencegate ready" not in out.stdout
        named = f"{setting[0][2:]} \"{setting[1]}\""
        assert named in out.stderr and "refusing to start" in out.stderr, out.stderr
        assert "store.accept_unsynced_changes = true" in out.stderr, out.stderr

        accepted = merge(config, {"store": {"accept_unsynced_changes": True}})
        path.write_text(to_toml(accepted))
        checked = subprocess.run([str(bin_path()), "check-config", "--config", str(path)], capture_output=True,
                                 text=True, timeout=60)
        assert "risk: store.accept_unsynced_changes = true" in checked.stdout, checked.stdout
        fg = fencegate(config={"store": accepted["store"], "upstream": {"probe_bucket": "probe"}},
                       local_buckets=("probe",))
        assert "risk: " in fg.log_tail(200) and named in fg.log_tail(200)
    finally:
        redis.kill9()


def test_redis_classic_and_kill9(fencegate, redis_server):
    bucket = "redisbkt"
    fg = local_with_redis(fencegate, redis_server, bucket)
    fg.client(token=11).put_object(Bucket=bucket, Key="k", Body=b"A")
    fg.client(token=12).put_object(Bucket=bucket, Key="k", Body=b"B's data")
    with pytest.raises(ClientError) as exc_info:
        fg.client(token=11).put_object(Bucket=bucket, Key="k", Body=b"A late")
    assert_stale(exc_info, 12)

    fg.restart(kill=True)
    with pytest.raises(ClientError) as exc_info:
        fg.client(token=11).put_object(Bucket=bucket, Key="k", Body=b"A later")
    assert_stale(exc_info, 12)
    assert read_object(fg.client(), bucket, "k") == b"B's data"


def test_redis_down_fails_closed(fencegate, redis_server):
    bucket = "g5bkt"
    fg = local_with_redis(fencegate, redis_server, bucket)
    fg.client(token=12).put_object(Bucket=bucket, Key="k", Body=b"B's data")

    redis_server.kill9()

    started = time.monotonic()
    with pytest.raises(ClientError) as exc_info:
        fg.client(token=13, read_timeout=60).put_object(Bucket=bucket, Key="k", Body=b"unchecked")
    took = time.monotonic() - started
    assert status_of(exc_info.value) == 503, exc_info.value.response
    assert code_of(exc_info.value) == "FenceStoreUnavailable", exc_info.value.response
    assert took < 30, f"the 503 took {took:.1f}s"
    with pytest.raises(ClientError) as exc_info:  # a brand-new resource too: never unchecked
        fg.client(token=1).put_object(Bucket=bucket, Key="new", Body=b"unchecked")
    assert status_of(exc_info.value) == 503, exc_info.value.response
    assert code_of(exc_info.value) == "FenceStoreUnavailable", exc_info.value.response

    # Reads keep working (G5), and nothing unchecked reached the upstream.
    assert read_object(fg.client(), bucket, "k") == b"B's data"
    assert fg.admin("GET", "/healthz").status_code == 200
    assert fg.admin("GET", "/readyz").status_code == 503

    # Redis comes back with its data: fencegate recovers by itself.
    redis_server.start()

    def write_13():
        fg.client(token=13).put_object(Bucket=bucket, Key="k", Body=b"13")
        return True

    wait_until(write_13, timeout=30, interval=0.5, what="writes to work again after Redis is back")
    with pytest.raises(ClientError) as exc_info:
        fg.client(token=12).put_object(Bucket=bucket, Key="k", Body=b"12 again")
    assert_stale(exc_info, 13)
    wait_until(lambda: fg.admin("GET", "/readyz").status_code == 200, timeout=30, what="readyz")


def test_a_frozen_redis_is_reported_with_the_timeout_it_ran_past(fencegate, redis_server):
    """Before: a call the Redis client itself timed out was reported as "did not answer within
    0 ms". Now every timeout names `store.timeout_ms`."""
    bucket = "frozenbkt"
    fg = with_redis(fencegate, redis_server, local_buckets=(bucket,),
                    config={"upstream": {"probe_bucket": bucket}, "store": {"timeout_ms": 700}})
    redis_server.freeze()
    try:
        details = []
        for _ in range(3):
            r = fg.admin("GET", "/readyz")
            assert r.status_code == 503, r.text
            details.append(r.text)
    finally:
        redis_server.thaw()
    assert all("within 700 ms" in d for d in details), details


@pytest.fixture
def two_replicas(fencegate, redis_server, moto_server):
    bucket = unique("replicas")
    moto_server.client().create_bucket(Bucket=bucket)
    r1 = with_redis(fencegate, redis_server, upstream=moto_server.upstream_config())
    r2 = with_redis(fencegate, redis_server, upstream=moto_server.upstream_config())
    return r1, r2, bucket


def test_each_replica_lists_the_others_it_shares_the_store_with(two_replicas, fencegate, redis_server,
                                                                moto_server):
    """`/v1/status` names every replica the shared store saw lately: both, on either; one that
    stops is forgotten at once, one killed drops out once it has been silent for 15 s."""
    r1, r2, _ = two_replicas

    def replicas(fg) -> list:
        return fg.admin("GET", "/v1/status").json()["replicas"]

    ids = wait_until(lambda: len(replicas(r1)) == 2 and replicas(r1), 15, what="both replicas listed")
    assert replicas(r2) == ids and ids == sorted(ids) and len(set(ids)) == 2
    r3 = with_redis(fencegate, redis_server, upstream=moto_server.upstream_config())
    wait_until(lambda: len(replicas(r1)) == 3, 15, what="a third replica listed")
    r3.stop()
    wait_until(lambda: len(replicas(r1)) == 2, 5, what="a stopped replica forgotten at once")
    r2.kill9()
    started = time.monotonic()
    wait_until(lambda: len(replicas(r1)) == 1, 30, interval=0.5, what="a killed replica dropping out")
    assert time.monotonic() - started > 5, "dropped before it was silent for long"


def test_two_replicas_given_one_replica_id_keep_their_registrations_apart(held_s3, fencegate, redis_server,
                                                                           moto_server):
    """Before: a registration was named `<replica_id>:<n>:<token>`, n counted from 0 in every
    process, so two replicas given the same `store.replica_id` (one config file for all, with
    the key set) named their first token-5 registrations alike. B's withdrawal of its own, when
    B admitted token 6, removed A's while A's token-5 PUT was still in flight, and B's token 6
    committed without waiting for it. Now n starts at random in each process."""
    store = {"kind": "redis", "url": redis_server.url, "path": None, "replica_id": "one-id-for-all"}
    a = held_s3(config={"store": store})
    rule = {"bucket": a.bucket, "prefix": HELD_PREFIX, "resource": HELD_RESOURCE}
    b = fencegate(upstream=dict(moto_server.upstream_config(), probe_bucket=a.bucket),
                  config={"store": store, "fencing": {"rules": [rule]}})
    hold = a.up.hold_next("PUT", a.path(HELD_PREFIX + "a"))
    results = {}

    def put(name, fg, token, key):
        try:
            fg.client(token=token).put_object(Bucket=a.bucket, Key=key, Body=name.encode())
            results[name] = (200, time.monotonic())
        except ClientError as e:
            results[name] = (status_of(e), time.monotonic())

    held = threading.Thread(target=put, args=("a5", a.fg, 5, HELD_PREFIX + "a"))
    held.start()
    try:
        assert hold.wait_arrived(15), "A's token-5 PUT never reached the upstream"
        put("b5", b, 5, HELD_PREFIX + "b")
        assert results["b5"][0] == 200
        newer = threading.Thread(target=put, args=("b6", b, 6, HELD_PREFIX + "c"))
        newer.start()
        newer.join(2.0)
        assert "b6" not in results, "token 6 did not wait for A's token-5 write in flight"
    finally:
        released_at = time.monotonic()
        hold.release()
    held.join(30)
    newer.join(30)
    assert results["a5"][0] == 200 and results["b6"][0] == 200, results
    assert results["b6"][1] >= released_at, "token 6 was admitted while token 5 was in flight"


def test_replicas_share_fences(two_replicas):
    r1, r2, bucket = two_replicas
    r1.client(token=12, resource="job:shared").put_object(Bucket=bucket, Key="a", Body=b"12")
    with pytest.raises(ClientError) as exc_info:
        r2.client(token=11, resource="job:shared").put_object(Bucket=bucket, Key="b", Body=b"11")
    assert_stale(exc_info, 12)
    assert r2.get_fence("job:shared").json()["token"] == 12
    r = r2.put_fence("job:shared", 20)
    assert r.status_code == 200, r.text
    with pytest.raises(ClientError) as exc_info:
        r1.client(token=12, resource="job:shared").put_object(Bucket=bucket, Key="a", Body=b"12")
    assert_stale(exc_info, 20)


def test_race_across_replicas_same_object(two_replicas):
    r1, r2, bucket = two_replicas
    run_race(r1, bucket, "obj", "obj", resource=None, fg_new=r2)
    assert_holds_new(r2, bucket, "obj")


def test_race_across_replicas_two_objects(two_replicas):
    """The advance on one replica cancels the older upload streaming through the other."""
    r1, r2, bucket = two_replicas
    run_race(r1, bucket, "part-a", "part-b", resource="job:r", fg_new=r2)
    assert_holds_new(r2, bucket, "part-b")
    time.sleep(1.0)
    reader = r2.client()
    with pytest.raises(ClientError) as exc_info:
        reader.head_object(Bucket=bucket, Key="part-a")
    assert status_of(exc_info.value) == 404


def test_a_grant_answered_with_an_error_leaves_no_ghost_lease(fencegate, redis_server):
    """Before: with Redis stalled (here `CLIENT PAUSE WRITE` past `store.timeout_ms`), a grant
    was answered 503 and applied when Redis woke: the lease stayed held, for its whole TTL, by a
    holder that had been told it had none and had gone (2 times in 3). Now fencegate sends that
    grant's release after it (compare-and-delete on its id, which nobody was told): once Redis
    is back, the name is free for the next holder at once."""
    import json
    import time

    from fencegate_testlib import quote_resource, signed_raw_request

    bucket = "ghostbkt"
    fg = with_redis(fencegate, redis_server, local_buckets=(bucket,),
                    config={"upstream": {"probe_bucket": bucket}, "store": {"timeout_ms": 500}})
    path = "/_fencegate/v1/leases/" + quote_resource("job:ghost")
    head = {"Content-Type": "application/json"}
    # A first grant and release: the name's state is in Redis (and the scripts are loaded).
    r = signed_raw_request(fg, "POST", path, head, json.dumps({"holder": "warm", "ttl_ms": 60000}).encode())
    assert r.status == 201, (r.status, r.body)
    r = signed_raw_request(fg, "DELETE", path, head, json.dumps({"lease_id": json.loads(r.body)["lease_id"]}).encode())
    assert r.status == 204, (r.status, r.body)

    assert redis_server.command(b"CLIENT PAUSE 1500 WRITE").startswith(b"+OK")
    r = signed_raw_request(fg, "POST", path, head, json.dumps({"holder": "gone", "ttl_ms": 60000}).encode())
    assert r.status == 503, (r.status, r.body)  # the holder is told it has nothing, and goes
    time.sleep(2.0)  # Redis is back: the paused grant was applied, then its release
    deadline = time.monotonic() + 10
    while True:
        r = signed_raw_request(fg, "POST", path, head, json.dumps({"holder": "next", "ttl_ms": 60000}).encode())
        if r.status == 201 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert r.status == 201, f"the name is held by a ghost: {r.status} {r.body!r}"
    assert json.loads(r.body)["holder"] == "next"


def test_a_redis_store_never_initialised_is_not_ready_and_names_init_store(tmp_path, redis_server):
    """Before: without `fencegate init-store`, /readyz was 200 and every first write on a slot
    got 503 for about 40 s with nothing naming init-store or the quiet period. Now /readyz is
    503 with a detail that names init-store and when not to run it, a refused write says the
    same, and readiness comes back by itself once the quiet period has passed (it would after a
    loss too, where init-store must not be run)."""
    import requests

    from fencegate_testlib import FenceGate, base_config, seed_local_buckets

    workdir = tmp_path / "fresh"
    workdir.mkdir()
    seed_local_buckets(workdir / "objects", ("fresh",))
    cfg = merge(merge(base_config(workdir), redis_store(redis_server)),
                {"upstream": {"probe_bucket": "fresh"}, "fencing": {"inflight_deadline_ms": 2000}})
    fg = FenceGate(workdir=workdir, config=cfg, init_store=False)
    fg.start()
    try:
        ready = requests.get(fg.admin_url + "/readyz", timeout=10)
        assert ready.status_code == 503, ready.text
        detail = ready.json()["detail"]
        assert "fencegate init-store" in detail and "never run it on a store that lost its state" in detail, detail
        # `fencegate health` (a container's health check) says the same cause.
        import subprocess

        from fencegate_testlib import bin_path, to_toml
        host, port = fg.admin_addr
        asked = tmp_path / "health.toml"
        asked.write_text(to_toml(merge(fg.config, {"server": {"admin_listen": f"{host}:{port}"}})) + "\n")
        health = subprocess.run([str(bin_path()), "health", "--config", str(asked)], capture_output=True, text=True,
                                timeout=30)
        assert health.returncode == 1 and "fencegate init-store" in health.stderr, (health.stdout, health.stderr)
        with pytest.raises(ClientError) as refused:
            fg.client(token=1).put_object(Bucket="fresh", Key="k", Body=b"x")
        assert status_of(refused.value) == 503 and "init-store" in str(refused.value.response), refused.value.response
        # The quiet period (11/8 of the 2 s deadline) passes: ready without anyone's help.
        wait_until(lambda: requests.get(fg.admin_url + "/readyz", timeout=10).status_code == 200, timeout=10,
                   what="readiness after the quiet period")
    finally:
        fg.stop()
