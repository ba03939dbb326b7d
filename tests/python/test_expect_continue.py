"""Proves a stale write is rejected before its body is read: a 64 MiB upload is refused after less than 1 MiB."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest

from fencegate_testlib import (
    ACCESS_KEY,
    MiB,
    SECRET_KEY,
    build_head,
    connect,
    head_status,
    read_object,
    read_response,
    s3_error_code,
    sign_headers,
)

BUCKET = "bigbkt"
BIG = 64 * MiB


@pytest.fixture
def stale_setup(fg):
    fg.client().create_bucket(Bucket=BUCKET)
    r = fg.put_fence(f"{BUCKET}/big", 5)
    assert r.status_code == 200, r.text
    return fg


def curl_put(fg, path_on_disk, key: str, token: int, extra=()):
    if shutil.which("curl") is None:
        pytest.fail("curl is not installed (scripts/test installs it)")
    out = path_on_disk.parent / "curl-body.txt"
    cmd = [
        "curl", "-sS", "--max-time", "60",
        "--aws-sigv4", "aws:amz:us-east-1:s3",
        "--user", f"{ACCESS_KEY}:{SECRET_KEY}",
        "-H", f"Fencing-Token: {token}",
        "-H", "x-amz-content-sha256: UNSIGNED-PAYLOAD",
        *extra,
        "-T", str(path_on_disk),
        "-o", str(out),
        "-w", "%{http_code} %{size_upload}",
        f"{fg.s3_url}/{BUCKET}/{key}",
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    code, _, size = p.stdout.strip().partition(" ")
    body = out.read_bytes() if out.exists() else b""
    return int(code or 0), int(float(size or 0)), body, p


@pytest.mark.parametrize("expect", ["explicit", "curl-default"])
def test_stale_64mib_upload_with_expect_100_continue(stale_setup, tmp_path, expect):
    """curl adds `Expect: 100-continue` to a large upload by itself; also sent explicitly."""
    fg = stale_setup
    extra = ("-H", "Expect: 100-continue") if expect == "explicit" else ()
    big = tmp_path / "bigfile"
    with open(big, "wb") as f:  # 64 MiB of real bytes, written in 1 MiB blocks
        block = b"\x5a" * MiB
        for _ in range(BIG // MiB):
            f.write(block)
    code, uploaded, body, p = curl_put(fg, big, "big", 1, extra=extra)
    assert code == 409, (code, uploaded, body[:500], p.stderr)
    assert s3_error_code(body) == "FencingTokenStale", body[:500]
    assert uploaded < MiB, f"curl sent {uploaded} bytes of a stale 64 MiB upload"
    assert head_status(fg.client(), BUCKET, "big") == 404


def test_current_token_upload_with_expect_100_continue_succeeds(stale_setup, tmp_path):
    fg = stale_setup
    f = tmp_path / "medium"
    data = b"m" * (2 * MiB)
    f.write_bytes(data)
    code, uploaded, body, p = curl_put(fg, f, "big", 5, extra=("-H", "Expect: 100-continue"))
    assert code == 200, (code, body[:500], p.stderr)
    assert uploaded == len(data)
    assert read_object(fg.client(), BUCKET, "big") == data


def _stale_head(fg, expect: bool) -> bytes:
    host, port = fg.s3_addr
    path = f"/{BUCKET}/big"
    headers = {"Fencing-Token": "1", "Content-Length": str(BIG)}
    if expect:
        headers["Expect"] = "100-continue"
    return build_head("PUT", path, sign_headers("PUT", host, port, path, headers))


def test_stale_expect_gets_final_answer_not_100(stale_setup):
    """With `Expect: 100-continue` the first thing back is the 409, never `100 Continue`."""
    fg = stale_setup
    with connect(fg.s3_addr) as sock:
        sock.sendall(_stale_head(fg, expect=True))
        sock.settimeout(10)
        deadline = time.monotonic() + 10
        first = b""
        while b"\r\n" not in first and time.monotonic() < deadline:
            chunk = sock.recv(4096)
            if not chunk:
                break
            first += chunk
    status_line = first.split(b"\r\n", 1)[0]
    assert status_line.startswith(b"HTTP/1.1 409"), first[:300]


def test_stale_without_expect_is_answered_without_the_body(stale_setup):
    """Without `Expect`, the 409 arrives while the client has sent none of the 64 MiB."""
    fg = stale_setup
    with connect(fg.s3_addr) as sock:
        sock.sendall(_stale_head(fg, expect=False))
        started = time.monotonic()
        resp = read_response(sock, timeout=10)
    assert resp.status == 409, (resp.status, resp.error, resp.body[:300])
    assert resp.code() == "FencingTokenStale"
    assert resp.headers.get("fencing-token-current") == "5"
    assert time.monotonic() - started < 10
    assert head_status(fg.client(), BUCKET, "big") == 404
