"""Proves that a replica whose monotonic clock did not count a suspension hands nothing over
once the shared store dropped its registration (G3 at its bounds, docs/design.md section 3a,
item 5): registration ages are read on CLOCK_BOOTTIME, which counts the suspension.

A host suspension (a VM paused or restored from a snapshot) stops CLOCK_MONOTONIC, Rust's
`Instant` and tokio's timers, while the other replicas and Redis go on. It is reproduced here
on one host: replica A runs under libfaketime, which fakes every clock read through the C
library (Rust's `Instant` too), is stopped (SIGSTOP) past the store's time to live of its
registration, and its faked clocks are then moved back by the time it was stopped, so that, as
after a suspension, its monotonic clock says almost no time went by. fencegate reads
CLOCK_BOOTTIME from the kernel directly (not through the C library), as a real suspension
would leave it: counted. Meanwhile replica B admits and commits token 6 on another object of
the same resource, and its announcement never reaches A (A's subscription is cut while it is
stopped). A's token-5 body, completed while it was stopped, must not be handed over.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest

from fencegate_testlib import build_head, connect, read_response, sign_headers, wait_until
from holding_upstream import HELD_PREFIX, HoldingUpstream
from test_bounds import D_MS, committed, start_replica

TTL_S = D_MS * 11 / 8 / 1000  # how long Redis keeps a registration after a renewal
LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1")


def faketime_missing() -> str:
    if not LIBFAKETIME.exists():
        return f"{LIBFAKETIME} is missing (Debian's libfaketime; scripts/test installs it)"
    return ""


def start_put(fg, bucket: str, key: str, token: int, body: bytes, hold_back: int) -> socket.socket:
    """Sends a signed PUT's head and all of its body but the last `hold_back` bytes."""
    host, port = fg.s3_addr
    path = f"/{bucket}/{key}"
    headers = sign_headers("PUT", host, port, path, {"Fencing-Token": str(token), "Content-Length": str(len(body))})
    sock = connect(fg.s3_addr, timeout=30)
    sock.sendall(build_head("PUT", path, headers) + body[: len(body) - hold_back])
    return sock


def live_members(redis_server) -> bytes:
    """The raw reply listing the in-flight members of resource `job` not yet expired on Redis's
    clock (an expired one stays in the set until the next admission sweeps it)."""
    seconds, micros = (int(x) for x in redis_server.command(b"TIME").split(b"\r\n")[2::2][:2])
    now_ms = seconds * 1000 + micros // 1000
    return redis_server.command(f"ZRANGEBYSCORE fg:{{job}}:inflight ({now_ms} +inf".encode())


@pytest.mark.skipif(bool(faketime_missing()), reason=faketime_missing())
def test_a_replica_whose_clock_skipped_a_suspension_hands_nothing_over(
        fencegate, redis_server, moto_server, tmp_path):
    up = HoldingUpstream(moto_server.url).start()
    try:
        bucket = f"susp-{os.getpid()}-{time.monotonic_ns() % 10**9}"
        moto_server.client().create_bucket(Bucket=bucket)
        offset = tmp_path / "faketime-offset"
        offset.write_text("+0\n")
        faked = {"LD_PRELOAD": str(LIBFAKETIME), "FAKETIME_TIMESTAMP_FILE": str(offset), "FAKETIME_NO_CACHE": "1"}
        a = start_replica(fencegate, redis_server.url, up, moto_server, bucket, "a", store_timeout_ms=2000, env=faked)
        b = start_replica(fencegate, redis_server.url, up, moto_server, bucket, "b", store_timeout_ms=2000)

        body = b"x" * 4096
        sock = start_put(a, bucket, f"{HELD_PREFIX}a", 5, body, hold_back=1)
        # A registered token 5 in Redis: its write is in flight, its body not yet complete.
        wait_until(lambda: b":5\r\n" in redis_server.command(b"ZRANGE fg:{job}:inflight 0 -1"), 10,
                   what="replica a's registration of token 5")

        stopped = time.monotonic()
        os.kill(a.proc.pid, signal.SIGSTOP)
        try:
            # B's advance is never announced to A (a lost announcement: A's subscription is cut
            # while it is stopped), so only A's own check of its registration's age can stop it.
            assert redis_server.command(b"CLIENT KILL TYPE pubsub").startswith(b":"), "no subscription cut"
            # Past the registration's time to live: Redis drops it, and B admits token 6.
            time.sleep(TTL_S + 0.5)
            wait_until(lambda: b":5\r\n" not in live_members(redis_server), 10,
                       what="Redis dropping the stopped replica's registration")
            b.client(token=6).put_object(Bucket=bucket, Key=f"{HELD_PREFIX}b", Body=b"B's data")
            # The last byte arrives while A is stopped; A's clocks are moved back by the time
            # it was stopped, as a suspension leaves CLOCK_MONOTONIC.
            sock.sendall(body[-1:])
            offset.write_text(f"-{time.monotonic() - stopped:.3f}\n")
        finally:
            os.kill(a.proc.pid, signal.SIGCONT)
        resp = read_response(sock, timeout=30)
        sock.close()

        # Refused either by A's check of its registration's age (503), or, when A's resumed
        # subscription or renewal learns of token 6 first, as stale (409, cut off): both
        # hand nothing over (a full suite once saw the second).
        assert (resp.status, resp.code()) in ((503, "FenceStoreUnavailable"), (409, "FencingTokenStale")), (
            resp.status, resp.body[:300])
        assert [(key, token) for _, key, token in committed(up, bucket)] == [(f"{HELD_PREFIX}b", 6)], (
            "token 5 was handed over after Redis dropped its registration", up.writes())
    finally:
        up.close()
