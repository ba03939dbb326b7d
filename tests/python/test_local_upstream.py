"""Do no harm on the local upstream (the shipped default): one key is one object and no two
keys share bytes, a non-empty bucket is not deleted, and a store file fencegate cannot prove
is its own is refused.

Before: the local upstream kept objects as files named by their keys. `PUT /bkt/a//b` was fenced
as its own resource while it wrote the file of `a/b`, so a stale token overwrote a fenced object
(later refused with 400); `a` and `a/b` could not both exist; file names limited keys;
`DeleteBucket` on a non-empty bucket deleted every object; an empty `fences.redb` started as an
empty store (every fence gone). Objects are now records in an embedded database and bytes in
files named by a fresh id (src/upstream/local/).
"""

from __future__ import annotations

import subprocess
import time

import pytest
from botocore.exceptions import ClientError

from fencegate_testlib import bin_path, signed_raw_request


def _stamp_and_body(fg, bucket, key):
    got = fg.client().get_object(Bucket=bucket, Key=key)
    return got["Metadata"].get("fencing-token"), got["Body"].read()


@pytest.mark.parametrize("path,key", [("/bkt/a//b", "a//b"), ("/bkt/a%2F%2Fb", "a//b"), ("/bkt//a/b", "/a/b"),
                                      ("/bkt/a/%2Fb", "a//b"), ("/bkt/a/b/", "a/b/")])
def test_a_key_with_an_empty_segment_is_its_own_object(fencegate, path, key):
    """`a//b`, `/a/b` and `a/b/` are keys of their own, as in S3: fenced as their own resource,
    stored as their own object; `a/b` (fenced at 5) is untouched by a token-1 write to them."""
    fg = fencegate()
    fg.client().create_bucket(Bucket="bkt")
    fg.client(token=5).put_object(Bucket="bkt", Key="a/b", Body=b"five")
    other = signed_raw_request(fg, "PUT", path, headers={"Fencing-Token": "1"}, body=b"other")
    assert other.status == 200, (other.status, other.body)
    assert _stamp_and_body(fg, "bkt", "a/b") == ("5", b"five")
    assert _stamp_and_body(fg, "bkt", key) == ("1", b"other")
    assert fg.get_fence(f"bkt/{key}").json()["token"] == 1
    listed = [o["Key"] for o in fg.client().list_objects_v2(Bucket="bkt").get("Contents", [])]
    assert listed == sorted(["a/b", key])
    # A stale write to the new name is refused by its own fence.
    stale = signed_raw_request(fg, "PUT", path, headers={"Fencing-Token": "0"}, body=b"stale")
    assert stale.status == 409, (stale.status, stale.body)


def test_a_key_longer_than_s3_allows_is_a_client_error(fencegate):
    """S3 holds keys of up to 1024 bytes; a longer one is the client's 400 `KeyTooLongError`
    before anything is admitted or sent. The local upstream holds every key up to that length,
    single and multipart (file names no longer limit it: they were 132 bytes here)."""
    fg = fencegate()
    fg.client().create_bucket(Bucket="bkt")
    for key, token in (("s" * 1025, "1"), ("dir/" + "s" * 1021, "1"), ("s" * 1025, None)):
        headers = {"Fencing-Token": token} if token else {}
        r = signed_raw_request(fg, "PUT", f"/bkt/{key}", headers=headers, body=b"x")
        assert r.status == 400 and b"<Code>KeyTooLongError</Code>" in r.body, (len(key), r.status, r.body)
    longest = "s" * 1024
    # `bkt/` and the key make the default resource, which is at most 1024 bytes: a key that
    # long is fenced on a resource named apart (Fencing-Resource).
    fg.client(token=1, resource="job:long").put_object(Bucket="bkt", Key=longest, Body=b"fits")
    assert fg.client().get_object(Bucket="bkt", Key=longest)["Body"].read() == b"fits"
    c = fg.client(token=1, resource="job:long")
    upload = c.create_multipart_upload(Bucket="bkt", Key=longest)["UploadId"]
    part = c.upload_part(Bucket="bkt", Key=longest, UploadId=upload, PartNumber=1, Body=b"multipart fits")
    c.complete_multipart_upload(Bucket="bkt", Key=longest, UploadId=upload,
                                MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]})
    assert fg.client().get_object(Bucket="bkt", Key=longest)["Body"].read() == b"multipart fits"


