"""Proves the admin listener: health, fence registration (G7), bearer protection and decision metrics."""

from __future__ import annotations

import os
import subprocess

import pytest
from botocore.exceptions import ClientError

from fencegate_testlib import (
    MotoServer,
    base_config,
    bin_path,
    code_of,
    head_status,
    header_of,
    metric,
    metric_samples,
    status_of,
    to_toml,
    wait_until,
)


def test_health_and_ready(fg):
    assert fg.admin("GET", "/healthz").status_code == 200
    assert fg.admin("GET", "/readyz").status_code == 200


def test_ready_only_while_the_upstream_answers(fencegate, tmp_path):
    """/readyz is 503 naming the cause while the upstream cannot be reached, 200 once it answers again."""
    moto = MotoServer(tmp_path).start()
    try:
        moto.client().create_bucket(Bucket="ready-probe")
        upstream = dict(moto.upstream_config(), probe_bucket="ready-probe", health_interval_ms=200)
        fg = fencegate(upstream=upstream)
        assert fg.admin("GET", "/readyz").status_code == 200
        assert fg.admin("GET", "/v1/status").json()["upstream"] == {"ready": True, "detail": None}
    finally:
        moto.stop()
    wait_until(lambda: fg.admin("GET", "/readyz").status_code == 503, 10, what="readyz 503 with moto stopped")
    problem = fg.admin("GET", "/readyz").json()
    assert problem["type"].endswith("UpstreamUnavailable"), problem
    assert "the upstream cannot be reached" in problem["detail"], problem
    status = fg.admin("GET", "/v1/status").json()
    assert status["upstream"]["ready"] is False and "cannot be reached" in status["upstream"]["detail"]
    assert status["store"]["ready"] is True


def test_a_missing_probe_bucket_is_not_ready(fencegate, moto_server):
    """A bucket fencegate was told to use that does not exist: not ready, and the detail names it."""
    upstream = dict(moto_server.upstream_config(), probe_bucket="no-such-ready-bucket")
    fg = fencegate(upstream=upstream)
    problem = fg.admin("GET", "/readyz").json()
    assert problem["status"] == 503 and 'the bucket "no-such-ready-bucket" does not exist' in problem["detail"]


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
    assert r.status_code == 400, (r.status_code, r.text)
    assert r.headers.get("Content-Type") == "application/problem+json", r.headers
    assert r.json()["title"] == "InvalidFencingToken", r.text
    assert fg.get_fence("job:bad").status_code == 404


def test_admin_token(fencegate):
    fg = fencegate(config={"server": {"admin_token": "secret-of-16-bytes"}})
    assert fg.admin("GET", "/v1/fences/job%3Ax").status_code == 401
    assert fg.admin("GET", "/v1/fences/job%3Ax", token="wrong").status_code == 401
    r = fg.admin("GET", "/v1/fences/job%3Ax", headers={"Authorization": "Basic c2VjcmV0LW9mLTE2LWJ5dGVz"})
    assert r.status_code == 401
    assert fg.admin("GET", "/v1/fences/job%3Ax", token="secret-of-16-bytes").status_code == 404

    assert fg.put_fence("job:x", 5).status_code == 401
    assert fg.put_fence("job:x", 5, token="wrong").status_code == 401
    assert fg.get_fence("job:x", token="secret-of-16-bytes").status_code == 404  # nothing was registered
    r = fg.put_fence("job:x", 5, token="secret-of-16-bytes")
    assert r.status_code == 200, r.text
    assert fg.get_fence("job:x", token="secret-of-16-bytes").json()["token"] == 5

    # The scheme is case-insensitive; probes need no token; metrics do.
    r = fg.admin("GET", "/v1/fences/job%3Ax", headers={"Authorization": "bearer secret-of-16-bytes"})
    assert r.status_code == 200, r.text
    assert fg.admin("GET", "/healthz").status_code == 200
    assert fg.admin("GET", "/readyz").status_code == 200
    assert fg.admin("GET", "/metrics").status_code == 401
    assert fg.admin("GET", "/metrics", token="secret-of-16-bytes").status_code == 200


DECISIONS = ("accepted", "stale", "missing_token", "invalid_token")


def _counts(fg) -> dict:
    samples = metric_samples(fg)
    counts = {o: metric(samples, "fencegate_decisions_total", outcome=o) for o in DECISIONS}
    counts["advances"] = metric(samples, "fencegate_advances_total")
    return counts


