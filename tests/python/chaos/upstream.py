"""A slow, logging S3 upstream: a threaded HTTP/1.1 proxy in front of a real moto_server.

For every request it reads the whole request first (head and body). Writes (PUT, POST,
DELETE) into the chaos bucket are then, for a configurable fraction, held for a random time
(a slow S3 commit) before they are forwarded, and every write is forwarded to moto under ONE
global lock, so the order in which the wrapper forwards them is the order in which moto commits
them. Each write is logged (`events`), with its position in that order (`seq`), the token
fencegate stamped on it, the writer's chaos id, moto's answer and the times it arrived, was
forwarded and was answered.

The faults it models: a held write is forwarded even if fencegate (its client here) hung up
meanwhile, exactly like S3 committing a request whose client went away; and, for a fraction of
the held writes (`early_fraction`), the answer comes first: fencegate is told 500, 502, 503 or
504 at once, and the write still commits after its hold, as S3 does with a write it answered
500 or 503, or a load balancer's backend after the balancer gave up (502, 504). A write whose
body never arrived whole is not forwarded (S3 commits nothing for a truncated body).

fencegate assumes that an upstream commits a request it received whole within
`fencing.inflight_deadline_ms`, or never (README, "Guarantees and limits"). The wrapper keeps to
that when given `commit_within`: a write whose turn at moto comes too late after its body
arrived is answered 503 `SlowDown` and never forwarded (outcome "expired"), and a commit that
still ended late (moto itself slow) is marked `late`. So every violation the checker finds is
one under fencegate's own assumptions.

Reads (GET, HEAD, listings) pass through at once, without the lock. The proxy itself (requests
forwarded unchanged, connection management, body framing) is `moto_proxy.MotoProxy`, shared
with the holding upstream of test_inflight.py and test_error_paths.py.
"""

from __future__ import annotations

import random
import threading
import time
import urllib.parse
import xml.etree.ElementTree as ET

from moto_proxy import Answer, MotoProxy, Request, peer_closed

MOTO_MARGIN_S = 0.25  # time left for moto's own work when a write is forwarded near its budget
EXPIRED = Answer(503, "Slow Down", [("Content-Type", "application/xml")],
                 b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
                 b"<Message>chaos upstream: commit budget spent, not committed</Message></Error>")
WRITE_METHODS = ("PUT", "POST", "DELETE")
EARLY_ANSWERS = {
    status: Answer(status, reason, [("Content-Type", "application/xml")],
                   f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                   f"<Message>chaos upstream: answered before the commit</Message></Error>".encode())
    for status, reason, code in ((500, "Internal Server Error", "InternalError"), (502, "Bad Gateway", "BadGateway"),
                                 (503, "Slow Down", "SlowDown"), (504, "Gateway Timeout", "GatewayTimeout"))
}


def _s3_keys(xml: bytes, element: str) -> list:
    """The `<Key>` of every `<element>` entry (`Object` of a Delete request, `Deleted` of a
    DeleteResult), namespace or not."""
    try:
        root = ET.fromstring(xml)
    except ET.ParseError:
        return []
    keys = []
    for el in root.iter():
        if el.tag.rsplit("}", 1)[-1] == element:
            for child in el:
                if child.tag.rsplit("}", 1)[-1] == "Key" and child.text is not None:
                    keys.append(child.text)
    return keys


def classify(method: str, key: str, query: str) -> str:
    """The write kinds the checker knows; multipart steps and sub-resources are "other"."""
    params = urllib.parse.parse_qs(query, keep_blank_values=True)
    if method == "POST" and "delete" in params:
        return "delete_objects"
    if not key or params:
        return "other"
    return {"PUT": "put", "DELETE": "delete"}.get(method, "other")


