"""Proves the error answers of README "What fencegate answers" and "HTTP API gateway" end to end,
each with its fault made real: the one right answer (status, S3 error code or problem type, and
`Retry-After` where promised) and what must not happen with it (nothing written at the upstream,
no fence moved, no ambiguous outcome counted when nothing was sent).

- older writes still in flight past `fencing.inflight_deadline_ms`: 503 `SlowDown`;
- more than `fencing.inflight_per_resource_max` writes in flight on a resource: 503 `SlowDown`;
- an S3 upstream that refuses connections: 502 `UpstreamUnavailable`, writes and reads;
- an S3 upstream slower than `upstream.request_timeout_ms`: 504 `UpstreamTimeout` (sent: the
  write stays in flight; cut off: nothing commits and nothing waits for it; a read);
- a Redis fence store frozen (SIGSTOP) past `store.timeout_ms`: 503 `FenceStoreUnavailable`;
- `FENCEGATE_` variables that are no override are ignored; an unknown section is refused;
- `[[routes]]`: 413 `RequestTooLarge`, 400 `IncompleteBody`, 400 `InvalidIdempotencyKey`,
  503 `TooManyInflightWrites` / `FencingDrainTimeout`, 502 `UpstreamUnavailable` from a closed
  API port (no record: the retry executes), 503 `FenceStoreUnavailable` from a frozen Redis, and
  a 429 or 503 from the API passed on and not recorded.

A chunked route body past `body_bytes_max` was 400 `IncompleteBody` (now 413), and an
`Idempotency-Key` with a space was accepted (now 400): found by this file.

S3 faults use `holding_upstream.HoldingUpstream` in front of moto_server (it logs every request
that reached it whole); the API gateway uses a small recording HTTP server. Everything listens on
127.0.0.1, and every wait is bounded.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass

import pytest

from fencegate_testlib import (
    FenceGate,
    base_config,
    bin_path,
    build_head,
    connect,
    metric,
    metric_samples,
    raw_request,
    read_response,
    reserve_port,
    sign_headers,
    signed_raw_request,
    to_toml,
    wait_until,
)
from holding_upstream import HELD_RESOURCE, HeldS3, HoldingUpstream
from recording_api import RecordingApi

RESOURCE = HELD_RESOURCE
WAIT_S = 15.0  # every wait for something that should happen promptly
DECISIONS = "fencegate_decisions_total"
AMBIGUOUS = "fencegate_ambiguous_outcomes_total"


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def metric_sum(samples: dict, name: str) -> float:
    """Every series of `name` added up (e.g. ambiguous outcomes of any `op`)."""
    return sum(v for (n, _labels), v in samples.items() if n == name)


def s3_message(body: bytes) -> str:
    try:
        root = ET.fromstring(body)
    except ET.ParseError:
        return ""
    el = root.find("Message")
    return el.text if el is not None and el.text else ""


def open_request(fg: FenceGate, method: str, path: str, headers: dict, body: bytes = b"",
                 content_length: int | None = None) -> socket.socket:
    """Sends a signed request (head and `body`) on a raw socket and returns the socket, response
    unread. `content_length` announces more than `body` (the rest is never sent by this)."""
    host, port = fg.s3_addr
    h = dict(headers)
    h["Content-Length"] = str(len(body) if content_length is None else content_length)
    sock = connect(fg.s3_addr, timeout=10)
    sock.sendall(build_head(method, path, sign_headers(method, host, port, path, h)) + body)
    return sock


def in_thread(fn) -> tuple:
    """Runs `fn()` in a daemon thread; returns (thread, result dict with "value" or "error")."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except Exception as exc:  # noqa: BLE001 - reported by the test's assertion
            out["error"] = repr(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


class S3Env(HeldS3):
    """`held_s3`'s HeldS3 with this file's helpers."""

    def put(self, key: str, token: int, body: bytes, timeout: float = WAIT_S):
        return signed_raw_request(self.fg, "PUT", self.path(key), {"Fencing-Token": str(token)}, body,
                                  timeout=timeout)

    def reached(self, key: str, method: str = "PUT") -> list:
        """(method, path, status) of every `method` request on `key` that reached the upstream whole."""
        return [(r["method"], r["path"], r["status"]) for r in self.up.requests(self.path(key))
                if r["method"] == method]

    def committed(self) -> list:
        """(key, token) of every 2xx PUT moto answered under `jobs/`, in commit order."""
        out = []
        for w in self.up.writes(self.path("jobs/")):
            if w["method"] == "PUT" and w["status"] is not None and 200 <= w["status"] < 300:
                out.append((w["path"].split("/", 2)[2], w["token"]))
        return out

    def at_moto(self, key: str):
        try:
            return self.moto.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except Exception as exc:  # noqa: BLE001 - a missing object is an answer here
            return f"absent ({type(exc).__name__})"


@pytest.fixture
def s3_env(held_s3):
    """Factory: `held_s3` (same arguments: upstream, fencing, config, proxy) returning an S3Env."""

    def start(**kwargs) -> S3Env:
        return S3Env(**vars(held_s3(bucket_prefix="errpaths", **kwargs)))

    return start


# --------------------------------------------------------------------------------------------
# 1. older writes still in flight past the drain wait
# --------------------------------------------------------------------------------------------


def test_newer_token_gets_503_slowdown_while_an_older_write_is_still_in_flight(s3_env):
    """A token-5 PUT held at the upstream (its body arrived whole: it can only be awaited) keeps
    a token-6 PUT on another key of the resource waiting; past `fencing.inflight_deadline_ms`
    token 6 gets 503 `SlowDown` with `Retry-After: 1`, counted as `drain_timeout`, and nothing of
    it reached the upstream. Once the token-5 write finished, token 6 goes through."""
    env = s3_env(fencing={"inflight_deadline_ms": 1500})
    hold = env.up.hold_next("PUT", env.path("jobs/a"))
    five = open_request(env.fg, "PUT", env.path("jobs/a"), {"Fencing-Token": "5"}, b"token five")
    try:
        assert hold.wait_arrived(WAIT_S), "token 5's PUT never reached the upstream whole"
        before = metric_samples(env.fg)
        started = time.monotonic()
        six = env.put("jobs/b", 6, b"token six")
        waited = time.monotonic() - started
        after = metric_samples(env.fg)
        six_reached_while_held = env.reached("jobs/b")
        hold.release()
        five_answer = read_response(five, timeout=WAIT_S)
    finally:
        hold.release()
        five.close()

    assert (six.status, six.code()) == (503, "SlowDown"), (six.status, six.error, six.body[:300])
    assert six.headers.get("retry-after") == "1", six.headers
    assert 1.2 <= waited < 8, f"answered after {waited:.2f}s; inflight_deadline_ms = 1500"
    assert not six_reached_while_held, f"token 6 reached the upstream while 5 was held: {six_reached_while_held}"
    assert metric(after, DECISIONS, outcome="drain_timeout") - metric(before, DECISIONS, outcome="drain_timeout") == 1
    assert metric_sum(after, AMBIGUOUS) == metric_sum(before, AMBIGUOUS)
    assert five_answer.status == 200, (five_answer.status, five_answer.error, five_answer.body[:300])

    again = env.put("jobs/b", 6, b"token six")
    assert again.status == 200, (again.status, again.body[:300])
    assert env.up.wait_idle(WAIT_S)
    assert env.committed() == [("jobs/a", "5"), ("jobs/b", "6")], env.committed()


# --------------------------------------------------------------------------------------------
# 2. too many writes in flight on one resource
# --------------------------------------------------------------------------------------------


def test_too_many_inflight_writes_on_a_resource_get_503_slowdown(s3_env):
    """With `fencing.inflight_per_resource_max = 2` and two token-5 PUTs held at the upstream, a
    third on the same resource is refused at once with 503 `SlowDown` and `Retry-After: 1`
    (decision `too_many_inflight`), never reaching the upstream; another resource is not
    limited by it; once the two finished, the third goes through."""
    # One credential writes all three: its own share is the resource's whole budget here.
    env = s3_env(fencing={"inflight_per_resource_max": 2, "inflight_per_caller_max": 2, "inflight_deadline_ms": 10000})
    holds = [env.up.hold_next("PUT", env.path(f"jobs/{k}")) for k in ("a", "b")]
    socks = []
    try:
        for k in ("a", "b"):
            socks.append(open_request(env.fg, "PUT", env.path(f"jobs/{k}"), {"Fencing-Token": "5"}, b"held"))
        for h in holds:
            assert h.wait_arrived(WAIT_S), "a held PUT never reached the upstream whole"
        before = metric_samples(env.fg)
        started = time.monotonic()
        third = env.put("jobs/c", 5, b"third")
        took = time.monotonic() - started
        after = metric_samples(env.fg)
        third_reached = env.reached("jobs/c")
        other = env.put("other/x", 5, b"another resource")
        for h in holds:
            h.release()
        answers = [read_response(s, timeout=WAIT_S) for s in socks]
    finally:
        for h in holds:
            h.release()
        for s in socks:
            s.close()

    assert (third.status, third.code()) == (503, "SlowDown"), (third.status, third.error, third.body[:300])
    assert third.headers.get("retry-after") == "1", third.headers
    assert took < 3, f"the refusal took {took:.2f}s: it waited instead of refusing"
    assert not third_reached, third_reached
    delta = metric(after, DECISIONS, outcome="too_many_inflight") - metric(before, DECISIONS, outcome="too_many_inflight")
    assert delta == 1, delta
    assert other.status == 200, ("another resource is limited too", other.status, other.body[:300])
    assert [a.status for a in answers] == [200, 200], [(a.status, a.body[:200]) for a in answers]

    again = env.put("jobs/c", 5, b"third")
    assert again.status == 200, (again.status, again.body[:300])
    assert env.at_moto("jobs/c") == b"third"


# --------------------------------------------------------------------------------------------
# 3. the S3 upstream refuses connections
# --------------------------------------------------------------------------------------------


def test_unreachable_upstream_is_502_and_leaves_nothing_in_flight(s3_env, moto_server):
    """The upstream's port is closed: a fenced PUT gets 502 `UpstreamUnavailable` and counts no
    ambiguous outcome (nothing was sent), a GET gets 502 too; once the upstream is up, a newer
    token on the same resource goes through at once (the failed write is not in flight: it does
    not wait for `fencing.inflight_deadline_ms`), and only that write reached the upstream."""
    proxy = HoldingUpstream(moto_server.url).reserve()  # not started: the port refuses connections
    env = s3_env(upstream={"probe": "off"}, fencing={"inflight_deadline_ms": 20000}, proxy=proxy)
    assert env.up is proxy

    before = metric_samples(env.fg)
    started = time.monotonic()
    put = env.put("jobs/a", 5, b"never sent")
    took = time.monotonic() - started
    # With `Expect: 100-continue` the client is never asked for its body: the 502 comes first.
    sock = open_request(env.fg, "PUT", env.path("jobs/a"), {"Fencing-Token": "5", "Expect": "100-continue"},
                        content_length=1000)
    try:
        sock.settimeout(WAIT_S)
        first_bytes = b""
        deadline = time.monotonic() + WAIT_S
        while b"\r\n" not in first_bytes and time.monotonic() < deadline:
            chunk = sock.recv(4096)
            if not chunk:
                break
            first_bytes += chunk
    finally:
        sock.close()
    get = signed_raw_request(env.fg, "GET", env.path("jobs/a"), timeout=WAIT_S)
    after = metric_samples(env.fg)

    assert (put.status, put.code()) == (502, "UpstreamUnavailable"), (put.status, put.error, put.body[:300])
    assert took < 5, f"the 502 took {took:.2f}s for a refused connection"
    assert first_bytes.startswith(b"HTTP/1.1 502"), f"with Expect: 100-continue the first answer was {first_bytes[:60]!r}"
    assert (get.status, get.code()) == (502, "UpstreamUnavailable"), (get.status, get.error, get.body[:300])
    assert metric_sum(after, AMBIGUOUS) == metric_sum(before, AMBIGUOUS), "an unsent write counted as ambiguous"

    proxy.start()
    started = time.monotonic()
    six = env.put("jobs/b", 6, b"token six")
    took = time.monotonic() - started
    assert six.status == 200, (six.status, six.body[:300])
    assert took < 5, f"token 6 waited {took:.2f}s for a write that was never sent"
    assert env.up.wait_idle(WAIT_S)
    assert env.reached("jobs/a") == [], env.reached("jobs/a")
    assert env.committed() == [("jobs/b", "6")], env.committed()
    assert env.at_moto("jobs/a").startswith("absent")


# --------------------------------------------------------------------------------------------
# 4. the S3 upstream is slower than upstream.request_timeout_ms
# --------------------------------------------------------------------------------------------


def test_write_sent_but_unanswered_past_request_timeout_is_504_and_stays_in_flight(s3_env):
    """A token-5 PUT held at the upstream past `upstream.request_timeout_ms` is answered 504
    `UpstreamTimeout` whose message says the write may still commit, counted as an ambiguous
    outcome; a token-6 PUT on the resource is not forwarded until the upstream answered it."""
    env = s3_env(upstream={"request_timeout_ms": 1000}, fencing={"inflight_deadline_ms": 10000})
    hold = env.up.hold_next("PUT", env.path("jobs/a"))
    try:
        before = metric_samples(env.fg)
        started = time.monotonic()
        five = env.put("jobs/a", 5, b"token five")
        took = time.monotonic() - started
        after = metric_samples(env.fg)
        assert hold.arrived.is_set(), "token 5's PUT never reached the upstream whole"
        t, six = in_thread(lambda: env.put("jobs/b", 6, b"token six", timeout=30))
        t.join(timeout=2.0)
        six_done_while_held = not t.is_alive()
        six_reached_while_held = env.reached("jobs/b")
    finally:
        hold.release()
    t.join(timeout=30)

    assert (five.status, five.code()) == (504, "UpstreamTimeout"), (five.status, five.error, five.body[:300])
    assert "may still commit" in s3_message(five.body), s3_message(five.body)
    assert took < 6, f"the 504 took {took:.2f}s (request_timeout_ms = 1000)"
    assert metric_sum(after, AMBIGUOUS) - metric_sum(before, AMBIGUOUS) == 1
    # The unanswered call is an upstream error too, of the write's own operation.
    errors = "fencegate_upstream_errors_total"
    assert metric(after, errors, op="put_object") - metric(before, errors, op="put_object") == 1
    assert not six_done_while_held and not six_reached_while_held, (six, six_reached_while_held)
    assert six.get("value") is not None and six["value"].status == 200, six
    assert env.up.wait_idle(WAIT_S)
    assert env.committed() == [("jobs/a", "5"), ("jobs/b", "6")], env.committed()


def test_write_whose_body_is_not_sent_by_request_timeout_is_cut_off(s3_env):
    """A token-5 PUT whose client sends only part of its body: at `upstream.request_timeout_ms`
    it is answered 504 `UpstreamTimeout` whose message says it was cut off and nothing was
    committed; the upstream never got it whole, no ambiguous outcome is counted, and a token-6
    PUT on the resource does not wait for it."""
    env = s3_env(upstream={"request_timeout_ms": 1000}, fencing={"inflight_deadline_ms": 10000})
    before = metric_samples(env.fg)
    started = time.monotonic()
    sock = open_request(env.fg, "PUT", env.path("jobs/a"), {"Fencing-Token": "5"}, b"x" * 1024,
                        content_length=64 * 1024)
    try:
        five = read_response(sock, timeout=WAIT_S)
        took = time.monotonic() - started
    finally:
        sock.close()
    after = metric_samples(env.fg)
    started = time.monotonic()
    six = env.put("jobs/b", 6, b"token six")
    six_took = time.monotonic() - started

    assert (five.status, five.code()) == (504, "UpstreamTimeout"), (five.status, five.error, five.body[:300])
    assert "nothing was committed" in s3_message(five.body), s3_message(five.body)
    assert 0.8 <= took < 6, f"the 504 came after {took:.2f}s (request_timeout_ms = 1000)"
    assert metric_sum(after, AMBIGUOUS) == metric_sum(before, AMBIGUOUS)
    assert six.status == 200, (six.status, six.body[:300])
    assert six_took < 3, f"token 6 waited {six_took:.2f}s for a write that was cut off"
    assert env.up.wait_idle(WAIT_S)
    assert env.reached("jobs/a") == [], env.reached("jobs/a")
    assert env.at_moto("jobs/a").startswith("absent")


def test_read_slower_than_request_timeout_is_504(s3_env):
    """A GET held at the upstream past `upstream.request_timeout_ms` is answered 504
    `UpstreamTimeout` within about that time."""
    env = s3_env(upstream={"request_timeout_ms": 1000})
    env.moto.put_object(Bucket=env.bucket, Key="r", Body=b"readable")
    hold = env.up.hold_next("GET", env.path("r"))
    try:
        started = time.monotonic()
        get = signed_raw_request(env.fg, "GET", env.path("r"), timeout=WAIT_S)
        took = time.monotonic() - started
    finally:
        hold.release()
    assert hold.arrived.is_set(), "the GET never reached the upstream"
    assert (get.status, get.code()) == (504, "UpstreamTimeout"), (get.status, get.error, get.body[:300])
    assert 0.8 <= took < 6, took
    ok = signed_raw_request(env.fg, "GET", env.path("r"), timeout=WAIT_S)
    assert (ok.status, ok.body) == (200, b"readable")


# --------------------------------------------------------------------------------------------
# 5. a frozen fence store
# --------------------------------------------------------------------------------------------


def test_frozen_fence_store_fails_writes_closed_with_503_and_recovers(s3_env, redis_server):
    """Redis frozen with SIGSTOP (it holds its connections open and answers nothing), with
    `store.timeout_ms = 400`: a write with the current token and one with a newer token each get
    503 `FenceStoreUnavailable` with `Retry-After: 1` within about that time, nothing reaches
    the upstream, no ambiguous outcome is counted, reads go on and `/readyz` is 503; after
    SIGCONT writes work again and the fence store is consistent (older tokens refused).
    (The fence after SIGCONT is not asserted before token 6 writes: the newer token's admission,
    queued in the frozen Redis, may still run when it resumes; a 503 says the state is unknown.)"""
    env = s3_env(config={"store": {"kind": "redis", "url": redis_server.url, "path": None,
                                   "timeout_ms": 400, "wait_timeout_ms": 100}})
    ok = env.put("jobs/a", 5, b"token five")
    assert ok.status == 200, (ok.status, ok.body[:300])

    before = metric_samples(env.fg)
    redis_server.freeze()
    try:
        answers = {}
        for label, key, token in (("current", "jobs/b", 5), ("newer", "jobs/c", 6)):
            started = time.monotonic()
            r = env.put(key, token, b"must not land")
            answers[label] = (r, time.monotonic() - started)
        read = signed_raw_request(env.fg, "GET", env.path("jobs/a"), timeout=WAIT_S)
        ready = env.fg.admin("GET", "/readyz").status_code
        after = metric_samples(env.fg)
        reached = env.reached("jobs/b") + env.reached("jobs/c")
    finally:
        redis_server.thaw()

    for label, (r, took) in answers.items():
        assert (r.status, r.code()) == (503, "FenceStoreUnavailable"), (label, r.status, r.error, r.body[:300])
        assert r.headers.get("retry-after") == "1", (label, r.headers)
        assert took < 5, f"{label}: the 503 took {took:.2f}s (store.timeout_ms = 400)"
    assert not reached, f"a write reached the upstream while the fence store was frozen: {reached}"
    delta = metric(after, DECISIONS, outcome="store_unavailable") - metric(before, DECISIONS, outcome="store_unavailable")
    assert delta == 2, delta
    assert metric_sum(after, AMBIGUOUS) == metric_sum(before, AMBIGUOUS)
    assert (read.status, read.body) == (200, b"token five"), (read.status, read.body[:300])
    assert ready == 503

    def newer_write_goes_through():
        r = env.put("jobs/c", 6, b"token six")
        assert r.status in (200, 503), (r.status, r.code(), r.body[:300])
        return r.status == 200

    wait_until(newer_write_goes_through, timeout=WAIT_S, interval=0.2, what="writes to work after SIGCONT")
    stale = env.put("jobs/b", 5, b"token five, late")
    assert (stale.status, stale.code()) == (409, "FencingTokenStale"), (stale.status, stale.body[:300])
    assert stale.headers.get("fencing-token-current") == "6", stale.headers
    assert env.fg.get_fence(RESOURCE).json()["token"] == 6
    assert env.up.wait_idle(WAIT_S)
    assert env.committed() == [("jobs/a", "5"), ("jobs/c", "6")], env.committed()
    wait_until(lambda: env.fg.admin("GET", "/readyz").status_code == 200, WAIT_S, what="readyz 200")


# --------------------------------------------------------------------------------------------
# 6. FENCEGATE_ environment variables
# --------------------------------------------------------------------------------------------


def test_fencegate_variables_without_double_underscore_are_ignored(fencegate):
    """`FENCEGATE_` variables that cannot be overrides (no `__`), even with values that are no
    TOML, do not stop the start, and the config is the file's."""
    fg = fencegate(env={
        "FENCEGATE_BIN": "/no/such/fencegate",
        "FENCEGATE_SOMETHING": "[[[ not toml",
        "FENCEGATE_LATENCY_REQUESTS": "2000",
        "FENCEGATE_SERVER_LISTEN": "not-an-address",  # one underscore: not an override
    })
    assert fg.alive()
    assert fg.s3_addr[0] == "127.0.0.1"
    fg.client().create_bucket(Bucket="envbkt")
    fg.client(token=3).put_object(Bucket="envbkt", Key="k", Body=b"x")
    assert fg.get_fence("envbkt/k").json()["token"] == 3


def test_an_unknown_section_from_the_environment_stops_the_start(tmp_path):
    """`FENCEGATE_NOSUCHSECTION__SOMEKEY` is an override of a key that does not exist: `serve`
    exits non-zero before it is ready, naming the key, the file and the environment."""
    cfg = tmp_path / "fencegate.toml"
    cfg.write_text(to_toml(base_config(tmp_path)) + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FENCEGATE_")}
    env["FENCEGATE_NOSUCHSECTION__SOMEKEY"] = "1"
    p = subprocess.run([str(bin_path()), "serve", "--config", str(cfg)], capture_output=True, text=True,
                       timeout=30, stdin=subprocess.DEVNULL, env=env)
    assert p.returncode != 0, p.stdout
    assert "fencegate ready" not in p.stdout
    assert "nosuchsection" in p.stderr.lower(), p.stderr
    assert str(cfg) in p.stderr, p.stderr
    assert "from the environment: FENCEGATE_NOSUCHSECTION" in p.stderr, p.stderr


# --------------------------------------------------------------------------------------------
# 7. the HTTP API gateway
# --------------------------------------------------------------------------------------------


def gateway(fencegate, api, fencing: dict | None = None, config_store: dict | None = None, **route) -> FenceGate:
    """fencegate with one `idempotency-key` route `/pay/` -> `<api>/v1/payments/` (`api` is a
    RecordingApi or a base URL), resource `payment:{1}`, whose writes may raise the fence
    (`advance = "write"`)."""
    base = api if isinstance(api, str) else api.url
    r = {"prefix": "/pay/", "upstream": base + "/v1/payments/", "resource": "payment:{1}",
         "mode": "idempotency-key", "advance": "write", "request_timeout_ms": 5000}
    r.update(route)
    cfg = {"routes": [r]}
    if fencing:
        cfg["fencing"] = fencing
    if config_store:  # a shared store probes the (local) upstream at start-up: give it a bucket
        cfg["store"] = config_store
        cfg["upstream"] = {"probe_bucket": "probe"}
        return fencegate(config=cfg, local_buckets=("probe",))
    return fencegate(config=cfg)


@dataclass
class ApiResp:
    status: int | None
    headers: dict
    body: bytes
    error: str | None

    def code(self) -> str:
        assert self.headers.get("content-type") == "application/problem+json", (self.status, self.headers, self.body)
        kind = json.loads(self.body)["type"]
        assert kind.startswith("urn:fencegate:problem:"), kind
        return kind.rsplit(":", 1)[1]


def route_headers(fg: FenceGate, token: int | None = 5, key: str | list | None = None, length: int | None = None,
                  caller: str = "Bearer alice") -> list:
    h = [("Host", f"{fg.s3_addr[0]}:{fg.s3_addr[1]}"), ("Authorization", caller)]
    if token is not None:
        h.append(("Fencing-Token", str(token)))
    for k in ([key] if isinstance(key, str) else key or []):
        h.append(("Idempotency-Key", k))
    if length is not None:
        h.append(("Content-Length", str(length)))
    return h


def route_call(fg: FenceGate, path: str, body: bytes, method: str = "POST", **kw) -> ApiResp:
    r = raw_request(fg.s3_addr, method, path, route_headers(fg, length=len(body), **kw), body, timeout=WAIT_S)
    return ApiResp(r.status, r.headers, r.body, r.error)


def fence_of(fg: FenceGate, resource: str):
    r = fg.get_fence(resource)
    return r.json()["token"] if r.status_code == 200 else r.status_code


def test_route_body_above_body_bytes_max_is_413_and_never_forwarded(fencegate, api):
    """`body_bytes_max = 1024`: a 1025-byte body (announced by Content-Length, or chunked with no
    length) gets 413 `RequestTooLarge`, reaches no API and moves no fence; 1024 bytes go through."""
    fg = gateway(fencegate, api, body_bytes_max=1024)
    big = route_call(fg, "/pay/1/charges", b"x" * 1025, key="big")
    head = route_headers(fg, token=6, key="big-chunked") + [("Transfer-Encoding", "chunked")]
    data = b"y" * 1025
    chunked_raw = raw_request(fg.s3_addr, "POST", "/pay/1/charges", head,
                              f"{len(data):x}\r\n".encode() + data + b"\r\n0\r\n\r\n", timeout=WAIT_S)
    chunked = ApiResp(chunked_raw.status, chunked_raw.headers, chunked_raw.body, chunked_raw.error)

    for r in (big, chunked):
        assert (r.status, r.code()) == (413, "RequestTooLarge"), (r.status, r.error, r.body[:300])
    assert api.requests() == [], [e["path"] for e in api.requests()]
    assert fence_of(fg, "payment:1") == 404, "a refused body moved the fence"

    fits = route_call(fg, "/pay/1/charges", b"z" * 1024, key="fits")
    assert fits.status == 201, (fits.status, fits.body[:300])
    assert [len(e["body"]) for e in api.requests()] == [1024]


@pytest.mark.parametrize("mode", ["fence-only", "conditional"])
def test_streamed_route_body_above_body_bytes_max_is_413(fencegate, api, mode):
    fg = gateway(fencegate, api, mode=mode, body_bytes_max=1024)
    head = route_headers(fg, token=6) + [("Transfer-Encoding", "chunked")]
    data = b"y" * 1025
    raw = raw_request(fg.s3_addr, "PUT", "/pay/1/doc", head,
                      f"{len(data):x}\r\n".encode() + data + b"\r\n0\r\n\r\n", timeout=WAIT_S)
    r = ApiResp(raw.status, raw.headers, raw.body, raw.error)
    assert api.requests() == [], "a body above the limit reached the API whole"
    assert (r.status, r.code()) == (413, "RequestTooLarge"), (r.status, r.body[:300])


def test_route_body_that_ends_early_is_400_and_never_forwarded(fencegate, api):
    """A client announces 100 bytes, sends 40 and ends its side: 400 `IncompleteBody`, nothing
    reaches the API, no fence moves, and no record is left: the same request sent whole (same
    `Idempotency-Key`) executes (201, not 409 in flight, not a replay)."""
    fg = gateway(fencegate, api)
    with connect(fg.s3_addr) as sock:
        sock.sendall(build_head("POST", "/pay/2/charges", route_headers(fg, key="short", length=100)) + b"a" * 40)
        sock.shutdown(socket.SHUT_WR)
        raw = read_response(sock, timeout=WAIT_S)
    short = ApiResp(raw.status, raw.headers, raw.body, raw.error)
    assert (short.status, short.code()) == (400, "IncompleteBody"), (short.status, short.error, short.body[:300])
    assert api.requests() == []
    assert fence_of(fg, "payment:2") == 404

    whole = route_call(fg, "/pay/2/charges", b"a" * 100, key="short")
    assert whole.status == 201, (whole.status, whole.body[:300])
    assert "idempotent-replayed" not in whole.headers
    assert len(api.requests("/v1/payments/2/charges")) == 1


BAD_KEYS = {
    "empty": [""],
    "256-chars": ["k" * 256],
    "two-headers": ["one", "two"],
    "non-ascii": ["caf\xe9"],
    "tab-inside": ["a\tb"],
}


@pytest.mark.parametrize("keys", list(BAD_KEYS.values()), ids=list(BAD_KEYS.keys()))
def test_route_invalid_idempotency_key_is_400_and_never_forwarded(fencegate, api, keys):
    """`Idempotency-Key` is one header of 1 to 255 visible characters: anything else gets 400
    `InvalidIdempotencyKey`, reaches no API and moves no fence; a 255-character key is fine."""
    fg = gateway(fencegate, api)
    bad = route_call(fg, "/pay/3/charges", b"{}", key=keys)
    assert (bad.status, bad.code()) == (400, "InvalidIdempotencyKey"), (bad.status, bad.error, bad.body[:300])
    assert api.requests() == []
    assert fence_of(fg, "payment:3") == 404
    longest = route_call(fg, "/pay/3/charges", b"{}", key="k" * 255)
    assert longest.status == 201, (longest.status, longest.body[:300])


def test_route_idempotency_key_with_a_space_is_400(fencegate, api):
    fg = gateway(fencegate, api)
    bad = route_call(fg, "/pay/4/charges", b"{}", key="a b")
    assert api.requests() == [], f"forwarded: {bad.status}"
    assert (bad.status, bad.code()) == (400, "InvalidIdempotencyKey"), (bad.status, bad.body[:300])


@pytest.mark.parametrize("status", [429, 503])
def test_route_429_or_503_from_the_api_is_passed_on_and_not_recorded(fencegate, api, status):
    """The API answers 429 / 503 (with its own `Retry-After` and body): the client gets exactly
    that, and it is not recorded: the retry with the same key reaches the API again (with the
    same upstream `Idempotency-Key`), and its 201 is what later retries replay."""
    fg = gateway(fencegate, api)
    path = "/v1/payments/5/charges"
    api.script(path, (status, {"Retry-After": "7", "Content-Type": "text/plain"}, b"busy, come back"))
    first = route_call(fg, "/pay/5/charges", b'{"amount":1}', key="pay-5")
    assert first.status == status, (first.status, first.body[:300])
    assert first.body == b"busy, come back"
    assert first.headers.get("retry-after") == "7", first.headers
    assert len(api.requests(path)) == 1

    retry = route_call(fg, "/pay/5/charges", b'{"amount":1}', key="pay-5")
    assert retry.status == 201, (retry.status, retry.body[:300])
    assert "idempotent-replayed" not in retry.headers, "the refusal was recorded and replayed"
    sent = api.requests(path)
    assert len(sent) == 2, "the retry did not reach the API"
    assert sent[0]["headers"]["idempotency-key"] == sent[1]["headers"]["idempotency-key"]
    assert sent[0]["headers"]["idempotency-key"].startswith("fg-")

    replay = route_call(fg, "/pay/5/charges", b'{"amount":1}', key="pay-5")
    assert (replay.status, replay.body) == (201, retry.body)
    assert replay.headers.get("idempotent-replayed") == "true", replay.headers
    assert len(api.requests(path)) == 2


def test_route_too_many_inflight_and_drain_timeout_are_503_problems(fencegate, api):
    """`fencing.inflight_per_resource_max = 1`, `inflight_deadline_ms = 1000`, a token-5 call held
    at the API: another token-5 write on the resource gets 503 `TooManyInflightWrites`, a
    token-6 write 503 `FencingDrainTimeout` after the deadline, both with `Retry-After: 1`,
    neither reaching the API, no ambiguous outcome counted. Once the held call ended, the
    token-6 retry executes and the token-5 retry is stale (409 `FencingTokenStale`, not
    `IdempotentRequestInFlight`): the refused attempts left no record in flight."""
    fg = gateway(fencegate, api, fencing={"inflight_per_resource_max": 1, "inflight_deadline_ms": 1000})
    hold = api.hold("/v1/payments/6/a")
    t, held = in_thread(lambda: route_call(fg, "/pay/6/a", b"{}", key="a"))
    try:
        assert hold.arrived.wait(WAIT_S), "the first call never reached the API"
        before = metric_samples(fg)
        too_many = route_call(fg, "/pay/6/b", b"{}", key="b")
        started = time.monotonic()
        newer = route_call(fg, "/pay/6/c", b"{}", token=6, key="c")
        waited = time.monotonic() - started
        after = metric_samples(fg)
        reached_while_held = [e["path"] for e in api.requests() if e["path"] != "/v1/payments/6/a"]
    finally:
        hold.released.set()
    t.join(WAIT_S)

    assert (too_many.status, too_many.code()) == (503, "TooManyInflightWrites"), (too_many.status, too_many.body[:300])
    assert (newer.status, newer.code()) == (503, "FencingDrainTimeout"), (newer.status, newer.body[:300])
    for r in (too_many, newer):
        assert r.headers.get("retry-after") == "1", r.headers
    assert 0.8 <= waited < 6, waited
    assert not reached_while_held, reached_while_held
    for outcome in ("too_many_inflight", "drain_timeout"):
        assert metric(after, DECISIONS, outcome=outcome) - metric(before, DECISIONS, outcome=outcome) == 1, outcome
    assert metric_sum(after, AMBIGUOUS) == metric_sum(before, AMBIGUOUS)
    assert held.get("value") is not None and held["value"].status == 201, held

    retry_newer = route_call(fg, "/pay/6/c", b"{}", token=6, key="c")
    assert retry_newer.status == 201, (retry_newer.status, retry_newer.body[:300])
    stale = route_call(fg, "/pay/6/b", b"{}", key="b")
    assert (stale.status, stale.code()) == (409, "FencingTokenStale"), (stale.status, stale.body[:300])
    assert [e["path"] for e in api.requests()] == ["/v1/payments/6/a", "/v1/payments/6/c"]


def test_route_api_unreachable_is_502_with_no_record_and_the_retry_goes_ahead(fencegate):
    """The API's port is closed: a write gets 502 `UpstreamUnavailable` (nothing was sent: no
    ambiguous outcome, no record), a read 502 too; once the API listens, the retry with the same
    `Idempotency-Key` executes there (201, not a replayed 502, not 409 in flight)."""
    closed = reserve_port()  # bound, not listening: connections are refused until the API starts
    fg = gateway(fencegate, f"http://127.0.0.1:{closed.getsockname()[1]}")
    before = metric_samples(fg)
    write = route_call(fg, "/pay/7/charges", b'{"amount":7}', key="pay-7")
    read = route_call(fg, "/pay/7/charges", b"", method="GET")
    after = metric_samples(fg)
    assert (write.status, write.code()) == (502, "UpstreamUnavailable"), (write.status, write.error, write.body[:300])
    assert (read.status, read.code()) == (502, "UpstreamUnavailable"), (read.status, read.error, read.body[:300])
    assert metric_sum(after, AMBIGUOUS) == metric_sum(before, AMBIGUOUS), "nothing was sent, yet counted ambiguous"

    api = RecordingApi(closed)
    try:
        retry = route_call(fg, "/pay/7/charges", b'{"amount":7}', key="pay-7")
        assert retry.status == 201, (retry.status, retry.body[:300])
        assert "idempotent-replayed" not in retry.headers, retry.headers
        assert len(api.requests("/v1/payments/7/charges")) == 1
    finally:
        api.stop()


def test_route_write_with_a_frozen_fence_store_is_503_and_never_forwarded(fencegate, api, redis_server):
    """Redis (fences and idempotency records) frozen with SIGSTOP, `store.timeout_ms = 400`: a
    route write gets 503 `FenceStoreUnavailable` with `Retry-After: 1`, never reaching the API;
    after SIGCONT the retry with the same key executes once."""
    fg = gateway(fencegate, api, config_store={"kind": "redis", "url": redis_server.url, "path": None,
                                               "timeout_ms": 400, "wait_timeout_ms": 100})
    redis_server.freeze()
    try:
        started = time.monotonic()
        frozen = route_call(fg, "/pay/8/charges", b'{"amount":8}', key="pay-8")
        took = time.monotonic() - started
    finally:
        redis_server.thaw()
    assert (frozen.status, frozen.code()) == (503, "FenceStoreUnavailable"), (frozen.status, frozen.body[:300])
    assert frozen.headers.get("retry-after") == "1", frozen.headers
    assert took < 5, took
    assert api.requests() == []

    def executes():
        r = route_call(fg, "/pay/8/charges", b'{"amount":8}', key="pay-8")
        assert r.status in (201, 503), (r.status, r.body[:300])
        return r if r.status == 201 else None

    retry = wait_until(executes, timeout=WAIT_S, interval=0.2, what="the route to work after SIGCONT")
    assert "idempotent-replayed" not in retry.headers
    assert len(api.requests("/v1/payments/8/charges")) == 1


# --------------------------------------------------------------------------------------------
# 8. what route callers (not authenticated by fencegate) can make it hold
# --------------------------------------------------------------------------------------------


def open_slow_body(fg: FenceGate, path: str, caller: str, key: str, length: int = 1000) -> socket.socket:
    """A route call whose head announces `length` bytes and whose body never comes (10 bytes)."""
    sock = socket.create_connection(fg.s3_addr, timeout=WAIT_S)
    head = route_headers(fg, key=key, length=length, caller=caller)
    sock.sendall(build_head("POST", path, head) + b"x" * 10)
    return sock


def test_slow_bodies_are_cut_off_and_one_caller_holds_a_share_of_the_route(fencegate, api):
    """Before: a route reserved `body_bytes_max` of its buffer for every body being read, for as
    long as the client took: eight slow bodies locked an idempotency-key route, and every other
    caller got 503. Now a body is held for what its length announces, one caller holds at most a
    quarter of the route's buffer (at least one body), and a body that has not arrived within
    the route's `request_timeout_ms` gets 408 `RequestTimeout`. Nothing of the slow calls
    reaches the API."""
    fg = gateway(fencegate, api, body_bytes_max=1024, buffered_bytes_max=4096, request_timeout_ms=1000)
    slow = [open_slow_body(fg, f"/pay/{i}/charges", "Bearer mallory", f"slow-{i}") for i in range(8)]
    try:
        time.sleep(0.3)
        alice = route_call(fg, "/pay/100/charges", b'{"amount": 1}', key="alice-1", caller="Bearer alice")
        assert alice.status == 201, (alice.status, alice.body)
        answers = []
        for sock in slow:
            r = read_response(sock, timeout=WAIT_S)
            answers.append((r.status, json.loads(r.body)["type"].rsplit(":", 1)[1] if r.body else None))
        # Mallory's share (1024 bytes) holds one 1000-byte body: that one is cut off at the
        # route's timeout, the other seven were refused at once.
        assert sorted(answers) == [(408, "RequestTimeout")] + [(503, "SlowDown")] * 7, answers
    finally:
        for sock in slow:
            sock.close()
    assert [r["path"] for r in api.requests()] == ["/v1/payments/100/charges"]


def test_a_record_is_never_dropped_before_its_retention(fencegate, api):
    """Before: beyond `store.idempotency_records_max` the records that expired first were
    dropped, so other callers' requests evicted a victim's record, and the victim's retry
    executed again at the API. Now a full store refuses new claims (503 `SlowDown`, nothing
    executed) and the victim's retry is still answered from its record."""
    fg = gateway(fencegate, api, config_store={"idempotency_records_max": 2})
    first = route_call(fg, "/pay/1/charges", b'{"amount": 5}', key="victim", caller="Bearer victim")
    assert first.status == 201, (first.status, first.body)
    other = route_call(fg, "/pay/2/charges", b'{"amount": 6}', key="other-1", caller="Bearer other")
    assert other.status == 201, (other.status, other.body)
    full = route_call(fg, "/pay/3/charges", b'{"amount": 7}', key="other-2", caller="Bearer other")
    assert (full.status, full.code()) == (503, "SlowDown"), (full.status, full.body)
    retry = route_call(fg, "/pay/1/charges", b'{"amount": 5}', key="victim", caller="Bearer victim")
    assert retry.status == 201 and retry.headers.get("idempotent-replayed") == "true", (retry.status, retry.headers)
    assert [r["path"] for r in api.requests()] == ["/v1/payments/1/charges", "/v1/payments/2/charges"]


def test_callers_are_told_apart_by_every_header_the_route_names(fencegate, api):
    """Before: with an API keyed by `X-Api-Key` and `routes.caller_header` left at
    `authorization`, every caller looked alike, and one caller's retry of another's request id
    was answered with the other's recorded response. With `caller_headers = ["x-api-key"]`, a
    caller is told apart by its key too: the second caller's request executes on its own."""
    fg = gateway(fencegate, api, caller_headers=["x-api-key"])
    host, port = fg.s3_addr
    body = b'{"amount": 9}'
    answers = []
    for key in ("key-of-alice", "key-of-bob"):
        head = [("Host", f"{host}:{port}"), ("X-Api-Key", key), ("Fencing-Token", "5"),
                ("Idempotency-Key", "same-id"), ("Content-Length", str(len(body)))]
        r = raw_request(fg.s3_addr, "POST", "/pay/1/charges", head, body, timeout=WAIT_S)
        answers.append((r.status, r.headers.get("idempotent-replayed"), json.loads(r.body)))
    assert answers[0] == (201, None, {"executed": 1}), answers
    assert answers[1] == (201, None, {"executed": 2}), "bob was answered with alice's response"
    assert [r["headers"]["x-api-key"] for r in api.requests()] == ["key-of-alice", "key-of-bob"]
