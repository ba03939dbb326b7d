"""Proves G3: a write with an older token still uploading when the fence advances never commits after the newer write."""

from __future__ import annotations

import threading
import time

import pytest

from fencegate_testlib import (
    MiB,
    build_head,
    connect,
    head_status,
    read_object,
    read_response,
    sign_headers,
    unique,
    wait_until,
)

OLD_BODY = b"a" * MiB  # token 11, sent in two halves
NEW_BODY = b"B" * (64 * 1024)  # token 12


@pytest.fixture(params=["local", "s3"])
def upstream_fg(request, fencegate):
    """(fencegate, bucket) on the local upstream or on moto_server."""
    bucket = unique("race")
    if request.param == "local":
        fg = fencegate()
        fg.client().create_bucket(Bucket=bucket)
    else:
        moto = request.getfixturevalue("moto_server")
        moto.client().create_bucket(Bucket=bucket)
        fg = fencegate(upstream=moto.upstream_config())
    return fg, bucket


def start_half_put(fg, bucket: str, key: str, token: int, resource: str | None):
    """Send a signed PUT's headers and half its body on a raw socket; return the socket."""
    headers = {
        "Fencing-Token": str(token),
        "Content-Length": str(len(OLD_BODY)),
        "Content-Type": "application/octet-stream",
    }
    if resource is not None:
        headers["Fencing-Resource"] = resource
    host, port = fg.s3_addr
    path = f"/{bucket}/{key}"
    sock = connect(fg.s3_addr, timeout=10)
    sock.sendall(build_head("PUT", path, sign_headers("PUT", host, port, path, headers)))
    sock.sendall(OLD_BODY[: len(OLD_BODY) // 2])
    return sock


def run_race(fg, bucket: str, old_key: str, new_key: str, resource: str | None, fg_new=None):
    """Token 11 stalls mid-body on `fg`; token 12 writes through `fg_new` (default: `fg`)."""
    fg_new = fg_new or fg
    fence_name = resource if resource is not None else f"{bucket}/{old_key}"
    sock = start_half_put(fg, bucket, old_key, 11, resource)
    try:
        # Token 11 was admitted (the fence advanced to 11) and its body is streaming upstream.
        wait_until(
            lambda: fg.get_fence(fence_name).status_code == 200
            and fg.get_fence(fence_name).json()["token"] == 11,
            timeout=15,
            what="fence to advance to 11",
        )
        time.sleep(0.3)

        result: dict = {}

        def new_holder_put():
            client = fg_new.client(token=12, resource=resource, read_timeout=60)
            try:
                r = client.put_object(Bucket=bucket, Key=new_key, Body=NEW_BODY)
                result["status"] = r["ResponseMetadata"]["HTTPStatusCode"]
            except Exception as exc:  # noqa: BLE001 - reported in the assertion
                result["error"] = repr(exc)

        t = threading.Thread(target=new_holder_put, daemon=True)
        t.start()
        t.join(timeout=30)
        new_done_before_old_body = not t.is_alive()

        # Now the stalled writer sends the rest of its body.
        send_error = None
        try:
            sock.settimeout(10)
            sock.sendall(OLD_BODY[len(OLD_BODY) // 2 :])
        except OSError as exc:  # closed / reset / server stopped reading: all fine
            send_error = repr(exc)
        old = read_response(sock, timeout=30)
        t.join(timeout=60)
    finally:
        sock.close()

    assert new_done_before_old_body, (
        "token 12's PUT did not finish within 30 s while token 11's upload was stalled "
        f"(it must cancel the older in-flight body, not wait for it); result={result}"
    )
    assert result.get("status") == 200, f"token 12's PUT failed: {result}"
    assert old.status is not None, (
        f"token 11's request got no answer ({old.error}; send_error={send_error})"
    )
    assert_cut_off(old, current=12)
    return old


def assert_cut_off(old, current: int):
    """The older write was admitted, then cut off while streaming: 409 FencingTokenStale naming
    the new fence, and saying so (README, "What fencegate answers")."""
    assert (old.status, old.code()) == (409, "FencingTokenStale"), (
        f"token 11's write was not refused as stale: status={old.status} body={old.body[:500]!r}"
    )
    assert old.headers.get("fencing-token-current") == str(current), old.headers
    assert b"became stale while its body was streaming" in old.body, old.body[:500]


def assert_holds_new(fg, bucket: str, key: str):
    reader = fg.client()
    for _ in range(2):  # once now, once after any late commit would have landed
        assert read_object(reader, bucket, key) == NEW_BODY
        assert reader.head_object(Bucket=bucket, Key=key)["Metadata"].get("fencing-token") == "12"
        time.sleep(1.0)


def test_race_same_object(upstream_fg):
    fg, bucket = upstream_fg
    run_race(fg, bucket, "obj", "obj", resource=None)
    assert_holds_new(fg, bucket, "obj")
    assert fg.get_fence(f"{bucket}/obj").json()["token"] == 12


def test_race_two_objects_one_resource(upstream_fg):
    fg, bucket = upstream_fg
    run_race(fg, bucket, "part-a", "part-b", resource="job:r")
    assert_holds_new(fg, bucket, "part-b")
    reader = fg.client()
    assert head_status(reader, bucket, "part-a") == 404, "token 11's object was committed"
    time.sleep(1.0)
    assert head_status(reader, bucket, "part-a") == 404, "token 11's object was committed late"
    assert fg.get_fence("job:r").json()["token"] == 12


def test_equal_tokens_run_concurrently(fg):
    """Writes with the current token are not serialised behind each other."""
    bucket = "samebkt"
    fg.client().create_bucket(Bucket=bucket)
    fg.client(token=11, resource="job:same").put_object(Bucket=bucket, Key="first", Body=b"x")
    sock = start_half_put(fg, bucket, "slow", 11, "job:same")
    try:
        time.sleep(0.3)
        start = time.monotonic()
        fg.client(token=11, resource="job:same", read_timeout=20).put_object(
            Bucket=bucket, Key="fast", Body=b"fast"
        )
        elapsed = time.monotonic() - start
        try:
            sock.settimeout(10)
            sock.sendall(OLD_BODY[len(OLD_BODY) // 2 :])
        except OSError:
            pass
        slow = read_response(sock, timeout=30)
    finally:
        sock.close()
    assert elapsed < 5, f"an equal-token write waited {elapsed:.1f}s behind another"
    assert slow.status == 200, (slow.status, slow.error, slow.body[:300])
    assert read_object(fg.client(), bucket, "slow") == OLD_BODY


def test_registration_resolves_inflight_older_write(fg):
    """An admin registration (G7) cancels an older write that is still uploading."""
    bucket = "regrace"
    fg.client().create_bucket(Bucket=bucket)
    sock = start_half_put(fg, bucket, "obj", 11, None)
    try:
        wait_until(
            lambda: fg.get_fence(f"{bucket}/obj").status_code == 200
            and fg.get_fence(f"{bucket}/obj").json()["token"] == 11,
            timeout=15,
            what="fence to advance to 11",
        )
        time.sleep(0.3)
        started = time.monotonic()
        r = fg.put_fence(f"{bucket}/obj", 12)
        took = time.monotonic() - started
        try:
            sock.settimeout(10)
            sock.sendall(OLD_BODY[len(OLD_BODY) // 2 :])
        except OSError:
            pass
        old = read_response(sock, timeout=30)
    finally:
        sock.close()
    assert r.status_code == 200, r.text
    assert took < 10, f"registration waited {took:.1f}s for an upload it should have cancelled"
    assert old.status is not None, f"token 11's request got no answer ({old.error})"
    assert_cut_off(old, current=12)
    time.sleep(1.0)
    assert head_status(fg.client(), bucket, "obj") == 404, "token 11 committed after registration of 12"
