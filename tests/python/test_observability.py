"""What operators see is true (docs/operations.md, "Metrics and logs"): every metric has `# HELP` and the ones alerts
read exist from start-up; S3 requests the S3 library refuses before fencegate sees them (a bad
signature) are counted; the log holds no colour codes when it is not a terminal and no raw
response bodies at ERROR from the S3 library; client mistakes fencegate cannot pass on as meant
are 400 before anything is sent, never 502 or an ambiguous outcome.
"""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest
from botocore.exceptions import ClientError

from fencegate_testlib import metric, metric_samples, s3_client, sign_headers, signed_raw_request, wait_until


def test_metrics_are_described_and_exist_from_start_up(fg):
    text = fg.admin("GET", "/metrics").text
    for name in ("fencegate_decisions_total", "fencegate_advances_total", "fencegate_inflight_writes",
                 "fencegate_store_wait_failures_total", "fencegate_registrations_revoked_total"):
        assert f"# HELP {name} " in text, name
    samples = metric_samples(fg)
    for outcome in ("accepted", "stale", "missing_token", "store_unavailable"):
        assert ("fencegate_decisions_total", frozenset({("outcome", outcome)})) in samples, outcome
    assert metric(samples, "fencegate_inflight_writes") == 0


def test_refused_signatures_are_counted(fg, bucket):
    before = metric_samples(fg)
    forged = s3_client(fg.s3_url, secret_key="not-the-secret")
    for _ in range(3):
        with pytest.raises(ClientError) as info:
            forged.list_objects_v2(Bucket=bucket)
        assert info.value.response["Error"]["Code"] == "SignatureDoesNotMatch"
    after = metric_samples(fg)
    name = "fencegate_s3_protocol_refusals_total"
    assert metric(after, name, status="403") - metric(before, name, status="403") == 3
    # A request fencegate's handler answered is not counted there.
    fg.client(token=1).put_object(Bucket=bucket, Key="k", Body=b"x")
    assert metric(metric_samples(fg), name, status="403") == metric(after, name, status="403")


def test_the_log_has_no_colour_codes_and_no_library_error_dumps(fg, bucket):
    # A 501 from fencegate (POST Object) and a 403 from the library.
    r = signed_raw_request(fg, "POST", f"/{bucket}", {"Content-Type": "multipart/form-data; boundary=x",
                                                      "Fencing-Token": "1"}, b"--x--\r\n")
    assert r.status in (400, 501), (r.status, r.body)
    with pytest.raises(ClientError):
        s3_client(fg.s3_url, secret_key="wrong").list_objects_v2(Bucket=bucket)
    # The local upstream's ordinary answers: a missing key, a create-only write on a present one.
    with pytest.raises(ClientError):
        fg.client().get_object(Bucket=bucket, Key="missing")
    fg.client(token=1).put_object(Bucket=bucket, Key="once", Body=b"x")
    with pytest.raises(ClientError):
        fg.client(token=1).put_object(Bucket=bucket, Key="once", Body=b"y", IfNoneMatch="*")
    log = fg.log_tail(10_000)
    assert "\x1b[" not in log, "colour codes in a log file"
    assert not re.search(r"ERROR\s+s3s", log), log


