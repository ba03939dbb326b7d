"""No multipart upload of a superseded token is left behind (docs/design.md, "Uploads left behind").

Before: a worker whose token went stale mid-upload could not abort its own upload (409: the
abort is a fenced write), a writer without a token got 428, and nothing else aborted it: every
such upload stayed at the upstream with its parts, on moto and on the local upstream alike.

Now every upload created with a token is recorded in the fence store with that token and its
creator; a newer token that sends a part or the completion takes it over. The record's token
and signer may abort it whatever became of the token (superseded, or a lease that lapsed with
no successor); nobody else may with a stale token, and no upload a newer token created or took
over can be aborted with an older one. fencegate aborts the uploads of superseded tokens
`fencing.abort_stale_uploads_after_ms` after it saw them superseded, never sooner, and forgets
the records of uploads the upstream no longer has.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from fencegate_testlib import ACCESS_KEY, SECRET_KEY, metric, metric_samples, unique, wait_until
from test_lease_credentials import grant, leased_client, refusal
from test_multipart_keys import refused

OTHER = ("AKIAOTHERISSUER00001", "other-issuer-secret-key-000000000000001")
RESOURCE = "job:uploads"


LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1")
# The smallest delay the tests' deadlines allow: (request timeout 2 s + D 2 s) plus 8 %.
AFTER_MS = 4500


def start(fencegate, moto_server, upstream_kind: str, env=None, **fencing):
    bucket = unique("stale")
    rules = [{"bucket": bucket, "prefix": "data/", "resource": RESOURCE}]
    credentials = [{"access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY, "role": "issuer"},
                   {"access_key_id": OTHER[0], "secret_access_key": OTHER[1], "role": "issuer"}]
    config = {"fencing": dict(rules=rules, **fencing), "credentials": credentials}
    if upstream_kind == "moto":
        moto_server.client().create_bucket(Bucket=bucket)
        fg = fencegate(upstream=dict(moto_server.upstream_config(), request_timeout_ms=2000), config=config, env=env)
    else:
        config["upstream"] = {"request_timeout_ms": 2000}
        fg = fencegate(config=config, local_buckets=(bucket,), env=env)
    fg.bucket = bucket
    return fg


def open_uploads(fg) -> set:
    """The upload ids the upstream still holds in the bucket (listed through fencegate: a read)."""
    listed = fg.client().list_multipart_uploads(Bucket=fg.bucket).get("Uploads", [])
    return {u["UploadId"] for u in listed}


def begin(fg, token: int, key: str, client=None, size: int = 1024) -> str:
    s3 = client or fg.client(token=token)
    upload = s3.create_multipart_upload(Bucket=fg.bucket, Key=key)["UploadId"]
    s3.upload_part(Bucket=fg.bucket, Key=key, UploadId=upload, PartNumber=1, Body=b"p" * size)
    return upload


@pytest.mark.parametrize("upstream_kind", ["local", "moto"])
def test_the_creator_aborts_its_own_upload_after_its_token_went_stale(fencegate, moto_server, upstream_kind):
    fg = start(fencegate, moto_server, upstream_kind)
    stale = begin(fg, 5, "data/a.bin")
    # The same stale token from another credential is not the creator.
    theirs = begin(fg, 5, "data/theirs.bin", client=fg.client(token=5, access_key=OTHER[0], secret_key=OTHER[1]))
    # Written before the fence rose past 5, the record survives a restart.
    fg.restart()
    other_stale = fg.client(token=5, access_key=OTHER[0], secret_key=OTHER[1])
    fg.client(token=6).put_object(Bucket=fg.bucket, Key="data/b.txt", Body=b"new holder")
    newer = begin(fg, 6, "data/c.bin")
    assert {stale, theirs, newer} <= open_uploads(fg)

    old = fg.client(token=5)
    # An upload of the newer token cannot be aborted with the older one.
    assert refused(lambda: old.abort_multipart_upload(Bucket=fg.bucket, Key="data/c.bin", UploadId=newer)) \
        == (409, "FencingTokenStale")
    # Nor can another credential's upload, with the same stale token.
    assert refused(lambda: old.abort_multipart_upload(Bucket=fg.bucket, Key="data/theirs.bin", UploadId=theirs)) \
        == (409, "FencingTokenStale")
    # Named under another key, the upload is not the one the record is for (404 where the
    # upload id is checked against its key first, as S3 does).
    assert refused(lambda: old.abort_multipart_upload(Bucket=fg.bucket, Key="data/c.bin", UploadId=stale)) \
        in {(409, "FencingTokenStale"), (404, "NoSuchUpload")}
    assert {stale, theirs, newer} <= open_uploads(fg)
    # Its own, it may: the abort commits nothing.
    old.abort_multipart_upload(Bucket=fg.bucket, Key="data/a.bin", UploadId=stale)
    assert open_uploads(fg) == {theirs, newer}
    # Its other writes stay refused.
    assert refused(lambda: old.put_object(Bucket=fg.bucket, Key="data/a.bin", Body=b"late")) \
        == (409, "FencingTokenStale")
    assert refused(lambda: old.upload_part(Bucket=fg.bucket, Key="data/c.bin", UploadId=newer, PartNumber=2,
                                           Body=b"late")) == (409, "FencingTokenStale")
    other_stale.abort_multipart_upload(Bucket=fg.bucket, Key="data/theirs.bin", UploadId=theirs)
    assert open_uploads(fg) == {newer}
    samples = metric_samples(fg)
    assert metric(samples, "fencegate_stale_uploads_aborted_total", by="creator") == 2
    assert metric(samples, "fencegate_stale_uploads_aborted_total", by="fencegate") == 0


@pytest.mark.parametrize("upstream_kind", ["local", "moto"])
def test_uploads_of_superseded_tokens_are_aborted_after_the_delay_never_before(
        fencegate, moto_server, upstream_kind):
    """The bound: an upload superseded at `r` is aborted in [r + X, r + X + 2 periods] (the sweep
    sees it superseded within one period of `r`, and aborts it at the first sweep past X after
    that), X = fencing.abort_stale_uploads_after_ms, a period X/4 but at least 1 s."""
    after_ms = AFTER_MS
    fg = start(fencegate, moto_server, upstream_kind, abort_stale_uploads_after_ms=after_ms,
               inflight_deadline_ms=2000)
    abandoned = begin(fg, 5, "data/abandoned.bin")
    completed = begin(fg, 5, "data/done.bin")
    parts = fg.client(token=5).list_parts(Bucket=fg.bucket, Key="data/done.bin", UploadId=completed)["Parts"]
    fg.client(token=5).complete_multipart_upload(
        Bucket=fg.bucket, Key="data/done.bin", UploadId=completed,
        MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": parts[0]["ETag"]}]})
    fg.client(token=6).put_object(Bucket=fg.bucket, Key="data/b.txt", Body=b"new holder")
    superseded_at = time.monotonic()
    current = begin(fg, 6, "data/current.bin")
    period_s = max(after_ms / 4, 1000) / 1000

    # Just before the bound the abandoned upload is still there.
    time.sleep(max(0.0, superseded_at + after_ms / 1000 - 0.3 - time.monotonic()))
    assert abandoned in open_uploads(fg), "aborted before fencing.abort_stale_uploads_after_ms"
    wait_until(lambda: abandoned not in open_uploads(fg), timeout=2 * period_s + 1.5, interval=0.1,
               what="the abandoned upload aborted by fencegate")
    assert time.monotonic() - superseded_at <= after_ms / 1000 + 2 * period_s + 1.5
    # The newer token's upload stays, and completes.
    assert current in open_uploads(fg)
    s3 = fg.client(token=6)
    parts = s3.list_parts(Bucket=fg.bucket, Key="data/current.bin", UploadId=current)["Parts"]
    s3.complete_multipart_upload(Bucket=fg.bucket, Key="data/current.bin", UploadId=current,
                                 MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": parts[0]["ETag"]}]})
    assert open_uploads(fg) == set()
    assert fg.client().get_object(Bucket=fg.bucket, Key="data/done.bin")["Body"].read() == b"p" * 1024
    samples = metric_samples(fg)
    # The completed upload was forgotten on completion: no abort was sent for it.
    assert metric(samples, "fencegate_stale_uploads_aborted_total", by="fencegate") == 1
    assert "aborted an upload of a superseded token" in fg.log_tail(200)



def parts_of(s3, fg, key: str, upload: str) -> list:
    return [{"PartNumber": p["PartNumber"], "ETag": p["ETag"]}
            for p in s3.list_parts(Bucket=fg.bucket, Key=key, UploadId=upload)["Parts"]]


@pytest.mark.parametrize("upstream_kind", ["local", "moto"])
def test_an_upload_a_newer_token_took_over_is_neither_its_creators_nor_swept(fencegate, moto_server,
                                                                            upstream_kind):
    """B (token 6) goes on with A's upload (token 5): from B's first part on the upload is B's.
    A cannot abort it, and the sweep, past its delay, leaves it to B, who completes it."""
    fg = start(fencegate, moto_server, upstream_kind, abort_stale_uploads_after_ms=AFTER_MS,
               inflight_deadline_ms=2000)
    key = "data/resumed.bin"
    upload = begin(fg, 5, key, size=5 * 1024 * 1024)  # not the last part: S3's minimum
    b = fg.client(token=6)
    b.put_object(Bucket=fg.bucket, Key="data/x.txt", Body=b"fence to 6")
    superseded_at = time.monotonic()
    b.upload_part(Bucket=fg.bucket, Key=key, UploadId=upload, PartNumber=2, Body=b"q" * 1024)
    old = fg.client(token=5)
    assert refused(lambda: old.abort_multipart_upload(Bucket=fg.bucket, Key=key, UploadId=upload)) \
        == (409, "FencingTokenStale")
    # Past the delay and two sweeps: B's upload is still there.
    time.sleep(max(0.0, superseded_at + AFTER_MS / 1000 + 2 * 1.2 + 0.5 - time.monotonic()))
    assert upload in open_uploads(fg), "the sweep aborted an upload the current token took over"
    b.complete_multipart_upload(Bucket=fg.bucket, Key=key, UploadId=upload,
                                MultipartUpload={"Parts": parts_of(b, fg, key, upload)})
    assert fg.client().get_object(Bucket=fg.bucket, Key=key)["Body"].read() == b"p" * 5 * 1024 * 1024 + b"q" * 1024
    assert open_uploads(fg) == set()
    assert metric(metric_samples(fg), "fencegate_stale_uploads_aborted_total", by="fencegate") == 0


def test_a_lease_that_lapsed_with_no_successor_still_aborts_its_own_upload(fencegate, moto_server):
    """Nobody took the resource after the lease lapsed, so nothing supersedes the upload: only
    its owner can end it, and may (before: 403 ExpiredToken, and the upload stayed forever)."""
    bucket = unique("lapsed")
    moto_server.client().create_bucket(Bucket=bucket)
    rules = [{"bucket": bucket, "prefix": "data/", "resource": RESOURCE}]
    fg = fencegate(upstream=moto_server.upstream_config(), config={"fencing": {"rules": rules}})
    fg.bucket = bucket
    lease = grant(fg, RESOURCE, ttl_ms=1000)
    worker = leased_client(fg, lease)
    upload = worker.create_multipart_upload(Bucket=bucket, Key="data/a.bin")["UploadId"]
    time.sleep(1.5)
    # The lease is over: writes are refused as before.
    assert refusal(lambda: worker.put_object(Bucket=bucket, Key="data/a.bin", Body=b"late"))[1] == "ExpiredToken"
    worker.abort_multipart_upload(Bucket=bucket, Key="data/a.bin", UploadId=upload)
    assert open_uploads(fg) == set()
    # Another lease's credential is not the owner.
    second = leased_client(fg, grant(fg, RESOURCE, ttl_ms=60_000))
    other = second.create_multipart_upload(Bucket=bucket, Key="data/b.bin")["UploadId"]
    assert refusal(lambda: worker.abort_multipart_upload(Bucket=bucket, Key="data/b.bin", UploadId=other))[0] \
        in (403, 409)
    assert other in open_uploads(fg)


@pytest.mark.skipif(not LIBFAKETIME.exists(), reason=f"{LIBFAKETIME} is missing (scripts/test installs libfaketime)")
def test_the_record_of_an_upload_ended_around_fencegate_is_forgotten(fencegate, moto_server, tmp_path):
    """An upload aborted at the upstream directly leaves its record behind; the sweep asks the
    upstream about records older than an hour, once an hour, and forgets the ones it no longer
    has. Two hours pass in a moment under libfaketime."""
    offset = tmp_path / "faketime-offset"
    offset.write_text("+0\n")
    faked = {"LD_PRELOAD": str(LIBFAKETIME), "FAKETIME_TIMESTAMP_FILE": str(offset), "FAKETIME_NO_CACHE": "1"}
    # The sweep runs every quarter of the delay: a short one, so that it runs within the test
    # (its sleep is a real one). Nothing is superseded while the clocks are ahead, so the delay
    # aborts nothing.
    fg = start(fencegate, moto_server, "moto", env=faked, abort_stale_uploads_after_ms=AFTER_MS,
               inflight_deadline_ms=2000)
    gone = begin(fg, 5, "data/gone.bin")
    kept = begin(fg, 5, "data/kept.bin")
    moto_server.client().abort_multipart_upload(Bucket=fg.bucket, Key="data/gone.bin", UploadId=gone)
    offset.write_text("+7200\n")
    # (The jump can time out a store call of a sweep under way: it is logged, and tried again.)
    forgotten = "the upstream no longer has a recorded upload"
    wait_until(lambda: forgotten in fg.log_tail(100_000), timeout=15,
               what="the sweep forgetting the record of the upload aborted around fencegate")
    offset.write_text("+0\n")
    time.sleep(0.5)
    assert fg.log_tail(100_000).count(forgotten) == 1, fg.log_tail(60)
    # The other record stays: its owner, stale now, still aborts it (without it: 409).
    fg.client(token=6).put_object(Bucket=fg.bucket, Key="data/x.txt", Body=b"fence to 6")
    fg.client(token=5).abort_multipart_upload(Bucket=fg.bucket, Key="data/kept.bin", UploadId=kept)
    assert kept not in open_uploads(fg)
