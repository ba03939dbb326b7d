"""Proves that a DeleteObjects cannot be overtaken per object (G3, G4): fencegate deletes each
of its keys as a conditional DeleteObject, so the request delivered again later (a hop between
fencegate and S3 that retried it) cannot delete what a newer token wrote in between.

One fencegate (embedded store) in front of a proxy in front of moto_server that keeps a copy of
every write it forwarded and can forward the copies again, as a retrying hop would.
"""

from __future__ import annotations

import pytest
from botocore.exceptions import ClientError

from fencegate_testlib import code_of, status_of
from holding_upstream import HELD_PREFIX, HoldingUpstream
from moto_proxy import Request


class ReplayingUpstream(HoldingUpstream):
    """The holding proxy, keeping every write it forwarded; `replay` sends copies again."""

    def __init__(self, moto_url: str):
        super().__init__(moto_url)
        self.kept: list[Request] = []

    def handle(self, conn, req: Request, buf: bytes):
        # Kept before it is answered (fencegate may answer its client at once after); its body
        # is read into the same object by the holding proxy.
        if req.method.upper() not in ("GET", "HEAD", "OPTIONS"):
            with self.lock:
                self.kept.append(req)
        return super().handle(conn, req, buf)

    def replay(self, requests: list) -> list:
        """Forwards `requests` to moto again, in order, under the commit lock; their statuses."""
        statuses = []
        for req in requests:
            with self.commit_lock:
                statuses.append(self.forward(req).status)
        return statuses


def test_a_delete_objects_delivered_again_does_not_delete_a_newer_write(held_s3, moto_server):
    up = ReplayingUpstream(moto_server.url).start()
    env = held_s3(proxy=up, bucket_prefix="delobj")
    key = f"{HELD_PREFIX}a"
    env.fg.client(token=5).put_object(Bucket=env.bucket, Key=key, Body=b"A's data")

    before = len(up.kept)
    resp = env.fg.client(token=5).delete_objects(Bucket=env.bucket, Delete={"Objects": [{"Key": key}]})
    assert [d["Key"] for d in resp.get("Deleted", [])] == [key] and not resp.get("Errors"), resp
    delete_requests = up.kept[before:]
    assert delete_requests, "the delete never reached the upstream"

    env.fg.client(token=6).put_object(Bucket=env.bucket, Key=key, Body=b"B's data")
    statuses = up.replay(delete_requests)

    body = env.moto.get_object(Bucket=env.bucket, Key=key)["Body"].read()
    assert body == b"B's data", f"token 5's DeleteObjects, delivered again ({statuses}), deleted token 6's write"
    assert all(s == 412 for s in statuses), statuses


def test_a_delete_objects_names_at_most_1000_keys_as_in_s3(fg, bucket):
    """More than 1000 keys (or none) is S3's 400 MalformedXML, and nothing is deleted: each key
    costs a fence check, maybe an advance made durable, and an upstream call."""
    client = fg.client(token=5)
    client.put_object(Bucket=bucket, Key="kept", Body=b"kept")
    too_many = [{"Key": "kept"}] + [{"Key": f"k{i}"} for i in range(1000)]
    for objects in (too_many, []):
        with pytest.raises(ClientError) as refused:
            client.delete_objects(Bucket=bucket, Delete={"Objects": objects})
        assert (status_of(refused.value), code_of(refused.value)) == (400, "MalformedXML"), refused.value.response
    assert client.get_object(Bucket=bucket, Key="kept")["Body"].read() == b"kept"
    done = client.delete_objects(Bucket=bucket, Delete={"Objects": too_many[:1000]})
    assert len(done["Deleted"]) == 1000 and not done.get("Errors"), done.get("Errors")


def test_a_key_with_a_condition_fencegate_cannot_judge_is_refused_not_deleted(fg, bucket):
    """S3's per-key `LastModifiedTime` and `Size` conditions of a DeleteObjects are not judged
    here: such a key comes back as an error and stays, never deleted without its condition; the
    other keys go ahead."""
    client = fg.client(token=5)
    for key in ("sized", "dated", "plain"):
        client.put_object(Bucket=bucket, Key=key, Body=b"seven b")
    resp = client.delete_objects(Bucket=bucket, Delete={"Objects": [
        {"Key": "sized", "Size": 999},
        {"Key": "dated", "LastModifiedTime": "2020-01-01T00:00:00Z"},
        {"Key": "plain"},
    ]})
    assert sorted(e["Key"] for e in resp.get("Errors", [])) == ["dated", "sized"], resp
    assert all(e["Code"] == "NotImplemented" for e in resp["Errors"]), resp["Errors"]
    assert [d["Key"] for d in resp.get("Deleted", [])] == ["plain"], resp
    for key in ("sized", "dated"):
        assert client.get_object(Bucket=bucket, Key=key)["Body"].read() == b"seven b"
