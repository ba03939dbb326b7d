"""A holding S3 upstream: the proxy of `moto_proxy.py` in front of a real moto_server (requests
forwarded unchanged, each only once it arrived whole), where a test can make it hold one request:

    up = HoldingUpstream(moto_url).start()
    hold = up.hold_next("PUT", "jobs/a")      # the next PUT whose path contains "jobs/a"
    ...                                        # fencegate forwards it
    assert hold.wait_arrived(10)               # its whole body is here; it is held
    ...
    hold.release()                             # now it goes to moto

A held request is forwarded after its release even if its client (fencegate) hung up
meanwhile, exactly like S3 committing a request whose client went away. A hold can also end by
itself: `hold_next(..., commit_after_s=s)` forwards the request at its arrival + s (an upstream
that commits what it received s later). `answer_then_commit(method, key, status, s)` answers
the next matching request at once with an S3-style 5xx error, without forwarding it, and then
forwards (commits) it at its arrival + s anyway: an ambiguous answer whose write still lands.
A request whose body never arrived whole is not forwarded (S3 commits nothing for a truncated
body).

Writes (every method but GET, HEAD and OPTIONS, so also a non-standard `put`) are forwarded to
moto under ONE lock, so the order of `writes()` (the requests moto answered, in forwarding order)
is the order in which moto committed them. Holding happens before that lock is taken: a held
write does not block the others. `requests()` lists every request that arrived whole (reads
too), in arrival order.

Everything listens on and talks to 127.0.0.1; every wait is bounded.

`HeldS3` is what conftest's `held_s3` fixture hands a test: such a proxy in front of the session's
moto_server, a fresh bucket, and a fencegate using the proxy as its S3 upstream, where every key
under `jobs/` of the bucket belongs to resource `job`.
"""

from __future__ import annotations

import http
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from moto_proxy import Answer, MotoProxy, Request, peer_closed

if TYPE_CHECKING:
    from fencegate_testlib import FenceGate

READ_METHODS = {"GET", "HEAD", "OPTIONS"}
HOLD_MAX_S = 120.0  # a hold nobody releases ends by itself (the test has failed by then)
HELD_RESOURCE = "job"  # the resource of every key under HELD_PREFIX in a HeldS3 bucket
HELD_PREFIX = "jobs/"


class Hold:
    """One registered hold: the next request with `method` whose path contains `key`
    (and whose query contains `query`, if given) is held after its whole body arrived."""

    def __init__(self, method: str | None, key: str, query: str | None,
                 commit_after_s: float | None = None):
        self.method = method
        self.key = key
        self.query = query
        self.commit_after_s = commit_after_s  # if set: released by itself at arrival + this
        self.arrived = threading.Event()  # set when the matching request is held
        self.released = threading.Event()
        self.entry: dict | None = None  # the held request's log entry

    def matches(self, method: str, path: str, query: str) -> bool:
        if self.method is not None and method != self.method:
            return False
        if self.key not in path:
            return False
        return self.query is None or self.query in query

    def wait_arrived(self, timeout: float) -> bool:
        return self.arrived.wait(timeout)

    def release(self):
        self.released.set()

    def client_gone(self) -> bool:
        """Whether fencegate closed the held request's connection (checked while held)."""
        return bool(self.entry and self.entry.get("client_gone"))


class Refusal:
    """One registered refusal: the next `count` requests with `method` that carry `header`
    are answered 412 `PreconditionFailed` without reaching moto. `refused` counts them."""

    def __init__(self, method: str, header: str, count: int):
        self.method, self.header, self.count = method, header.lower(), count
        self.refused = 0


