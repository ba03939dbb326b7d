"""Proves G3 under a 32-way race: 32 writers with tokens 1..32 (in shuffled order), released
together by a barrier, each PUT the same object through fencegate. The final object is the one
of the highest token that was accepted, and no lower token committed after it.

What is checked:
- every answer is 200 (committed), 409 FencingTokenStale (refused) or 503 SlowDown (retryable,
  nothing committed); the highest token, 32, cannot be stale;
- the object holds the bytes of the highest accepted token and is stamped with it, and the fence
  is that token;
- client-side history: a write with token t' < t that was answered 200 was sent before the write
  with token t was answered (otherwise t' would have been admitted after t's commit);
- upstream history (moto, with versioning on): every committed version is stamped with a token
  answered 200, every token answered 200 left exactly one version, and in the upstream's commit
  order the stamps never go down; in particular nothing older than the final token committed
  after it.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
from botocore.exceptions import ClientError

from fencegate_testlib import code_of, read_object, status_of, unique

WRITERS = 32
ROUNDS = 3


def body_for(token: int, size: int) -> bytes:
    line = f"token {token:02d};".encode()
    return (line * (size // len(line) + 1))[:size]


@pytest.fixture(params=["local", "moto"])
def race_target(request, fencegate):
    """(fencegate, bucket, moto client or None). On moto the bucket is versioned, so the
    upstream keeps every committed write in commit order."""
    bucket = unique("race32")
    if request.param == "local":
        fg = fencegate(local_buckets=(bucket,))
        return fg, bucket, None
    moto_server = request.getfixturevalue("moto_server")
    moto = moto_server.client()
    moto.create_bucket(Bucket=bucket)
    moto.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    fg = fencegate(upstream=moto_server.upstream_config())
    return fg, bucket, moto


def run_race(fg, bucket: str, key: str, size: int, seed: int) -> dict:
    tokens = list(range(1, WRITERS + 1))
    random.Random(seed).shuffle(tokens)
    clients = {t: fg.client(token=t, read_timeout=120) for t in tokens}  # boto3 clients: made in one thread
    barrier = threading.Barrier(WRITERS, timeout=60)
    results: dict = {}
    lock = threading.Lock()

    def writer(token: int):
        client = clients[token]
        body = body_for(token, size)
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            with lock:
                results[token] = ("barrier", None, None, None)
            return
        sent = time.monotonic()
        try:
            resp = client.put_object(Bucket=bucket, Key=key, Body=body)
            outcome = (resp["ResponseMetadata"]["HTTPStatusCode"], "", resp.get("ETag"))
        except ClientError as exc:
            outcome = (status_of(exc), code_of(exc), None)
        except Exception as exc:  # noqa: BLE001 - reported as a failed outcome below
            outcome = (None, repr(exc), None)
        answered = time.monotonic()
        with lock:
            results[token] = (outcome[0], outcome[1], sent, answered)

    threads = [threading.Thread(target=writer, args=(t,), name=f"writer-{t}") for t in tokens]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=180)
    assert not any(th.is_alive() for th in threads), "a writer is still running after 180 s"
    assert len(results) == WRITERS, results
    return results


def check_race(fg, bucket: str, key: str, size: int, results: dict, moto):
    table = {t: r[:2] for t, r in sorted(results.items())}
    for token, (status, code, _sent, _answered) in results.items():
        assert (status, code) in {(200, ""), (409, "FencingTokenStale"), (503, "SlowDown")}, (token, table)
    accepted = sorted(t for t, r in results.items() if r[0] == 200)
    assert accepted, table
    top = max(accepted)
    assert results[WRITERS][0] in (200, 503), f"the highest token cannot be stale: {table}"

    # The final object is the highest accepted token's, stamped with it; the fence is there.
    reader = fg.client()
    assert read_object(reader, bucket, key) == body_for(top, size), table
    assert reader.head_object(Bucket=bucket, Key=key)["Metadata"].get("fencing-token") == str(top)
    fence = fg.get_fence(f"{bucket}/{key}")
    assert fence.status_code == 200 and fence.json()["token"] >= top, fence.text
    # Every refusal as stale names a fence above the refused token (checked via the answers).
    for token, (status, _c, _s, _a) in results.items():
        if status == 409:
            assert token < fence.json()["token"], (token, table)

    # Client-side history: no lower token was admitted after a higher one was answered.
    for t in accepted:
        for lower in accepted:
            if lower < t:
                assert results[lower][2] < results[t][3], (
                    f"token {lower} was sent after token {t} was answered, and still committed: {table}"
                )

    if moto is None:
        return
    # Upstream history: versions in commit order (moto keeps them per key in insertion order;
    # ListObjectVersions sorts by LastModified, newest first).
    versions = []
    marker = {}
    for _page in range(50):
        resp = moto.list_object_versions(Bucket=bucket, Prefix=key, **marker)
        versions += [v for v in resp.get("Versions", []) if v["Key"] == key]
        if not resp.get("IsTruncated"):
            break
        marker = {"KeyMarker": resp["NextKeyMarker"], "VersionIdMarker": resp["NextVersionIdMarker"]}
    stamps = []
    for v in versions:
        head = moto.head_object(Bucket=bucket, Key=key, VersionId=v["VersionId"])
        stamps.append((v["LastModified"], int(head["Metadata"]["fencing-token"]), v["IsLatest"]))
    committed = sorted(s[1] for s in stamps)
    assert committed == accepted, f"upstream versions {committed} != tokens answered 200 {accepted}"
    latest = [s for s in stamps if s[2]]
    assert len(latest) == 1 and latest[0][1] == top, stamps
    # Commit order (oldest first) by LastModified: the stamps never go down. Versions within
    # the same clock tick are unordered by the listing, so they only need to agree as a set.
    by_time = sorted(stamps, key=lambda s: s[0])
    for earlier, later in zip(by_time, by_time[1:]):
        if earlier[0] < later[0]:
            assert earlier[1] < later[1], f"token {later[1]} committed after token {earlier[1]}: {by_time}"
    assert all(s[0] <= latest[0][0] for s in stamps), by_time


@pytest.mark.parametrize("size", [1024, 256 * 1024], ids=["1KiB", "256KiB"])
def test_race_32_writers_one_object(race_target, size):
    fg, bucket, moto = race_target
    for round_no in range(ROUNDS):
        key = f"race/{size}/round-{round_no}"
        results = run_race(fg, bucket, key, size, seed=round_no * 1000 + size)
        check_race(fg, bucket, key, size, results, moto)
        print(f"round {round_no}: accepted {sorted(t for t, r in results.items() if r[0] == 200)}")