def _data_files(fg, expected, timeout=10):
    """The local store's data files, once there are `expected` of them (a replaced object's
    files are removed just after the commit that frees them)."""
    deadline = time.monotonic() + timeout
    while True:
        files = sorted(p.name for p in (fg.objects_dir / "data").iterdir())
        if len(files) == expected or time.monotonic() > deadline:
            return files
        time.sleep(0.02)


def test_a_multipart_overwrite_serves_its_own_checksums_and_a_delete_leaves_nothing(fencegate):
    """The old local upstream kept the replaced object's checksums after a multipart overwrite
    (clients reading it failed their checksum check) and a deleted object's metadata files."""
    fg = fencegate()
    c = fg.client(token=1)
    c.create_bucket(Bucket="bkt")
    c.put_object(Bucket="bkt", Key="k", Body=b"one", ChecksumAlgorithm="CRC32", Metadata={"owner": "a"})
    assert "ChecksumCRC32" in fg.client().get_object(Bucket="bkt", Key="k", ChecksumMode="ENABLED")
    upload = c.create_multipart_upload(Bucket="bkt", Key="k")["UploadId"]
    part = c.upload_part(Bucket="bkt", Key="k", UploadId=upload, PartNumber=1, Body=b"two")
    c.complete_multipart_upload(Bucket="bkt", Key="k", UploadId=upload,
                                MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]})
    # boto3 checks a served checksum against the body (ChecksumMode=ENABLED asks for it).
    got = fg.client().get_object(Bucket="bkt", Key="k", ChecksumMode="ENABLED")
    assert got["Body"].read() == b"two"
    assert "ChecksumCRC32" not in got
    assert "owner" not in got["Metadata"], got["Metadata"]
    assert len(_data_files(fg, 1)) == 1, "the replaced object's file is removed"
    c.delete_object(Bucket="bkt", Key="k")
    assert _data_files(fg, 0) == []


@pytest.mark.parametrize("first,second", [("a", "a/b"), ("a/b", "a")])
def test_a_key_and_a_key_under_it_coexist(fencegate, first, second):
    """S3 keys are strings, not paths: `a` and `a/b` are two objects (the old local upstream,
    which kept objects as files, refused the second with 400)."""
    fg = fencegate()
    c = fg.client(token=1)
    c.create_bucket(Bucket="bkt")
    c.put_object(Bucket="bkt", Key=first, Body=b"first")
    c.put_object(Bucket="bkt", Key=second, Body=b"second")
    reader = fg.client()
    assert reader.get_object(Bucket="bkt", Key=first)["Body"].read() == b"first"
    assert reader.get_object(Bucket="bkt", Key=second)["Body"].read() == b"second"
    c.copy_object(Bucket="bkt", Key=second, CopySource={"Bucket": "bkt", "Key": first})
    assert reader.get_object(Bucket="bkt", Key=second)["Body"].read() == b"first"
    assert [o["Key"] for o in reader.list_objects_v2(Bucket="bkt")["Contents"]] == ["a", "a/b"]
    folded = reader.list_objects_v2(Bucket="bkt", Delimiter="/")
    assert [o["Key"] for o in folded["Contents"]] == ["a"]
    assert [p["Prefix"] for p in folded["CommonPrefixes"]] == ["a/"]
    c.delete_object(Bucket="bkt", Key="a")
    assert reader.get_object(Bucket="bkt", Key="a/b")["Body"].read() == b"first"


