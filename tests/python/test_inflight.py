"""Proves G3's "in flight until the outcome is known" (docs/design.md §3 and §8) with an
upstream that holds one chosen request: a write whose body reached the upstream stays in flight
whatever its client or its deadline does, so a newer token never commits before it; and the
holes next to it are closed (a DELETE of an absent object is never forwarded, a method S3 does
not know is never forwarded, a stale cached ETag does not turn a write into a 404, a slowly sent
CompleteMultipartUpload cannot commit after a newer registration).

One fencegate per test (embedded store) in front of `holding_upstream.HoldingUpstream`, a proxy
in front of moto_server that logs every write moto answered in commit order. Every key under
`jobs/` of the test's bucket belongs to resource `job` (`[[fencing.rules]]`).
"""

from __future__ import annotations

import threading
import time
import urllib.parse

import pytest
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from botocore.exceptions import ClientError

from fencegate_testlib import (
    ACCESS_KEY,
    REGION,
    SECRET_KEY,
    FenceGate,
    build_head,
    code_of,
    connect,
    read_response,
    sign_headers,
    signed_raw_request,
    status_of,
    wait_until,
)
from holding_upstream import HELD_RESOURCE, HeldS3

RESOURCE = HELD_RESOURCE
WAIT_S = 15.0  # every wait for something that should happen promptly
NEWER_WAITS_S = 2.5  # how long a test watches the newer token being held back


class Env(HeldS3):
    """`held_s3`'s HeldS3 with this file's `committed()`."""

    def committed(self, key_part: str = "jobs/") -> list:
        """(method, key, token) of every write moto answered 2xx under `jobs/`, commit order."""
        out = []
        for w in self.up.writes(f"/{self.bucket}/{key_part}"):
            if w["status"] is not None and 200 <= w["status"] < 300:
                key = w["path"].split("/", 2)[2]
                out.append((w["method"], key, w["token"]))
        return out


@pytest.fixture
def inflight_env(held_s3):
    """Factory: `held_s3` with `fencing.inflight_deadline_ms` (3000 unless given) and, if given,
    `upstream.request_timeout_ms`; returns an Env."""

    def start(request_timeout_ms: int | None = None, inflight_deadline_ms: int = 3000) -> Env:
        upstream = {} if request_timeout_ms is None else {"request_timeout_ms": request_timeout_ms}
        held = held_s3(upstream=upstream, fencing={"inflight_deadline_ms": inflight_deadline_ms},
                       bucket_prefix="inflight")
        return Env(**vars(held))

    return start


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def open_request(fg: FenceGate, method: str, path: str, headers: dict, body: bytes = b""):
    """Sends a whole signed request on a raw socket and returns the socket (response unread)."""
    host, port = fg.s3_addr
    h = dict(headers)
    h.setdefault("Content-Length", str(len(body)))
    sock = connect(fg.s3_addr, timeout=10)
    sock.sendall(build_head(method, path, sign_headers(method, host, port, path, h)) + body)
    return sock


def put_in_thread(fg: FenceGate, bucket: str, key: str, token: int, body: bytes):
    """Starts a boto3 PUT with `token` in a thread; returns (thread, result dict)."""
    result: dict = {}

    def run():
        client = fg.client(token=token, read_timeout=60)
        try:
            r = client.put_object(Bucket=bucket, Key=key, Body=body)
            result["status"] = r["ResponseMetadata"]["HTTPStatusCode"]
        except ClientError as exc:
            result["status"] = status_of(exc)
            result["error"] = exc.response.get("Error")
        except Exception as exc:  # noqa: BLE001 - reported in the assertion
            result["error"] = repr(exc)
        result["t_done"] = time.monotonic()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, result


def stamp_at_moto(env: Env, key: str):
    try:
        return env.moto.head_object(Bucket=env.bucket, Key=key)["Metadata"].get("fencing-token")
    except ClientError as exc:
        return f"HEAD {status_of(exc)}"


class _VerbatimMethodSigV4(SigV4Auth):
    """SigV4 over the method exactly as sent (botocore upper-cases it; a server does not)."""

    def canonical_request(self, request):
        cr = super().canonical_request(request)
        return request.method + cr[len(request.method):]

    def _normalize_url_path(self, path):
        return urllib.parse.quote(urllib.parse.unquote(path), safe="/~")


