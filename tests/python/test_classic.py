"""Proves the classic lease scenario: a stale holder's write is rejected and the new holder's data stays intact."""

from __future__ import annotations

import os
import subprocess

import pytest
from botocore.exceptions import ClientError

from fencegate_testlib import (
    ACCESS_KEY,
    REGION,
    SECRET_KEY,
    code_of,
    head_status,
    header_of,
    read_object,
    status_of,
    unique,
)


def assert_stale(exc_info, current: int):
    exc = exc_info.value
    assert status_of(exc) == 409, exc.response
    assert code_of(exc) == "FencingTokenStale", exc.response
    assert header_of(exc, "Fencing-Token-Current") == str(current), exc.response


def classic_scenario(fg, bucket: str, key: str):
    worker_a = fg.client(token=11)
    worker_b = fg.client(token=12)

    worker_a.put_object(Bucket=bucket, Key=key, Body=b"A's first write")
    worker_b.put_object(Bucket=bucket, Key=key, Body=b"B's data")
    with pytest.raises(ClientError) as exc_info:
        worker_a.put_object(Bucket=bucket, Key=key, Body=b"A woke up late")
    assert_stale(exc_info, 12)

    reader = fg.client()
    assert read_object(reader, bucket, key) == b"B's data"
    assert reader.head_object(Bucket=bucket, Key=key)["Metadata"].get("fencing-token") == "12"


def test_classic_local_upstream(fg):
    bucket = "classic"
    fg.client().create_bucket(Bucket=bucket)
    classic_scenario(fg, bucket, "report.csv")


def test_classic_s3_upstream_moto(fencegate, moto_server):
    bucket = unique("classic")
    moto = moto_server.client()
    moto.create_bucket(Bucket=bucket)
    fg = fencegate(upstream=moto_server.upstream_config())
    classic_scenario(fg, bucket, "report.csv")

    # Straight from the upstream, bypassing fencegate: B's bytes, stamped with 12.
    head = moto.head_object(Bucket=bucket, Key="report.csv")
    assert head["Metadata"].get("fencing-token") == "12", head
    assert read_object(moto, bucket, "report.csv") == b"B's data"


def test_token_as_object_metadata(fg, bucket):
    """Metadata `fencing-token` (x-amz-meta-fencing-token) alone is accepted as the token."""
    plain = fg.client()
    plain.put_object(Bucket=bucket, Key="m", Body=b"one", Metadata={"fencing-token": "11"})
    plain.put_object(Bucket=bucket, Key="m", Body=b"two", Metadata={"fencing-token": "12"})
    with pytest.raises(ClientError) as exc_info:
        plain.put_object(Bucket=bucket, Key="m", Body=b"old", Metadata={"fencing-token": "11"})
    assert_stale(exc_info, 12)
    assert read_object(plain, bucket, "m") == b"two"


