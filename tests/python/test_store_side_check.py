"""Proves G4: the object's own stamp rejects a stale write even when the fence store never saw the newer token (lost state, or another replica)."""

from __future__ import annotations

import shutil
import time

import pytest
from botocore.exceptions import ClientError

from fencegate_testlib import code_of, header_of, read_object, status_of, unique


def assert_stale(exc_info):
    exc = exc_info.value
    assert status_of(exc) == 409, exc.response
    assert code_of(exc) == "FencingTokenStale", exc.response


def assert_refused_by_stamp(exc_info, presented: int, stamp: int):
    """The stamp refused it, and the answer says so: not "the current fence", which an on-call
    engineer would look up on the resource and not find (the resource's fence admitted it)."""
    exc = exc_info.value
    assert_stale(exc_info)
    message = exc.response["Error"]["Message"]
    assert f"older than this object's stamp {stamp}" in message and "current fence" not in message, message
    assert f"the resource's fence admitted {presented}" in message, message
    assert header_of(exc, "Fencing-Token-Current") == str(stamp), exc.response


def test_lost_fence_store_local_upstream(fg):
    """The fence store is wiped; the object stamped 12 still refuses token 11."""
    bucket = "g4local"
    fg.client().create_bucket(Bucket=bucket)
    fg.client(token=12).put_object(Bucket=bucket, Key="k", Body=b"B's data")
    fg.stop()
    shutil.rmtree(fg.workdir / "fences")
    fg.accept_restored_store()  # its witness refuses the empty store otherwise (test_crash.py)
    fg.config["fencing"] = dict(fg.config.get("fencing", {}), inflight_deadline_ms=1000)
    fg.start()
    time.sleep(1.1)  # the hold of an accepted store, as after a crash
    assert fg.get_fence(f"{bucket}/k").status_code == 404  # the store really forgot

    with pytest.raises(ClientError) as exc_info:
        fg.client(token=11).put_object(Bucket=bucket, Key="k", Body=b"A's stale data")
    assert_refused_by_stamp(exc_info, presented=11, stamp=12)
    assert read_object(fg.client(), bucket, "k") == b"B's data"


def test_two_replicas_share_one_s3_upstream(fencegate, moto_server):
    """Two fencegates with separate fence stores in front of one bucket: per-object G4 holds."""
    bucket = unique("g4replicas")
    moto = moto_server.client()
    moto.create_bucket(Bucket=bucket)
    replica_1 = fencegate(upstream=moto_server.upstream_config())
    replica_2 = fencegate(upstream=moto_server.upstream_config())

    replica_1.client(token=11).put_object(Bucket=bucket, Key="k", Body=b"A's data")
    replica_2.client(token=12).put_object(Bucket=bucket, Key="k", Body=b"B's data")
    # replica_1 has fence 11 and a cached ETag from A's write; the object moved on under it.
    with pytest.raises(ClientError) as exc_info:
        replica_1.client(token=11).put_object(Bucket=bucket, Key="k", Body=b"A again")
    assert_refused_by_stamp(exc_info, presented=11, stamp=12)
    assert read_object(moto, bucket, "k") == b"B's data"
    assert moto.head_object(Bucket=bucket, Key="k")["Metadata"].get("fencing-token") == "12"


def test_object_changed_by_older_writer_is_overwritten(fencegate, moto_server):
    """An object changed behind fencegate's back (not stamped newer) does not block the current holder."""
    bucket = unique("g4bypass")
    moto = moto_server.client()
    moto.create_bucket(Bucket=bucket)
    fg = fencegate(upstream=moto_server.upstream_config())
    fg.client(token=12).put_object(Bucket=bucket, Key="k", Body=b"first")
    moto.put_object(Bucket=bucket, Key="k", Body=b"bypass", Metadata={"fencing-token": "3"})
    fg.client(token=12).put_object(Bucket=bucket, Key="k", Body=b"second")
    assert read_object(moto, bucket, "k") == b"second"
    assert moto.head_object(Bucket=bucket, Key="k")["Metadata"].get("fencing-token") == "12"


def test_object_stamped_newer_behind_fencegate(fencegate, moto_server):
    """An object stamped with a newer token by another path refuses an older token here."""
    bucket = unique("g4stamp")
    moto = moto_server.client()
    moto.create_bucket(Bucket=bucket)
    fg = fencegate(upstream=moto_server.upstream_config())
    moto.put_object(Bucket=bucket, Key="k", Body=b"newer", Metadata={"fencing-token": "40"})
    with pytest.raises(ClientError) as exc_info:
        fg.client(token=30).put_object(Bucket=bucket, Key="k", Body=b"older")
    assert_stale(exc_info)
    assert read_object(moto, bucket, "k") == b"newer"
