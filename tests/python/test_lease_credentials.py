"""Lease credentials (docs/leases.md, "Lease credentials: unmodified tools"): a grant with
`"credentials": true` answers with temporary S3 credentials bound to the lease's resource and
token. Requests signed with them need no fencing header. Each test is one promise and the fault
that would break it:

- a write inside the resource commits with the lease's token, and its stamp says so;
- outside the resource, or a bucket operation: 403 `AccessDenied`; a disagreeing
  `Fencing-Token` or `Fencing-Resource`: 400; reads go where the issuer may read;
- superseded by a registration or a newer grant: writes 409 `FencingTokenStale`;
- expired or released: every request 403 `ExpiredToken`; renewing extends them;
- a tampered session token, a missing one, or an issuer removed from the config: refused;
- they survive a restart, work on every replica of a shared store, and their secret appears
  in no log.
"""

from __future__ import annotations

import json
import time

import boto3
import pytest
import requests
from botocore.config import Config
from botocore.exceptions import ClientError

from fencegate_testlib import (
    REGION,
    merge,
    quote_resource,
    signed_raw_request,
    unique,
)
from test_redis_store import redis_store



def rules(bucket: str) -> list:
    return [{"bucket": bucket, "prefix": "reports/", "resource": "job:reports"}]


def lease_call(fg, method: str, name: str, body: dict, suffix: str = ""):
    path = "/_fencegate/v1/leases/" + quote_resource(name) + suffix
    return signed_raw_request(fg, method, path, {"Content-Type": "application/json"}, json.dumps(body).encode())


def grant(fg, name: str, ttl_ms: int = 60_000, holder: str = "w") -> dict:
    r = lease_call(fg, "POST", name, {"holder": holder, "ttl_ms": ttl_ms, "credentials": True})
    assert r.status == 201, (r.status, r.body)
    return json.loads(r.body)


def release(fg, name: str, lease_id: str):
    r = lease_call(fg, "DELETE", name, {"lease_id": lease_id})
    assert r.status == 204, (r.status, r.body)


def renew(fg, name: str, lease_id: str) -> dict:
    r = lease_call(fg, "POST", name, {"lease_id": lease_id, "credentials": True}, "/renew")
    assert r.status == 200, (r.status, r.body)
    return json.loads(r.body)


def leased_client(fg, g: dict, endpoint: str | None = None):
    c = g["credentials"]
    return boto3.client(
        "s3",
        endpoint_url=endpoint or fg.s3_url,
        region_name=REGION,
        aws_access_key_id=c["access_key_id"],
        aws_secret_access_key=c["secret_access_key"],
        aws_session_token=c["session_token"],
        config=Config(signature_version="s3v4", s3={"addressing_style": "path"}, retries={"total_max_attempts": 1}),
    )


def refusal(call) -> tuple:
    with pytest.raises(ClientError) as info:
        call()
    e = info.value.response
    return e["ResponseMetadata"]["HTTPStatusCode"], e["Error"]["Code"], e["ResponseMetadata"]["HTTPHeaders"]


def start(fencegate, moto_server, config: dict | None = None):
    """fencegate in front of moto, with a bucket of its own (`fg.bucket`) whose `reports/`
    belong to resource `job:reports`."""
    bucket = unique("leased")
    fg = fencegate(upstream=moto_server.upstream_config(), config=merge({"fencing": {"rules": rules(bucket)}}, config or {}))
    fg.bucket = bucket
    fg.client().create_bucket(Bucket=bucket)
    return fg


@pytest.fixture
def leased(fencegate, moto_server):
    return start(fencegate, moto_server)


def stamp(fg, key: str) -> str:
    """The token that wrote `key`, as fencegate stamps it."""
    head = fg.client().head_object(Bucket=fg.bucket, Key=key)
    return head["Metadata"].get("fencing-token")