def _aws(fg, tmp_path, *args):
    cfg = tmp_path / "aws-config"
    cfg.write_text("[default]\nregion = us-east-1\ns3 =\n    addressing_style = path\n")
    env = dict(os.environ)
    env.update(
        AWS_ACCESS_KEY_ID=ACCESS_KEY,
        AWS_SECRET_ACCESS_KEY=SECRET_KEY,
        AWS_DEFAULT_REGION=REGION,
        AWS_CONFIG_FILE=str(cfg),
        AWS_SHARED_CREDENTIALS_FILE=os.devnull,
        AWS_MAX_ATTEMPTS="1",
        AWS_PAGER="",
    )
    env.pop("AWS_PROFILE", None)
    return subprocess.run(
        ["aws", "--endpoint-url", fg.s3_url, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_classic_aws_cli(fg, bucket, tmp_path):
    a_file = tmp_path / "a.txt"
    a_file.write_bytes(b"A via the aws CLI")
    late = tmp_path / "late.txt"
    late.write_bytes(b"A again, too late")

    r = _aws(fg, tmp_path, "s3api", "put-object", "--bucket", bucket, "--key", "cli.txt",
             "--body", str(a_file), "--metadata", "fencing-token=11")
    assert r.returncode == 0, r.stderr

    fg.client(token=12).put_object(Bucket=bucket, Key="cli.txt", Body=b"B via boto3")

    r = _aws(fg, tmp_path, "s3api", "put-object", "--bucket", bucket, "--key", "cli.txt",
             "--body", str(late), "--metadata", "fencing-token=11")
    assert r.returncode != 0, r.stdout
    assert "FencingTokenStale" in r.stderr, r.stderr
    assert read_object(fg.client(), bucket, "cli.txt") == b"B via boto3"

    r = _aws(fg, tmp_path, "s3api", "head-object", "--bucket", bucket, "--key", "cli.txt")
    assert r.returncode == 0, r.stderr
    assert '"fencing-token": "12"' in r.stdout, r.stdout


def test_require_token_false(fencegate):
    fg = fencegate(config={"fencing": {"require_token": False}})
    bucket = "gradual"
    plain = fg.client()
    plain.create_bucket(Bucket=bucket)

    # Without a token: passes unchecked.
    plain.put_object(Bucket=bucket, Key="k", Body=b"no token")
    assert read_object(plain, bucket, "k") == b"no token"

    # A token is always checked.
    fg.client(token=12).put_object(Bucket=bucket, Key="k", Body=b"token 12")
    with pytest.raises(ClientError) as exc_info:
        fg.client(token=11).put_object(Bucket=bucket, Key="k", Body=b"token 11")
    assert_stale(exc_info, 12)
    assert read_object(plain, bucket, "k") == b"token 12"

    # Token-less writes still pass (gradual adoption), also on the fenced object itself, and
    # never lower its fence: after one, token 11 (below the fence 12) is still stale there.
    assert fg.get_fence(f"{bucket}/k").json() == {"resource": f"{bucket}/k", "token": 12}
    plain.put_object(Bucket=bucket, Key="k", Body=b"no token again")
    assert read_object(plain, bucket, "k") == b"no token again"
    assert fg.get_fence(f"{bucket}/k").json() == {"resource": f"{bucket}/k", "token": 12}
    with pytest.raises(ClientError) as exc_info:
        fg.client(token=11).put_object(Bucket=bucket, Key="k", Body=b"token 11 again")
    assert_stale(exc_info, 12)
    assert fg.get_fence(f"{bucket}/k").json() == {"resource": f"{bucket}/k", "token": 12}
    assert read_object(plain, bucket, "k") == b"no token again"


def test_missing_token_is_428(fg, bucket):
    with pytest.raises(ClientError) as exc_info:
        fg.client().put_object(Bucket=bucket, Key="nt", Body=b"x")
    assert status_of(exc_info.value) == 428, exc_info.value.response
    assert code_of(exc_info.value) == "FencingTokenRequired"
    assert head_status(fg.client(), bucket, "nt") == 404


def test_stale_delete_and_copy_are_rejected(fg, bucket):
    b = fg.client(token=12)
    b.put_object(Bucket=bucket, Key="keep", Body=b"B's data")
    b.put_object(Bucket=bucket, Key="src", Body=b"source")
    a = fg.client(token=11)

    with pytest.raises(ClientError) as exc_info:
        a.delete_object(Bucket=bucket, Key="keep")
    assert_stale(exc_info, 12)

    with pytest.raises(ClientError) as exc_info:
        fg.client(token=11).copy_object(
            Bucket=bucket, Key="keep", CopySource={"Bucket": bucket, "Key": "src"}
        )
    assert_stale(exc_info, 12)
    assert read_object(fg.client(), bucket, "keep") == b"B's data"

    with pytest.raises(ClientError) as exc_info:
        fg.client().delete_object(Bucket=bucket, Key="keep")
    assert status_of(exc_info.value) == 428, exc_info.value.response
    assert code_of(exc_info.value) == "FencingTokenRequired", exc_info.value.response

    # The current holder can copy and delete; the copy is stamped with its token.
    b.copy_object(Bucket=bucket, Key="copy", CopySource={"Bucket": bucket, "Key": "src"})
    head = fg.client().head_object(Bucket=bucket, Key="copy")
    assert head["Metadata"].get("fencing-token") == "12", head
    b.delete_object(Bucket=bucket, Key="keep")
    assert head_status(fg.client(), bucket, "keep") == 404


def test_fencing_resource_header_groups_objects(fg, bucket):
    """Two objects under one `Fencing-Resource` share one fence."""
    fg.client(token=12, resource="job:invoices").put_object(Bucket=bucket, Key="x", Body=b"12")
    with pytest.raises(ClientError) as exc_info:
        fg.client(token=11, resource="job:invoices").put_object(Bucket=bucket, Key="y", Body=b"11")
    assert_stale(exc_info, 12)
    assert head_status(fg.client(), bucket, "y") == 404
    # A different resource has its own fence.
    fg.client(token=11, resource="job:other").put_object(Bucket=bucket, Key="y", Body=b"11")


def test_rules_map_prefix_to_resource(fencegate):
    fg = fencegate(
        config={"fencing": {"rules": [{"bucket": "ruled", "prefix": "jobs/", "resource": "job:x"}]}}
    )
    fg.client().create_bucket(Bucket="ruled")
    fg.client(token=12).put_object(Bucket="ruled", Key="jobs/a", Body=b"12")
    with pytest.raises(ClientError) as exc_info:
        fg.client(token=11).put_object(Bucket="ruled", Key="jobs/b", Body=b"11")
    assert_stale(exc_info, 12)
    assert fg.get_fence("job:x").json()["token"] == 12

    # Outside the prefix the object is its own resource.
    fg.client(token=11).put_object(Bucket="ruled", Key="other", Body=b"11")

    # A Fencing-Resource header that disagrees with the rule is rejected.
    with pytest.raises(ClientError) as exc_info:
        fg.client(token=13, resource="job:y").put_object(Bucket="ruled", Key="jobs/c", Body=b"13")
    assert status_of(exc_info.value) == 400, exc_info.value.response
    assert code_of(exc_info.value) == "FencingResourceMismatch", exc_info.value.response
    assert head_status(fg.client(), "ruled", "jobs/c") == 404


def test_stale_multipart_upload_cannot_complete(fg, bucket):
    """A multipart upload started under token 11 cannot commit after token 12 wrote."""
    a = fg.client(token=11)
    part = b"p" * (5 * 1024 * 1024)
    mpu = a.create_multipart_upload(Bucket=bucket, Key="mp")
    up = a.upload_part(Bucket=bucket, Key="mp", UploadId=mpu["UploadId"], PartNumber=1, Body=part)

    fg.client(token=12).put_object(Bucket=bucket, Key="mp", Body=b"B's data")

    with pytest.raises(ClientError) as exc_info:
        a.upload_part(Bucket=bucket, Key="mp", UploadId=mpu["UploadId"], PartNumber=2, Body=b"x")
    assert_stale(exc_info, 12)
    with pytest.raises(ClientError) as exc_info:
        a.complete_multipart_upload(
            Bucket=bucket,
            Key="mp",
            UploadId=mpu["UploadId"],
            MultipartUpload={"Parts": [{"ETag": up["ETag"], "PartNumber": 1}]},
        )
    assert_stale(exc_info, 12)
    assert read_object(fg.client(), bucket, "mp") == b"B's data"


def test_multipart_upload_with_current_token(fg, bucket):
    b = fg.client(token=12)
    part = b"q" * (5 * 1024 * 1024)
    mpu = b.create_multipart_upload(Bucket=bucket, Key="mp2")
    up = b.upload_part(Bucket=bucket, Key="mp2", UploadId=mpu["UploadId"], PartNumber=1, Body=part)
    b.complete_multipart_upload(
        Bucket=bucket,
        Key="mp2",
        UploadId=mpu["UploadId"],
        MultipartUpload={"Parts": [{"ETag": up["ETag"], "PartNumber": 1}]},
    )
    reader = fg.client()
    assert read_object(reader, bucket, "mp2") == part
    assert reader.head_object(Bucket=bucket, Key="mp2")["Metadata"].get("fencing-token") == "12"


def test_delete_objects_checks_each_key(fg, bucket):
    """DeleteObjects: stale keys come back as per-key errors, the rest are deleted."""
    fg.client(token=12).put_object(Bucket=bucket, Key="fenced", Body=b"B's data")
    fg.client(token=5).put_object(Bucket=bucket, Key="free", Body=b"old data")
    r = fg.client(token=11).delete_objects(
        Bucket=bucket, Delete={"Objects": [{"Key": "fenced"}, {"Key": "free"}]}
    )
    errors = {e["Key"]: e["Code"] for e in r.get("Errors", [])}
    deleted = {d["Key"] for d in r.get("Deleted", [])}
    assert errors == {"fenced": "FencingTokenStale"}, r
    assert deleted == {"free"}, r
    reader = fg.client()
    assert read_object(reader, bucket, "fenced") == b"B's data"
    assert head_status(reader, bucket, "free") == 404


def test_presigned_put(fg, bucket):
    """Presigned URLs work; the token rides as signed metadata (a `Fencing-Token` header the
    signature does not cover counts for nothing: 400)."""
    import requests

    signer = fg.client()
    url_12 = signer.generate_presigned_url(
        "put_object", Params={"Bucket": bucket, "Key": "pre", "Metadata": {"fencing-token": "12"}},
        ExpiresIn=300,
    )
    r = requests.put(url_12, data=b"B via presigned", headers={"x-amz-meta-fencing-token": "12"}, timeout=30)
    assert r.status_code == 200, r.text

    url_11 = signer.generate_presigned_url(
        "put_object", Params={"Bucket": bucket, "Key": "pre", "Metadata": {"fencing-token": "11"}},
        ExpiresIn=300,
    )
    r = requests.put(url_11, data=b"A late", headers={"x-amz-meta-fencing-token": "11"}, timeout=30)
    assert r.status_code == 409, r.text
    assert "FencingTokenStale" in r.text
    assert r.headers.get("Fencing-Token-Current") == "12"
    url = signer.generate_presigned_url("put_object", Params={"Bucket": bucket, "Key": "pre"}, ExpiresIn=300)
    r = requests.put(url, data=b"A late", headers={"Fencing-Token": "13"}, timeout=30)
    assert r.status_code == 400 and "InvalidFencingToken" in r.text, r.text
    r = requests.put(url, data=b"no token", timeout=30)
    assert r.status_code == 428, r.text
    assert read_object(fg.client(), bucket, "pre") == b"B via presigned"
