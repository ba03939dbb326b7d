"""Proves that bad input gets a clear error, writes nothing upstream, and never crashes or hangs fencegate.

Note on ` 12` (leading space): HTTP strips optional whitespace around every header value
(RFC 9110 5.5), and so does SigV4's canonical form, so ` 12` arrives as `12` in any server.
It is covered here by tokens with whitespace inside (`1 2`), which do reach fencegate.
"""

from __future__ import annotations

import base64
import hashlib
import socket
import time
import zlib
from pathlib import Path

import pytest
from botocore.exceptions import ClientError

from fencegate_testlib import (
    MiB,
    assert_still_serving,
    build_head,
    code_of,
    connect,
    head_status,
    raw_request,
    read_object,
    read_response,
    s3_client,
    sign_headers,
    signed_raw_request,
    status_of,
)

BAD_TOKENS = {
    "2^64": "18446744073709551616",
    "21-digits": "999999999999999999999",
    "negative": "-1",
    "hex": "0x10",
    "empty": "",
    "10KB-digits": "7" * 10240,
    "inner-space": "1 2",
    "plus": "+12",
    "trailing-junk": "12a",
    "decimal-point": "12.0",
}


@pytest.mark.parametrize("token", list(BAD_TOKENS.values()), ids=list(BAD_TOKENS.keys()))
def test_malformed_token_header(fg, bucket, token):
    key = "malformed"
    with pytest.raises(ClientError) as exc_info:
        fg.client(token=token).put_object(Bucket=bucket, Key=key, Body=b"x")
    assert status_of(exc_info.value) == 400, exc_info.value.response
    assert code_of(exc_info.value) == "InvalidFencingToken", exc_info.value.response
    assert head_status(fg.client(), bucket, key) == 404
    assert fg.get_fence(f"{bucket}/{key}").status_code == 404
    assert_still_serving(fg, bucket)


@pytest.mark.parametrize("token", ["-1", "0x10", "18446744073709551616", "abc"])
def test_malformed_token_metadata(fg, bucket, token):
    with pytest.raises(ClientError) as exc_info:
        fg.client().put_object(Bucket=bucket, Key="meta", Body=b"x", Metadata={"fencing-token": token})
    assert status_of(exc_info.value) == 400, exc_info.value.response
    assert code_of(exc_info.value) == "InvalidFencingToken", exc_info.value.response
    assert head_status(fg.client(), bucket, "meta") == 404


def test_header_and_metadata_disagree(fg, bucket):
    with pytest.raises(ClientError) as exc_info:
        fg.client(token=12).put_object(
            Bucket=bucket, Key="both", Body=b"x", Metadata={"fencing-token": "13"}
        )
    assert status_of(exc_info.value) == 400, exc_info.value.response
    assert code_of(exc_info.value) == "InvalidFencingToken", exc_info.value.response
    assert head_status(fg.client(), bucket, "both") == 404
    assert fg.get_fence(f"{bucket}/both").status_code == 404
    # Agreeing header and metadata are fine.
    fg.client(token=12).put_object(Bucket=bucket, Key="both", Body=b"y", Metadata={"fencing-token": "12"})
    assert read_object(fg.client(), bucket, "both") == b"y"


def test_extreme_valid_tokens(fg, bucket):
    """0 and 2^64-1 are valid u64 tokens."""
    fg.client(token=0).put_object(Bucket=bucket, Key="zero", Body=b"0")
    fg.client(token=18446744073709551615).put_object(Bucket=bucket, Key="max", Body=b"max")
    assert fg.get_fence(f"{bucket}/max").json()["token"] == 18446744073709551615
    with pytest.raises(ClientError) as exc_info:
        fg.client(token=18446744073709551614).put_object(Bucket=bucket, Key="max", Body=b"m-1")
    assert status_of(exc_info.value) == 409, exc_info.value.response
    assert code_of(exc_info.value) == "FencingTokenStale", exc_info.value.response
    assert read_object(fg.client(), bucket, "max") == b"max"