class ChaosUpstream(MotoProxy):
    """The wrapper. `start()` listens on 127.0.0.1 (a free port); `url` is its endpoint."""

    def __init__(self, moto_url: str, bucket: str, hold_fraction: float, hold_range: tuple,
                 commit_within: float | None = None, seed: int = 0, early_fraction: float = 0.0):
        super().__init__(moto_url, backlog=256)
        self.bucket = bucket  # only writes into this bucket are held
        self.hold_fraction = hold_fraction
        self.hold_range = hold_range
        self.early_fraction = early_fraction  # of held writes: a 5xx answered first, then the commit
        self.commit_within = commit_within  # seconds after the body arrived; None: no bound
        self.rng = random.Random(seed)
        self.rng_lock = threading.Lock()
        self.events: list = []  # one dict per write request (see checker.py)
        self.seq = 0

    def snapshot(self) -> list:
        with self.lock:
            return [dict(e) for e in self.events]

    # one request ------------------------------------------------------------------------
    def handle(self, conn, req: Request, buf: bytes):
        """Pending (for `wait_idle`) from its head's arrival until it is answered."""
        with self.answering():
            return self._handle(conn, req, buf)

    def _handle(self, conn, req: Request, buf: bytes):
        parts = req.path.lstrip("/").split("/", 1)
        bucket, key = parts[0], (parts[1] if len(parts) > 1 else "")
        event = None
        if req.method in WRITE_METHODS:
            op = classify(req.method, key, req.query)
            stamp = req.h.get("x-amz-meta-fencing-token")
            event = {
                "seq": None, "method": req.method, "bucket": bucket, "key": key, "query": req.query,
                "op": op, "chaos_id": req.h.get("x-chaos-id") or req.h.get("x-amz-meta-chaos-id"),
                "stamp": int(stamp) if stamp and stamp.isdigit() else None,
                "keys": [key] if op in ("put", "delete") else [], "committed_keys": [],
                "status": None, "outcome": "truncated", "t_arrival": req.t_arrival, "t_body": None,
                "t_fwd": None, "t_done": None, "hold": 0.0, "client_gone": False, "late": False,
                "early": None,
                "headers": req.logged_headers(),
            }
            with self.lock:
                self.events.append(event)
        rest = self.read_body(conn, req, buf)
        if rest is None:
            return None  # a truncated request is never forwarded
        if event is None:
            return self.respond(conn, req, self.forward(req), rest)

        event["t_body"] = time.monotonic()
        if event["op"] == "delete_objects":
            event["keys"] = _s3_keys(req.body, "Object")
        with self.rng_lock:
            held = bucket == self.bucket and self.rng.random() < self.hold_fraction
            hold = self.rng.uniform(*self.hold_range) if held else 0.0
            early = self.rng.choice(sorted(EARLY_ANSWERS)) if held and self.rng.random() < self.early_fraction else None
        if early:
            # Answered now, committed after the hold: pending (for `wait_idle`) until then.
            event["early"] = early
            with self.lock:
                self.pending += 1
            kept = self.respond(conn, req, EARLY_ANSWERS[early], rest)
            threading.Thread(target=self._commit_late, args=(conn, req, event, hold), daemon=True).start()
            return kept
        answer = self._commit(conn, req, event, hold)
        return self.respond(conn, req, answer, rest)

    def _commit_late(self, conn, req: Request, event: dict, hold: float):
        try:
            self._commit(conn, req, event, hold)
        finally:
            with self.idle:
                self.pending -= 1
                self.idle.notify_all()

    def _commit(self, conn, req: Request, event: dict, hold: float) -> Answer:
        """Holds the write `hold` seconds, then forwards it to moto under the commit lock
        (unless its commit budget is spent) and logs what moto answered."""
        if hold:
            event["hold"] = hold
            time.sleep(hold)  # the slow commit (a fault): whether or not fencegate is still there
        with self.commit_lock:
            if not event["early"]:  # the connection is fencegate's again once it was answered
                event["client_gone"] = peer_closed(conn)
            budget = self.commit_within
            if budget is not None and time.monotonic() - event["t_body"] > budget - MOTO_MARGIN_S:
                event["outcome"], event["status"] = "expired", 503
                return EXPIRED
            with self.lock:
                self.seq += 1
                event["seq"] = self.seq
            event["t_fwd"] = time.monotonic()
            answer = self.forward(req)
            event["t_done"] = time.monotonic()
        event["late"] = budget is not None and event["t_done"] - event["t_body"] > budget
        event["status"] = answer.status
        key = event["key"]
        if answer.status is None:
            event["outcome"] = "unknown"
        elif 200 <= answer.status < 300:
            event["outcome"] = "committed"
            if event["op"] == "delete_objects":
                event["committed_keys"] = _s3_keys(answer.body, "Deleted")
            else:
                event["committed_keys"] = [key] if event["op"] != "other" else []
        else:
            event["outcome"] = "refused"
        return answer
