"""Proves that fencegate is transparent: with `require_token = false`, the same boto3 scenarios
give the same results directly against the upstream (moto_server) and through fencegate:
status codes, ETags, bodies, headers, listings (prefixes, delimiters, pagination), error codes,
HeadObject metadata, range and conditional GETs, multipart, copy, tagging, ACLs, checksums.

Each scenario runs twice on the same moto_server, in two buckets whose names have the same length
(so even the XML bodies have the same size), and the two transcripts must be equal. Every step of
a transcript holds the HTTP status, the parsed response, the raw response headers and any body.

It runs in two modes:
- `no-token`: requests carry no fencing token, so every request passes through unchecked;
- `token`: every request carries `Fencing-Token`, so writes take the fenced path (stamp,
  upstream precondition, COPY->REPLACE rewrite of CopyObject, DeleteObjects rewritten per key,
  conditional CompleteMultipartUpload).

What cannot be the same is normalised, and listed in `NOT_PASSED_THROUGH` below; nothing else
is.
"""

from __future__ import annotations

import datetime
import re

import pytest
from botocore.exceptions import ClientError

from fencegate_testlib import MiB, s3_client_ex, start_fencegate, unique

# What fencegate does not pass through unchanged, and how it is normalised here. The first group
# cannot be the same (they are what a proxy is); the second group is what fencegate changes on
# the fenced path (token mode) by design.
NOT_PASSED_THROUGH = {
    "request ids": "x-amz-request-id / x-amzn-requestid / x-amz-id-2 and <RequestId>/<HostId> differ per request",
    "dates": "Date, Last-Modified and LastModified/Initiated differ by when the request ran",
    "random ids": "upload ids and version ids are the upstream's random ids (and a body holding an upload id "
                  "has a Content-Length that varies with it)",
    "hop headers": "Connection (moto answers `Connection: close`; fencegate keeps client connections open), "
                   "Keep-Alive, Transfer-Encoding, Server",
    "payload signing": "fencegate re-signs every request for the upstream with UNSIGNED-PAYLOAD; moto echoes the "
                       "x-amz-content-sha256 of the request that wrote an object on its GET/HEAD responses",
    # token mode (the fenced path)
    "unknown uploads": "with a token, a multipart step of an upload moto does not list under that key is answered "
                       "404 NoSuchUpload by fencegate (S3's answer; moto answers 500 to parts and completions), "
                       "since moto keeps parts by upload id alone (test_multipart_keys.py)",
    "DeleteObjects order": "with a token, the Deleted/Error entries come back grouped per resource (sorted), "
                           "not in request order; compared as sets",
}

DYNAMIC_HEADERS = {
    "date", "x-amz-request-id", "x-amzn-requestid", "x-amz-id-2", "last-modified", "connection",
    "keep-alive", "transfer-encoding", "server",
}

# Response headers compared as "present", not by value (see NOT_PASSED_THROUGH).
PRESENCE_ONLY_HEADERS = {"x-amz-content-sha256"}

PART = b"m" * (5 * MiB)


@pytest.fixture(scope="module")
def transparent_gate(moto_server, tmp_path_factory):
    fg = start_fencegate(
        tmp_path_factory.mktemp("transparency"),
        upstream=moto_server.upstream_config(),
        # The stamp hidden, as by default: a client's metadata is its own.
        config={"fencing": {"require_token": False, "show_stamp": False}},
    )
    try:
        yield fg
    finally:
        fg.stop()
        print(fg.log_tail(40))


@pytest.fixture(scope="module")
def transparent_gate_https(moto_server, tmp_path_factory, tls_files):
    fg = start_fencegate(
        tmp_path_factory.mktemp("transparency-https"),
        upstream=moto_server.upstream_config(),
        config={"fencing": {"require_token": False, "show_stamp": False}},
        https=tls_files,
    )
    try:
        yield fg
    finally:
        fg.stop()
        print(fg.log_tail(40))


