"""The `ceph_rgw` fixture is a real S3 server (Ceph RGW, tests/python/ceph_rgw.py)."""

import pytest
from botocore.exceptions import ClientError

from fencegate_testlib import unique


def test_rgw_stores_objects_and_enforces_if_match(ceph_rgw):
    """RGW makes a bucket, stores and serves an object, overwrites it under `If-Match` with the
    object's ETag, and answers 412 to a wrong ETag without changing the object."""
    s3 = ceph_rgw.client()
    bucket = ceph_rgw.make_bucket(unique("rgw"))
    etag = s3.put_object(Bucket=bucket, Key="k", Body=b"one")["ETag"]
    assert s3.get_object(Bucket=bucket, Key="k")["Body"].read() == b"one"
    # RGW 16 compares If-Match with its ETag as sent: the quoted form S3 returns never matches.
    s3.put_object(Bucket=bucket, Key="k", Body=b"two", IfMatch=etag.strip('"'))
    with pytest.raises(ClientError) as refused:
        s3.put_object(Bucket=bucket, Key="k", Body=b"three", IfMatch="0" * 32)
    assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert s3.get_object(Bucket=bucket, Key="k")["Body"].read() == b"two"
