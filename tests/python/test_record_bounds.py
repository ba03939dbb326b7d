"""What fencegate keeps in the fence store for a caller is bounded and expires (docs/security.md,
"Tenants"; docs/operations.md, "Sizing the fence store"): the upload record of every multipart
upload made with a token counts per caller (the access key that signed its creation), per
resource and in all, by count and bytes (`store.upload_records_*`), and on Redis stops at three
quarters of `maxmemory`. A creation past a bound is aborted at the upstream and answered 503
`SlowDown`; lease grants, registrations and fence advances never pass there, so they keep
working in a full store. Every upload is aborted `fencing.abort_uploads_after_ms` after its
creation.

Before: 8,102 CreateMultipartUpload requests from one writer key filled a 24 MB Redis; lease
grants, registrations and advances then got 503, and still did after the attacker stopped.
"""

from __future__ import annotations

import json
import time

import pytest
from botocore.exceptions import ClientError

from fencegate_testlib import (
    code_of,
    merge,
    metric,
    metric_samples,
    quote_resource,
    redis_call,
    signed_raw_request,
    status_of,
    unique,
    wait_until,
)

RESOURCE = "job:uploads"
OTHER = ("AKIAOTHERWRITER00001", "other-writer-secret-key-0000000000001")


def start(fencegate, bucket: str, store: dict | None = None, fencing: dict | None = None, upstream=None):
    credentials = [{"access_key_id": "fencegate-dev", "secret_access_key": "fencegate-dev-secret", "role": "issuer"},
                   {"access_key_id": OTHER[0], "secret_access_key": OTHER[1], "role": "writer"}]
    rules = [{"bucket": bucket, "prefix": "up/", "resource": RESOURCE}]
    config = {"credentials": credentials, "fencing": merge({"rules": rules}, fencing or {})}
    if store:
        config = merge(config, {"store": store})
    if store and store.get("kind") == "redis":
        config = merge(config, {"upstream": {"probe_bucket": bucket}})
    if upstream:
        config = merge(config, {"upstream": upstream})
    return fencegate(config=config, local_buckets=(bucket,))


def create(client, bucket: str, key: str):
    """The upload id, or the refusal."""
    try:
        return client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    except ClientError as e:
        return e


def grant(fg, resource: str) -> int:
    body = json.dumps({"holder": "worker", "ttl_ms": 30000}).encode()
    r = signed_raw_request(fg, "POST", "/_fencegate/v1/leases/" + quote_resource(resource),
                           {"Content-Type": "application/json"}, body)
    assert r.status == 201, (r.status, r.body)
    return json.loads(r.body)["token"]


def register(fg, resource: str, token: int):
    r = signed_raw_request(fg, "PUT", "/_fencegate/v1/fences/" + quote_resource(resource),
                           {"Content-Type": "application/json"}, json.dumps({"token": token}).encode())
    assert r.status == 200, (r.status, r.body)


def open_uploads(fg, bucket: str) -> set:
    """The upload ids the upstream holds in `bucket` (listed through fencegate, every page)."""
    pages = fg.client().get_paginator("list_multipart_uploads").paginate(Bucket=bucket)
    return {u["UploadId"] for page in pages for u in page.get("Uploads", [])}


def assert_fence_operations_work(fg, bucket: str, name: str):
    """A lease grant, a registration and a write that advances a fence, each on a new resource."""
    granted = grant(fg, f"job:{name}-granted")
    fg.client(token=granted, resource=f"job:{name}-granted").put_object(Bucket=bucket, Key=f"ops/{name}/g", Body=b"g")
    register(fg, f"job:{name}-registered", 7)
    assert fg.get_fence(f"job:{name}-registered").json()["token"] == 7
    fg.client(token=9, resource=f"job:{name}-advanced").put_object(Bucket=bucket, Key=f"ops/{name}/a", Body=b"a")
    assert fg.get_fence(f"job:{name}-advanced").json()["token"] == 9