def test_reads_keep_their_conditions(fencegate):
    """GET and HEAD with `If-Match` / `If-None-Match` are answered as S3 does (the old local
    upstream ignored them): a wrong `If-Match` is 412, a matching `If-None-Match` is 304."""
    fg = fencegate()
    c = fg.client(token=1)
    c.create_bucket(Bucket="bkt")
    etag = c.put_object(Bucket="bkt", Key="k", Body=b"v1")["ETag"]
    reader = fg.client()
    assert reader.get_object(Bucket="bkt", Key="k", IfMatch=etag)["Body"].read() == b"v1"
    for call in (lambda: reader.get_object(Bucket="bkt", Key="k", IfMatch='"0000"'),
                 lambda: reader.head_object(Bucket="bkt", Key="k", IfMatch='"0000"')):
        with pytest.raises(ClientError) as failed:
            call()
        assert failed.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    for call in (lambda: reader.get_object(Bucket="bkt", Key="k", IfNoneMatch=etag),
                 lambda: reader.head_object(Bucket="bkt", Key="k", IfNoneMatch=etag)):
        with pytest.raises(ClientError) as unchanged:
            call()
        assert unchanged.value.response["ResponseMetadata"]["HTTPStatusCode"] == 304
    assert reader.get_object(Bucket="bkt", Key="k", IfNoneMatch='"0000"')["Body"].read() == b"v1"
    # `If-Modified-Since`: unchanged since now is 304; a date later than now is ignored
    # (RFC 9110, 13.1.3), as S3 ignores it, for reads and for a copy's source alike.
    import datetime

    now = datetime.datetime.now(datetime.timezone.utc)
    with pytest.raises(ClientError) as unchanged:
        reader.get_object(Bucket="bkt", Key="k", IfModifiedSince=now)
    assert unchanged.value.response["ResponseMetadata"]["HTTPStatusCode"] == 304
    future = now + datetime.timedelta(days=1)
    assert reader.get_object(Bucket="bkt", Key="k", IfModifiedSince=future)["Body"].read() == b"v1"
    c.copy_object(Bucket="bkt", Key="k2", CopySource={"Bucket": "bkt", "Key": "k"}, MetadataDirective="REPLACE",
                  CopySourceIfModifiedSince=future)
    assert reader.get_object(Bucket="bkt", Key="k2")["Body"].read() == b"v1"


def test_a_slow_upload_holds_no_other_write_of_the_object(fencegate):
    """The old local upstream locked an object while the client's body was still arriving, so a
    DELETE of the object waited for a slow upload. A body now streams to a file of its own
    first, and only the commit (one transaction) touches the object."""
    import socket
    import time

    from fencegate_testlib import sign_headers

    fg = fencegate()
    c = fg.client(token=1)
    c.create_bucket(Bucket="bkt")
    c.put_object(Bucket="bkt", Key="k", Body=b"old")
    host, port = fg.s3_addr
    body = b"n" * 100_000
    headers = sign_headers("PUT", host, port, "/bkt/k", {"Fencing-Token": "1", "Content-Length": str(len(body))})
    head = ("PUT /bkt/k HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n").encode()
    with socket.create_connection(fg.s3_addr, timeout=30) as slow:
        slow.sendall(head + body[:50_000])  # half the body, then the client stalls
        time.sleep(0.3)
        started = time.monotonic()
        c.delete_object(Bucket="bkt", Key="k")  # same token: admitted beside the upload
        took = time.monotonic() - started
        slow.sendall(body[50_000:])
        reply = slow.recv(65536)
    assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
    assert took < 5, f"the DELETE waited {took:.1f} s for the stalled upload"
    assert fg.client().get_object(Bucket="bkt", Key="k")["Body"].read() == body


def test_a_large_put_is_written_whole_and_ranges_cross_parts(fencegate):
    """A body streams to its data file whole; a multipart object's ranged and part reads span
    its parts' files."""
    import os

    fg = fencegate()
    c = fg.client(token=1)
    c.create_bucket(Bucket="bkt")
    data = os.urandom(9 * 1024 * 1024 + 17)
    c.put_object(Bucket="bkt", Key="big", Body=data)
    assert fg.client().get_object(Bucket="bkt", Key="big")["Body"].read() == data
    upload = c.create_multipart_upload(Bucket="bkt", Key="mp")["UploadId"]
    half = 5 * 1024 * 1024
    etags = [c.upload_part(Bucket="bkt", Key="mp", UploadId=upload, PartNumber=n, Body=chunk)["ETag"]
             for n, chunk in ((1, data[:half]), (2, data[half:]))]
    c.complete_multipart_upload(Bucket="bkt", Key="mp", UploadId=upload, MultipartUpload={
        "Parts": [{"PartNumber": n + 1, "ETag": e} for n, e in enumerate(etags)]})
    reader = fg.client()
    got = reader.get_object(Bucket="bkt", Key="mp", Range=f"bytes={half - 10}-{half + 9}")
    assert got["Body"].read() == data[half - 10:half + 10]
    assert got["ContentRange"] == f"bytes {half - 10}-{half + 9}/{len(data)}"
    assert reader.get_object(Bucket="bkt", Key="mp", PartNumber=2)["Body"].read() == data[half:]
    assert reader.get_object(Bucket="bkt", Key="mp")["Body"].read() == data
    assert reader.head_object(Bucket="bkt", Key="mp")["ETag"].endswith('-2"')