def test_a_grant_answers_with_credentials_that_write_the_resource(leased):
    fg = leased
    BUCKET = fg.bucket
    g = grant(fg, "job:reports")
    c = g["credentials"]
    assert c["access_key_id"].startswith("FGL") and len(c["access_key_id"]) == 20
    assert len(c["secret_access_key"]) == 40
    assert time.strptime(c["expiration"], "%Y-%m-%dT%H:%M:%SZ")
    s3 = leased_client(fg, g)
    s3.put_object(Bucket=BUCKET, Key="reports/a.csv", Body=b"by the lease")
    assert s3.get_object(Bucket=BUCKET, Key="reports/a.csv")["Body"].read() == b"by the lease"
    assert stamp(fg, "reports/a.csv") == str(g["token"])
    listed = s3.list_objects_v2(Bucket=BUCKET, Prefix="reports/")
    assert [o["Key"] for o in listed["Contents"]] == ["reports/a.csv"]
    # The same header the lease's token would carry is fine.
    with_header = leased_client(fg, g)
    with_header.meta.events.register(
        "before-sign.s3.*", lambda request, **_: request.headers.__setitem__("Fencing-Token", str(g["token"]))
    )
    with_header.put_object(Bucket=BUCKET, Key="reports/b.csv", Body=b"b")
    # A grant without the flag has no credentials.
    r = lease_call(fg, "POST", "job:plain", {"holder": "w", "ttl_ms": 1000})
    assert r.status == 201 and "credentials" not in json.loads(r.body)
    # Nothing secret reaches the log.
    log = fg.log_tail(10_000)
    assert c["secret_access_key"] not in log and c["session_token"] not in log


def test_outside_the_lease_is_refused(leased):
    fg = leased
    BUCKET = fg.bucket
    g = grant(fg, "job:reports")
    s3 = leased_client(fg, g)
    status, code, _ = refusal(lambda: s3.put_object(Bucket=BUCKET, Key="other/a.csv", Body=b"x"))
    assert (status, code) == (403, "AccessDenied")
    status, code, _ = refusal(lambda: s3.delete_object(Bucket=BUCKET, Key="other/a.csv"))
    assert (status, code) == (403, "AccessDenied")
    status, code, _ = refusal(lambda: s3.create_bucket(Bucket="another"))
    assert (status, code) == (403, "AccessDenied")
    # DeleteObjects: keys outside are refused one by one, the others deleted.
    s3.put_object(Bucket=BUCKET, Key="reports/in.csv", Body=b"in")
    fg.client(token=1, resource="x").put_object(Bucket=BUCKET, Key="other/out.csv", Body=b"out")
    result = s3.delete_objects(
        Bucket=BUCKET, Delete={"Objects": [{"Key": "reports/in.csv"}, {"Key": "other/out.csv"}]}
    )
    assert [d["Key"] for d in result.get("Deleted", [])] == ["reports/in.csv"]
    assert [(e["Key"], e["Code"]) for e in result["Errors"]] == [("other/out.csv", "AccessDenied")]
    assert fg.client().get_object(Bucket=BUCKET, Key="other/out.csv")["Body"].read() == b"out"
    # Reads anywhere the issuer may read.
    assert s3.get_object(Bucket=BUCKET, Key="other/out.csv")["Body"].read() == b"out"


@pytest.mark.parametrize(
    "header,value,code",
    [
        ("Fencing-Token", "999", "InvalidFencingToken"),
        ("Fencing-Resource", "job:other", "FencingResourceMismatch"),
        ("x-amz-meta-fencing-token", "99", "InvalidFencingToken"),
    ],
)
def test_a_disagreeing_fencing_header_is_refused(leased, header, value, code):
    fg = leased
    BUCKET = fg.bucket
    g = grant(fg, "job:reports")
    s3 = leased_client(fg, g)
    s3.meta.events.register("before-sign.s3.*", lambda request, **_: request.headers.__setitem__(header, value))
    status, got, _ = refusal(lambda: s3.put_object(Bucket=BUCKET, Key="reports/a.csv", Body=b"x"))
    assert (status, got) == (400, code)
    assert fg.client().list_objects_v2(Bucket=BUCKET).get("KeyCount") == 0


def test_superseded_by_a_registration_writes_get_409(leased):
    fg = leased
    BUCKET = fg.bucket
    g = grant(fg, "job:reports")
    s3 = leased_client(fg, g)
    s3.put_object(Bucket=BUCKET, Key="reports/a.csv", Body=b"first")
    newer = g["token"] + 5
    r = signed_raw_request(fg, "PUT", "/_fencegate/v1/fences/" + quote_resource("job:reports"),
                           {"Content-Type": "application/json"}, json.dumps({"token": newer}).encode())
    assert r.status == 200, r.body
    status, code, headers = refusal(lambda: s3.put_object(Bucket=BUCKET, Key="reports/a.csv", Body=b"late"))
    assert (status, code) == (409, "FencingTokenStale")
    assert headers["fencing-token-current"] == str(newer)
    assert fg.client().get_object(Bucket=BUCKET, Key="reports/a.csv")["Body"].read() == b"first"


