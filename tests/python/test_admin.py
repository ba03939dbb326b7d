"""Proves the admin listener: health, fence registration (G7), bearer protection and decision metrics."""

from __future__ import annotations

import re

import pytest
from botocore.exceptions import ClientError

from fencegate_testlib import code_of, head_status, header_of, status_of


def test_health_and_ready(fg):
    assert fg.admin("GET", "/healthz").status_code == 200
    assert fg.admin("GET", "/readyz").status_code == 200


def test_unknown_fence_is_404(fg):
    assert fg.get_fence("never/seen").status_code == 404
    assert fg.get_fence("job:never-seen").status_code == 404


def test_registration_closes_the_gap(fg):
    bucket = "bkt1"
    fg.client().create_bucket(Bucket=bucket)
    resource = f"{bucket}/key"

    r = fg.put_fence(resource, 12)
    assert r.status_code == 200, r.text
    assert r.json() == {"resource": resource, "token": 12}

    r = fg.put_fence(resource, 11)
    assert r.status_code == 409, r.text
    assert r.json()["token"] == 12
    assert r.json()["resource"] == resource

    r = fg.put_fence(resource, 12)  # equal: not lower, so accepted
    assert r.status_code == 200, r.text
    assert r.json()["token"] == 12

    r = fg.get_fence(resource)
    assert r.status_code == 200
    assert r.json() == {"resource": resource, "token": 12}

    # The new holder has not written yet, and the old one is already shut out (G7).
    with pytest.raises(ClientError) as exc_info:
        fg.client(token=11).put_object(Bucket=bucket, Key="key", Body=b"old holder")
    assert status_of(exc_info.value) == 409
    assert code_of(exc_info.value) == "FencingTokenStale"
    assert header_of(exc_info.value, "Fencing-Token-Current") == "12"
    assert head_status(fg.client(), bucket, "key") == 404

    fg.client(token=12).put_object(Bucket=bucket, Key="key", Body=b"new holder")
    assert fg.client().get_object(Bucket=bucket, Key="key")["Body"].read() == b"new holder"


@pytest.mark.parametrize("resource", ["job:invoice-generation", "reports/2026/", "a b/ü/%"])
def test_resource_names_roundtrip(fg, resource):
    r = fg.put_fence(resource, 3)
    assert r.status_code == 200, r.text
    r = fg.get_fence(resource)
    assert r.status_code == 200
    assert r.json() == {"resource": resource, "token": 3}


@pytest.mark.parametrize(
    "body",
    [
        b'{"token": "abc"}',
        b'{"token": -1}',
        b'{"token": 18446744073709551616}',
        b'{"token": 1.5}',
        b"{}",
        b"not json",
    ],
)
def test_bad_registration_body(fg, body):
    r = fg.admin(
        "PUT", "/v1/fences/job%3Abad", data=body, headers={"Content-Type": "application/json"}
    )
    assert 400 <= r.status_code < 500 and r.status_code != 409, (r.status_code, r.text)
    assert fg.get_fence("job:bad").status_code == 404


def test_admin_token(fencegate):
    fg = fencegate(config={"server": {"admin_token": "secret"}})
    assert fg.admin("GET", "/v1/fences/job%3Ax").status_code == 401
    assert fg.admin("GET", "/v1/fences/job%3Ax", token="wrong").status_code == 401
    r = fg.admin("GET", "/v1/fences/job%3Ax", headers={"Authorization": "Basic c2VjcmV0"})
    assert r.status_code == 401
    assert fg.admin("GET", "/v1/fences/job%3Ax", token="secret").status_code == 404

    assert fg.put_fence("job:x", 5).status_code == 401
    assert fg.put_fence("job:x", 5, token="wrong").status_code == 401
    assert fg.get_fence("job:x", token="secret").status_code == 404  # nothing was registered
    r = fg.put_fence("job:x", 5, token="secret")
    assert r.status_code == 200, r.text
    assert fg.get_fence("job:x", token="secret").json()["token"] == 5

    # The scheme is case-insensitive; probes need no token; metrics do.
    r = fg.admin("GET", "/v1/fences/job%3Ax", headers={"Authorization": "bearer secret"})
    assert r.status_code == 200, r.text
    assert fg.admin("GET", "/healthz").status_code == 200
    assert fg.admin("GET", "/readyz").status_code == 200
    assert fg.admin("GET", "/metrics").status_code == 401
    assert fg.admin("GET", "/metrics", token="secret").status_code == 200


def _samples(text: str):
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if m:
            yield m.group(1), m.group(2) or "", float(m.group(3))


def test_metrics_count_decisions(fg):
    bucket = "metricsbkt"
    fg.client().create_bucket(Bucket=bucket)
    fg.client(token=12).put_object(Bucket=bucket, Key="k", Body=b"12")
    with pytest.raises(ClientError):
        fg.client(token=11).put_object(Bucket=bucket, Key="k", Body=b"11")

    r = fg.admin("GET", "/metrics")
    assert r.status_code == 200
    assert r.headers.get("Content-Type", "").startswith("text/plain"), r.headers
    decisions = [(n, l, v) for n, l, v in _samples(r.text) if "decision" in n]
    assert decisions, "no metric named *decision* in /metrics:\n" + r.text[:3000]
    stale = [s for s in decisions if "stale" in s[1].lower() and s[2] >= 1]
    assert stale, f"no decision sample labelled stale with a count >= 1: {decisions}"
    assert sum(v for _n, _l, v in decisions if "stale" not in _l.lower()) >= 1, decisions