def sign_verbatim(method: str, fg: FenceGate, path: str, headers: dict) -> list:
    host, port = fg.s3_addr
    hdrs = {"Host": f"{host}:{port}", "x-amz-content-sha256": "UNSIGNED-PAYLOAD"}
    hdrs.update(headers)
    req = AWSRequest(method=method, url=f"http://{host}:{port}{path}", headers=hdrs)
    _VerbatimMethodSigV4(Credentials(ACCESS_KEY, SECRET_KEY), "s3", REGION).add_auth(req)
    return list(req.headers.items())


# --------------------------------------------------------------------------------------------
# a. the client disconnects after its body reached the upstream
# --------------------------------------------------------------------------------------------


def test_client_disconnect_does_not_end_a_sent_write(inflight_env):
    """A token-5 PUT whose body reached the upstream stays in flight after its client hung up:
    a token-6 PUT on another key of the resource waits at fencegate until the upstream answered
    the token-5 write, so moto commits 5 before 6 (never 6 then 5)."""
    env = inflight_env(inflight_deadline_ms=10000)
    hold = env.up.hold_next("PUT", env.path("jobs/a"))
    sock = open_request(env.fg, "PUT", env.path("jobs/a"), {"Fencing-Token": "5"}, b"token five")
    try:
        assert hold.wait_arrived(WAIT_S), "token 5's PUT never reached the upstream whole"
    finally:
        sock.close()  # the client goes away; its write is held at the upstream

    t, result = put_in_thread(env.fg, env.bucket, "jobs/b", 6, b"token six")
    t.join(timeout=NEWER_WAITS_S)
    six_done_while_five_held = not t.is_alive()
    six_reached_upstream_early = env.up.requests(env.path("jobs/b"))
    hold.release()
    t.join(timeout=30)
    assert env.up.wait_idle(30)

    assert not six_done_while_five_held and not any(
        r["method"] == "PUT" for r in six_reached_upstream_early
    ), (
        "token 6's PUT was forwarded while token 5's write (client gone) was still held at the "
        f"upstream: result={result} early={[(r['method'], r['path']) for r in six_reached_upstream_early]}"
    )
    assert result.get("status") == 200, f"token 6's PUT failed after token 5 was released: {result}"
    assert env.committed() == [("PUT", "jobs/a", "5"), ("PUT", "jobs/b", "6")], env.committed()


# --------------------------------------------------------------------------------------------
# b. the upstream is slower than upstream.request_timeout_ms
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("body", [b"token five", b""], ids=["body", "empty"])
def test_upstream_slower_than_request_timeout_keeps_the_write_in_flight(inflight_env, body):
    """A token-5 PUT held at the upstream past `upstream.request_timeout_ms` is answered 504,
    but its call is not abandoned: a token-6 PUT on another key of the resource does not commit
    before the upstream answered the token-5 write (commit order 5, then 6). An empty body is
    handed over with the request's head (the HTTP client never polls it)."""
    env = inflight_env(request_timeout_ms=1500, inflight_deadline_ms=10000)
    hold = env.up.hold_next("PUT", env.path("jobs/a"))
    started = time.monotonic()
    five = signed_raw_request(
        env.fg, "PUT", env.path("jobs/a"), {"Fencing-Token": "5"}, body, timeout=WAIT_S
    )
    answered_after = time.monotonic() - started
    assert hold.arrived.is_set(), "token 5's PUT never reached the upstream whole"
    assert (five.status, five.code()) == (504, "UpstreamTimeout"), (five.status, five.error, five.body[:300])
    assert answered_after < 8, f"the 504 took {answered_after:.1f}s (request_timeout_ms = 1500)"

    t, result = put_in_thread(env.fg, env.bucket, "jobs/b", 6, b"token six")
    t.join(timeout=NEWER_WAITS_S)
    six_done_while_five_held = not t.is_alive()
    six_early = [r for r in env.up.requests(env.path("jobs/b")) if r["method"] == "PUT"]
    fencegate_hung_up = hold.client_gone()
    hold.release()
    t.join(timeout=30)
    assert env.up.wait_idle(30)

    assert not six_done_while_five_held and not six_early, (
        "token 6's PUT was forwarded while token 5's timed-out write was still held at the "
        f"upstream (fencegate closed that call: {fencegate_hung_up}): result={result}"
    )
    assert result.get("status") == 200, f"token 6's PUT failed after token 5 was released: {result}"
    assert env.committed() == [("PUT", "jobs/a", "5"), ("PUT", "jobs/b", "6")], env.committed()