class LateCommit:
    """One registered `answer_then_commit` rule: the next request with `method` whose path
    contains `key` is answered `status` at once (unforwarded), then forwarded to moto at its
    arrival + `commit_after_s` under the commit lock, and logged in `writes()` like any write."""

    CODES = {500: "InternalError", 502: "BadGateway", 503: "ServiceUnavailable", 504: "GatewayTimeout"}

    def __init__(self, method: str, key: str, status: int, commit_after_s: float):
        self.method, self.key, self.status, self.commit_after_s = method, key, status, commit_after_s
        self.arrived = threading.Event()  # the request arrived whole (set before it is answered)
        self.committed = threading.Event()  # moto answered the late forward
        self.entry: dict | None = None

    def matches(self, method: str, path: str) -> bool:
        return method == self.method and self.key in path

    def answer(self) -> Answer:
        code = self.CODES.get(self.status, "InternalError")
        body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                f"<Message>answered {self.status} by the test upstream</Message></Error>").encode()
        return Answer(self.status, http.HTTPStatus(self.status).phrase,
                      [("Content-Type", "application/xml")], body)


PRECONDITION_FAILED = Answer(
    412, "Precondition Failed", [("Content-Type", "application/xml")],
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>PreconditionFailed</Code>'
    b"<Message>At least one of the pre-conditions you specified did not hold</Message></Error>",
)