def test_released_or_expired_every_request_is_expired_token(leased):
    fg = leased
    BUCKET = fg.bucket
    g = grant(fg, "job:reports")
    s3 = leased_client(fg, g)
    s3.put_object(Bucket=BUCKET, Key="reports/a.csv", Body=b"kept")
    release(fg, "job:reports", g["lease_id"])
    for call in (
        lambda: s3.put_object(Bucket=BUCKET, Key="reports/a.csv", Body=b"after release"),
        lambda: s3.get_object(Bucket=BUCKET, Key="reports/a.csv"),
        lambda: s3.list_objects_v2(Bucket=BUCKET),
    ):
        status, code, _ = refusal(call)
        assert (status, code) == (403, "ExpiredToken")

    short = grant(fg, "job:reports", ttl_ms=600)
    s3 = leased_client(fg, short)
    s3.put_object(Bucket=BUCKET, Key="reports/b.csv", Body=b"in time")
    time.sleep(0.9)
    status, code, _ = refusal(lambda: s3.put_object(Bucket=BUCKET, Key="reports/b.csv", Body=b"too late"))
    assert (status, code) == (403, "ExpiredToken")
    # A newer grant: the old credential's writes are stale, its reads expired.
    newer = grant(fg, "job:reports", holder="b")
    assert newer["token"] > short["token"]
    status, code, headers = refusal(lambda: s3.put_object(Bucket=BUCKET, Key="reports/b.csv", Body=b"stale"))
    assert (status, code) == (409, "FencingTokenStale")
    assert headers["fencing-token-current"] == str(newer["token"])
    status, code, _ = refusal(lambda: s3.get_object(Bucket=BUCKET, Key="reports/b.csv"))
    assert (status, code) == (403, "ExpiredToken")
    assert fg.client().get_object(Bucket=BUCKET, Key="reports/b.csv")["Body"].read() == b"in time"
    assert fg.client().get_object(Bucket=BUCKET, Key="reports/a.csv")["Body"].read() == b"kept"


def test_renewing_extends_the_credentials(leased):
    fg = leased
    BUCKET = fg.bucket
    g = grant(fg, "job:reports", ttl_ms=800)
    s3 = leased_client(fg, g)
    deadline = time.monotonic() + 2.5
    n = 0
    while time.monotonic() < deadline:
        renewed = renew(fg, "job:reports", g["lease_id"])
        assert renewed["credentials"]["access_key_id"] == g["credentials"]["access_key_id"]
        assert renewed["credentials"]["secret_access_key"] == g["credentials"]["secret_access_key"]
        s3.put_object(Bucket=BUCKET, Key=f"reports/{n}.csv", Body=b"x")
        n += 1
        time.sleep(0.25)
    assert n >= 5
    assert renewed["credentials"]["expiration"] >= g["credentials"]["expiration"]


def test_a_tampered_or_missing_session_token_is_refused(leased):
    fg = leased
    BUCKET = fg.bucket
    g = grant(fg, "job:reports")
    c = g["credentials"]
    # A write with the real credentials first: the lean path keeps the signing key it derived,
    # and the forged claims below come under the same access key (it names the grant only).
    leased_client(fg, g).put_object(Bucket=BUCKET, Key="reports/real.csv", Body=b"real")
    # A session token naming a higher token (or another resource) needs a secret nobody has.
    import base64

    claims = json.loads(base64.urlsafe_b64decode(c["session_token"][5:] + "=="))
    claims["t"] += 1
    forged = "fgl1." + base64.urlsafe_b64encode(json.dumps(claims).encode()).decode().rstrip("=")
    s3 = leased_client(fg, {"credentials": dict(c, session_token=forged)})
    status, code, _ = refusal(lambda: s3.put_object(Bucket=BUCKET, Key="reports/a.csv", Body=b"x"))
    assert (status, code) == (403, "SignatureDoesNotMatch")
    no_token = boto3.client(
        "s3", endpoint_url=fg.s3_url, region_name=REGION, aws_access_key_id=c["access_key_id"],
        aws_secret_access_key=c["secret_access_key"],
        config=Config(signature_version="s3v4", s3={"addressing_style": "path"}, retries={"total_max_attempts": 1}),
    )
    status, code, _ = refusal(lambda: no_token.put_object(Bucket=BUCKET, Key="reports/a.csv", Body=b"x"))
    assert (status, code) == (400, "InvalidToken")
    listed = fg.client().list_objects_v2(Bucket=BUCKET).get("Contents", [])
    assert [o["Key"] for o in listed] == ["reports/real.csv"]
    # A lease credential is no issuer: it cannot grant, nor renew or release another lease (or
    # another grant of the same name); its own lease it renews and releases (a shell that
    # `eval`ed `fencegate-lease acquire --env` holds nothing else).
    lease_path = "/_fencegate/v1/leases/" + quote_resource("job:reports")
    as_lease = dict(access_key=c["access_key_id"], secret_key=c["secret_access_key"], session_token=c["session_token"])
    json_head = {"Content-Type": "application/json"}
    r = signed_raw_request(fg, "POST", lease_path, json_head, json.dumps({"holder": "x", "ttl_ms": 1000}).encode(),
                           **as_lease)
    assert r.status == 403, (r.status, r.body)
    other = "/_fencegate/v1/leases/" + quote_resource("job:other")
    r = signed_raw_request(fg, "POST", other + "/renew", json_head, json.dumps({"lease_id": g["lease_id"]}).encode(),
                           **as_lease)
    assert r.status == 403, (r.status, r.body)
    r = signed_raw_request(fg, "POST", lease_path + "/renew", json_head, json.dumps({"lease_id": "0" * 32}).encode(),
                           **as_lease)
    assert r.status == 403, (r.status, r.body)
    body = json.dumps({"lease_id": g["lease_id"]}).encode()
    r = signed_raw_request(fg, "POST", lease_path + "/renew", json_head, body, **as_lease)
    assert r.status == 200, (r.status, r.body)
    r = signed_raw_request(fg, "DELETE", lease_path, json_head, body, **as_lease)
    assert r.status == 204, (r.status, r.body)


