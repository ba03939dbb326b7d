"""Proves the S3 surface (docs/clients.md) with real clients against a real S3-compatible upstream (moto_server): every
fenced S3 write through fencegate, with a fresh token, a stale token and no token, over HTTP and
over HTTPS; the 2025 SDK checksum defaults (aws-chunked with trailing checksums, verified before
the upstream commit); virtual-hosted addressing; presigned URLs (SigV4 and SigV2); HTTP/2.

Every fenced write is tried three ways on a resource whose fence is F:
  - stale: token F-1 -> 409 FencingTokenStale, `Fencing-Token-Current: F`, upstream unchanged;
  - none:  no token  -> 428 FencingTokenRequired, upstream unchanged;
  - fresh: token F+1 -> the upstream's own success status, and the change is at the upstream.
The upstream is checked directly (moto, bypassing fencegate) after every attempt. The observed
statuses are collected into a table written to `<pytest basetemp>/s3_surface_status.md` (and to
`$FENCEGATE_STATUS_TABLE` when set).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import socket
import subprocess
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests
from botocore.exceptions import ClientError

from fencegate_testlib import (
    ACCESS_KEY,
    CHECKSUMS,
    REGION,
    SECRET_KEY,
    TEST_DOMAIN,
    MiB,
    aws_chunked_headers,
    aws_chunked_unsigned,
    checksum_b64,
    code_of,
    h2_body,
    h2_request,
    h2_status,
    header_of,
    raw_request_any,
    s3_client_ex,
    s3_error_code,
    sign_headers,
    signed_chunked_request,
    start_fencegate,
    status_of,
    unique,
    wrong_checksum_b64,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
PART = b"P" * (5 * MiB)  # S3's smallest non-last part

# --------------------------------------------------------------------------------------------
# fixtures: one fencegate per scheme in front of the session's moto_server
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def status_table(tmp_path_factory):
    """(operation, case) -> scheme -> statuses observed. Written out at the end of the module."""
    table: dict = defaultdict(lambda: defaultdict(set))
    yield table
    cases = ("fresh", "stale", "none")
    lines = ["| operation | " + " | ".join(cases) + " |", "|---|" + "---|" * len(cases)]
    ops = []
    for op, _case in table:
        if op not in ops:
            ops.append(op)
    for op in ops:
        cells = []
        for case in cases:
            per_scheme = table.get((op, case), {})
            rendered = {s: "/".join(sorted(v)) for s, v in per_scheme.items()}
            if not rendered:
                cells.append("")
            elif len(set(rendered.values())) == 1:
                cells.append(next(iter(rendered.values())))
            else:
                cells.append(", ".join(f"{s}: {v}" for s, v in sorted(rendered.items())))
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    raw = {f"{op}|{case}": {s: sorted(v) for s, v in d.items()} for (op, case), d in table.items()}
    out = [tmp_path_factory.getbasetemp() / "s3_surface_status.md"]
    if os.environ.get("FENCEGATE_STATUS_TABLE"):
        out.append(Path(os.environ["FENCEGATE_STATUS_TABLE"]))
    for path in out:
        path.write_text(text + "\n<!--\n" + json.dumps(raw, indent=1) + "\n-->\n")
    print("\n" + text)


@dataclass
class Surface:
    fg: object
    scheme: str
    ca: Path | None
    moto: object  # a boto3 client straight to moto
    table: dict
    buckets: list = field(default_factory=list)

    def client(self, token=None, **kw):
        return s3_client_ex(self.fg.s3_url, token=token, verify=self.ca, **kw)

    @property
    def verify(self):
        """For `requests`: the test CA over HTTPS."""
        return str(self.ca) if self.ca else True

    def bucket(self, prefix: str = "surf", **create_kw) -> str:
        name = unique(f"{prefix}-{self.scheme}")[:63]
        self.moto.create_bucket(Bucket=name, **create_kw)
        return name

    def record(self, op: str, case: str, status):
        self.table[(op, case)][self.scheme].add(str(status))


@pytest.fixture(scope="module", params=["http", "https"])
def surface(request, moto_server, tls_files, tmp_path_factory, status_table):
    scheme = request.param
    workdir = tmp_path_factory.mktemp(f"surface-{scheme}")
    fg = start_fencegate(
        workdir,
        # SigV2 on, for its presigned URLs (test_presigned_urls); off by default.
        config={"server": {"sigv2": True}},
        upstream=moto_server.upstream_config(),
        https=tls_files if scheme == "https" else None,
    )
    assert fg.s3_url.startswith(scheme + "://")
    try:
        yield Surface(fg, scheme, tls_files.ca if scheme == "https" else None, moto_server.client(), status_table)
    finally:
        fg.stop()
        print(fg.log_tail(40))


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def outcome(fn):
    """(status, error code, Fencing-Token-Current, response or exception) of one boto3 call."""
    try:
        resp = fn()
        return resp["ResponseMetadata"]["HTTPStatusCode"], "", None, resp
    except ClientError as exc:
        return status_of(exc), code_of(exc), header_of(exc, "Fencing-Token-Current"), exc


def expect(s: Surface, op: str, case: str, fn, status: int, code: str = "", current=None):
    """Runs `fn`, records the status in the table, and checks status, code and current fence."""
    got, got_code, got_current, resp = outcome(fn)
    s.record(op, case, got)
    detail = getattr(resp, "response", resp)
    assert got == status, f"{op} ({case}, {s.scheme}): expected {status}, got {got} {got_code}: {detail}"
    if code:
        assert got_code == code, f"{op} ({case}): {detail}"
    if current is not None:
        assert got_current == str(current), f"{op} ({case}): Fencing-Token-Current {got_current}: {detail}"
    return resp


def refused_three_ways(s: Surface, op: str, fence: int, call, unchanged):
    """The stale and the token-less attempt are refused and change nothing upstream."""
    expect(s, op, "none", lambda: call(s.client()), 428, "FencingTokenRequired")
    unchanged()
    expect(s, op, "stale", lambda: call(s.client(token=fence - 1)), 409, "FencingTokenStale", current=fence)
    unchanged()


def body_at_upstream(s: Surface, bucket: str, key: str):
    try:
        return s.moto.get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError as exc:
        assert status_of(exc) == 404, exc.response
        return None


def stamp_at_upstream(s: Surface, bucket: str, key: str):
    return s.moto.head_object(Bucket=bucket, Key=key)["Metadata"].get("fencing-token")


def upload_ids(s: Surface, bucket: str) -> list:
    return [u["UploadId"] for u in s.moto.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]


def part_numbers(s: Surface, bucket: str, key: str, upload_id: str) -> list:
    return [p["PartNumber"] for p in s.moto.list_parts(Bucket=bucket, Key=key, UploadId=upload_id).get("Parts", [])]


def capture_requests(client) -> list:
    """Records (method, url, headers) of every request the client sends."""
    seen = []

    def hook(request, **_kw):
        headers = {k: v.decode() if isinstance(v, bytes) else v for k, v in request.headers.items()}
        seen.append((request.method, request.url, headers))

    client.meta.events.register("before-send.s3.*", hook)
    return seen


# --------------------------------------------------------------------------------------------
# object writes
# --------------------------------------------------------------------------------------------


def test_put_object(surface):
    s = surface
    bucket, key = s.bucket(), "put/report.csv"
    s.client(token=20).put_object(Bucket=bucket, Key=key, Body=b"v20")

    def unchanged():
        assert body_at_upstream(s, bucket, key) == b"v20"
        assert stamp_at_upstream(s, bucket, key) == "20"

    refused_three_ways(s, "PutObject", 20, lambda c: c.put_object(Bucket=bucket, Key=key, Body=b"late"), unchanged)
    expect(s, "PutObject", "fresh", lambda: s.client(token=21).put_object(Bucket=bucket, Key=key, Body=b"v21"), 200)
    assert body_at_upstream(s, bucket, key) == b"v21"
    assert stamp_at_upstream(s, bucket, key) == "21"
    # The current token again: accepted (writes with the current token run concurrently).
    expect(s, "PutObject", "fresh", lambda: s.client(token=21).put_object(Bucket=bucket, Key=key, Body=b"v21b"), 200)
    assert body_at_upstream(s, bucket, key) == b"v21b"


def test_put_object_token_as_metadata(surface):
    """For clients that cannot set headers: object metadata `fencing-token`."""
    s = surface
    bucket, key = s.bucket(), "meta/obj"
    plain = s.client()
    plain.put_object(Bucket=bucket, Key=key, Body=b"v20", Metadata={"fencing-token": "20"})
    op = "PutObject (token as metadata)"
    expect(s, op, "stale", lambda: plain.put_object(Bucket=bucket, Key=key, Body=b"x", Metadata={"fencing-token": "19"}),
           409, "FencingTokenStale", current=20)
    assert body_at_upstream(s, bucket, key) == b"v20"
    expect(s, op, "none", lambda: plain.put_object(Bucket=bucket, Key=key, Body=b"x", Metadata={"other": "1"}),
           428, "FencingTokenRequired")
    expect(s, op, "fresh", lambda: plain.put_object(Bucket=bucket, Key=key, Body=b"v21", Metadata={"fencing-token": "21"}),
           200)
    assert body_at_upstream(s, bucket, key) == b"v21"
    assert stamp_at_upstream(s, bucket, key) == "21"
    # Header and metadata both present: they must agree.
    bad = outcome(lambda: s.client(token=22).put_object(Bucket=bucket, Key=key, Body=b"x", Metadata={"fencing-token": "23"}))
    assert (bad[0], bad[1]) == (400, "InvalidFencingToken"), bad
    ok = outcome(lambda: s.client(token=22).put_object(Bucket=bucket, Key=key, Body=b"v22", Metadata={"fencing-token": "22"}))
    assert ok[0] == 200, ok
    assert body_at_upstream(s, bucket, key) == b"v22"


def test_copy_object_destination(surface):
    s = surface
    bucket = s.bucket()
    src, dst = "copy/src", "copy/dst"
    s.client(token=5).put_object(
        Bucket=bucket, Key=src, Body=b"source bytes", ContentType="text/csv", Metadata={"owner": "etl"}
    )
    s.client(token=20).put_object(Bucket=bucket, Key=dst, Body=b"v20")

    def copy(c):
        return c.copy_object(Bucket=bucket, Key=dst, CopySource={"Bucket": bucket, "Key": src})

    def unchanged():
        assert body_at_upstream(s, bucket, dst) == b"v20"

    refused_three_ways(s, "CopyObject", 20, copy, unchanged)
    resp = expect(s, "CopyObject", "fresh", lambda: copy(s.client(token=21)), 200)
    assert resp["CopyObjectResult"]["ETag"]
    head = s.moto.head_object(Bucket=bucket, Key=dst)
    assert body_at_upstream(s, bucket, dst) == b"source bytes"
    # COPY directive: the source's metadata and content type are kept, and the stamp is added.
    assert head["Metadata"] == {"owner": "etl", "fencing-token": "21"}, head
    assert head["ContentType"] == "text/csv", head
    # The source is not a write target: its own fence does not matter (token 21 > 5 anyway).
    assert stamp_at_upstream(s, bucket, src) == "5"

    # REPLACE directive: the new metadata plus the stamp.
    resp = expect(
        s, "CopyObject", "fresh",
        lambda: s.client(token=22).copy_object(
            Bucket=bucket, Key=dst, CopySource={"Bucket": bucket, "Key": src},
            MetadataDirective="REPLACE", Metadata={"replaced": "yes"}, ContentType="text/plain",
        ),
        200,
    )
    head = s.moto.head_object(Bucket=bucket, Key=dst)
    assert head["Metadata"] == {"replaced": "yes", "fencing-token": "22"}, head
    assert head["ContentType"] == "text/plain"


def test_delete_object(surface):
    s = surface
    bucket, key = s.bucket(), "del/obj"
    s.client(token=20).put_object(Bucket=bucket, Key=key, Body=b"v20")

    def unchanged():
        assert body_at_upstream(s, bucket, key) == b"v20"

    refused_three_ways(s, "DeleteObject", 20, lambda c: c.delete_object(Bucket=bucket, Key=key), unchanged)
    expect(s, "DeleteObject", "fresh", lambda: s.client(token=21).delete_object(Bucket=bucket, Key=key), 204)
    assert body_at_upstream(s, bucket, key) is None
    # A stale token cannot re-create it either.
    expect(s, "PutObject", "stale", lambda: s.client(token=20).put_object(Bucket=bucket, Key=key, Body=b"x"),
           409, "FencingTokenStale", current=21)
    assert body_at_upstream(s, bucket, key) is None


def test_delete_objects_per_key(surface):
    s = surface
    bucket = s.bucket()
    s.client(token=20).put_object(Bucket=bucket, Key="dk/fenced-a", Body=b"a20")
    s.client(token=20).put_object(Bucket=bucket, Key="dk/fenced-b", Body=b"b20")
    s.client(token=5).put_object(Bucket=bucket, Key="dk/free", Body=b"free5")
    keys = [{"Key": "dk/fenced-a"}, {"Key": "dk/free"}, {"Key": "dk/fenced-b"}]

    def delete(c, quiet=False):
        return c.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": quiet})

    op = "DeleteObjects"
    expect(s, op, "none", lambda: delete(s.client()), 428, "FencingTokenRequired")
    assert body_at_upstream(s, bucket, "dk/free") == b"free5"

    # Token 19: the two keys fenced at 20 are stale, the third (fence 5) is deleted.
    resp = expect(s, op, "stale", lambda: delete(s.client(token=19)), 200)
    errors = {e["Key"]: e["Code"] for e in resp.get("Errors", [])}
    assert errors == {"dk/fenced-a": "FencingTokenStale", "dk/fenced-b": "FencingTokenStale"}, resp
    assert {d["Key"] for d in resp.get("Deleted", [])} == {"dk/free"}, resp
    assert body_at_upstream(s, bucket, "dk/fenced-a") == b"a20"
    assert body_at_upstream(s, bucket, "dk/fenced-b") == b"b20"
    assert body_at_upstream(s, bucket, "dk/free") is None

    # Quiet mode: the refused keys are still reported (moto itself ignores Quiet and lists the
    # deleted keys anyway; that part is the upstream's).
    s.client(token=19).put_object(Bucket=bucket, Key="dk/free", Body=b"free19")
    resp = expect(s, op, "stale", lambda: delete(s.client(token=19), quiet=True), 200)
    assert {e["Key"] for e in resp.get("Errors", [])} == {"dk/fenced-a", "dk/fenced-b"}, resp
    assert {d["Key"] for d in resp.get("Deleted", [])} <= {"dk/free"}, resp
    assert body_at_upstream(s, bucket, "dk/free") is None

    # Every key stale: nothing is forwarded, every key is an error.
    s.client(token=20).put_object(Bucket=bucket, Key="dk/free", Body=b"free20")
    resp = expect(s, op, "stale", lambda: delete(s.client(token=7)), 200)
    assert {e["Key"] for e in resp.get("Errors", [])} == {"dk/fenced-a", "dk/fenced-b", "dk/free"}, resp
    assert body_at_upstream(s, bucket, "dk/free") == b"free20"

    resp = expect(s, op, "fresh", lambda: delete(s.client(token=21)), 200)
    assert not resp.get("Errors"), resp
    assert {d["Key"] for d in resp["Deleted"]} == {"dk/fenced-a", "dk/fenced-b", "dk/free"}, resp
    for k in keys:
        assert body_at_upstream(s, bucket, k["Key"]) is None


# --------------------------------------------------------------------------------------------
# multipart
# --------------------------------------------------------------------------------------------


def test_multipart_upload_every_step(surface):
    s = surface
    bucket, key = s.bucket(), "mp/object.bin"
    s.client(token=20).put_object(Bucket=bucket, Key=key, Body=b"v20")
    s.moto.put_object(Bucket=bucket, Key="mp/copy-source", Body=b"tail from a copy")

    # CreateMultipartUpload (fence 20)
    refused_three_ways(
        s, "CreateMultipartUpload", 20, lambda c: c.create_multipart_upload(Bucket=bucket, Key=key),
        lambda: upload_ids(s, bucket) == [] or pytest.fail(f"an upload was created: {upload_ids(s, bucket)}"),
    )
    created = expect(s, "CreateMultipartUpload", "fresh",
                     lambda: s.client(token=21).create_multipart_upload(Bucket=bucket, Key=key), 200)
    upload_id = created["UploadId"]
    assert upload_ids(s, bucket) == [upload_id]

    # UploadPart (fence 21)
    def no_parts():
        assert part_numbers(s, bucket, key, upload_id) == []

    refused_three_ways(
        s, "UploadPart", 21,
        lambda c: c.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=1, Body=PART), no_parts,
    )
    part1 = expect(s, "UploadPart", "fresh", lambda: s.client(token=22).upload_part(
        Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=1, Body=PART), 200)
    assert part_numbers(s, bucket, key, upload_id) == [1]

    # UploadPartCopy (fence 22)
    def copy_part(c):
        return c.upload_part_copy(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=2,
                                  CopySource={"Bucket": bucket, "Key": "mp/copy-source"})

    refused_three_ways(s, "UploadPartCopy", 22, copy_part,
                       lambda: part_numbers(s, bucket, key, upload_id) == [1] or pytest.fail("part 2 appeared"))
    part2 = expect(s, "UploadPartCopy", "fresh", lambda: copy_part(s.client(token=23)), 200)
    assert part_numbers(s, bucket, key, upload_id) == [1, 2]

    # CompleteMultipartUpload (fence 23): the commit point.
    parts = {"Parts": [{"PartNumber": 1, "ETag": part1["ETag"]},
                       {"PartNumber": 2, "ETag": part2["CopyPartResult"]["ETag"]}]}

    def complete(c):
        return c.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload=parts)

    def not_completed():
        assert body_at_upstream(s, bucket, key) == b"v20"
        assert upload_ids(s, bucket) == [upload_id]

    refused_three_ways(s, "CompleteMultipartUpload", 23, complete, not_completed)
    done = expect(s, "CompleteMultipartUpload", "fresh", lambda: complete(s.client(token=24)), 200)
    assert done["ETag"].endswith('-2"'), done
    assert body_at_upstream(s, bucket, key) == PART + b"tail from a copy"
    # The stamp is the one CreateMultipartUpload carried (the completion cannot change metadata).
    assert stamp_at_upstream(s, bucket, key) == "21"
    assert upload_ids(s, bucket) == []

    # AbortMultipartUpload (fence 24)
    other = s.client(token=24).create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    refused_three_ways(
        s, "AbortMultipartUpload", 24,
        lambda c: c.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=other),
        lambda: upload_ids(s, bucket) == [other] or pytest.fail("the upload was aborted"),
    )
    expect(s, "AbortMultipartUpload", "fresh",
           lambda: s.client(token=25).abort_multipart_upload(Bucket=bucket, Key=key, UploadId=other), 204)
    assert upload_ids(s, bucket) == []
    assert body_at_upstream(s, bucket, key) == PART + b"tail from a copy"


def test_stale_holder_upload_cannot_complete_new_holder_completes(surface):
    """A's upload (token 11) is overtaken by B (token 12): A's parts and Complete are refused,
    B's own upload completes, and the object is B's."""
    s = surface
    bucket, key = s.bucket(), "mp/handover"
    a, b = s.client(token=11), s.client(token=12)
    a_id = a.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    a1 = a.upload_part(Bucket=bucket, Key=key, UploadId=a_id, PartNumber=1, Body=PART)
    b_id = b.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    b1 = b.upload_part(Bucket=bucket, Key=key, UploadId=b_id, PartNumber=1, Body=b"B" * 1024)

    st = outcome(lambda: a.upload_part(Bucket=bucket, Key=key, UploadId=a_id, PartNumber=2, Body=b"late"))
    assert st[:3] == (409, "FencingTokenStale", "12"), st
    st = outcome(lambda: a.complete_multipart_upload(
        Bucket=bucket, Key=key, UploadId=a_id, MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": a1["ETag"]}]}))
    assert st[:3] == (409, "FencingTokenStale", "12"), st
    assert body_at_upstream(s, bucket, key) is None
    b.complete_multipart_upload(
        Bucket=bucket, Key=key, UploadId=b_id, MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": b1["ETag"]}]})
    assert body_at_upstream(s, bucket, key) == b"B" * 1024
    assert stamp_at_upstream(s, bucket, key) == "12"
    # The stale holder may still clean up its own upload (docs/design.md, "Uploads left behind"), which commits
    # nothing; then it is gone for the new holder too.
    assert outcome(lambda: a.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=a_id))[0] == 204
    assert outcome(lambda: b.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=a_id))[0] == 404
    assert body_at_upstream(s, bucket, key) == b"B" * 1024


def test_next_write_after_an_early_answer_on_one_connection(surface):
    """boto3 sends `Expect: 100-continue` on every PutObject and keeps connections open. When a
    PutObject is answered without a `100 Continue` (an empty body, or a refusal), the next write
    on the same connection must still be reported as what it was. (One client, so one pooled
    connection; the token travels as metadata so that it can change per call.)"""
    s = surface
    bucket = s.bucket()
    c = s.client()

    def put(key, body, token):
        return outcome(lambda: c.put_object(Bucket=bucket, Key=key, Body=body, Metadata={"fencing-token": str(token)}))

    problems = []
    assert put("ka/obj", b"v5", 5)[0] == 200
    # An empty body, accepted; then a write with a body.
    assert put("ka/empty", b"", 5)[0] == 200
    status, code, _cur, resp = put("ka/obj", b"after an empty write", 6)
    etag = resp.get("ETag") if isinstance(resp, dict) else None
    s.record("PutObject after an empty PutObject (same connection)", "fresh",
             f"{status}" + ("" if etag or status != 200 else " without headers"))
    if not (status == 200 and etag):
        problems.append(("write after an empty write", status, code, getattr(resp, "response", resp)))
    assert body_at_upstream(s, bucket, "ka/obj") == b"after an empty write"

    # An empty body, refused as stale; then a fresh write with a body.
    c = s.client()  # a fresh connection, so the first case cannot disturb this one
    assert put("ka/obj", b"", 4)[:2] == (409, "FencingTokenStale")
    status, code, _cur, resp = put("ka/obj", b"fresh after a refusal", 7)
    committed = body_at_upstream(s, bucket, "ka/obj")
    s.record("PutObject after a refused empty PutObject (same connection)", "fresh", f"{status} {code}".strip())
    if (status, committed) != (200, b"fresh after a refusal"):
        problems.append(("write after a refused empty write", f"reported {status} {code}",
                         f"upstream holds {committed!r}", getattr(resp, "response", resp)))
    assert not problems, problems


# --------------------------------------------------------------------------------------------
# object sub-resources
# --------------------------------------------------------------------------------------------


def test_tagging_and_acl(surface):
    s = surface
    bucket, key = s.bucket(), "sub/obj"
    s.client(token=20).put_object(Bucket=bucket, Key=key, Body=b"v20")
    s.moto.put_object_tagging(Bucket=bucket, Key=key, Tagging={"TagSet": [{"Key": "state", "Value": "v20"}]})

    def tags():
        return {t["Key"]: t["Value"] for t in s.moto.get_object_tagging(Bucket=bucket, Key=key)["TagSet"]}

    def put_tags(c):
        return c.put_object_tagging(Bucket=bucket, Key=key, Tagging={"TagSet": [{"Key": "state", "Value": "late"}]})

    refused_three_ways(s, "PutObjectTagging", 20, put_tags, lambda: tags() == {"state": "v20"} or pytest.fail(tags()))
    expect(s, "PutObjectTagging", "fresh", lambda: s.client(token=21).put_object_tagging(
        Bucket=bucket, Key=key, Tagging={"TagSet": [{"Key": "state", "Value": "v21"}]}), 200)
    assert tags() == {"state": "v21"}

    refused_three_ways(s, "DeleteObjectTagging", 21, lambda c: c.delete_object_tagging(Bucket=bucket, Key=key),
                       lambda: tags() == {"state": "v21"} or pytest.fail(tags()))
    expect(s, "DeleteObjectTagging", "fresh",
           lambda: s.client(token=22).delete_object_tagging(Bucket=bucket, Key=key), 204)
    assert tags() == {}

    def public():
        grants = s.moto.get_object_acl(Bucket=bucket, Key=key)["Grants"]
        return any(g["Grantee"].get("URI", "").endswith("/AllUsers") for g in grants)

    assert not public()
    refused_three_ways(s, "PutObjectAcl", 22, lambda c: c.put_object_acl(Bucket=bucket, Key=key, ACL="public-read"),
                       lambda: not public() or pytest.fail("ACL changed"))
    expect(s, "PutObjectAcl", "fresh",
           lambda: s.client(token=23).put_object_acl(Bucket=bucket, Key=key, ACL="public-read"), 200)
    assert public()


def test_retention_and_legal_hold(surface):
    s = surface
    bucket = s.bucket("lock", ObjectLockEnabledForBucket=True)
    key = "sub/locked"
    s.client(token=20).put_object(Bucket=bucket, Key=key, Body=b"v20")
    until = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0) + datetime.timedelta(days=1)

    def lock_mode():
        return s.moto.head_object(Bucket=bucket, Key=key).get("ObjectLockMode")

    def retention(c):
        return c.put_object_retention(Bucket=bucket, Key=key,
                                      Retention={"Mode": "GOVERNANCE", "RetainUntilDate": until})

    refused_three_ways(s, "PutObjectRetention", 20, retention,
                       lambda: lock_mode() is None or pytest.fail(f"retention set: {lock_mode()}"))
    expect(s, "PutObjectRetention", "fresh", lambda: retention(s.client(token=21)), 200)
    assert lock_mode() == "GOVERNANCE"

    def hold():
        return s.moto.get_object_legal_hold(Bucket=bucket, Key=key)["LegalHold"]["Status"]

    def put_hold(c, status="ON"):
        return c.put_object_legal_hold(Bucket=bucket, Key=key, LegalHold={"Status": status})

    s.moto.put_object_legal_hold(Bucket=bucket, Key=key, LegalHold={"Status": "OFF"})
    refused_three_ways(s, "PutObjectLegalHold", 21, put_hold, lambda: hold() == "OFF" or pytest.fail(hold()))
    expect(s, "PutObjectLegalHold", "fresh", lambda: put_hold(s.client(token=22)), 200)
    assert hold() == "ON"


def test_reads_listings_and_bucket_operations_need_no_token(surface):
    s = surface
    plain = s.client()
    bucket = unique(f"made-{s.scheme}")[:63]
    assert plain.create_bucket(Bucket=bucket)["ResponseMetadata"]["HTTPStatusCode"] == 200
    s.client(token=3).put_object(Bucket=bucket, Key="r/a", Body=b"0123456789")
    assert plain.get_object(Bucket=bucket, Key="r/a")["Body"].read() == b"0123456789"
    assert plain.get_object(Bucket=bucket, Key="r/a", Range="bytes=2-4")["Body"].read() == b"234"
    assert plain.head_object(Bucket=bucket, Key="r/a")["Metadata"] == {"fencing-token": "3"}
    assert [o["Key"] for o in plain.list_objects_v2(Bucket=bucket)["Contents"]] == ["r/a"]
    assert bucket in [b["Name"] for b in plain.list_buckets()["Buckets"]]
    plain.put_bucket_tagging(Bucket=bucket, Tagging={"TagSet": [{"Key": "team", "Value": "x"}]})
    assert outcome(lambda: plain.get_object(Bucket=bucket, Key="missing"))[:2] == (404, "NoSuchKey")


# --------------------------------------------------------------------------------------------
# checksums: the SDK defaults, and hand-made aws-chunked bodies
# --------------------------------------------------------------------------------------------

SDK_ALGORITHMS = ["CRC32", "SHA1", "SHA256"]  # boto3 without awscrt cannot do CRC32C/CRC64NVME


@pytest.mark.parametrize("algorithm", SDK_ALGORITHMS)
def test_sdk_checksums_put_object(surface, algorithm):
    s = surface
    bucket, key = s.bucket(), f"sum/{algorithm}"
    data = bytes(range(256)) * 800  # 200 KiB, several aws-chunked chunks
    s.client(token=20).put_object(Bucket=bucket, Key=key, Body=b"v20")
    op = f"PutObject ChecksumAlgorithm={algorithm}"

    def put(c, body):
        return c.put_object(Bucket=bucket, Key=key, Body=body, ChecksumAlgorithm=algorithm)

    refused_three_ways(s, op, 20, lambda c: put(c, data),
                       lambda: body_at_upstream(s, bucket, key) == b"v20" or pytest.fail("changed"))
    fresh = s.client(token=21)
    sent = capture_requests(fresh)
    expect(s, op, "fresh", lambda: put(fresh, data), 200)
    assert body_at_upstream(s, bucket, key) == data
    _method, _url, headers = sent[-1]
    trailer = CHECKSUMS[algorithm][0]
    if s.scheme == "https":
        # Over TLS botocore sends the SDK default: aws-chunked with the checksum as a trailer.
        assert headers.get("Content-Encoding") == "aws-chunked", headers
        assert headers.get("X-Amz-Trailer") == trailer, headers
    else:
        assert headers.get(trailer) == checksum_b64(algorithm, data), headers


@pytest.mark.parametrize("algorithm", SDK_ALGORITHMS)
def test_sdk_checksums_upload_part(surface, algorithm):
    s = surface
    bucket, key = s.bucket(), f"sumpart/{algorithm}"
    c = s.client(token=20)
    upload_id = c.create_multipart_upload(Bucket=bucket, Key=key, ChecksumAlgorithm=algorithm)["UploadId"]
    op = f"UploadPart ChecksumAlgorithm={algorithm}"

    def part(cl, n, body):
        return cl.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=n, Body=body,
                              ChecksumAlgorithm=algorithm)

    refused_three_ways(s, op, 20, lambda cl: part(cl, 1, PART),
                       lambda: part_numbers(s, bucket, key, upload_id) == [] or pytest.fail("part added"))
    p1 = expect(s, op, "fresh", lambda: part(s.client(token=21), 1, PART), 200)
    p2 = expect(s, op, "fresh", lambda: part(s.client(token=21), 2, b"last part"), 200)
    s.client(token=21).complete_multipart_upload(
        Bucket=bucket, Key=key, UploadId=upload_id,
        MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": p1["ETag"]}, {"PartNumber": 2, "ETag": p2["ETag"]}]},
    )
    assert body_at_upstream(s, bucket, key) == PART + b"last part"


def _raw(s: Surface, method: str, path: str, headers: dict, body: bytes):
    host, port = s.fg.s3_addr
    h = dict(headers)
    h.setdefault("Content-Length", str(len(body)))
    signed = sign_headers(method, host, port, path, h)
    return raw_request_any(s.fg.s3_addr, method, path, signed, body, ca=s.ca)


@pytest.mark.parametrize("algorithm", list(CHECKSUMS))
def test_trailing_checksum_verified_before_commit(surface, algorithm):
    """A hand-made aws-chunked PutObject: the right trailer commits, a wrong one is refused with
    400 BadDigest and nothing is committed (neither a new object nor over an existing one)."""
    s = surface
    bucket = s.bucket()
    data = os.urandom(150 * 1024)
    trailer = CHECKSUMS[algorithm][0]
    token = {"Fencing-Token": "20"}

    good = _raw(s, "PUT", f"/{bucket}/chunked/good", {**aws_chunked_headers(data, trailer, algorithm), **token},
                aws_chunked_unsigned(data, trailer, checksum_b64(algorithm, data)))
    assert good.status == 200, (good.status, good.body[:400])
    assert body_at_upstream(s, bucket, "chunked/good") == data

    bad_body = aws_chunked_unsigned(data, trailer, wrong_checksum_b64(algorithm, data))
    bad = _raw(s, "PUT", f"/{bucket}/chunked/new", {**aws_chunked_headers(data, trailer, algorithm), **token}, bad_body)
    s.record(f"PutObject, wrong trailing {algorithm}", "fresh", bad.status)
    assert (bad.status, bad.code()) == (400, "BadDigest"), (bad.status, bad.body[:400])
    assert body_at_upstream(s, bucket, "chunked/new") is None

    bad = _raw(s, "PUT", f"/{bucket}/chunked/good", {**aws_chunked_headers(data, trailer, algorithm), **token}, bad_body)
    assert (bad.status, bad.code()) == (400, "BadDigest"), (bad.status, bad.body[:400])
    assert body_at_upstream(s, bucket, "chunked/good") == data


@pytest.mark.parametrize("algorithm", list(CHECKSUMS))
def test_trailing_checksum_upload_part(surface, algorithm):
    s = surface
    bucket, key = s.bucket(), "chunked/mp"
    upload_id = s.client(token=20).create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    trailer = CHECKSUMS[algorithm][0]
    path = f"/{bucket}/{key}?partNumber=1&uploadId={upload_id}"
    headers = {**aws_chunked_headers(PART, trailer, algorithm), "Fencing-Token": "20"}

    bad = _raw(s, "PUT", path, headers, aws_chunked_unsigned(PART, trailer, wrong_checksum_b64(algorithm, PART)))
    s.record(f"UploadPart, wrong trailing {algorithm}", "fresh", bad.status)
    assert (bad.status, bad.code()) == (400, "BadDigest"), (bad.status, bad.body[:400])
    assert part_numbers(s, bucket, key, upload_id) == []

    good = _raw(s, "PUT", path, headers, aws_chunked_unsigned(PART, trailer, checksum_b64(algorithm, PART)))
    assert good.status == 200, (good.status, good.body[:400])
    assert part_numbers(s, bucket, key, upload_id) == [1]


def test_signed_chunks(surface):
    """`STREAMING-AWS4-HMAC-SHA256-PAYLOAD[-TRAILER]`: a body whose chunk signature, trailer
    signature or trailing checksum fails is never committed."""
    s = surface
    bucket = s.bucket()
    host, port = s.fg.s3_addr
    data = os.urandom(200 * 1024)
    crc = ("x-amz-checksum-crc32", checksum_b64("CRC32", data))
    token = {"Fencing-Token": "20"}

    def send(key, **kw):
        path = f"/{bucket}/{key}"
        headers, body = signed_chunked_request(host, port, path, data, extra_headers=token, **kw)
        return raw_request_any(s.fg.s3_addr, "PUT", path, headers, body, ca=s.ca)

    for key, kw in [("sig/plain", {}), ("sig/trailer", {"trailer": crc})]:
        r = send(key, **kw)
        assert r.status == 200, (key, r.status, r.body[:400])
        assert body_at_upstream(s, bucket, key) == data

    # What matters is that nothing commits. The status: S3 answers 403 SignatureDoesNotMatch to
    # a bad chunk signature; fencegate answers 400 (IncompleteBody, the body failed to decode).
    cases = {
        "sig/tampered-chunk": (dict(tamper_chunk=1), (400, "IncompleteBody")),
        "sig/tampered-chunk-trailer": (dict(tamper_chunk=0, trailer=crc), (400, "IncompleteBody")),
        "sig/tampered-trailer-signature": (dict(trailer=crc, tamper_trailer_signature=True), (400, "IncompleteBody")),
        "sig/wrong-checksum": (dict(trailer=("x-amz-checksum-crc32", wrong_checksum_b64("CRC32", data))), (400, "BadDigest")),
    }
    for key, (kw, answer) in cases.items():
        r = send(key, **kw)
        s.record(f"PutObject, signed chunks: {key.split('/')[1]}", "fresh", f"{r.status} {r.code()}")
        assert (r.status, r.code()) == answer, (key, r.status, r.body[:400])
        assert body_at_upstream(s, bucket, key) is None, key
        # Over an existing object: it keeps its bytes.
        r = send("sig/plain", **kw)
        assert (r.status, r.code()) == answer, (key, r.status, r.body[:400])
        assert body_at_upstream(s, bucket, "sig/plain") == data, key


# --------------------------------------------------------------------------------------------
# presigned URLs
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("signature_version", ["s3v4", "s3"], ids=["sigv4", "sigv2"])
def test_presigned_urls(surface, signature_version):
    s = surface
    bucket, key = s.bucket(), f"pre/{signature_version}"
    s.client(token=20).put_object(Bucket=bucket, Key=key, Body=b"v20")
    signer = s.client(signature_version=signature_version)
    label = "SigV4" if signature_version == "s3v4" else "SigV2"

    url = signer.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=300)
    if signature_version == "s3":
        assert "AWSAccessKeyId=" in url and "Signature=" in url, url
    else:
        assert "X-Amz-Signature=" in url, url
    r = requests.get(url, verify=s.verify, timeout=30)
    assert (r.status_code, r.content) == (200, b"v20"), r.text

    op = f"PutObject presigned {label}"
    put_url = signer.generate_presigned_url("put_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=300)

    def put(token, body):
        headers = {"Fencing-Token": str(token)} if token is not None else {}
        r = requests.put(put_url, data=body, headers=headers, verify=s.verify, timeout=30)
        return r

    r = put(None, b"none")
    s.record(op, "none", r.status_code)
    assert (r.status_code, s3_error_code(r.content)) == (428, "FencingTokenRequired"), r.text
    # A `Fencing-Token` header the signature does not cover counts for nothing: whoever holds
    # the URL could otherwise set any token (docs/security.md, "Who can move a fence").
    for token, case in [(19, "stale, unsigned header"), (21, "fresh, unsigned header")]:
        r = put(token, b"unsigned token")
        s.record(op, case, r.status_code)
        assert (r.status_code, s3_error_code(r.content)) == (400, "InvalidFencingToken"), r.text
        assert body_at_upstream(s, bucket, key) == b"v20"

    # The token in the presigned metadata (signed: the caller must send the same header). A
    # SigV2 write never raises a fence (it signs no body): above the fence it is 409
    # `FencingTokenUnregistered`, at the fence it is written.
    op = f"PutObject presigned {label}, token as signed metadata"
    written = 22 if signature_version == "s3v4" else 20
    for token, expected in [(19, 409), (20, 200), (22, 200 if written == 22 else 409)]:
        meta_url = signer.generate_presigned_url(
            "put_object", Params={"Bucket": bucket, "Key": key, "Metadata": {"fencing-token": str(token)}},
            ExpiresIn=300)
        r = requests.put(meta_url, data=f"meta {token}".encode(), headers={"x-amz-meta-fencing-token": str(token)},
                         verify=s.verify, timeout=30)
        s.record(op, {19: "stale", 20: "at the fence", 22: "fresh"}[token], r.status_code)
        assert r.status_code == expected, r.text
        if token == 22 and written == 20:
            assert s3_error_code(r.content) == "FencingTokenUnregistered", r.text
    assert body_at_upstream(s, bucket, key) == f"meta {written}".encode()

    op = f"DeleteObject presigned {label}"
    del_url = signer.generate_presigned_url("delete_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=300)
    # boto3 cannot sign a header into a presigned DELETE: its token can only be unsigned, so
    # such a URL cannot carry one (a SigV4 URL made with the header in X-Amz-SignedHeaders can:
    # test_trust.py).
    for token, expected in [(None, (428, "FencingTokenRequired")), (21, (400, "InvalidFencingToken")),
                            (23, (400, "InvalidFencingToken"))]:
        headers = {"Fencing-Token": str(token)} if token else {}
        r = requests.delete(del_url, headers=headers, verify=s.verify, timeout=30)
        s.record(op, {None: "none", 21: "stale, unsigned header", 23: "fresh, unsigned header"}[token], r.status_code)
        assert (r.status_code, s3_error_code(r.content)) == expected, r.text
    assert body_at_upstream(s, bucket, key) == f"meta {written}".encode()

    # A tampered signature and an expired URL are refused (403), and write nothing.
    bad = re.sub(r"(Signature=)([^&]+)", lambda m: m.group(1) + ("1" if m.group(2)[0] != "1" else "2")
                 + m.group(2)[1:], put_url)
    assert bad != put_url
    r = requests.put(bad, data=b"forged", headers={"Fencing-Token": "30"}, verify=s.verify, timeout=30)
    assert r.status_code == 403, r.text
    expired = signer.generate_presigned_url("put_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=1)
    time.sleep(2.1)
    r = requests.put(expired, data=b"expired", headers={"Fencing-Token": "30"}, verify=s.verify, timeout=30)
    assert r.status_code == 403, r.text
    assert body_at_upstream(s, bucket, key) == f"meta {written}".encode()


# --------------------------------------------------------------------------------------------
# HTTP/2 (curl --aws-sigv4) and HTTP/1.1
# --------------------------------------------------------------------------------------------


def _curl(s: Surface, url: str, *args) -> tuple:
    out = s.fg.workdir / "curl.out"
    cmd = [
        "curl", "-sS", "--max-time", "30",
        "--aws-sigv4", f"aws:amz:{REGION}:s3", "--user", f"{ACCESS_KEY}:{SECRET_KEY}",
        "-H", "x-amz-content-sha256: UNSIGNED-PAYLOAD",
        "-o", str(out), "-w", "%{http_code} %{http_version}",
    ]
    if s.ca:
        cmd += ["--cacert", str(s.ca)]
    r = subprocess.run(cmd + list(args) + [url], capture_output=True, text=True, timeout=60)
    status, _, version = r.stdout.partition(" ")
    body = out.read_bytes() if out.exists() else b""
    out.unlink(missing_ok=True)
    return int(status or 0), version, body, r.stderr.strip()


def test_http2_curl(surface, tmp_path):
    """curl over HTTP/2: ALPN h2 over HTTPS (`--http2`), prior knowledge (h2c) over HTTP.

    The refusals here are body-less writes (DELETE). A refused PUT whose body is still being
    sent is answered in full and then reset with NO_ERROR (RFC 9113 8.1), which curl 7.88
    sometimes reports as "(92) Stream error in the HTTP/2 framing layer" instead of the
    response: that case is checked frame by frame in `test_http2_refusal_frames`.
    """
    s = surface
    bucket, key = s.bucket(), "h2/obj"
    url = f"{s.fg.s3_url}/{bucket}/{key}"
    h2 = ["--http2"] if s.scheme == "https" else ["--http2-prior-knowledge"]
    payload = tmp_path / "payload"
    data = os.urandom(256 * 1024)
    payload.write_bytes(data)
    s.client(token=20).put_object(Bucket=bucket, Key=key, Body=b"v20")

    op = "PutObject over HTTP/2 (curl)"
    status, version, body, err = _curl(s, url, *h2, "-H", "Fencing-Token: 21", "-T", str(payload))
    s.record(op, "fresh", status)
    assert (status, version) == (200, "2"), (status, version, body, err)
    assert body_at_upstream(s, bucket, key) == data
    assert stamp_at_upstream(s, bucket, key) == "21"

    status, version, body, err = _curl(s, url, *h2)
    assert (status, version, body) == (200, "2", data), (status, version, err)

    op = "DeleteObject over HTTP/2 (curl)"
    for case, extra, expected in [("stale", ["-H", "Fencing-Token: 20"], (409, "FencingTokenStale")),
                                  ("none", [], (428, "FencingTokenRequired"))]:
        status, version, body, err = _curl(s, url, *h2, *extra, "-X", "DELETE")
        s.record(op, case, status)
        assert (status, version, s3_error_code(body)) == (*expected[:1], "2", expected[1]), (status, version, body, err)
        assert body_at_upstream(s, bucket, key) == data
    status, version, body, err = _curl(s, url, *h2, "-H", "Fencing-Token: 21", "-X", "DELETE")
    s.record(op, "fresh", status)
    assert (status, version) == (204, "2"), (status, version, body, err)
    assert body_at_upstream(s, bucket, key) is None

    if s.scheme == "https":
        s.client(token=21).put_object(Bucket=bucket, Key=key, Body=b"h1")
        status, version, body, err = _curl(s, url, "--http1.1")
        assert (status, version, body) == (200, "1.1", b"h1"), (status, version, err)


@pytest.mark.parametrize("body_size", [16 * 1024, 1 * MiB], ids=["16KiB", "1MiB"])
def test_http2_refusal_frames(surface, body_size):
    """A write refused over HTTP/2 while its body is still coming: the whole 409/428 response
    (HEADERS, then DATA with END_STREAM) is sent before the stream is reset, and the reset is
    NO_ERROR (RFC 9113 8.1), so a client can read the refusal. A fresh write over the same
    kind of connection commits."""
    s = surface
    bucket, key = s.bucket(), "h2raw/obj"
    host, port = s.fg.s3_addr
    path = f"/{bucket}/{key}"
    s.client(token=20).put_object(Bucket=bucket, Key=key, Body=b"v20")
    data = os.urandom(body_size)
    op = "PutObject over HTTP/2 (frames)"

    for case, token, status, code in [("stale", "19", 409, "FencingTokenStale"), ("none", None, 428, "FencingTokenRequired")]:
        headers = {"Content-Length": str(len(data))}
        if token:
            headers["Fencing-Token"] = token
        signed = sign_headers("PUT", host, port, path, headers)
        frames = h2_request(s.fg.s3_addr, "PUT", path, signed, data[:16384], end_stream=len(data) <= 16384, ca=s.ca)
        got = h2_status(frames)
        s.record(op, case, got)
        kinds = [(f.kind, f.error_code) for f in frames if f.stream in (0, 1) and f.kind not in ("SETTINGS", "WINDOW_UPDATE", "PING")]
        assert got == status, kinds
        assert s3_error_code(h2_body(frames)) == code, h2_body(frames)[:300]
        ends = [i for i, f in enumerate(frames) if f.stream == 1 and f.end_stream]
        resets = [i for i, f in enumerate(frames) if f.stream == 1 and f.kind == "RST_STREAM"]
        assert ends, kinds
        assert all(r > ends[0] for r in resets), f"reset before the response ended: {kinds}"
        assert all(frames[r].error_code == 0 for r in resets), f"reset with an error code: {kinds}"
        assert not any(f.kind == "GOAWAY" and f.error_code for f in frames), kinds
        assert body_at_upstream(s, bucket, key) == b"v20"

    whole = data[:60000]  # within the initial flow-control window: this client sends without waiting
    signed = sign_headers("PUT", host, port, path, {"Content-Length": str(len(whole)), "Fencing-Token": "21"})
    frames = h2_request(s.fg.s3_addr, "PUT", path, signed, whole, end_stream=True, ca=s.ca, wait=10)
    got = h2_status(frames)
    s.record(op, "fresh", got)
    assert got == 200, [(f.kind, f.error_code) for f in frames]
    assert body_at_upstream(s, bucket, key) == whole


# --------------------------------------------------------------------------------------------
# the aws CLI: metadata token, and a plugin that adds the header (docs/clients.md)
# --------------------------------------------------------------------------------------------


def doc_block(name: str) -> str:
    """The code block after `<!-- example: NAME -->` in docs/clients.md."""
    text = (REPO_ROOT / "docs" / "clients.md").read_text()
    m = re.search(r"<!-- example: " + re.escape(name) + r" -->\s*```[a-z]*\n(.*?)```", text, re.S)
    assert m, f"docs/clients.md has no example {name!r}"
    return m.group(1)


def _aws(s: Surface, tmp_path, *args, env_extra=None):
    cfg = tmp_path / "aws-config"
    cfg.write_text(f"[default]\nregion = {REGION}\ns3 =\n    addressing_style = path\n")
    env = dict(os.environ)
    env.update(
        AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_DEFAULT_REGION=REGION,
        AWS_CONFIG_FILE=str(cfg), AWS_SHARED_CREDENTIALS_FILE=os.devnull, AWS_MAX_ATTEMPTS="1", AWS_PAGER="",
    )
    env.update(env_extra or {})
    cmd = ["aws", "--endpoint-url", s.fg.s3_url]
    if s.ca:
        cmd += ["--ca-bundle", str(s.ca)]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, env=env, timeout=120)


def test_aws_cli(surface, tmp_path):
    s = surface
    bucket, key = s.bucket(), "cli/obj"
    f = tmp_path / "f.txt"
    f.write_bytes(b"from the aws CLI")
    r = _aws(s, tmp_path, "s3api", "put-object", "--bucket", bucket, "--key", key, "--body", str(f),
             "--metadata", "fencing-token=20")
    assert r.returncode == 0, r.stderr
    r = _aws(s, tmp_path, "s3api", "put-object", "--bucket", bucket, "--key", key, "--body", str(f),
             "--metadata", "fencing-token=19")
    assert r.returncode != 0 and "FencingTokenStale" in r.stderr, (r.stdout, r.stderr)

    # The plugin from docs/clients.md: Fencing-Token from $FENCING_TOKEN on every S3 request,
    # so operations without metadata (delete-object, tagging, multipart steps) carry it too.
    plugin_dir = tmp_path / "plugins"
    plugin_dir.mkdir()
    (plugin_dir / "fencing_token_plugin.py").write_text(doc_block("aws-cli-plugin"))
    cfg_extra = "\n[plugins]\nfencing_token = fencing_token_plugin\n"
    env = {"PYTHONPATH": str(plugin_dir)}

    def aws_plugin(token, *args):
        cfg = tmp_path / "aws-config-plugin"
        cfg.write_text(f"[default]\nregion = {REGION}\ns3 =\n    addressing_style = path\n{cfg_extra}")
        extra = dict(env, AWS_CONFIG_FILE=str(cfg))
        if token is not None:
            extra["FENCING_TOKEN"] = str(token)
        return _aws(s, tmp_path, *args, env_extra=extra)

    r = aws_plugin(19, "s3api", "delete-object", "--bucket", bucket, "--key", key)
    assert r.returncode != 0 and "FencingTokenStale" in r.stderr, (r.stdout, r.stderr)
    r = aws_plugin(None, "s3api", "delete-object", "--bucket", bucket, "--key", key)
    assert r.returncode != 0 and "FencingTokenRequired" in r.stderr, (r.stdout, r.stderr)
    assert body_at_upstream(s, bucket, key) == b"from the aws CLI"
    r = aws_plugin(21, "s3", "cp", str(f), f"s3://{bucket}/cli/copied")
    assert r.returncode == 0, r.stderr
    assert stamp_at_upstream(s, bucket, "cli/copied") == "21"
    r = aws_plugin(21, "s3api", "delete-object", "--bucket", bucket, "--key", key)
    assert r.returncode == 0, r.stderr
    assert body_at_upstream(s, bucket, key) is None


def test_boto3_example_from_docs(surface, monkeypatch):
    """The boto3 example of docs/clients.md runs as written (endpoint and CA from the env)."""
    s = surface
    bucket = s.bucket()
    monkeypatch.setenv("FENCEGATE_ENDPOINT", s.fg.s3_url)
    monkeypatch.setenv("FENCEGATE_BUCKET", bucket)
    if s.ca:
        monkeypatch.setenv("AWS_CA_BUNDLE", str(s.ca))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    namespace: dict = {"__name__": "docs_example"}
    exec(compile(doc_block("boto3-hook"), "docs/clients.md:boto3-hook", "exec"), namespace)
    assert body_at_upstream(s, bucket, "reports/2026/11.csv") == b"B's report"
    assert stamp_at_upstream(s, bucket, "reports/2026/11.csv") == "12"


# --------------------------------------------------------------------------------------------
# virtual-hosted addressing (server.domain)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["http", "https"])
def vhost(request, moto_server, tls_files, tmp_path_factory, status_table):
    """fencegate with `server.domain = "s3.fencegate.test"`; names under the test domain are
    resolved to 127.0.0.1 inside this process only (see `resolve_test_domain`)."""
    scheme = request.param
    fg = start_fencegate(
        tmp_path_factory.mktemp(f"vhost-{scheme}"),
        upstream=moto_server.upstream_config(),
        https=tls_files if scheme == "https" else None,
        config={"server": {"domain": TEST_DOMAIN}},
    )
    try:
        yield Surface(fg, scheme, tls_files.ca if scheme == "https" else None, moto_server.client(), status_table)
    finally:
        fg.stop()
        print(fg.log_tail(40))


@pytest.fixture
def resolve_test_domain(monkeypatch):
    """`*.s3.fencegate.test` -> 127.0.0.1 for this process (urllib3 resolves via getaddrinfo)."""
    real = socket.getaddrinfo

    def getaddrinfo(host, *args, **kwargs):
        if isinstance(host, str) and (host == TEST_DOMAIN or host.endswith("." + TEST_DOMAIN)):
            host = "127.0.0.1"
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


def _vclient(v: Surface, token=None, **kw):
    endpoint = f"{v.scheme}://{TEST_DOMAIN}:{v.fg.s3_addr[1]}"
    return s3_client_ex(endpoint, token=token, verify=v.ca, addressing_style="virtual", **kw)


def test_virtual_hosted_boto3(vhost, resolve_test_domain):
    """boto3 with virtual-hosted addressing: `Host: <bucket>.s3.fencegate.test:<port>`."""
    v = vhost
    bucket = v.bucket("vh")
    key = "vh/obj"
    fresh = _vclient(v, token=20)
    sent = capture_requests(fresh)
    expect(v, "PutObject (virtual-hosted)", "fresh",
           lambda: fresh.put_object(Bucket=bucket, Key=key, Body=b"v20"), 200)
    assert sent[-1][1].startswith(f"{v.scheme}://{bucket}.{TEST_DOMAIN}:"), sent[-1][1]
    assert body_at_upstream(v, bucket, key) == b"v20"
    assert stamp_at_upstream(v, bucket, key) == "20"
    expect(v, "PutObject (virtual-hosted)", "stale",
           lambda: _vclient(v, token=19).put_object(Bucket=bucket, Key=key, Body=b"x"), 409, "FencingTokenStale", 20)
    expect(v, "PutObject (virtual-hosted)", "none",
           lambda: _vclient(v).put_object(Bucket=bucket, Key=key, Body=b"x"), 428, "FencingTokenRequired")
    assert body_at_upstream(v, bucket, key) == b"v20"

    reader = _vclient(v)
    assert reader.get_object(Bucket=bucket, Key=key)["Body"].read() == b"v20"
    assert [o["Key"] for o in reader.list_objects_v2(Bucket=bucket, Prefix="vh/")["Contents"]] == [key]
    expect(v, "CopyObject (virtual-hosted)", "fresh", lambda: _vclient(v, token=5).copy_object(
        Bucket=bucket, Key="vh/copy", CopySource={"Bucket": bucket, "Key": key}), 200)
    assert stamp_at_upstream(v, bucket, "vh/copy") == "5"
    expect(v, "DeleteObject (virtual-hosted)", "stale",
           lambda: _vclient(v, token=19).delete_object(Bucket=bucket, Key=key), 409, "FencingTokenStale", 20)
    expect(v, "DeleteObject (virtual-hosted)", "fresh",
           lambda: _vclient(v, token=20).delete_object(Bucket=bucket, Key=key), 204)
    assert body_at_upstream(v, bucket, key) is None

    # Presigned, virtual-hosted: the token as signed metadata (an unsigned header would not count).
    for token, status in [("19", 409), ("21", 200)]:
        params = {"Bucket": bucket, "Key": key, "Metadata": {"fencing-token": token}}
        url = _vclient(v).generate_presigned_url("put_object", Params=params, ExpiresIn=300)
        assert url.startswith(f"{v.scheme}://{bucket}.{TEST_DOMAIN}:"), url
        r = requests.put(url, data=b"presigned vh", headers={"x-amz-meta-fencing-token": token}, verify=v.verify,
                         timeout=30)
        assert r.status_code == status, r.text
    assert body_at_upstream(v, bucket, key) == b"presigned vh"


def test_path_style_still_works_with_a_domain(vhost, resolve_test_domain):
    """With `server.domain` set, path-style requests keep working, by IP and by name."""
    v = vhost
    bucket = v.bucket("ps")
    by_ip = v.client(token=3)
    by_ip.put_object(Bucket=bucket, Key="ps/ip", Body=b"by ip")
    assert body_at_upstream(v, bucket, "ps/ip") == b"by ip"
    for host in ("localhost", TEST_DOMAIN):
        endpoint = f"{v.scheme}://{host}:{v.fg.s3_addr[1]}"
        c = s3_client_ex(endpoint, token=3, verify=v.ca, addressing_style="path")
        st = outcome(lambda: c.put_object(Bucket=bucket, Key=f"ps/{host}", Body=host.encode()))
        assert st[0] == 200, (host, st)
        assert body_at_upstream(v, bucket, f"ps/{host}") == host.encode()


def _signed_for_host(host_header: str, method: str, path: str, headers: dict, body: bytes = b""):
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    from fencegate_testlib import _S3PathSigV4

    h = {"Host": host_header, "x-amz-content-sha256": "UNSIGNED-PAYLOAD", "Content-Length": str(len(body))}
    h.update(headers)
    req = AWSRequest(method=method, url=f"http://{host_header}{path}", headers=h)
    _S3PathSigV4(Credentials(ACCESS_KEY, SECRET_KEY), "s3", REGION).add_auth(req)
    return list(req.headers.items())


@pytest.mark.parametrize("with_port", [False, True], ids=["host-without-port", "host-with-port"])
def test_virtual_hosted_raw(vhost, with_port):
    """Raw signed requests to 127.0.0.1 with `Host: <bucket>.s3.fencegate.test[:port]` (what a
    client sends behind a load balancer on 443, and on fencegate's own port)."""
    v = vhost
    bucket = v.bucket("vhraw")
    host = f"{bucket}.{TEST_DOMAIN}" + (f":{v.fg.s3_addr[1]}" if with_port else "")
    sni = f"{bucket}.{TEST_DOMAIN}"

    def send(method, path, headers, body=b""):
        return raw_request_any(v.fg.s3_addr, method, path, _signed_for_host(host, method, path, headers, body),
                               body, ca=v.ca, server_hostname=sni)

    r = send("PUT", "/raw/obj", {"Fencing-Token": "20"}, b"raw v20")
    assert r.status == 200, (host, r.status, r.body[:300])
    assert body_at_upstream(v, bucket, "raw/obj") == b"raw v20"
    r = send("PUT", "/raw/obj", {"Fencing-Token": "19"}, b"late")
    assert (r.status, r.code()) == (409, "FencingTokenStale"), (r.status, r.body[:300])
    r = send("PUT", "/raw/obj", {}, b"late")
    assert (r.status, r.code()) == (428, "FencingTokenRequired"), (r.status, r.body[:300])
    r = send("GET", "/raw/obj", {})
    assert (r.status, r.body) == (200, b"raw v20"), (r.status, r.body[:300])
    r = send("GET", "/?list-type=2&prefix=raw%2F", {})
    assert r.status == 200 and b"<Key>raw/obj</Key>" in r.body, (r.status, r.body[:300])
    assert body_at_upstream(v, bucket, "raw/obj") == b"raw v20"