class Transcript:
    """Runs steps and records a normalised account of each.

    `checksums`: whether the flexible-checksum fields (x-amz-checksum-*, Checksum*) are part of
    the comparison. They are for `test_checksums`, which covers every operation that carries
    one; the other scenarios leave them out so each test shows one kind of difference."""

    def __init__(self, client, bucket: str, mode: str, checksums: bool):
        self.client = client
        self.bucket = bucket
        self.missing = bucket[:-6] + "nobckt"  # same length, never created
        self.mode = mode
        self.checksums = checksums
        self.steps: list = []
        self.ids: list = []  # upload and version ids, in order of appearance
        self.mentions_upload = False

    def learn_ids(self, value):
        if isinstance(value, dict):
            for k, v in value.items():
                if k in ("UploadId", "VersionId", "x-amz-version-id") and isinstance(v, str) and v != "null":
                    if v not in self.ids:
                        self.ids.append(v)
                else:
                    self.learn_ids(v)
        elif isinstance(value, list):
            for v in value:
                self.learn_ids(v)

    def norm(self, value):
        if isinstance(value, dict):
            out = {}
            for k, v in value.items():
                if not self.checksums and (k.startswith("Checksum") or k.startswith("x-amz-checksum-")):
                    continue
                out[k] = self.norm(v)
            return out
        if isinstance(value, list):
            return [self.norm(v) for v in value]
        if isinstance(value, (datetime.datetime, datetime.date)):
            return "<date>"
        if isinstance(value, bytes):
            return self.norm_text(value.decode("utf-8", "replace"))
        if isinstance(value, str):
            return self.norm_text(value)
        return value

    def norm_text(self, text: str) -> str:
        text = text.replace(self.bucket, "<bucket>").replace(self.missing, "<missing-bucket>")
        for i, some_id in enumerate(self.ids):
            text = text.replace(some_id, f"<id-{i}>")
        text = re.sub(r"<RequestId>[^<]*</RequestId>", "<RequestId/>", text)
        text = re.sub(r"<HostId>[^<]*</HostId>", "<HostId/>", text)
        text = re.sub(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z", "<date>", text)
        return text

    def headers(self, meta: dict) -> dict:
        out = {}
        for k, v in meta.get("HTTPHeaders", {}).items():
            k = k.lower()
            if k in DYNAMIC_HEADERS:
                continue
            if not self.checksums and k.startswith("x-amz-checksum-"):
                continue
            out[k] = "<present>" if k in PRESENCE_ONLY_HEADERS else self.norm(v)
        if self.mentions_upload and "content-length" in out:
            out["content-length"] = "<length of a body with a random upload id>"
        return out

    def step(self, name: str, fn, read_body: bool = False, mentions_upload: bool = False,
             unordered: tuple = ()):
        """Runs one step. `mentions_upload`: the response body holds an upload id (random, of
        random length), so its Content-Length is not compared. `unordered`: list fields
        compared as sets (see NOT_PASSED_THROUGH)."""
        self.mentions_upload = mentions_upload
        try:
            resp = fn()
        except ClientError as exc:
            r = exc.response
            meta = r.get("ResponseMetadata", {})
            self.learn_ids(meta.get("HTTPHeaders", {}))
            error = {k: v for k, v in r.get("Error", {}).items() if k not in ("RequestId", "HostId")}
            self.steps.append((name, {
                "status": meta.get("HTTPStatusCode"),
                "error": self.norm(error),
                "headers": self.headers(meta),
            }))
            return None
        meta = resp.get("ResponseMetadata", {})
        parsed = {k: v for k, v in resp.items() if k not in ("ResponseMetadata", "Body")}
        self.learn_ids(parsed)
        self.learn_ids(meta.get("HTTPHeaders", {}))
        for field_name in unordered:
            if isinstance(parsed.get(field_name), list):
                parsed[field_name] = sorted(parsed[field_name], key=repr)
        entry = {"status": meta.get("HTTPStatusCode"), "parsed": self.norm(parsed), "headers": self.headers(meta)}
        if "Body" in resp:
            body = resp["Body"].read()
            entry["body"] = body if not read_body else self.norm(body)
        self.steps.append((name, entry))
        return resp


# Steps whose outcome differs on the fenced path by design (NOT_PASSED_THROUGH): not compared in
# token mode; what fencegate answers instead is checked by the scenario's test.
# A fenced copy whose x-amz-copy-source-if-match the source does not meet is fencegate's 412, as
# from S3, where moto ignores the condition and copies (so the listing after it differs too).
# A fenced DeleteObjects in quiet mode lists only the keys that failed, as S3 does; moto lists
# the deleted keys too.
TOKEN_MODE_DIFFERS: set = {"copy if-match mismatch", "list after delete", "delete objects quiet"}
# A fenced DELETE of an absent object is answered 204 by fencegate itself, never forwarded
# (sent without a precondition it could land after a newer write), and a fenced copy of an object
# onto itself unchanged is refused by fencegate itself (its stamp would make it a change): same
# status and error, without the upstream's own headers. A fenced DeleteObjects deletes each key
# as a conditional DeleteObject and answers with its own result (same entries, fencegate's
# headers).
TOKEN_MODE_OWN_HEADERS = {"delete missing", "copy onto itself (no change)", "delete objects"}


def compare(direct: Transcript, via: Transcript):
    assert [n for n, _ in direct.steps] == [n for n, _ in via.steps]
    diffs = []
    for (name, a), (_, b) in zip(direct.steps, via.steps):
        if via.mode == "token" and name in TOKEN_MODE_DIFFERS:
            continue
        if via.mode == "token" and name in TOKEN_MODE_OWN_HEADERS:
            a, b = ({k: v for k, v in step.items() if k != "headers"} for step in (a, b))
        if a != b:
            keys = sorted(set(a) | set(b))
            detail = {k: (a.get(k), b.get(k)) for k in keys if a.get(k) != b.get(k)}
            diffs.append((name, detail))
    assert not diffs, "direct vs through fencegate:\n" + "\n".join(f"  {n}: {d}" for n, d in diffs)


def run_both(moto_server, fg, mode: str, scenario, checksums: bool = False, ca=None, **bucket_kw):
    """Runs `scenario(t)` directly against moto and through fencegate; returns both.

    Without `checksums` the clients send checksums only where S3 requires one
    (`request_checksum_calculation="when_required"`) and the checksum fields are not compared;
    `test_checksums` covers them."""
    stem = unique("tr")[:40]
    out = []
    for which in ("direct", "viafgw"):
        bucket = f"{stem}-{which}"  # "direct" and "viafgw": same length
        moto_server.client().create_bucket(Bucket=bucket, **bucket_kw)
        kw = {} if checksums else {"request_checksum_calculation": "when_required"}
        if which == "direct":
            client = s3_client_ex(moto_server.url, access_key="testing", secret_key="testing", **kw)
        else:
            client = s3_client_ex(fg.s3_url, token=7 if mode == "token" else None, verify=ca, **kw)
        t = Transcript(client, bucket, mode, checksums)
        scenario(t)
        out.append(t)
    compare(*out)
    return out


MODES = ["no-token", "token"]


# --------------------------------------------------------------------------------------------
# scenarios
# --------------------------------------------------------------------------------------------


def scenario_objects(t: Transcript):
    c, b = t.client, t.bucket
    data = bytes(range(256)) * 40  # 10240 bytes
    t.step("put", lambda: c.put_object(
        Bucket=b, Key="docs/a.bin", Body=data, ContentType="application/x-test", CacheControl="no-cache",
        ContentDisposition='attachment; filename="a.bin"', ContentLanguage="en", Metadata={"owner": "etl", "n": "1"}))
    t.step("put unicode key", lambda: c.put_object(Bucket=b, Key="docs/ünï cødé +&=.txt", Body=b"u"))
    t.step("put empty", lambda: c.put_object(Bucket=b, Key="docs/empty", Body=b""))
    t.step("get", lambda: c.get_object(Bucket=b, Key="docs/a.bin"))
    t.step("get unicode key", lambda: c.get_object(Bucket=b, Key="docs/ünï cødé +&=.txt"))
    t.step("get empty", lambda: c.get_object(Bucket=b, Key="docs/empty"))
    t.step("head", lambda: c.head_object(Bucket=b, Key="docs/a.bin"))
    t.step("range 0-9", lambda: c.get_object(Bucket=b, Key="docs/a.bin", Range="bytes=0-9"))
    t.step("range suffix", lambda: c.get_object(Bucket=b, Key="docs/a.bin", Range="bytes=-5"))
    t.step("range open", lambda: c.get_object(Bucket=b, Key="docs/a.bin", Range="bytes=10000-"))
    t.step("range past end", lambda: c.get_object(Bucket=b, Key="docs/a.bin", Range="bytes=20000-30000"))
    t.step("head range", lambda: c.head_object(Bucket=b, Key="docs/a.bin", Range="bytes=0-99"))
    etag = c.head_object(Bucket=b, Key="docs/a.bin")["ETag"]
    t.step("get if-match ok", lambda: c.get_object(Bucket=b, Key="docs/a.bin", IfMatch=etag))
    t.step("get if-match mismatch", lambda: c.get_object(Bucket=b, Key="docs/a.bin", IfMatch='"0000"'))
    t.step("get if-none-match", lambda: c.get_object(Bucket=b, Key="docs/a.bin", IfNoneMatch=etag))
    future = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=1)
    t.step("get if-modified-since future", lambda: c.get_object(Bucket=b, Key="docs/a.bin", IfModifiedSince=future))
    t.step("response overrides", lambda: c.get_object(
        Bucket=b, Key="docs/a.bin", ResponseContentType="text/plain", ResponseCacheControl="max-age=5"))
    t.step("overwrite", lambda: c.put_object(Bucket=b, Key="docs/a.bin", Body=b"second version"))
    t.step("get overwritten", lambda: c.get_object(Bucket=b, Key="docs/a.bin"))
    t.step("delete", lambda: c.delete_object(Bucket=b, Key="docs/a.bin"))
    t.step("get deleted", lambda: c.get_object(Bucket=b, Key="docs/a.bin"))
    t.step("delete missing", lambda: c.delete_object(Bucket=b, Key="docs/never"))