def test_presigned_with_lease_credentials(leased):
    fg = leased
    BUCKET = fg.bucket
    g = grant(fg, "job:reports")
    s3 = leased_client(fg, g)
    url = s3.generate_presigned_url("put_object", Params={"Bucket": BUCKET, "Key": "reports/p.csv"}, ExpiresIn=300)
    assert "X-Amz-Security-Token" in url
    r = requests.put(url, data=b"presigned", timeout=10)
    assert r.status_code == 200, r.text
    assert stamp(fg, "reports/p.csv") == str(g["token"])
    release(fg, "job:reports", g["lease_id"])
    r = requests.put(url, data=b"after release", timeout=10)
    assert r.status_code == 403 and "<Code>ExpiredToken</Code>" in r.text, r.text


def test_credentials_survive_a_restart(fencegate, moto_server):
    fg = start(fencegate, moto_server)
    BUCKET = fg.bucket
    g = grant(fg, "job:reports")
    fg.restart()
    s3 = leased_client(fg, g)
    s3.put_object(Bucket=BUCKET, Key="reports/after-restart.csv", Body=b"still mine")
    assert stamp(fg, "reports/after-restart.csv") == str(g["token"])


def test_an_issuer_removed_from_the_config_takes_its_credentials_along(fencegate, moto_server):
    second = {"access_key_id": "second-issuer", "secret_access_key": "second-issuer-secret-0123", "role": "issuer"}
    fg = start(fencegate, moto_server)
    BUCKET = fg.bucket
    fg.config["credentials"].append(second)
    fg.write_config()
    fg.restart()
    path = "/_fencegate/v1/leases/" + quote_resource("job:reports")
    body = json.dumps({"holder": "w", "ttl_ms": 60_000, "credentials": True}).encode()
    r = signed_raw_request(fg, "POST", path, {"Content-Type": "application/json"}, body,
                           access_key=second["access_key_id"], secret_key=second["secret_access_key"])
    assert r.status == 201, (r.status, r.body)
    g = json.loads(r.body)
    leased_client(fg, g).put_object(Bucket=BUCKET, Key="reports/a.csv", Body=b"ok")
    fg.config["credentials"].remove(second)
    fg.write_config()
    fg.restart()
    status, code, _ = refusal(lambda: leased_client(fg, g).put_object(Bucket=BUCKET, Key="reports/a.csv", Body=b"x"))
    # The answer of any forged session token: nobody learns which access keys are issuers.
    assert (status, code) == (403, "SignatureDoesNotMatch")