# --------------------------------------------------------------------------------------------
# c. DELETE of an absent object
# --------------------------------------------------------------------------------------------


def test_delete_of_absent_object_is_not_forwarded(inflight_env):
    """A token-5 DELETE of an absent key is answered 204 without reaching the upstream; so
    even if its client hangs up, nothing can land later and delete what token 6 then writes
    there: the token-6 object stays."""
    env = inflight_env(inflight_deadline_ms=3000)
    key = "jobs/c"
    hold = env.up.hold_next("DELETE", env.path(key))  # would catch a forwarded DELETE
    sock = open_request(env.fg, "DELETE", env.path(key), {"Fencing-Token": "5"})
    try:
        deleted = read_response(sock, timeout=3)  # no answer within 3 s: the client gives up
    finally:
        sock.close()

    six = env.fg.client(token=6)
    put = six.put_object(Bucket=env.bucket, Key=key, Body=b"token six")
    assert put["ResponseMetadata"]["HTTPStatusCode"] == 200
    time.sleep(0.5)
    hold.release()  # if the DELETE was forwarded and held, it lands now
    assert env.up.wait_idle(30)

    forwarded = [(r["method"], r["path"]) for r in env.up.requests(env.path(key)) if r["method"] == "DELETE"]
    assert not forwarded, f"the DELETE of an absent object reached the upstream: {forwarded}"
    assert deleted.status == 204, (deleted.status, deleted.error, deleted.body[:300])
    assert stamp_at_moto(env, key) == "6", "token 6's object did not survive token 5's DELETE"
    assert env.moto.get_object(Bucket=env.bucket, Key=key)["Body"].read() == b"token six"


# --------------------------------------------------------------------------------------------
# d. a method S3 does not know
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["put", "Put"])
@pytest.mark.parametrize("with_token", [True, False], ids=["token", "no-token"])
def test_unknown_method_is_refused_not_forwarded(inflight_env, method, with_token):
    """A correctly signed request with the method `put` (methods are case-sensitive, so it is
    not PUT) is refused 405 `MethodNotAllowed`, with or without a token: it is neither
    forwarded unfenced (an upstream may treat it as PUT) nor fenced as a PUT."""
    env = inflight_env()
    key = f"jobs/d-{method}-{with_token}"
    body = b"not a PUT"
    headers = {"Content-Length": str(len(body))}
    if with_token:
        headers["Fencing-Token"] = "5"
    signed = sign_verbatim(method, env.fg, env.path(key), headers)
    with connect(env.fg.s3_addr) as sock:
        sock.sendall(build_head(method, env.path(key), signed) + body)
        resp = read_response(sock, timeout=WAIT_S)
    assert env.up.wait_idle(WAIT_S)

    reached = [(r["method"], r["path"], r["status"]) for r in env.up.requests(env.path(key))]
    assert not reached, f"a `{method}` request reached the upstream: {reached}"
    assert resp.status == 405, (resp.status, resp.error, resp.body[:300])
    assert resp.code() == "MethodNotAllowed", resp.body[:300]
    assert stamp_at_moto(env, key) == "HEAD 404"


# --------------------------------------------------------------------------------------------
# e. a cached ETag of an object deleted behind fencegate's back
# --------------------------------------------------------------------------------------------


def test_stale_cached_etag_does_not_turn_a_put_into_404(inflight_env):
    """fencegate wrote an object (and remembers its ETag); it is deleted directly at the
    upstream; a PUT with the same token then gets `404 NoSuchKey` to its `If-Match` from the
    upstream: fencegate re-reads the object and writes it (200), not pass the 404 on."""
    env = inflight_env()
    key = "jobs/e"
    five = env.fg.client(token=5)
    five.put_object(Bucket=env.bucket, Key=key, Body=b"first")
    env.moto.delete_object(Bucket=env.bucket, Key=key)  # behind fencegate's back

    try:
        r = five.put_object(Bucket=env.bucket, Key=key, Body=b"second")
        status = r["ResponseMetadata"]["HTTPStatusCode"]
    except ClientError as exc:
        status = (status_of(exc), exc.response.get("Error"))
    assert status == 200, f"PUT after an out-of-band delete: {status}"
    assert env.moto.get_object(Bucket=env.bucket, Key=key)["Body"].read() == b"second"
    assert stamp_at_moto(env, key) == "5"