def scenario_listings(t: Transcript):
    c, b = t.client, t.bucket
    keys = [f"a/{i:02d}" for i in range(7)] + [f"a/b/{i}" for i in range(3)] + [f"c/{i}" for i in range(4)]
    keys += ["top-1", "top-2", "z/deep/er/key"]
    for k in keys:
        c.put_object(Bucket=b, Key=k, Body=k.encode())  # not recorded: the listings are
    t.step("list all", lambda: c.list_objects_v2(Bucket=b))
    t.step("list prefix", lambda: c.list_objects_v2(Bucket=b, Prefix="a/"))
    t.step("list delimiter", lambda: c.list_objects_v2(Bucket=b, Delimiter="/"))
    t.step("list prefix+delimiter", lambda: c.list_objects_v2(Bucket=b, Prefix="a/", Delimiter="/"))
    t.step("list start-after", lambda: c.list_objects_v2(Bucket=b, StartAfter="c/1"))
    t.step("list fetch-owner", lambda: c.list_objects_v2(Bucket=b, Prefix="c/", FetchOwner=True))
    t.step("list encoding-type", lambda: c.list_objects_v2(Bucket=b, Prefix="z/", EncodingType="url"))
    t.step("list nothing", lambda: c.list_objects_v2(Bucket=b, Prefix="nope/"))
    token = None
    for page in range(10):
        kw = {"ContinuationToken": token} if token else {}
        resp = t.step(f"page {page}", lambda kw=kw: c.list_objects_v2(Bucket=b, MaxKeys=4, **kw))
        if not resp or not resp.get("IsTruncated"):
            break
        token = resp["NextContinuationToken"]
    marker = None
    for page in range(10):
        kw = {"Marker": marker} if marker else {}
        resp = t.step(f"v1 page {page}", lambda kw=kw: c.list_objects(Bucket=b, MaxKeys=5, Delimiter="/", **kw))
        if not resp or not resp.get("IsTruncated"):
            break
        marker = resp.get("NextMarker") or resp["Contents"][-1]["Key"]
    t.step("list buckets contains", lambda: {
        "ResponseMetadata": {"HTTPStatusCode": 200},
        "found": b in [x["Name"] for x in c.list_buckets()["Buckets"]]})
    t.step("head bucket", lambda: c.head_bucket(Bucket=b))
    t.step("bucket location", lambda: c.get_bucket_location(Bucket=b))