def test_non_ascii_metadata_is_a_client_error_before_anything_is_sent(fg, bucket):
    before = metric_samples(fg)
    # botocore refuses to send non-ASCII header values itself: the bytes go raw.
    host, port = fg.s3_addr
    # Signed (its UTF-8 bytes in the canonical request), as every `x-amz-*` header must be.
    headers = sign_headers("PUT", host, port, f"/{bucket}/meta",
                           {"Fencing-Token": "1", "Content-Length": "4", "x-amz-meta-name": "caf\u00e9"})
    head = (f"PUT /{bucket}/meta HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers)).encode() + b"\r\n"
    with socket.create_connection(fg.s3_addr, timeout=10) as sock:
        sock.sendall(head + b"body")
        reply = sock.recv(65536)
    status = int(reply.split(b" ", 2)[1])
    assert 400 <= status < 500, reply[:300]
    assert b"<Code>InvalidArgument</Code>" in reply, reply[:600]
    after = metric_samples(fg)
    assert metric(after, "fencegate_ambiguous_outcomes_total", op="fenced_write") == \
        metric(before, "fencegate_ambiguous_outcomes_total", op="fenced_write")
    with pytest.raises(ClientError) as info:
        fg.client().head_object(Bucket=bucket, Key="meta")
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404


@pytest.mark.parametrize("source", ["bkt1/../etc/passwd", "bkt1/a/./b", "bkt1/%2E%2E/x"])
def test_a_copy_source_with_dot_segments_is_refused(fg, bucket, source):
    fg.client(token=1).put_object(Bucket=bucket, Key="a/b", Body=b"x")
    r = signed_raw_request(fg, "PUT", f"/{bucket}/copy", {"Fencing-Token": "1", "x-amz-copy-source": source})
    assert r.status == 400 and b"<Code>InvalidArgument</Code>" in r.body, (r.status, r.body)
    with pytest.raises(ClientError):
        fg.client().head_object(Bucket=bucket, Key="copy")


def test_a_write_failing_after_admission_logs_one_decision(fg, bucket):
    """The span's `decision` is recorded once (it showed `decision="accepted" ... decision="error"`
    when a write failed after admission); what failed goes to `error`."""
    host, port = fg.s3_addr
    path = f"/{bucket}/cut"
    headers = sign_headers("PUT", host, port, path, {"Fencing-Token": "1", "Content-Length": "100"})
    head = (f"PUT {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n").encode()
    with socket.create_connection(fg.s3_addr, timeout=10) as sock:
        sock.sendall(head + b"only ten b")
        sock.shutdown(socket.SHUT_WR)  # the body ends early
        try:
            sock.recv(65536)
        except OSError:
            pass

    def refused_lines():
        return [line for line in fg.log_tail(10_000).splitlines() if 'op="PutObject"' in line and "refused" in line]

    # The refusal is logged when the request ends (the `fg` fixture prints the log's tail).
    refused = wait_until(refused_lines, timeout=5, interval=0.1, what="the refused PutObject in the log")
    line = refused[-1]
    assert line.count("decision=") == 1, line
    assert 'decision="accepted"' in line and 'error="IncompleteBody"' in line, line


DOCS = Path(__file__).resolve().parents[2] / "docs"


def documented_counters() -> set:
    """Every counter docs/operations.md ("Metrics and logs") and the README name."""
    text = (DOCS / "operations.md").read_text() + (DOCS.parent / "README.md").read_text()
    return set(re.findall(r"\bfencegate_[a-z0-9_]+_total\b", text))


def test_every_documented_counter_exists_at_zero_from_start_up(fg):
    """A counter that appears only once it moved cannot be told from a missing scrape: every
    counter the docs name is there, at 0, before the first request."""
    samples = metric_samples(fg)
    names = {name for name, _ in samples}
    counters = documented_counters()
    assert len(counters) >= 15, counters
    assert counters <= names, f"missing from a fresh /metrics: {sorted(counters - names)}"
    assert all(value == 0 for (name, _), value in samples.items() if name in counters)


def test_every_metric_of_the_dashboard_is_exported(fg, bucket):
    """docs/grafana-dashboard.json reads only metrics fencegate exports (after one write and
    one stale write, which every histogram it reads has then observed)."""
    dashboard = json.loads((DOCS / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    read = {re.sub(r"_bucket$", "", n) for e in exprs for n in re.findall(r"\bfencegate_[a-z0-9_]+\b", e)}
    assert len(read) >= 15, read
    fg.client(token=5).put_object(Bucket=bucket, Key="k", Body=b"x")
    with pytest.raises(ClientError):
        fg.client(token=4).put_object(Bucket=bucket, Key="k", Body=b"stale")
    exported = {name for name, _ in metric_samples(fg)}
    exported |= {re.sub(r"_(bucket|sum|count)$", "", n) for n in exported}
    assert read <= exported, f"the dashboard reads what /metrics does not have: {sorted(read - exported)}"