def test_a_full_redis_refuses_new_upload_records_and_never_a_grant(tmp_path, fencegate, redis_server):
    """A Redis with a small `maxmemory` (8 MB, `noeviction`: its package's policy) that one writer
    key fills with CreateMultipartUpload, the per-caller and per-resource bounds set out of the
    way so that memory is the bound reached: creations get 503 `SlowDown` once Redis is three
    quarters full (each refused upload aborted at the upstream), Redis never reaches
    `maxmemory`, and a lease grant, a registration and an advance succeed during and after."""
    maxmemory = 8 << 20
    redis_call(redis_server.port, "CONFIG", "SET", "maxmemory", str(maxmemory))
    bucket = unique("filled")
    fg = start(fencegate, bucket, store={"kind": "redis", "url": redis_server.url, "path": None,
                                          "upload_records_per_caller_max": 1_000_000,
                                          "upload_records_per_resource_max": 1_000_000})
    attacker = fg.client(token=1, resource=RESOURCE, access_key=OTHER[0], secret_key=OTHER[1])
    created, refused, deadline = [], None, time.monotonic() + 240
    for i in range(40_000):
        assert time.monotonic() < deadline, f"no refusal after {len(created)} creations"
        got = create(attacker, bucket, f"up/k/{i}")
        if isinstance(got, ClientError):
            refused = got
            break
        created.append(got)
        if i % 1000 == 999:
            assert_fence_operations_work(fg, bucket, f"during{i}")
    assert refused is not None
    assert (status_of(refused), code_of(refused)) == (503, "SlowDown"), refused.response
    assert "memory" in refused.response["Error"]["Message"], refused.response
    assert len(created) > 1000, "Redis had room for more than a thousand records"
    info = redis_call(redis_server.port, "INFO", "memory")
    info = info.decode() if isinstance(info, bytes) else info
    used = int(info.split("used_memory:")[1].split("\r\n")[0])
    assert used < maxmemory, f"Redis reached maxmemory: {used}"
    print(f"{len(created)} upload records before Redis was three quarters full; used_memory {used}")

    # The attacker keeps trying: refused each time, and nothing it was refused stays upstream.
    for i in range(20):
        got = create(attacker, bucket, f"up/again/{i}")
        assert isinstance(got, ClientError) and status_of(got) == 503
    assert open_uploads(fg, bucket) == set(created), "a refused creation left an upload behind"
    assert_fence_operations_work(fg, bucket, "after")
    samples = metric_samples(fg)
    assert metric(samples, "fencegate_records_refused_total", kind="upload", bound="memory") >= 21

    # Ending uploads makes room again.
    for i, upload in enumerate(created[:200]):
        attacker.abort_multipart_upload(Bucket=bucket, Key=f"up/k/{i}", UploadId=upload)
    assert isinstance(create(attacker, bucket, "up/room"), str)


def test_each_bound_refuses_its_caller_and_spares_the_others(fencegate):
    """Embedded store, bounds of 5 per caller, 8 per resource, 12 in all: the writer key that holds
    5 uploads is refused (503 `SlowDown`, naming `store.upload_records_per_caller_max`) while
    another key still creates; a resource at 8 refuses everyone on it, not another resource;
    completing or aborting an upload makes room; a take-over by a newer token is never refused;
    grants, registrations and advances work throughout."""
    bucket = unique("bounds")
    fg = start(fencegate, bucket, store={"upload_records_per_caller_max": 5, "upload_records_per_resource_max": 8,
                                         "upload_records_max": 12})
    writer = fg.client(token=1, resource=RESOURCE, access_key=OTHER[0], secret_key=OTHER[1])
    issuer = fg.client(token=1, resource=RESOURCE)
    mine = [create(writer, bucket, f"up/w/{i}") for i in range(5)]
    assert all(isinstance(u, str) for u in mine), mine
    refused = create(writer, bucket, "up/w/5")
    assert (status_of(refused), code_of(refused)) == (503, "SlowDown"), refused.response
    assert "store.upload_records_per_caller_max" in refused.response["Error"]["Message"]
    assert refused.response["ResponseMetadata"]["HTTPHeaders"].get("retry-after") == "30"
    theirs = [create(issuer, bucket, f"up/i/{i}") for i in range(3)]
    assert all(isinstance(u, str) for u in theirs), theirs
    refused = create(issuer, bucket, "up/i/3")
    assert "store.upload_records_per_resource_max" in refused.response["Error"]["Message"], refused.response
    other = fg.client(token=1, resource="job:other")
    assert isinstance(create(other, bucket, "o/0"), str), "another resource has room"
    assert_fence_operations_work(fg, bucket, "full")

    # A newer token takes one of the writer's uploads over (its part): never refused, and the
    # record's count goes to the new creator: the writer is refused by the resource now, not
    # by its own bound.
    newer = fg.client(token=2, resource=RESOURCE)
    newer.upload_part(Bucket=bucket, Key="up/w/0", UploadId=mine[0], PartNumber=1, Body=b"x" * 1024)
    writer = fg.client(token=2, resource=RESOURCE, access_key=OTHER[0], secret_key=OTHER[1])
    refused = create(writer, bucket, "up/w/6")
    assert "store.upload_records_per_resource_max" in refused.response["Error"]["Message"], refused.response
    # An abort makes room.
    writer.abort_multipart_upload(Bucket=bucket, Key="up/w/1", UploadId=mine[1])
    assert isinstance(create(writer, bucket, "up/w/7"), str), "an abort made room"
    assert open_uploads(fg, bucket) >= set(mine[2:]) | {mine[0]}
    assert mine[1] not in open_uploads(fg, bucket)
    assert metric(metric_samples(fg), "fencegate_records_refused_total", kind="upload", bound="per_caller") == 1