def _assert_counted(fg, before: dict, expected_delta: dict):
    """The counters moved by exactly `expected_delta` (all others not at all) since `before`, on
    this process. Polled briefly: a counter may be bumped just after the answer is sent."""
    want = {k: before[k] + expected_delta.get(k, 0) for k in before}
    seen = {}

    def settled():
        seen.update(_counts(fg))
        return seen == want

    try:
        wait_until(settled, timeout=5, what="the decision counters")
    except AssertionError:
        raise AssertionError(f"counters {seen}, expected {want} (before {before})") from None


def test_metrics_count_decisions(fg):
    bucket = "metricsbkt"
    fg.client().create_bucket(Bucket=bucket)
    r = fg.admin("GET", "/metrics")
    assert r.status_code == 200
    assert r.headers.get("Content-Type", "").startswith("text/plain"), r.headers

    before = _counts(fg)
    fg.client(token=12).put_object(Bucket=bucket, Key="k", Body=b"12")  # advances the fence to 12
    _assert_counted(fg, before, {"accepted": 1, "advances": 1})

    before = _counts(fg)
    fg.client(token=12).put_object(Bucket=bucket, Key="k", Body=b"12 again")  # equal: no advance
    _assert_counted(fg, before, {"accepted": 1})

    before = _counts(fg)
    with pytest.raises(ClientError) as exc_info:
        fg.client(token=11).put_object(Bucket=bucket, Key="k", Body=b"11")
    assert (status_of(exc_info.value), code_of(exc_info.value)) == (409, "FencingTokenStale")
    _assert_counted(fg, before, {"stale": 1})

    before = _counts(fg)
    with pytest.raises(ClientError) as exc_info:
        fg.client().put_object(Bucket=bucket, Key="k", Body=b"no token")
    assert (status_of(exc_info.value), code_of(exc_info.value)) == (428, "FencingTokenRequired")
    _assert_counted(fg, before, {"missing_token": 1})

    before = _counts(fg)
    with pytest.raises(ClientError) as exc_info:
        fg.client(token="12a").put_object(Bucket=bucket, Key="k", Body=b"bad token")
    assert (status_of(exc_info.value), code_of(exc_info.value)) == (400, "InvalidFencingToken")
    _assert_counted(fg, before, {"invalid_token": 1})

    # Reads are not decisions.
    before = _counts(fg)
    assert fg.client().get_object(Bucket=bucket, Key="k")["Body"].read() == b"12 again"
    _assert_counted(fg, before, {})


@pytest.mark.parametrize("token", ["", "short", "fifteen-bytes!!"])
def test_an_admin_token_shorter_than_16_bytes_is_refused(tmp_path, token):
    """An unset shell variable (`FENCEGATE_SERVER__ADMIN_TOKEN=$UNSET`) gives an empty token, and
    `Authorization: Bearer ` then opened the admin API; a short one can be guessed: refused at
    start, naming the key."""
    cfg = tmp_path / "fg.toml"
    cfg.write_text(to_toml(base_config(tmp_path)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FENCEGATE_")}
    env["FENCEGATE_SERVER__ADMIN_TOKEN"] = token
    for command in ("check-config", "serve"):
        p = subprocess.run([str(bin_path()), command, "--config", str(cfg)], capture_output=True, text=True,
                           timeout=30, stdin=subprocess.DEVNULL, env=env)
        assert p.returncode != 0 and "server.admin_token" in p.stderr and "16 bytes" in p.stderr, p.stderr


def test_the_admin_listener_answers_only_to_its_own_names(fencegate):
    """A page whose name was rebound to the admin address (DNS rebinding) names its own host:
    421, before any token is looked at; the listener's address, localhost and the names in
    `server.admin_host_names` are served."""
    fg = fencegate(config={"server": {"admin_host_names": ["fencegate-admin.internal"]}})
    port = fg.admin_addr[1]
    for host in ("evil.example", f"evil.example:{port}", f"127.0.0.1:{port + 1}", "10.0.0.1"):
        r = fg.admin("GET", "/v1/fences/job%3Ax", headers={"Host": host})
        assert r.status_code == 421, (host, r.status_code, r.text)
        assert fg.admin("PUT", "/v1/fences/job%3Ax", json={"token": 5}, headers={"Host": host}).status_code == 421
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"fencegate-admin.internal:{port}"):
        assert fg.admin("GET", "/v1/fences/job%3Ax", headers={"Host": host}).status_code == 404, host
    assert fg.get_fence("job:x").status_code == 404, "nothing was registered through a refused host"