def test_a_non_empty_bucket_is_not_deleted(fencegate):
    fg = fencegate()
    c = fg.client()
    c.create_bucket(Bucket="keep")
    for i in range(3):
        fg.client(token=1).put_object(Bucket="keep", Key=f"dir/obj-{i}", Body=b"x")
    with pytest.raises(ClientError) as refused:
        c.delete_bucket(Bucket="keep")
    err = refused.value.response
    assert (err["ResponseMetadata"]["HTTPStatusCode"], err["Error"]["Code"]) == (409, "BucketNotEmpty")
    assert sorted(o["Key"] for o in c.list_objects_v2(Bucket="keep")["Contents"]) == [
        "dir/obj-0", "dir/obj-1", "dir/obj-2"]
    for i in range(3):
        fg.client(token=1).delete_object(Bucket="keep", Key=f"dir/obj-{i}")
    assert c.delete_bucket(Bucket="keep")["ResponseMetadata"]["HTTPStatusCode"] == 204
    with pytest.raises(ClientError) as gone:
        c.head_bucket(Bucket="keep")
    assert gone.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404


def test_object_versions_are_listed_as_s3_lists_an_unversioned_bucket(fencegate):
    """The local upstream keeps no versions: ListObjectVersions lists each object once, latest,
    with version id `null`, as S3 does for a bucket never versioned, and paginates by key (it
    was 501 NotImplemented, which broke every tool that empties a bucket by its versions). A
    prefix with a leading slash lists nothing on any listing."""
    fg = fencegate()
    c = fg.client()
    c.create_bucket(Bucket="vers")
    keys = ["a", "b&<c>", "dir/x", "dir/y", "z"]
    for key in keys:
        fg.client(token=1).put_object(Bucket="vers", Key=key, Body=key.encode())
    listed = c.list_object_versions(Bucket="vers")
    assert [v["Key"] for v in listed["Versions"]] == keys
    assert {(v["VersionId"], v["IsLatest"]) for v in listed["Versions"]} == {("null", True)}
    assert [v["Size"] for v in listed["Versions"]] == [len(k) for k in keys]
    v2 = c.list_objects_v2(Bucket="vers")["Contents"]
    assert [(v["LastModified"], v.get("ETag")) for v in listed["Versions"]] == [
        (o["LastModified"], o.get("ETag")) for o in v2]
    assert not listed["IsTruncated"]
    folded = c.list_object_versions(Bucket="vers", Delimiter="/")
    assert [v["Key"] for v in folded["Versions"]] == ["a", "b&<c>", "z"]
    assert [p["Prefix"] for p in folded["CommonPrefixes"]] == ["dir/"]
    assert [v["Key"] for v in c.list_object_versions(Bucket="vers", Prefix="dir/")["Versions"]] == ["dir/x", "dir/y"]
    pages = c.get_paginator("list_object_versions").paginate(Bucket="vers", MaxKeys=2)
    assert [v["Key"] for page in pages for v in page.get("Versions", [])] == keys
    # No key starts with a slash, so a prefix that does lists nothing (the old store listed every key).
    assert "Contents" not in c.list_objects_v2(Bucket="vers", Prefix="/", Delimiter="d")
    assert "Contents" not in c.list_objects(Bucket="vers", Prefix="/dir/")
    assert "Versions" not in c.list_object_versions(Bucket="vers", Prefix="/")
    assert c.list_objects_v2(Bucket="vers", Prefix="/dir/")["Prefix"] == "/dir/"
    # What the listing names can be deleted by it, and the bucket then goes.
    for v in listed["Versions"]:
        fg.client(token=1).delete_object(Bucket="vers", Key=v["Key"], VersionId=v["VersionId"])
    assert "Versions" not in c.list_object_versions(Bucket="vers")
    assert c.delete_bucket(Bucket="vers")["ResponseMetadata"]["HTTPStatusCode"] == 204