def test_an_upload_is_aborted_once_it_expires(fencegate):
    """`fencing.abort_uploads_after_ms` = X, C = (request timeout + D) * 1.08 the longest a
    completion may take: an upload of the current token, never superseded, takes parts until
    X - C after its creation and is refused them after (404 `NoSuchUpload`, so that none is in
    flight when it is aborted); it is aborted at the upstream X after its creation (within the
    sweep's period), never before, and its record forgotten, so its creator's count frees up."""
    bucket = unique("expire")
    after_ms, completion_ms = 5000, 2160
    fg = start(fencegate, bucket, store={"upload_records_per_caller_max": 1},
               fencing={"inflight_deadline_ms": 1000, "abort_uploads_after_ms": after_ms},
               upstream={"request_timeout_ms": 1000})
    writer = fg.client(token=1, resource=RESOURCE, access_key=OTHER[0], secret_key=OTHER[1])
    created_at = time.monotonic()
    upload = create(writer, bucket, "up/kept")
    assert isinstance(upload, str)
    assert status_of(create(writer, bucket, "up/second")) == 503
    writer.upload_part(Bucket=bucket, Key="up/kept", UploadId=upload, PartNumber=1, Body=b"p" * 1024)
    time.sleep(max(0.0, created_at + (after_ms - completion_ms) / 1000 + 0.2 - time.monotonic()))
    with pytest.raises(ClientError) as late:
        writer.upload_part(Bucket=bucket, Key="up/kept", UploadId=upload, PartNumber=2, Body=b"p" * 1024)
    assert (status_of(late.value), code_of(late.value)) == (404, "NoSuchUpload"), late.value.response
    assert "fencing.abort_uploads_after_ms" in late.value.response["Error"]["Message"]
    time.sleep(max(0.0, created_at + after_ms / 1000 - 0.3 - time.monotonic()))
    assert upload in open_uploads(fg, bucket), "aborted before fencing.abort_uploads_after_ms"
    wait_until(lambda: upload not in open_uploads(fg, bucket), timeout=after_ms / 1000 + 5,
               what="the expired upload aborted")
    wait_until(lambda: isinstance(create(writer, bucket, f"up/next-{time.monotonic()}"), str), timeout=5,
               what="the expired record forgotten")
    assert metric(metric_samples(fg), "fencegate_uploads_expired_total") == 1


@pytest.mark.parametrize("value", [0, 1000, 60000])
def test_uploads_must_expire_but_not_under_a_completion(fencegate, tmp_path, value):
    """`fencing.abort_uploads_after_ms` of 0 (never), or below twice the longest a completion may
    take (with the default request timeout and deadline, 2 * 356.4 s), is refused, naming the key."""
    import subprocess

    from fencegate_testlib import base_config, bin_path, to_toml

    config = merge(base_config(tmp_path), {"fencing": {"abort_uploads_after_ms": value}})
    path = tmp_path / "c.toml"
    path.write_text(to_toml(config))
    out = subprocess.run([str(bin_path()), "check-config", "--config", str(path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0
    assert "fencing.abort_uploads_after_ms" in out.stderr + out.stdout
