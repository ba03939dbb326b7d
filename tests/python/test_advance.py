"""Who may move a fence: with `fencing.advance = "registration"` only registrations and lease
grants raise a fence; a write whose token is above it gets 409 `FencingTokenUnregistered`,
reaches nothing and changes nothing (so no signed client can lock a resource at 2^64-1). Run on
both stores: the Redis store decides it in its admission script."""

from __future__ import annotations

import json

import pytest
from botocore.exceptions import ClientError

from fencegate_testlib import code_of, head_status, header_of, signed_raw_request, status_of

MAX = 18446744073709551615


@pytest.fixture(params=["embedded", "redis"])
def registration_only(request, fencegate, tmp_path):
    config = {"fencing": {"advance": "registration"}}
    if request.param == "redis":
        redis = request.getfixturevalue("redis_server")
        config["store"] = {"kind": "redis", "url": redis.url, "path": None}
        config["upstream"] = {"probe_bucket": "adv", "accept_no_preconditions": True}
    return fencegate(config=config, local_buckets=("adv",))


def refused(call):
    with pytest.raises(ClientError) as exc_info:
        call()
    return exc_info.value


def test_only_registrations_and_grants_raise_a_fence(registration_only):
    fg = registration_only
    resource = "job:adv"
    attacker = fg.client(token=MAX, resource=resource)
    error = refused(lambda: attacker.put_object(Bucket="adv", Key="k", Body=b"lock"))
    assert (status_of(error), code_of(error)) == (409, "FencingTokenUnregistered")
    assert head_status(fg.client(), "adv", "k") == 404, "nothing reached the upstream"
    assert fg.get_fence(resource).status_code == 404, "the fence did not move"

    assert fg.put_fence(resource, 5).status_code == 200
    fg.client(token=5, resource=resource).put_object(Bucket="adv", Key="k", Body=b"five")
    error = refused(lambda: fg.client(token=6, resource=resource).put_object(Bucket="adv", Key="k", Body=b"six"))
    assert (status_of(error), code_of(error), header_of(error, "Fencing-Token-Current")) == (
        409, "FencingTokenUnregistered", "5")
    error = refused(lambda: fg.client(token=4, resource=resource).put_object(Bucket="adv", Key="k", Body=b"four"))
    assert code_of(error) == "FencingTokenStale"
    assert fg.get_fence(resource).json()["token"] == 5

    # A lease grant raises the fence in the same step; its holder writes.
    body = json.dumps({"holder": "worker", "ttl_ms": 30000}).encode()
    grant = signed_raw_request(fg, "POST", f"/_fencegate/v1/leases/{resource}", {"Content-Type": "application/json"},
                               body)
    assert grant.status == 201, grant.body
    token = json.loads(grant.body)["token"]
    assert token == 6
    fg.client(token=token, resource=resource).put_object(Bucket="adv", Key="k", Body=b"granted")
    assert fg.client().get_object(Bucket="adv", Key="k")["Body"].read() == b"granted"
