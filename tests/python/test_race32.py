"""Proves G3 under a 32-way race: 32 writers with tokens 1..32 (in shuffled order), released
by a barrier (all at once, or spread over some milliseconds so that many commit), each PUT the
same object through fencegate. The final object is the one of the highest token that was
accepted, and no lower token committed after it.

What is checked:
- every answer is 200 (committed), 409 FencingTokenStale (refused) or 503 SlowDown (retryable,
  nothing committed); the highest token, 32, cannot be stale;
- the object holds the bytes of the highest accepted token and is stamped with it, and the fence
  is that token;
- client-side history: a write with token t' < t that was answered 200 was sent before the write
  with token t was answered (otherwise t' would have been admitted after t's commit);
- upstream history (moto, with versioning on): every committed version is stamped with a token
  answered 200, every token answered 200 left exactly one version, and in the upstream's commit
  order (the order of ListObjectVersions, not its one-second LastModified) the stamps never go
  down; in particular nothing older than the final token committed after it.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
from botocore.exceptions import ClientError

from fencegate_testlib import code_of, read_object, status_of, unique

WRITERS = 32
# One round each. "together": every writer released at once (mostly only the top token
# commits). "random": each released after a random delay of up to 100 ms. "rising": token t
# after about 8 ms * t, give or take 40 ms, so neighbours still race but many tokens commit,
# each within a few milliseconds of the last: a history whose order the checks below must
# prove from the upstream's commit order, not from its one-second LastModified.
STARTS = ("together", "random", "rising")


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


def run_race(fg, bucket: str, key: str, size: int, seed: int, start: str) -> dict:
    """Every writer waits at the barrier, then a delay that depends on `start` (see STARTS)."""
    rng = random.Random(seed)
    tokens = list(range(1, WRITERS + 1))
    rng.shuffle(tokens)
    if start == "together":
        delays = {t: 0.0 for t in tokens}
    elif start == "random":
        delays = {t: rng.uniform(0, 0.1) for t in tokens}
    else:  # "rising": token t after about 8 ms * t, give or take 40 ms
        delays = {t: 0.008 * t + rng.uniform(0, 0.04) for t in tokens}
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
        time.sleep(delays[token])
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
    # Upstream history: every token answered 200 left exactly one version, and in the
    # upstream's commit order the stamps never go down (each token committed at most once, so
    # they rise); the last one committed is the top token.
    commit_order = upstream_commit_order(moto, bucket, key)
    stamps = [stamp for _vid, stamp in commit_order]
    assert sorted(stamps) == accepted, f"upstream versions {stamps} != tokens answered 200 {accepted}"
    assert_stamps_rise(stamps)
    assert stamps[-1] == top, f"the last committed version is not token {top}: {stamps}"


def upstream_commit_order(moto, bucket: str, key: str) -> list:
    """The versions of `key` on versioned moto in commit order, oldest first, as
    (version id, stamp) with the stamp read by HeadObject with VersionId.

    moto's ListObjectVersions lists a key's versions newest first, ordered by their creation
    time at microsecond resolution, while the LastModified it answers is cut to whole seconds:
    quick versions share one, so only the list order orders them. fencegate forwards the
    writes of different tokens on one object one after another, so no two versions share a
    creation instant and the list order is the commit order. Its newest entry must be the
    version the upstream serves as the object, which ties the list to moto's own order."""
    versions, delete_markers = [], []
    marker = {}
    for _page in range(50):
        resp = moto.list_object_versions(Bucket=bucket, Prefix=key, **marker)
        versions += [v for v in resp.get("Versions", []) if v["Key"] == key]
        delete_markers += [d for d in resp.get("DeleteMarkers", []) if d["Key"] == key]
        if not resp.get("IsTruncated"):
            break
        marker = {"KeyMarker": resp["NextKeyMarker"], "VersionIdMarker": resp["NextVersionIdMarker"]}
    else:
        raise AssertionError(f"ListObjectVersions still truncated after 50 pages ({len(versions)} versions)")
    assert versions, f"no version of {key} upstream"
    assert not delete_markers, delete_markers
    current = moto.head_object(Bucket=bucket, Key=key)
    assert versions[0]["IsLatest"] and versions[0]["VersionId"] == current["VersionId"], (
        f"the newest listed version is not the object moto serves: {versions[0]} vs {current['VersionId']}"
    )
    order = []
    for v in reversed(versions):
        head = moto.head_object(Bucket=bucket, Key=key, VersionId=v["VersionId"])
        order.append((v["VersionId"], int(head["Metadata"]["fencing-token"])))
    return order


def assert_stamps_rise(stamps: list):
    for earlier, later in zip(stamps, stamps[1:]):
        assert earlier < later, f"token {later} committed after token {earlier}: commit order {stamps}"


def test_commit_order_is_read_from_the_version_list(fencegate, moto_server):
    """The upstream history check itself: writes committed one after another, most within one
    second (one LastModified), come back from upstream_commit_order in the order they were
    committed; two writes with one token are told apart by their bodies, numbered in commit
    order."""
    bucket = unique("order")
    moto = moto_server.client()
    moto.create_bucket(Bucket=bucket)
    moto.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    fg = fencegate(upstream=moto_server.upstream_config())
    key = "history"
    # Same-token writes do not advance the fence, so 3 may follow 3; then 5..9 rise.
    sequence = [3, 3, 5, 6, 7, 8, 9]
    for i, token in enumerate(sequence):
        fg.client(token=token).put_object(Bucket=bucket, Key=key, Body=f"{i}".encode())
    order = upstream_commit_order(moto, bucket, key)
    assert [stamp for _v, stamp in order] == sequence, order
    bodies = [moto.get_object(Bucket=bucket, Key=key, VersionId=vid)["Body"].read() for vid, _stamp in order]
    assert bodies == [f"{i}".encode() for i in range(len(sequence))], bodies


@pytest.mark.parametrize("size", [1024, 256 * 1024], ids=["1KiB", "256KiB"])
def test_race_32_writers_one_object(race_target, size):
    fg, bucket, moto = race_target
    for round_no, start in enumerate(STARTS):
        key = f"race/{size}/round-{round_no}"
        results = run_race(fg, bucket, key, size, seed=round_no * 1000 + size, start=start)
        check_race(fg, bucket, key, size, results, moto)
        print(f"round {round_no} ({start}): accepted {sorted(t for t, r in results.items() if r[0] == 200)}")