ESCAPE = "fg-escape-probe"
TRAVERSALS = {
    "dotdot": f"/bkt1/../victim/{ESCAPE}",
    "encoded-dots": f"/bkt1/%2E%2E/victim/{ESCAPE}",
    "encoded-slashes": f"/bkt1/..%2Fvictim%2F{ESCAPE}",
    "nested": f"/bkt1/a/../../victim/{ESCAPE}",
    "above-root": f"/bkt1/../../{ESCAPE}",
    "to-tmp": "/bkt1/" + "../" * 16 + f"tmp/{ESCAPE}",
}


@pytest.fixture
def tmp_probe():
    probe = Path("/tmp") / ESCAPE
    probe.unlink(missing_ok=True)
    yield probe
    for leftover in (probe, probe.with_name(ESCAPE + ".meta")):  # only if something escaped
        leftover.unlink(missing_ok=True)


def _tree(root: Path) -> dict:
    """Every file under `root` with its bytes, but fencegate's own logs: the local upstream's
    objects and the fence store."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.suffix != ".log"}


def _assert_refused_as_dot_segments(resp, what):
    assert resp.status is not None, (what, f"no response: {resp.error}")
    assert (resp.status, resp.code()) == (400, "InvalidArgument"), (what, resp.status, resp.body[:500])
    assert b"path segments are refused" in resp.body, (what, resp.body[:500])


# Keys with a `.` or `..` segment are legal S3 keys (S3 stores `a/../b` literally), but fencegate
# refuses them with 400 InvalidArgument on every request, before any upstream call or fence
# change (README, "What fencegate answers"): a proxy, client library or upstream that
# normalises the path would write another object than the one whose fence was checked, and
# the local upstream maps keys to files. So nothing lands anywhere: not outside the bucket,
# not in it, not in the fence store.
@pytest.mark.parametrize("path", list(TRAVERSALS.values()), ids=list(TRAVERSALS.keys()))
def test_path_traversal_keys(fg, bucket, path, tmp_probe):
    assert bucket == "bkt1"
    fg.client().create_bucket(Bucket="victim")
    before = _tree(fg.workdir)
    resp = signed_raw_request(fg, "PUT", path, headers={"Fencing-Token": "3"}, body=b"escaped!")
    _assert_refused_as_dot_segments(resp, path)
    # Nothing landed: the whole instance directory (upstream objects, fence store) is unchanged,
    # and nothing appeared next to it or in /tmp.
    assert _tree(fg.workdir) == before, f"{path} changed files under {fg.workdir}"
    for p in (tmp_probe, fg.workdir.parent / ESCAPE):
        assert not p.exists(), f"{path} wrote {p}"
    assert head_status(fg.client(), "victim", ESCAPE) == 404
    for name in ("bkt1", "victim"):
        assert fg.client().list_objects_v2(Bucket=name).get("KeyCount") == 0, name
    assert fg.get_fence(f"victim/{ESCAPE}").status_code == 404
    assert fg.get_fence(path.lstrip("/")).status_code == 404
    # A read of the same path is refused the same way.
    _assert_refused_as_dot_segments(signed_raw_request(fg, "GET", path), "GET " + path)
    assert_still_serving(fg, bucket)


# Dots that are not whole segments are ordinary key characters: stored under that exact key.
DOTTED_KEYS = ["a..b", "...", ".hidden", "a/.../b", "..a/b..", "x/.y/z."]


@pytest.mark.parametrize("key", DOTTED_KEYS)
def test_dots_inside_segments_are_ordinary_keys(fg, bucket, key):
    body = f"bytes of {key}".encode()
    resp = signed_raw_request(fg, "PUT", f"/{bucket}/{key}", headers={"Fencing-Token": "3"}, body=body)
    assert resp.status == 200, (resp.status, resp.body[:500])
    assert read_object(fg.client(), bucket, key) == body
    assert [o["Key"] for o in fg.client().list_objects_v2(Bucket=bucket)["Contents"]] == [key]
    assert fg.get_fence(f"{bucket}/{key}").json()["token"] == 3


def test_path_traversal_reads(fg, bucket):
    """Reads are unfenced but refused the same way, and never reach another bucket or a file
    outside the upstream."""
    fg.client().create_bucket(Bucket="victim")
    fg.client(token=1).put_object(Bucket="victim", Key="private", Body=b"victim's bytes")
    for path in ("/bkt1/../victim/private", "/bkt1/%2E%2E/victim/private",
                 "/bkt1/" + "../" * 16 + "etc/passwd", "/bkt1/" + "%2E%2E/" * 16 + "etc/passwd"):
        resp = signed_raw_request(fg, "GET", path)
        _assert_refused_as_dot_segments(resp, path)
        assert b"victim's bytes" not in resp.body, f"{path} read another bucket's object"
        assert b"root:" not in resp.body, f"{path} read a file outside the upstream"
    assert_still_serving(fg, bucket)


def test_unknown_bucket_passes_through_404(fg, bucket):
    with pytest.raises(ClientError) as exc_info:
        fg.client(token=5).put_object(Bucket="no-such-bucket-here", Key="k", Body=b"x")
    assert status_of(exc_info.value) == 404, exc_info.value.response
    assert code_of(exc_info.value) == "NoSuchBucket"
    with pytest.raises(ClientError) as exc_info:
        fg.client().get_object(Bucket="no-such-bucket-here", Key="k")
    assert status_of(exc_info.value) == 404
    assert code_of(exc_info.value) == "NoSuchBucket"
    assert_still_serving(fg, bucket)


@pytest.mark.parametrize("shape", ["one-1MiB-header", "2000-headers"])
def test_oversized_headers(fg, bucket, shape):
    if shape == "one-1MiB-header":
        extra = [("X-Big", "a" * MiB)]
    else:
        extra = [(f"X-H{i}", "v" * 100) for i in range(2000)]
    headers = [("Host", f"{fg.s3_addr[0]}:{fg.s3_addr[1]}"), ("Content-Length", "0")] + extra
    resp = raw_request(fg.s3_addr, "GET", f"/{bucket}/k", headers, timeout=15)
    assert resp.error != "timeout", "fencegate neither answered nor closed within 15 s"
    # server.header_bytes_max (64 KiB by default): 431 Request Header Fields Too Large.
    assert resp.status == 431, (resp.status, resp.error, resp.body[:300])
    assert_still_serving(fg, bucket)


def test_wrong_signature_and_unknown_key(fg, bucket):
    wrong_secret = s3_client(fg.s3_url, token=50, secret_key="not-the-secret")
    with pytest.raises(ClientError) as exc_info:
        wrong_secret.put_object(Bucket=bucket, Key="sig", Body=b"x")
    assert status_of(exc_info.value) == 403, exc_info.value.response
    assert code_of(exc_info.value) == "SignatureDoesNotMatch"

    wrong_key = s3_client(fg.s3_url, token=50, access_key="nobody")
    with pytest.raises(ClientError) as exc_info:
        wrong_key.put_object(Bucket=bucket, Key="sig", Body=b"x")
    assert status_of(exc_info.value) == 403, exc_info.value.response
    assert code_of(exc_info.value) == "InvalidAccessKeyId"

    # Unauthenticated requests neither write nor move the fence.
    assert head_status(fg.client(), bucket, "sig") == 404
    assert fg.get_fence(f"{bucket}/sig").status_code == 404
    fg.client(token=50).put_object(Bucket=bucket, Key="sig", Body=b"ok")
    fg.client(token=40, resource="other").put_object(Bucket=bucket, Key="sig2", Body=b"ok")
    assert_still_serving(fg, bucket)


def _truncated_put(fg, path: str, headers: dict, declared: int, payload: bytes):
    host, port = fg.s3_addr
    h = dict(headers)
    h["Content-Length"] = str(declared)
    with connect(fg.s3_addr) as sock:
        sock.sendall(build_head("PUT", path, sign_headers("PUT", host, port, path, h)))
        sock.sendall(payload)
        time.sleep(0.3)
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def test_truncated_body_commits_nothing(fg, bucket):
    # A new object: never appears.
    _truncated_put(fg, f"/{bucket}/trunc-new", {"Fencing-Token": "7"}, MiB, b"t" * (100 * 1024))
    # An existing object: keeps its old bytes.
    fg.client(token=7).put_object(Bucket=bucket, Key="trunc-old", Body=b"complete v1")
    _truncated_put(fg, f"/{bucket}/trunc-old", {"Fencing-Token": "7"}, MiB, b"t" * (100 * 1024))
    for _ in range(2):
        time.sleep(1.0)
        assert head_status(fg.client(), bucket, "trunc-new") == 404
        assert read_object(fg.client(), bucket, "trunc-old") == b"complete v1"
    assert_still_serving(fg, bucket)


def _aws_chunked(data: bytes, crc: bytes, chunk: int = 64 * 1024) -> bytes:
    out = b""
    for i in range(0, len(data), chunk):
        part = data[i : i + chunk]
        out += f"{len(part):x}\r\n".encode() + part + b"\r\n"
    out += b"0\r\n" + b"x-amz-checksum-crc32:" + base64.b64encode(crc) + b"\r\n\r\n"
    return out


def _chunked_headers(data: bytes) -> dict:
    return {
        "Fencing-Token": "9",
        "x-amz-content-sha256": "STREAMING-UNSIGNED-PAYLOAD-TRAILER",
        "Content-Encoding": "aws-chunked",
        "x-amz-decoded-content-length": str(len(data)),
        "x-amz-trailer": "x-amz-checksum-crc32",
    }


def test_aws_chunked_trailer_checksum(fg, bucket):
    """The SDK default (aws-chunked, trailing CRC32) works; a wrong checksum commits nothing."""
    data = b"chunked payload " * 20000
    good = zlib.crc32(data).to_bytes(4, "big")
    body = _aws_chunked(data, good)
    resp = signed_raw_request(fg, "PUT", f"/{bucket}/chunked-ok", headers=_chunked_headers(data), body=body)
    assert resp.status == 200, (resp.status, resp.body[:500])
    assert read_object(fg.client(), bucket, "chunked-ok") == data

    bad = ((zlib.crc32(data) + 1) & 0xFFFFFFFF).to_bytes(4, "big")
    resp = signed_raw_request(
        fg, "PUT", f"/{bucket}/chunked-bad", headers=_chunked_headers(data), body=_aws_chunked(data, bad)
    )
    assert resp.status == 400, (resp.status, resp.body[:500])
    assert resp.code() == "BadDigest", resp.body[:500]
    assert head_status(fg.client(), bucket, "chunked-bad") == 404

    # Truncated aws-chunked stream: the connection closes mid-chunk.
    full = _aws_chunked(data, good)
    h = _chunked_headers(data)
    _truncated_put(fg, f"/{bucket}/chunked-trunc", h, len(full), full[: len(full) // 2])
    time.sleep(1.0)
    assert head_status(fg.client(), bucket, "chunked-trunc") == 404
    assert_still_serving(fg, bucket)


def test_broken_xml_body(fg, bucket):
    body = b"<Delete><Object><Key>unterminated"
    md5 = base64.b64encode(hashlib.md5(body).digest()).decode()
    resp = signed_raw_request(
        fg, "POST", f"/{bucket}?delete", headers={"Fencing-Token": "4", "Content-MD5": md5}, body=body
    )
    assert resp.status is not None, resp.error
    assert (resp.status, resp.code()) == (400, "MalformedXML"), (resp.status, resp.body[:500])
    assert_still_serving(fg, bucket)


def test_fencegate_survives_all_of_it(fg, bucket):
    """A burst of mixed bad requests on one instance, then normal service."""
    for token in BAD_TOKENS.values():
        try:
            fg.client(token=token).put_object(Bucket=bucket, Key="burst", Body=b"x")
        except ClientError:
            pass
    raw_request(fg.s3_addr, "GET", "/", [("Host", "x"), ("X-Big", "b" * MiB)], timeout=15)
    _truncated_put(fg, f"/{bucket}/burst", {"Fencing-Token": "3"}, MiB, b"z" * 1000)
    with connect(fg.s3_addr) as sock:  # garbage that is not HTTP at all
        sock.sendall(b"\x00\x01\x02 not http at all\r\n\r\n")
        read_response(sock, timeout=10)
    assert_still_serving(fg, bucket)
    assert head_status(fg.client(), bucket, "burst") == 404


def test_slow_client_is_cut_off(fencegate):
    """A client that never finishes its request head is disconnected (header read timeout)."""
    fg = fencegate(config={"server": {"header_read_timeout_ms": 1000}})
    fg.client().create_bucket(Bucket="slowbkt")
    with connect(fg.s3_addr) as sock:
        sock.sendall(b"PUT /slowbkt/k HTTP/1.1\r\nHost: 127.0.0.1\r\nFencing-Tok")
        started = time.monotonic()
        resp = read_response(sock, timeout=15)
        took = time.monotonic() - started
    assert resp.error != "timeout", "a stalled request head kept its connection for 15 s"
    assert took < 10, f"cut off only after {took:.1f}s with a 1 s header timeout"
    # Closed without an answer (hyper's header read timeout sends no response).
    assert (resp.status, resp.error) == (None, "closed"), (resp.status, resp.error, resp.body[:300])
    assert_still_serving(fg, "slowbkt")


def test_body_over_limit_commits_nothing(fencegate):
    fg = fencegate(config={"server": {"body_bytes_max": MiB}})
    fg.client().create_bucket(Bucket="limitbkt")
    with pytest.raises(ClientError) as exc_info:
        fg.client(token=1).put_object(Bucket="limitbkt", Key="big", Body=b"x" * (2 * MiB))
    assert status_of(exc_info.value) == 400, exc_info.value.response
    assert code_of(exc_info.value) == "EntityTooLarge", exc_info.value.response
    assert head_status(fg.client(), "limitbkt", "big") == 404
    fg.client(token=1).put_object(Bucket="limitbkt", Key="small", Body=b"x" * 1000)
    assert_still_serving(fg, "limitbkt")


def _chunked_head(path: str, headers: list) -> bytes:
    """A request head sent with `Transfer-Encoding: chunked` (no Content-Length)."""
    return build_head("PUT", path, headers + [("Transfer-Encoding", "chunked")])


@pytest.mark.parametrize("framing", ["decoded-length-header", "aws-chunked-understated", "chunked-no-length"])
def test_body_limit_holds_whatever_the_body_announces(fencegate, framing):
    """Before: `server.body_bytes_max` was judged on the length the head announced, and the
    announcement was the client's word: a `x-amz-decoded-content-length: 10` on a plain 2 MiB
    body, an aws-chunked body whose decoded length was understated, and a chunked body with no
    length at all were each stored whole on the local upstream. Now the body is cut at the limit
    as it streams: 400 `EntityTooLarge`, nothing stored. (A PUT with no length at all is refused
    first by the S3 library, 411 `MissingContentLength`, as by S3.)"""
    fg = fencegate(config={"server": {"body_bytes_max": MiB}})
    fg.client().create_bucket(Bucket="limitbkt")
    data = b"y" * (2 * MiB)
    path = "/limitbkt/big"
    if framing == "decoded-length-header":
        resp = signed_raw_request(fg, "PUT", path, {"Fencing-Token": "1", "x-amz-decoded-content-length": "10"}, data)
    elif framing == "aws-chunked-understated":
        headers = _chunked_headers(data)
        headers["x-amz-decoded-content-length"] = "10"
        body = _aws_chunked(data, zlib.crc32(data).to_bytes(4, "big"))
        resp = signed_raw_request(fg, "PUT", path, headers, body)
    else:
        host, port = fg.s3_addr
        signed = sign_headers("PUT", host, port, path, {"Fencing-Token": "1"})
        chunks = b"".join(f"{len(data[i:i + 65536]):x}\r\n".encode() + data[i:i + 65536] + b"\r\n"
                          for i in range(0, len(data), 65536)) + b"0\r\n\r\n"
        with connect(fg.s3_addr) as sock:
            try:
                sock.sendall(_chunked_head(path, signed) + chunks)
            except OSError:
                pass
            resp = read_response(sock, timeout=30)
    assert resp.status is not None and 400 <= resp.status < 500, (resp.status, resp.error, resp.body[:300])
    expected = "MissingContentLength" if framing == "chunked-no-length" else "EntityTooLarge"
    assert resp.code() == expected, resp.body[:300]
    assert head_status(fg.client(), "limitbkt", "big") == 404
    assert_still_serving(fg, "limitbkt")
