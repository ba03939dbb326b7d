"""Do no harm on the local upstream (the shipped default): one object has one name, a non-empty
bucket is not deleted, and a fence store file fencegate cannot prove is its own is refused.

Before: `PUT /bkt/a//b` was fenced as its own resource while it wrote the file of `a/b`, so a
stale token overwrote a fenced object; `DeleteBucket` on a non-empty bucket deleted every
object; an empty `fences.redb` started as an empty store (every fence gone).
"""

from __future__ import annotations

import subprocess

import pytest
from botocore.exceptions import ClientError

from fencegate_testlib import bin_path, signed_raw_request


def _stamp_and_body(fg, bucket, key):
    got = fg.client().get_object(Bucket=bucket, Key=key)
    return got["Metadata"].get("fencing-token"), got["Body"].read()


@pytest.mark.parametrize("path", ["/bkt/a//b", "/bkt/a%2F%2Fb", "/bkt//a/b", "/bkt/a/%2Fb"])
def test_a_key_with_an_empty_segment_cannot_overwrite_another_key(fencegate, path):
    fg = fencegate()
    fg.client().create_bucket(Bucket="bkt")
    fg.client(token=5).put_object(Bucket="bkt", Key="a/b", Body=b"five")
    stale = signed_raw_request(fg, "PUT", path, headers={"Fencing-Token": "1"}, body=b"stale")
    assert stale.status == 400 and b"<Code>InvalidArgument</Code>" in stale.body, (stale.status, stale.body)
    assert _stamp_and_body(fg, "bkt", "a/b") == ("5", b"five")
    # Nothing was fenced under the other name either.
    assert fg.get_fence("bkt/a//b").status_code == 404
    listed = [o["Key"] for o in fg.client().list_objects_v2(Bucket="bkt").get("Contents", [])]
    assert listed == ["a/b"]


def test_a_key_longer_than_the_local_upstream_holds_is_a_client_error(fencegate):
    """The local upstream names files after the base64 of bucket and key (a multipart upload's
    metadata: `.bucket-{b}.object-{k}.upload-{uuid}.metadata.json`, at most 255 bytes): in bucket
    `bkt` a key holds 132 bytes. A longer one is the client's 400 before anything is admitted
    or sent, not a 500 from the file system after the fence moved."""
    fg = fencegate()
    fg.client().create_bucket(Bucket="bkt")
    for key, token in (("s" * 133, "1"), ("dir/" + "s" * 300, "1"), ("s" * 133, None)):
        headers = {"Fencing-Token": token} if token else {}
        r = signed_raw_request(fg, "PUT", f"/bkt/{key}", headers=headers, body=b"x")
        assert r.status == 400 and b"<Code>KeyTooLongError</Code>" in r.body, (key, r.status, r.body)
    assert fg.get_fence("bkt/" + "s" * 133).status_code == 404, "nothing was admitted"
    longest = "s" * 132
    fg.client(token=1).put_object(Bucket="bkt", Key=longest, Body=b"fits")
    assert fg.client().get_object(Bucket="bkt", Key=longest)["Body"].read() == b"fits"
    c = fg.client(token=1)
    upload = c.create_multipart_upload(Bucket="bkt", Key=longest)["UploadId"]
    part = c.upload_part(Bucket="bkt", Key=longest, UploadId=upload, PartNumber=1, Body=b"multipart fits")
    c.complete_multipart_upload(Bucket="bkt", Key=longest, UploadId=upload,
                                MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]})
    assert (fg.objects_dir / "bkt" / longest).read_bytes() == b"multipart fits"


def test_a_multipart_overwrite_serves_its_own_checksums_and_a_delete_leaves_nothing(fencegate):
    """s3s-fs kept the replaced object's checksums after a multipart overwrite (clients reading
    it failed their checksum check) and a deleted object's metadata files."""
    fg = fencegate()
    c = fg.client(token=1)
    c.create_bucket(Bucket="bkt")
    c.put_object(Bucket="bkt", Key="k", Body=b"one", ChecksumAlgorithm="CRC32", Metadata={"owner": "a"})
    upload = c.create_multipart_upload(Bucket="bkt", Key="k")["UploadId"]
    part = c.upload_part(Bucket="bkt", Key="k", UploadId=upload, PartNumber=1, Body=b"two")
    c.complete_multipart_upload(Bucket="bkt", Key="k", UploadId=upload,
                                MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]})
    # boto3 checks a served checksum against the body (ChecksumMode=ENABLED asks for it).
    got = fg.client().get_object(Bucket="bkt", Key="k", ChecksumMode="ENABLED")
    assert got["Body"].read() == b"two"
    assert "ChecksumCRC32" not in got
    c.delete_object(Bucket="bkt", Key="k")
    leftovers = [p.name for p in fg.objects_dir.iterdir() if p.name.startswith(".bucket-")]
    assert leftovers == [], leftovers