def test_every_replica_of_a_shared_store_honours_them(fencegate, moto_server, redis_server):
    BUCKET = unique("leased")
    config = merge(redis_store(redis_server), {"fencing": {"rules": rules(BUCKET)}})
    moto_server.client().create_bucket(Bucket=BUCKET)
    upstream = dict(moto_server.upstream_config(), probe_bucket=BUCKET)
    a = fencegate(upstream=upstream, config=config)
    b = fencegate(upstream=upstream, config=config)
    a.bucket = b.bucket = BUCKET
    g = grant(a, "job:reports")
    leased_client(b, g).put_object(Bucket=BUCKET, Key="reports/on-b.csv", Body=b"via b")
    assert stamp(a, "reports/on-b.csv") == str(g["token"])
    release(a, "job:reports", g["lease_id"])
    status, code, _ = refusal(lambda: leased_client(b, g).put_object(Bucket=BUCKET, Key="reports/on-b.csv", Body=b"x"))
    assert (status, code) == (403, "ExpiredToken")
    newer = grant(b, "job:reports", holder="b")
    status, code, _ = refusal(lambda: leased_client(a, g).put_object(Bucket=BUCKET, Key="reports/on-b.csv", Body=b"x"))
    assert (status, code) == (409, "FencingTokenStale")
    leased_client(a, newer).put_object(Bucket=BUCKET, Key="reports/on-b.csv", Body=b"newer via a")


def test_an_issuer_restricted_to_buckets_moves_only_fences_inside_them(fencegate, moto_server):
    """A fence only goes up: an issuer limited to some buckets must not lock (or lease) a
    resource with objects outside them."""
    fg = start(fencegate, moto_server)
    inside, outside = fg.bucket, unique("outside")
    scoped = {"access_key_id": "scoped-issuer", "secret_access_key": "scoped-issuer-secret-0123",
              "role": "issuer", "buckets": [inside]}
    fg.config["credentials"].append(scoped)
    fg.config["fencing"]["rules"].append({"bucket": outside, "prefix": "x/", "resource": "job:outside"})
    fg.write_config()
    fg.restart()
    keys = {"access_key": scoped["access_key_id"], "secret_key": scoped["secret_access_key"]}

    def register(resource: str, token: int):
        return signed_raw_request(fg, "PUT", "/_fencegate/v1/fences/" + quote_resource(resource),
                                  {"Content-Type": "application/json"}, json.dumps({"token": token}).encode(), **keys)

    def lease(resource: str):
        body = json.dumps({"holder": "s", "ttl_ms": 1000, "credentials": True}).encode()
        return signed_raw_request(fg, "POST", "/_fencegate/v1/leases/" + quote_resource(resource),
                                  {"Content-Type": "application/json"}, body, **keys)

    # Outside: another bucket's object, a resource bound to another bucket, a free name that
    # writes anywhere could present.
    for resource in (f"{outside}/secret", "job:outside", "job:anything"):
        for call in (lambda: register(resource, 2**64 - 1), lambda: lease(resource)):
            r = call()
            assert r.status == 403 and b"AccessDenied" in r.body, (resource, r.status, r.body)
            assert fg.get_fence(resource).status_code == 404, resource
    # Inside: its own bucket's objects, and a resource bound inside it by a rule.
    assert register(f"{inside}/mine", 5).status == 200
    assert lease("job:reports").status == 201


def test_a_read_refused_for_a_lapsed_lease_is_no_write_decision(leased):
    """Reads signed with a lease credential whose lease lapsed get 403 `ExpiredToken`; they were
    counted in `fencegate_decisions_total{outcome="lease_expired"}` with the writes, which made
    a dashboard of refused writes count reads. Now they are counted apart, in
    `fencegate_lease_reads_refused_total`; a refused write still counts as a decision."""
    import time

    from fencegate_testlib import metric, metric_samples

    fg = leased
    g = grant(fg, "job:reports", ttl_ms=500)
    s3 = leased_client(fg, g)
    s3.put_object(Bucket=fg.bucket, Key="reports/r.csv", Body=b"r")
    time.sleep(0.8)
    before = metric_samples(fg)
    status, code, _ = refusal(lambda: s3.get_object(Bucket=fg.bucket, Key="reports/r.csv"))
    assert (status, code) == (403, "ExpiredToken")
    status, code, _ = refusal(lambda: s3.put_object(Bucket=fg.bucket, Key="reports/r.csv", Body=b"late"))
    assert (status, code) == (403, "ExpiredToken")
    after = metric_samples(fg)
    assert metric(after, "fencegate_lease_reads_refused_total") - metric(before, "fencegate_lease_reads_refused_total") == 1
    decisions = "fencegate_decisions_total"
    assert metric(after, decisions, outcome="lease_expired") - metric(before, decisions, outcome="lease_expired") == 1