def test_an_empty_fence_store_file_is_refused_at_start(fencegate):
    fg = fencegate()
    fg.client().create_bucket(Bucket="bkt")
    fg.client(token=7).put_object(Bucket="bkt", Key="k", Body=b"x")
    fg.stop()
    store = fg.workdir / "fences" / "fences.redb"
    assert store.stat().st_size > 0
    store.write_bytes(b"")  # a crash during creation, a truncated restore
    p = subprocess.run([str(bin_path()), "serve", "--config", str(fg.config_path)],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode != 0
    assert "fences.redb" in p.stderr and "not one fencegate wrote" in p.stderr and "empty" in p.stderr, p.stderr
    assert store.stat().st_size == 0, "the file was left as it was"


def test_a_local_store_fencegate_cannot_prove_is_its_own_is_refused_at_start(fencegate):
    """An empty `local.redb` (every object gone if opened), and a directory holding files of
    another layout (the old one-file-per-key store), are refused with the reason, untouched."""
    fg = fencegate()
    fg.client().create_bucket(Bucket="bkt")
    fg.client(token=7).put_object(Bucket="bkt", Key="k", Body=b"x")
    fg.stop()
    db = fg.objects_dir / "local.redb"
    assert db.stat().st_size > 0
    db.write_bytes(b"")
    p = subprocess.run([str(bin_path()), "serve", "--config", str(fg.config_path)],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode != 0 and "local.redb" in p.stderr and "empty" in p.stderr, p.stderr
    assert db.stat().st_size == 0, "the file was left as it was"
    db.unlink()
    (fg.objects_dir / "bkt").mkdir()
    (fg.objects_dir / "bkt" / "k").write_bytes(b"an object of the old layout")
    p = subprocess.run([str(bin_path()), "serve", "--config", str(fg.config_path)],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode != 0 and "not fencegate's local store" in p.stderr, p.stderr
    assert (fg.objects_dir / "bkt" / "k").read_bytes() == b"an object of the old layout"


@pytest.mark.parametrize("key", ["a/b/", "a/b//"])
def test_a_trailing_slash_cannot_alias_a_fenced_object(fencegate, key):
    """`a/b/` was the file of `a/b` on the old local upstream (so it was refused). It is its own
    object now: a stale writer of `a/b` reaches only `a/b/`, on every write path, and `a/b`
    keeps its bytes and stamp (found by an adversarial review)."""
    fg = fencegate()
    fg.client().create_bucket(Bucket="bkt")
    fg.client(token=10).put_object(Bucket="bkt", Key="a/b", Body=b"ten")
    stale = fg.client(token=3)
    stale.put_object(Bucket="bkt", Key=key, Body=b"stale")
    stale.copy_object(Bucket="bkt", Key=key, CopySource={"Bucket": "bkt", "Key": "a/b"})
    upload = stale.create_multipart_upload(Bucket="bkt", Key=key)["UploadId"]
    part = stale.upload_part(Bucket="bkt", Key=key, UploadId=upload, PartNumber=1, Body=b"parts")
    stale.complete_multipart_upload(Bucket="bkt", Key=key, UploadId=upload,
                                    MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]})
    assert _stamp_and_body(fg, "bkt", "a/b") == ("10", b"ten")
    assert _stamp_and_body(fg, "bkt", key) == ("3", b"parts")


def test_delete_objects_keys_are_checked_like_path_keys(fencegate):
    """DeleteObjects names its keys in its body: `a/./b` and `../other/victim` are refused per
    key there too; `a//b` is a key of its own (with nothing there); nothing outside the named
    keys is deleted."""
    fg = fencegate()
    c = fg.client()
    for bucket in ("bkt", "other"):
        c.create_bucket(Bucket=bucket)
    fg.client(token=10).put_object(Bucket="bkt", Key="a/b", Body=b"ten")
    fg.client(token=1).put_object(Bucket="other", Key="victim", Body=b"v")
    result = fg.client(token=3).delete_objects(Bucket="bkt", Delete={"Objects": [
        {"Key": "a//b"}, {"Key": "a/./b"}, {"Key": "../other/victim"}]})
    assert [d["Key"] for d in result.get("Deleted", [])] == ["a//b"], result
    assert sorted(e["Key"] for e in result["Errors"]) == ["../other/victim", "a/./b"]
    assert {e["Code"] for e in result["Errors"]} == {"InvalidArgument"}
    assert _stamp_and_body(fg, "bkt", "a/b") == ("10", b"ten")
    assert c.get_object(Bucket="other", Key="victim")["Body"].read() == b"v"


def test_delete_bucket_with_a_query_keeps_a_non_empty_bucket(fencegate):
    fg = fencegate()
    fg.client().create_bucket(Bucket="keep2")
    fg.client(token=1).put_object(Bucket="keep2", Key="obj", Body=b"x")
    r = signed_raw_request(fg, "DELETE", "/keep2?x-id=DeleteBucket")
    assert r.status == 409 and b"BucketNotEmpty" in r.body, (r.status, r.body)
    assert fg.client().get_object(Bucket="keep2", Key="obj")["Body"].read() == b"x"


def test_an_sdk_query_does_not_turn_off_the_local_preconditions(fencegate):
    """aws-sdk-rust adds `?x-id=<Operation>`; the local upstream still enforces If-Match on
    copies and deletes then."""
    fg = fencegate()
    fg.client().create_bucket(Bucket="bkt")
    fg.client(token=1).put_object(Bucket="bkt", Key="k", Body=b"one")
    r = signed_raw_request(fg, "DELETE", "/bkt/k?x-id=DeleteObject",
                           headers={"Fencing-Token": "1", "If-Match": '"not-the-etag"'})
    assert r.status == 412, (r.status, r.body)
    assert fg.client().get_object(Bucket="bkt", Key="k")["Body"].read() == b"one"


def test_uploads_in_progress_are_listed_page_by_page_and_go_with_their_bucket(fencegate):
    """From an adversarial review: ListMultipartUploads skipped uploads of one key across pages
    (ids are random, the marker compared them as if ordered), so a tool aborting what it lists
    left some behind; and DeleteBucket refused a bucket holding only uploads in progress, which
    S3 deletes (with its uploads)."""
    fg = fencegate()
    c = fg.client(token=1)
    c.create_bucket(Bucket="mpu")
    started = [c.create_multipart_upload(Bucket="mpu", Key="same")["UploadId"] for _ in range(4)]
    started.append(c.create_multipart_upload(Bucket="mpu", Key="other")["UploadId"])
    c.upload_part(Bucket="mpu", Key="same", UploadId=started[0], PartNumber=1, Body=b"part")
    pages = fg.client().get_paginator("list_multipart_uploads").paginate(Bucket="mpu", PaginationConfig={"PageSize": 1})
    listed = [u["UploadId"] for page in pages for u in page.get("Uploads", [])]
    assert sorted(listed) == sorted(started) and len(listed) == len(started), listed
    assert fg.client().delete_bucket(Bucket="mpu")["ResponseMetadata"]["HTTPStatusCode"] == 204
    assert _data_files(fg, 0) == [], "the part's file went with its upload"


def test_reads_answer_as_s3_does_where_the_client_said_nothing(fencegate):
    """Found by an adversarial review and the s3-tests differential: an object stored without
    Content-Type is served as `binary/octet-stream`; checksums are served only to a read that
    asks; `max-keys=0` lists nothing and is not truncated; a part number with a range is the
    client's 400."""
    fg = fencegate()
    c = fg.client(token=1)
    c.create_bucket(Bucket="bkt")
    signed_raw_request(fg, "PUT", "/bkt/plain", headers={"Fencing-Token": "1"}, body=b"x")
    reader = fg.client()
    assert reader.head_object(Bucket="bkt", Key="plain")["ContentType"] == "binary/octet-stream"
    c.put_object(Bucket="bkt", Key="summed", Body=b"y", ChecksumAlgorithm="SHA256")
    assert "ChecksumSHA256" not in reader.head_object(Bucket="bkt", Key="summed")
    assert "ChecksumSHA256" in reader.head_object(Bucket="bkt", Key="summed", ChecksumMode="ENABLED")
    for listing in (reader.list_objects_v2(Bucket="bkt", MaxKeys=0), reader.list_objects(Bucket="bkt", MaxKeys=0)):
        assert (listing["IsTruncated"], "Contents" in listing) == (False, False), listing
    with pytest.raises(ClientError) as both:
        reader.get_object(Bucket="bkt", Key="plain", PartNumber=1, Range="bytes=0-0")
    assert both.value.response["ResponseMetadata"]["HTTPStatusCode"] == 400
    # As S3 in us-east-1: creating one's own bucket again is 200; an empty delimiter is none
    # (and not echoed); ListObjects v1 encodes keys, not its prefix, under encoding-type=url.
    assert c.create_bucket(Bucket="bkt")["ResponseMetadata"]["HTTPStatusCode"] == 200
    assert "Delimiter" not in reader.list_objects_v2(Bucket="bkt", Delimiter="")
    assert reader.list_objects(Bucket="bkt", Prefix="\n")["Prefix"] == "\n"