@pytest.mark.parametrize("first,second", [("a", "a/b"), ("a/b", "a")])
def test_a_key_and_a_key_under_it_are_a_client_error_not_a_server_error(fencegate, first, second):
    """Objects are files on the local upstream: `a` and `a/b` cannot both exist. The second is
    the client's 400 (with the reason), and the first object is untouched."""
    fg = fencegate()
    c = fg.client(token=1)
    c.create_bucket(Bucket="bkt")
    c.put_object(Bucket="bkt", Key=first, Body=b"first")
    with pytest.raises(ClientError) as refused:
        c.put_object(Bucket="bkt", Key=second, Body=b"second")
    err = refused.value.response
    assert (err["ResponseMetadata"]["HTTPStatusCode"], err["Error"]["Code"]) == (400, "InvalidArgument"), err
    assert "stores objects as files" in err["Error"]["Message"]
    assert fg.client().get_object(Bucket="bkt", Key=first)["Body"].read() == b"first"
    with pytest.raises(ClientError) as copy:
        c.copy_object(Bucket="bkt", Key=second, CopySource={"Bucket": "bkt", "Key": first})
    assert copy.value.response["ResponseMetadata"]["HTTPStatusCode"] == 400


def test_reads_keep_their_conditions(fencegate):
    """GET and HEAD with `If-Match` / `If-None-Match` are answered as S3 does (s3s-fs ignored
    them): a wrong `If-Match` is 412, a matching `If-None-Match` is 304."""
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


def test_a_slow_upload_holds_no_other_write_of_the_object(fencegate):
    """The local upstream locks an object while it commits a write; it locked it while the
    client's body was still arriving, so a DELETE of the object waited for a slow upload."""
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
    assert (fg.objects_dir / "bkt" / "k").read_bytes() == body


def test_a_large_put_is_written_whole(fencegate):
    """Bodies above 8 MiB are held in a temporary file before the commit: the object is intact
    and nothing is left in the temporary directory."""
    import os
    import tempfile

    fg = fencegate()
    c = fg.client(token=1)
    c.create_bucket(Bucket="bkt")
    data = os.urandom(9 * 1024 * 1024 + 17)
    c.put_object(Bucket="bkt", Key="big", Body=data)
    assert (fg.objects_dir / "bkt" / "big").read_bytes() == data
    assert not [n for n in os.listdir(tempfile.gettempdir()) if n.startswith("fencegate-spool-")]


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
    # No key starts with a slash, so a prefix that does lists nothing (s3s-fs listed every key).
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


@pytest.mark.parametrize("key", ["a/b/", "a/b//"])
def test_a_trailing_slash_cannot_alias_a_fenced_object(fencegate, key):
    """`a/b/` is the file of `a/b` on the local upstream: refused on every write path, copy
    and multipart completion included (found by an adversarial review)."""
    fg = fencegate()
    fg.client().create_bucket(Bucket="bkt")
    fg.client(token=10).put_object(Bucket="bkt", Key="a/b", Body=b"ten")
    stale = fg.client(token=3)
    with pytest.raises(ClientError) as put:
        stale.put_object(Bucket="bkt", Key=key, Body=b"stale")
    with pytest.raises(ClientError) as copy:
        stale.copy_object(Bucket="bkt", Key=key, CopySource={"Bucket": "bkt", "Key": "a/b"})
    with pytest.raises(ClientError) as upload:
        stale.create_multipart_upload(Bucket="bkt", Key=key)
    for refused in (put, copy, upload):
        assert refused.value.response["Error"]["Code"] == "InvalidArgument"
    assert _stamp_and_body(fg, "bkt", "a/b") == ("10", b"ten")


def test_delete_objects_keys_are_checked_like_path_keys(fencegate):
    """DeleteObjects names its keys in its body: `a//b`, `a/./b` and `../other/victim` are
    refused per key there too, and nothing outside the named keys is deleted."""
    fg = fencegate()
    c = fg.client()
    for bucket in ("bkt", "other"):
        c.create_bucket(Bucket=bucket)
    fg.client(token=10).put_object(Bucket="bkt", Key="a/b", Body=b"ten")
    fg.client(token=1).put_object(Bucket="other", Key="victim", Body=b"v")
    result = fg.client(token=3).delete_objects(Bucket="bkt", Delete={"Objects": [
        {"Key": "a//b"}, {"Key": "a/./b"}, {"Key": "../other/victim"}]})
    assert result.get("Deleted", []) == [], result
    assert sorted(e["Key"] for e in result["Errors"]) == ["../other/victim", "a/./b", "a//b"]
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