# --------------------------------------------------------------------------------------------
# f. a CompleteMultipartUpload whose parts list arrives slowly
# --------------------------------------------------------------------------------------------


def test_slow_complete_multipart_cannot_commit_after_a_newer_registration(inflight_env):
    """A token-5 CompleteMultipartUpload whose parts list is trickled over ~6 s while token 6
    is registered (`PUT /v1/fences/job`) meanwhile: the completion does not commit after the
    registration returned (it is refused 409, or it committed before the registration
    returned), and it does not commit after a token-6 write that follows the registration."""
    env = inflight_env(inflight_deadline_ms=3000)
    key = "jobs/f"
    five = env.fg.client(token=5)
    mpu = five.create_multipart_upload(Bucket=env.bucket, Key=key)
    upload_id = mpu["UploadId"]
    part = five.upload_part(
        Bucket=env.bucket, Key=key, UploadId=upload_id, PartNumber=1, Body=b"p" * 1024
    )
    xml = (
        '<?xml version="1.0" encoding="UTF-8"?>'
        '<CompleteMultipartUpload xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
        f"<Part><PartNumber>1</PartNumber><ETag>{part['ETag']}</ETag></Part>"
        "</CompleteMultipartUpload>"
    ).encode()
    path = f"{env.path(key)}?uploadId={urllib.parse.quote(upload_id, safe='')}"
    host, port = env.fg.s3_addr
    headers = {
        "Fencing-Token": "5",
        "Content-Length": str(len(xml)),
        "Content-Type": "application/xml",
    }
    registration: dict = {}

    def register():
        try:
            r = env.fg.put_fence(RESOURCE, 6)
            registration["status"] = r.status_code
            registration["body"] = r.text
        except Exception as exc:  # noqa: BLE001 - reported in the assertion
            registration["error"] = repr(exc)
        registration["t_returned"] = time.monotonic()

    pieces = 12
    step = -(-len(xml) // pieces)
    reg = threading.Thread(target=register, daemon=True)
    with connect(env.fg.s3_addr, timeout=10) as sock:
        sock.sendall(build_head("POST", path, sign_headers("POST", host, port, path, headers)))
        sock.sendall(xml[:step])
        send_error = None
        for i in range(1, pieces):
            time.sleep(0.5)
            if i == 2:
                reg.start()  # about 1 s into the body
            try:
                sock.sendall(xml[i * step : (i + 1) * step])
            except OSError as exc:  # fencegate may answer and close early
                send_error = repr(exc)
                break
        t_last_byte = time.monotonic()
        completion = read_response(sock, timeout=WAIT_S)
    reg.join(timeout=WAIT_S)
    assert not reg.is_alive(), "the registration did not return"
    six = env.fg.client(token=6)
    six.put_object(Bucket=env.bucket, Key="jobs/after", Body=b"token six")
    assert env.up.wait_idle(30)

    completions = [
        w for w in env.up.writes(env.path(key)) if w["method"] == "POST" and "uploadId" in w["query"]
    ]
    committed = [w for w in completions if w["status"] == 200]
    reg_returned = registration.get("t_returned")
    reg_vs_last_byte = f"{reg_returned - t_last_byte:+.2f}s" if reg_returned else "never"
    detail = (
        f"completion={completion.status} {completion.code()!r} send_error={send_error} "
        f"registration={registration} returned {reg_vs_last_byte} relative to the last byte; "
        f"upstream completions (status, answered relative to the last byte)="
        f"{[(w['status'], round(w['t_answered'] - t_last_byte, 2)) for w in completions]}"
    )
    if committed:
        assert committed[0]["t_answered"] < reg_returned, (
            "token 5's completion committed after token 6's registration returned: " + detail
        )
    else:
        assert completion.status == 409, detail
        assert completion.code() == "FencingTokenStale", detail
        assert registration.get("status") == 200, detail
    order = env.committed()
    assert order[-1] == ("PUT", "jobs/after", "6"), f"commit order {order}; {detail}"


# --------------------------------------------------------------------------------------------
# found by review: each of these let a stale write in, or a resource get stuck
# --------------------------------------------------------------------------------------------


def test_after_a_kill_even_the_current_token_waits_for_the_dead_process_writes(inflight_env):
    """The dead process made token 6 durable while its token-5 write was held at the upstream:
    after the restart a token-6 write on another key must not commit before that token-5 write
    could land (no admission at all for the in-flight deadline after an unclean start)."""
    env = inflight_env(inflight_deadline_ms=4000)
    hold = env.up.hold_next("PUT", env.path("jobs/a"))
    sock = open_request(env.fg, "PUT", env.path("jobs/a"), {"Fencing-Token": "5"}, b"token five")
    try:
        assert hold.wait_arrived(WAIT_S)
        t, _ = put_in_thread(env.fg, env.bucket, "jobs/b", 6, b"token six")  # advances, then waits for 5
        wait_until(lambda: env.fg.get_fence(RESOURCE).json().get("token") == 6, WAIT_S, what="fence 6")
        env.fg.restart(kill=True)
        t_after, after = put_in_thread(env.fg, env.bucket, "jobs/c", 6, b"token six again")
        time.sleep(1.0)
        assert "status" not in after, f"token 6 admitted right after an unclean start: {after}"
        hold.release()  # the dead process's write lands now, within the deadline
        t_after.join(WAIT_S)
        assert after.get("status") == 200, after
        assert env.up.wait_idle(WAIT_S)
        committed = [c for c in env.committed() if c[1] in ("jobs/a", "jobs/c")]
        assert committed == [("PUT", "jobs/a", "5"), ("PUT", "jobs/c", "6")], committed
    finally:
        sock.close()


def test_an_upstream_that_never_answers_does_not_lock_the_resource_for_good(inflight_env):
    """A write sent whole to an upstream that never answers stays in flight past its deadline,
    but not forever: after the in-flight deadline more (by then the upstream can no longer
    commit it, the design's assumption) newer tokens go ahead."""
    env = inflight_env(request_timeout_ms=1000, inflight_deadline_ms=2000)
    hold = env.up.hold_next("PUT", env.path("jobs/a"))
    sock = open_request(env.fg, "PUT", env.path("jobs/a"), {"Fencing-Token": "5"}, b"token five")
    try:
        assert hold.wait_arrived(WAIT_S)
        started = time.monotonic()
        admitted = None
        for token in range(6, 12):
            t, result = put_in_thread(env.fg, env.bucket, f"jobs/b{token}", token, b"x")
            t.join(WAIT_S)
            if result.get("status") == 200:
                admitted = time.monotonic() - started
                break
            assert result.get("status") == 503 and result["error"]["Code"] == "SlowDown", result
        assert admitted is not None, "the resource stayed locked by a write the upstream never answered"
        assert admitted >= 1.0, f"a newer token went ahead {admitted:.2f}s in, while the older one may commit"
    finally:
        hold.release()
        sock.close()


def test_a_fenced_delete_in_a_missing_bucket_is_404(fencegate):
    fg = fencegate()
    with pytest.raises(ClientError) as exc_info:
        fg.client(token=3).delete_object(Bucket="no-such-bucket-here", Key="k")
    assert (status_of(exc_info.value), code_of(exc_info.value)) == (404, "NoSuchBucket")


def test_an_object_stamp_does_not_move_another_resource_fence(fencegate):
    """`Fencing-Resource` is the client's word: an object stamped under one resource with a huge
    token must not raise the fence of another resource whose holder touches it."""
    fg = fencegate()
    fg.client().create_bucket(Bucket="stamps")
    job = fg.client(token=5, resource="job:own")
    job.put_object(Bucket="stamps", Key="a", Body=b"job 5")
    fg.client(token=18446744073709551615, resource="job:evil").put_object(Bucket="stamps", Key="shared", Body=b"x")
    with pytest.raises(ClientError) as exc_info:
        job.put_object(Bucket="stamps", Key="shared", Body=b"y")  # refused per object, as before
    assert (status_of(exc_info.value), code_of(exc_info.value)) == (409, "FencingTokenStale"), exc_info.value.response
    job.put_object(Bucket="stamps", Key="a", Body=b"job 5 again")  # its own objects still take 5
    assert fg.get_fence("job:own").json()["token"] == 5