def scenario_errors(t: Transcript):
    c, b = t.client, t.bucket
    missing = t.missing
    t.step("get missing key", lambda: c.get_object(Bucket=b, Key="missing"))
    t.step("head missing key", lambda: c.head_object(Bucket=b, Key="missing"))
    t.step("get missing bucket", lambda: c.get_object(Bucket=missing, Key="k"))
    t.step("put missing bucket", lambda: c.put_object(Bucket=missing, Key="k", Body=b"x"))
    t.step("list missing bucket", lambda: c.list_objects_v2(Bucket=missing))
    t.step("head missing bucket", lambda: c.head_bucket(Bucket=missing))
    t.step("tagging missing key", lambda: c.get_object_tagging(Bucket=b, Key="missing"))
    t.step("copy missing source", lambda: c.copy_object(Bucket=b, Key="dst", CopySource={"Bucket": b, "Key": "missing"}))
    if t.mode == "no-token":  # NOT_PASSED_THROUGH["unknown uploads"]
        t.step("upload part no such upload", lambda: c.upload_part(
            Bucket=b, Key="k", UploadId="bogus-upload-id", PartNumber=1, Body=b"x"))
        t.step("complete no such upload", lambda: c.complete_multipart_upload(
            Bucket=b, Key="k", UploadId="bogus-upload-id",
            MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": '"0123456789abcdef0123456789abcdef"'}]}))
        t.step("abort no such upload", lambda: c.abort_multipart_upload(Bucket=b, Key="k", UploadId="bogus-upload-id"))
    t.step("list parts no such upload", lambda: c.list_parts(Bucket=b, Key="k", UploadId="bogus-upload-id"))
    c.put_object(Bucket=b, Key="keep", Body=b"x")
    t.step("delete non-empty bucket", lambda: c.delete_bucket(Bucket=b))
    t.step("create existing bucket", lambda: c.create_bucket(Bucket=b))
    t.step("invalid range", lambda: c.get_object(Bucket=b, Key="keep", Range="bytes=5-9"))


def scenario_multipart(t: Transcript):
    c, b = t.client, t.bucket
    key = "mp/object"
    created = t.step("create", lambda: c.create_multipart_upload(
        Bucket=b, Key=key, ContentType="text/x-mp", Metadata={"kind": "multipart"}), mentions_upload=True)
    upload_id = created["UploadId"]
    p1 = t.step("part 1", lambda: c.upload_part(Bucket=b, Key=key, UploadId=upload_id, PartNumber=1, Body=PART))
    p2 = t.step("part 2", lambda: c.upload_part(Bucket=b, Key=key, UploadId=upload_id, PartNumber=2, Body=b"tail"))
    c.put_object(Bucket=b, Key="mp/source", Body=b"0123456789" * 10)
    p3 = t.step("part 3 copy range", lambda: c.upload_part_copy(
        Bucket=b, Key=key, UploadId=upload_id, PartNumber=3, CopySource={"Bucket": b, "Key": "mp/source"},
        CopySourceRange="bytes=10-29"))
    t.step("list parts", lambda: c.list_parts(Bucket=b, Key=key, UploadId=upload_id), mentions_upload=True)
    t.step("list uploads", lambda: c.list_multipart_uploads(Bucket=b), mentions_upload=True)
    t.step("complete wrong etag", lambda: c.complete_multipart_upload(
        Bucket=b, Key=key, UploadId=upload_id,
        MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": '"00000000000000000000000000000000"'}]}))
    t.step("complete bad order", lambda: c.complete_multipart_upload(
        Bucket=b, Key=key, UploadId=upload_id,
        MultipartUpload={"Parts": [{"PartNumber": 2, "ETag": p2["ETag"]}, {"PartNumber": 1, "ETag": p1["ETag"]}]}))
    t.step("complete", lambda: c.complete_multipart_upload(
        Bucket=b, Key=key, UploadId=upload_id, MultipartUpload={"Parts": [
            {"PartNumber": 1, "ETag": p1["ETag"]}, {"PartNumber": 2, "ETag": p2["ETag"]},
            {"PartNumber": 3, "ETag": p3["CopyPartResult"]["ETag"]}]}))
    t.step("get completed", lambda: c.get_object(Bucket=b, Key=key, Range="bytes=5242870-"))
    t.step("head completed", lambda: c.head_object(Bucket=b, Key=key))
    t.step("head part 2", lambda: c.head_object(Bucket=b, Key=key, PartNumber=2))
    t.step("complete again", lambda: c.complete_multipart_upload(
        Bucket=b, Key=key, UploadId=upload_id, MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": p1["ETag"]}]}),
        mentions_upload=True)

    small = t.step("create small", lambda: c.create_multipart_upload(Bucket=b, Key="mp/small"),
                   mentions_upload=True)["UploadId"]
    s1 = c.upload_part(Bucket=b, Key="mp/small", UploadId=small, PartNumber=1, Body=b"too small")
    s2 = c.upload_part(Bucket=b, Key="mp/small", UploadId=small, PartNumber=2, Body=b"last")
    t.step("complete too small", lambda: c.complete_multipart_upload(
        Bucket=b, Key="mp/small", UploadId=small, MultipartUpload={"Parts": [
            {"PartNumber": 1, "ETag": s1["ETag"]}, {"PartNumber": 2, "ETag": s2["ETag"]}]}))
    t.step("abort", lambda: c.abort_multipart_upload(Bucket=b, Key="mp/small", UploadId=small))
    t.step("list uploads after", lambda: c.list_multipart_uploads(Bucket=b))


def scenario_copy_and_tagging(t: Transcript):
    c, b = t.client, t.bucket
    t.step("put source", lambda: c.put_object(
        Bucket=b, Key="src", Body=b"source", ContentType="text/csv", Metadata={"a": "1"},
        Tagging="team=etl&tier=gold"))
    t.step("head source", lambda: c.head_object(Bucket=b, Key="src"))
    t.step("copy", lambda: c.copy_object(Bucket=b, Key="dst", CopySource={"Bucket": b, "Key": "src"}))
    t.step("head copy", lambda: c.head_object(Bucket=b, Key="dst"))
    t.step("get copy", lambda: c.get_object(Bucket=b, Key="dst"))
    t.step("copy tags", lambda: c.get_object_tagging(Bucket=b, Key="dst"))
    t.step("copy replace", lambda: c.copy_object(
        Bucket=b, Key="dst2", CopySource={"Bucket": b, "Key": "src"}, MetadataDirective="REPLACE",
        Metadata={"b": "2"}, ContentType="text/plain", TaggingDirective="REPLACE", Tagging="new=1"))
    t.step("head copy replace", lambda: c.head_object(Bucket=b, Key="dst2"))
    t.step("copy replace tags", lambda: c.get_object_tagging(Bucket=b, Key="dst2"))
    t.step("copy onto itself (no change)", lambda: c.copy_object(
        Bucket=b, Key="src", CopySource={"Bucket": b, "Key": "src"}))
    t.step("copy onto itself replace", lambda: c.copy_object(
        Bucket=b, Key="src", CopySource={"Bucket": b, "Key": "src"}, MetadataDirective="REPLACE",
        Metadata={"a": "2"}))
    t.step("head self copy", lambda: c.head_object(Bucket=b, Key="src"))
    t.step("copy if-match mismatch", lambda: c.copy_object(
        Bucket=b, Key="dst3", CopySource={"Bucket": b, "Key": "src"}, CopySourceIfMatch='"0000"'))
    t.step("put tagging", lambda: c.put_object_tagging(
        Bucket=b, Key="src", Tagging={"TagSet": [{"Key": "x", "Value": "y"}]}))
    t.step("get tagging", lambda: c.get_object_tagging(Bucket=b, Key="src"))
    t.step("delete tagging", lambda: c.delete_object_tagging(Bucket=b, Key="src"))
    t.step("get tagging after", lambda: c.get_object_tagging(Bucket=b, Key="src"))
    t.step("put acl", lambda: c.put_object_acl(Bucket=b, Key="src", ACL="public-read"))
    t.step("get acl", lambda: c.get_object_acl(Bucket=b, Key="src"))
    t.step("delete objects", lambda: c.delete_objects(Bucket=b, Delete={"Objects": [
        {"Key": "src"}, {"Key": "dst"}, {"Key": "never-existed"}]}), unordered=("Deleted", "Errors"))
    t.step("delete objects quiet", lambda: c.delete_objects(Bucket=b, Delete={"Objects": [{"Key": "dst2"}],
                                                                                "Quiet": True}),
           unordered=("Deleted", "Errors"))
    t.step("list after delete", lambda: c.list_objects_v2(Bucket=b))


def scenario_checksums(t: Transcript):
    c, b = t.client, t.bucket
    for algorithm in ("CRC32", "SHA1", "SHA256"):
        key = f"sum/{algorithm}"
        t.step(f"put {algorithm}", lambda key=key, a=algorithm: c.put_object(
            Bucket=b, Key=key, Body=b"checksummed " * 100, ChecksumAlgorithm=a))
        t.step(f"head {algorithm}", lambda key=key: c.head_object(Bucket=b, Key=key, ChecksumMode="ENABLED"))
        t.step(f"get {algorithm}", lambda key=key: c.get_object(Bucket=b, Key=key, ChecksumMode="ENABLED"))
    up = t.step("create with checksum", lambda: c.create_multipart_upload(
        Bucket=b, Key="sum/mp", ChecksumAlgorithm="SHA256"), mentions_upload=True)["UploadId"]
    t.step("part with checksum", lambda: c.upload_part(
        Bucket=b, Key="sum/mp", UploadId=up, PartNumber=1, Body=b"part", ChecksumAlgorithm="SHA256"))
    t.step("abort checksum upload", lambda: c.abort_multipart_upload(Bucket=b, Key="sum/mp", UploadId=up))
    # Operations for which S3 requires a checksum: botocore sends CRC32 even when_required.
    t.step("put tagging", lambda: c.put_object_tagging(
        Bucket=b, Key="sum/CRC32", Tagging={"TagSet": [{"Key": "x", "Value": "y"}]}))
    t.step("put acl", lambda: c.put_object_acl(Bucket=b, Key="sum/CRC32", ACL="public-read"))
    t.step("delete objects", lambda: c.delete_objects(Bucket=b, Delete={"Objects": [{"Key": "sum/SHA1"}]}))


def scenario_write_after_empty_write(t: Transcript):
    """boto3 sends `Expect: 100-continue` on every PutObject, also with an empty body, and keeps
    its connections open. The write after an empty write goes on the same connection."""
    c, b = t.client, t.bucket
    t.step("put empty", lambda: c.put_object(Bucket=b, Key="empty", Body=b""))
    t.step("put after empty", lambda: c.put_object(Bucket=b, Key="next", Body=b"next"))
    t.step("get after empty", lambda: c.get_object(Bucket=b, Key="next"))
    t.step("put empty again", lambda: c.put_object(Bucket=b, Key="empty", Body=b""))
    t.step("tagging after empty", lambda: c.put_object_tagging(
        Bucket=b, Key="next", Tagging={"TagSet": [{"Key": "x", "Value": "y"}]}))
    upload_id = t.step("create", lambda: c.create_multipart_upload(Bucket=b, Key="mp"),
                       mentions_upload=True)["UploadId"]
    t.step("put empty before a part", lambda: c.put_object(Bucket=b, Key="marker", Body=b""))
    t.step("part after empty", lambda: c.upload_part(
        Bucket=b, Key="mp", UploadId=upload_id, PartNumber=1, Body=b"only part"))
    t.step("list parts", lambda: c.list_parts(Bucket=b, Key="mp", UploadId=upload_id), mentions_upload=True)
    t.step("abort", lambda: c.abort_multipart_upload(Bucket=b, Key="mp", UploadId=upload_id))


def scenario_object_lock(t: Transcript):
    c, b = t.client, t.bucket
    until = datetime.datetime(2099, 1, 1, tzinfo=datetime.timezone.utc)
    t.step("put", lambda: c.put_object(Bucket=b, Key="locked", Body=b"x"))
    t.step("retention", lambda: c.put_object_retention(
        Bucket=b, Key="locked", Retention={"Mode": "GOVERNANCE", "RetainUntilDate": until}))
    t.step("legal hold", lambda: c.put_object_legal_hold(Bucket=b, Key="locked", LegalHold={"Status": "ON"}))
    t.step("get legal hold", lambda: c.get_object_legal_hold(Bucket=b, Key="locked"))
    t.step("head", lambda: c.head_object(Bucket=b, Key="locked"))


# --------------------------------------------------------------------------------------------
# tests
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_objects_ranges_and_conditions(moto_server, transparent_gate, mode):
    run_both(moto_server, transparent_gate, mode, scenario_objects)


@pytest.mark.parametrize("mode", MODES)
def test_listings(moto_server, transparent_gate, mode):
    run_both(moto_server, transparent_gate, mode, scenario_listings)


@pytest.mark.parametrize("mode", MODES)
def test_error_codes(moto_server, transparent_gate, mode):
    direct, via = run_both(moto_server, transparent_gate, mode, scenario_errors)
    codes = {n: s.get("error", {}).get("Code") for n, s in direct.steps}
    # The scenario really produces the upstream's errors (so the comparison means something).
    assert codes["get missing key"] == "NoSuchKey"
    assert codes["get missing bucket"] == "NoSuchBucket"
    assert codes["put missing bucket"] == "NoSuchBucket"
    if mode == "no-token":
        assert codes["abort no such upload"] == "NoSuchUpload"  # (moto answers 500 to the bogus Complete)
    assert codes["delete non-empty bucket"] == "BucketNotEmpty"
    assert codes["copy missing source"] == "NoSuchKey"


def test_unknown_upload_with_a_token_is_no_such_upload(moto_server, transparent_gate):
    """NOT_PASSED_THROUGH["unknown uploads"]: S3's answer, where moto answers 500."""
    bucket = unique("tr-up")[:40]
    moto_server.client().create_bucket(Bucket=bucket)
    c = s3_client_ex(transparent_gate.s3_url, token=7)
    for call in (
        lambda: c.upload_part(Bucket=bucket, Key="k", UploadId="bogus-upload-id", PartNumber=1, Body=b"x"),
        lambda: c.complete_multipart_upload(
            Bucket=bucket, Key="k", UploadId="bogus-upload-id",
            MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": '"0123456789abcdef0123456789abcdef"'}]}),
        lambda: c.abort_multipart_upload(Bucket=bucket, Key="k", UploadId="bogus-upload-id"),
    ):
        with pytest.raises(ClientError) as info:
            call()
        r = info.value.response
        assert (r["ResponseMetadata"]["HTTPStatusCode"], r["Error"]["Code"]) == (404, "NoSuchUpload")


@pytest.mark.parametrize("mode", MODES)
def test_multipart(moto_server, transparent_gate, mode):
    direct, _via = run_both(moto_server, transparent_gate, mode, scenario_multipart)
    codes = {n: s.get("error", {}).get("Code") for n, s in direct.steps}
    assert codes["complete wrong etag"] == "InvalidPart"
    assert codes["complete too small"] == "EntityTooSmall"


@pytest.mark.parametrize("mode", MODES)
def test_copy_tagging_acl_delete_objects(moto_server, transparent_gate, mode):
    direct, via = run_both(moto_server, transparent_gate, mode, scenario_copy_and_tagging)
    self_copy = dict(direct.steps)["copy onto itself (no change)"], dict(via.steps)["copy onto itself (no change)"]
    # S3 refuses it; so does fencegate on the fenced path, where its stamp would make it a change.
    assert self_copy[0]["error"]["Code"] == self_copy[1]["error"]["Code"] == "InvalidRequest", self_copy
    if mode == "token":
        refused = dict(via.steps)["copy if-match mismatch"]
        assert (refused["status"], refused["error"]["Code"]) == (412, "PreconditionFailed"), refused
        assert dict(via.steps)["list after delete"]["parsed"]["KeyCount"] == 0
        quiet = dict(via.steps)["delete objects quiet"]
        assert (quiet["status"], quiet["parsed"]) == (200, {}), quiet


@pytest.mark.parametrize("mode", MODES)
def test_write_after_empty_write(moto_server, transparent_gate, mode):
    run_both(moto_server, transparent_gate, mode, scenario_write_after_empty_write)


@pytest.mark.parametrize("mode", MODES)
def test_object_lock(moto_server, transparent_gate, mode):
    run_both(moto_server, transparent_gate, mode, scenario_object_lock, ObjectLockEnabledForBucket=True)


@pytest.mark.parametrize("mode", MODES)
def test_checksums(moto_server, transparent_gate, mode):
    """The SDK's flexible checksums (a header over HTTP): the upstream stores and returns them."""
    run_both(moto_server, transparent_gate, mode, scenario_checksums, checksums=True)


@pytest.mark.xfail(
    strict=True,
    reason="known gap: fencegate verifies aws-chunked trailing checksums, then forwards the body "
    "unframed, so the upstream stores no checksum (README, 'Guarantees and limits'); strict, so "
    "this fails loudly once trailers are forwarded",
)
@pytest.mark.parametrize("mode", MODES)
def test_checksums_sdk_default_over_https(moto_server, transparent_gate_https, tls_files, mode):
    """Over HTTPS botocore sends its checksums as aws-chunked trailers (the 2025 SDK default).
    fencegate verifies them; the upstream must still end up with what a direct write gives it
    (the direct client here talks HTTP to moto, so it sends the same checksums as headers)."""
    run_both(moto_server, transparent_gate_https, mode, scenario_checksums, checksums=True, ca=tls_files.ca)