class HoldingUpstream(MotoProxy):
    """The holding proxy. `start()` listens on a free port of 127.0.0.1; `url` is its endpoint.
    `reserve()` before `start()`: an upstream that refuses connections until it starts."""

    def __init__(self, moto_url: str):
        super().__init__(moto_url, backlog=128)
        self._requests: list = []
        self._writes: list = []
        self._holds: list = []
        self._refusals: list = []
        self._late_commits: list = []

    # rules and log ----------------------------------------------------------------------
    def hold_next(self, method: str | None, key: str, query: str | None = None,
                  commit_after_s: float | None = None) -> Hold:
        """Hold the next request matching (method, path substring[, query substring]); with
        `commit_after_s`, it is released by itself at its arrival + that many seconds."""
        hold = Hold(method, key, query, commit_after_s)
        with self.lock:
            self._holds.append(hold)
        return hold

    def refuse_next(self, method: str, header: str, count: int = 1) -> Refusal:
        """Answer the next `count` requests with `method` that carry `header` with S3's 412,
        unforwarded: what S3 answers when what the precondition names changed between
        fencegate's read and the write, and may have changed back since (ETags name bytes)."""
        refusal = Refusal(method, header, count)
        with self.lock:
            self._refusals.append(refusal)
        return refusal

    def answer_then_commit(self, method: str, key: str, status: int, commit_after_s: float) -> LateCommit:
        """Answer the next `method` request whose path contains `key` with `status` (an S3-style
        XML error) at once without forwarding it, then forward it to moto (commit it) at its
        arrival + `commit_after_s`, under the commit lock; `wait_idle` waits for that forward."""
        rule = LateCommit(method, key, status, commit_after_s)
        with self.lock:
            self._late_commits.append(rule)
        return rule

    def release_all(self):
        with self.lock:
            holds = list(self._holds)
            self._holds.clear()
        for h in holds:
            h.release()

    def requests(self, key: str | None = None) -> list:
        """Every request that arrived whole, in arrival order (optionally: path contains key)."""
        with self.lock:
            return [dict(e) for e in self._requests if key is None or key in e["path"]]

    def writes(self, key: str | None = None) -> list:
        """The writes moto answered, in forwarding (= commit) order."""
        with self.lock:
            return [dict(e) for e in self._writes if key is None or key in e["path"]]

    def stop(self):
        self.release_all()
        super().stop()

    def close(self, timeout: float = 30.0):
        """A test's teardown: every hold released, the requests in flight answered (at most
        `timeout` seconds), then stopped."""
        self.release_all()
        self.wait_idle(timeout)
        self.stop()

    # one request ------------------------------------------------------------------------
    def handle(self, conn, req: Request, buf: bytes):
        rest = self.read_body(conn, req, buf)
        if rest is None:
            return None  # a truncated request is never forwarded
        entry = {
            "seq": None, "method": req.method, "path": req.path, "query": req.query,
            "token": req.h.get("x-amz-meta-fencing-token"), "status": None, "held": False,
            "client_gone": False, "t_arrived": time.monotonic(), "t_arrived_wall": time.time(),
            "t_forwarded": None, "t_answered": None, "headers": req.logged_headers(),
            "body_bytes": len(req.body),
        }
        with self.lock:
            refusal = next((r for r in self._refusals if r.method == req.method and r.header in req.h
                            and r.refused < r.count), None)
            if refusal is not None:
                refusal.refused += 1
        if refusal is not None:
            return self.respond(conn, req, PRECONDITION_FAILED, rest)
        with self.lock:
            late = next((r for r in self._late_commits if r.matches(req.method, req.path)), None)
            if late is not None:
                self._late_commits.remove(late)
                self._requests.append(entry)
                self.pending += 1  # until the late forward is answered (`_commit_late`)
        if late is not None:
            late.entry = entry
            entry["answered_first"] = late.status
            threading.Thread(target=self._commit_late, args=(req, entry, late), daemon=True,
                             name="HoldingUpstream-late").start()
            late.arrived.set()
            return self.respond(conn, req, late.answer(), rest)
        with self.answering():
            with self.lock:
                self._requests.append(entry)
                hold = next((x for x in self._holds if x.matches(req.method, req.path, req.query)), None)
                if hold is not None:
                    self._holds.remove(hold)
            if hold is not None:
                self._hold(conn, hold, entry)  # forwarded afterwards whether or not fencegate is still there
            if req.method.upper() in READ_METHODS and req.method.isupper():
                answer = self._forward_logged(req, entry)
            else:
                with self.commit_lock:
                    answer = self._forward_logged(req, entry)
                    with self.lock:
                        entry["seq"] = len(self._writes) + 1
                        self._writes.append(entry)
        return self.respond(conn, req, answer, rest)

    def _commit_late(self, req: Request, entry: dict, late: LateCommit):
        """The late forward of an `answer_then_commit` request (at its arrival + the delay)."""
        try:
            delay = entry["t_arrived"] + late.commit_after_s - time.monotonic()
            if delay > 0:
                time.sleep(min(delay, HOLD_MAX_S))
            with self.commit_lock:
                self._forward_logged(req, entry)
                with self.lock:
                    entry["seq"] = len(self._writes) + 1
                    self._writes.append(entry)
            late.committed.set()
        finally:
            with self.idle:
                self.pending -= 1
                self.idle.notify_all()

    @staticmethod
    def _hold(conn, hold: Hold, entry: dict):
        """Until the test releases it (at most HOLD_MAX_S; with `commit_after_s`, until the
        request's arrival + that), watching whether fencegate hangs up."""
        entry["held"] = True
        hold.entry = entry
        hold.arrived.set()
        deadline = time.monotonic() + HOLD_MAX_S
        if hold.commit_after_s is not None:
            deadline = min(deadline, entry["t_arrived"] + hold.commit_after_s)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or hold.released.wait(min(0.05, left)):
                break
            if not entry["client_gone"] and peer_closed(conn):
                entry["client_gone"] = True

    def _forward_logged(self, req: Request, entry: dict) -> Answer:
        entry["t_forwarded"] = time.monotonic()
        answer = self.forward(req)
        entry["t_answered"] = time.monotonic()
        entry["status"] = answer.status
        return answer


@dataclass
class HeldS3:
    """A fencegate in front of a HoldingUpstream in front of moto, with a bucket of its own
    (made by conftest's `held_s3`). Test modules subclass it for helpers of their own."""

    fg: FenceGate
    up: HoldingUpstream
    bucket: str
    moto: object  # a boto3 client straight at moto (bypasses fencegate and the proxy)

    def path(self, key: str) -> str:
        return f"/{self.bucket}/{key}"
