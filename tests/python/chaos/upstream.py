"""A slow, logging S3 upstream: a threaded HTTP/1.1 proxy in front of a real moto_server.

For every request it reads the whole request first (head and body). Writes (PUT, POST,
DELETE) into the chaos bucket are then, for a configurable fraction, held for a random time
(a slow S3 commit) before they are forwarded, and every write is forwarded to moto under ONE
global lock, so the order in which the wrapper forwards them is the order in which moto commits
them. Each write is logged (`events`), with its position in that order (`seq`), the token
fencegate stamped on it, the writer's chaos id, moto's answer and the times it arrived, was
forwarded and was answered.

The fault it models: a held write is forwarded even if fencegate (its client here) hung up
meanwhile, exactly like S3 committing a request whose client went away. A write whose body
never arrived whole is not forwarded (S3 commits nothing for a truncated body).

fencegate assumes that an upstream commits a request it received whole within
`fencing.inflight_deadline_ms`, or never (README, "Guarantees and limits"). The wrapper keeps to
that when given `commit_within`: a write whose turn at moto comes too late after its body
arrived is answered 503 `SlowDown` and never forwarded (outcome "expired"), and a commit that
still ended late (moto itself slow) is marked `late`. So every violation the checker finds is
one under fencegate's own assumptions.

Reads (GET, HEAD, listings) pass through at once, without the lock. Requests are forwarded
unchanged (the Host header too: fencegate signed for this wrapper's address, and moto does not
verify signatures) except for connection management and the body framing (a chunked body is
forwarded with its Content-Length).
"""

from __future__ import annotations

import http.client
import random
import select
import socket
import threading
import time
import urllib.parse
import xml.etree.ElementTree as ET

HOP_BY_HOP = {
    "connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
    "upgrade", "expect", "content-length",
}
HEAD_BYTES_MAX = 64 * 1024
BODY_READ_TIMEOUT_S = 60.0  # a client streaming a body this slowly is treated as gone
IDLE_TIMEOUT_S = 120.0  # a pooled connection with no request for this long is closed
MOTO_TIMEOUT_S = 30.0
MOTO_MARGIN_S = 0.25  # time left for moto's own work when a write is forwarded near its budget
EXPIRED_BODY = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
                b"<Message>chaos upstream: commit budget spent, not committed</Message></Error>")


class _Incomplete(Exception):
    """The client closed or stalled before the request was whole."""


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


class ChaosUpstream:
    """The wrapper. `start()` listens on 127.0.0.1 (a free port); `url` is its endpoint."""

    def __init__(self, moto_url: str, bucket: str, hold_fraction: float, hold_range: tuple,
                 commit_within: float | None = None, seed: int = 0):
        parsed = urllib.parse.urlsplit(moto_url)
        self.moto = (parsed.hostname, parsed.port)
        self.bucket = bucket  # only writes into this bucket are held
        self.hold_fraction = hold_fraction
        self.hold_range = hold_range
        self.commit_within = commit_within  # seconds after the body arrived; None: no bound
        self.rng = random.Random(seed)
        self.rng_lock = threading.Lock()
        self.commit_lock = threading.Lock()  # the ONE lock: forwarding writes to moto
        self.log_lock = threading.Lock()
        self.events: list = []  # one dict per write request (see checker.py)
        self.seq = 0
        self.pending = 0  # requests read but not yet answered by moto
        self.idle = threading.Condition(self.log_lock)
        self.sock: socket.socket | None = None
        self.conns: set = set()
        self.stopping = False
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # lifecycle ------------------------------------------------------------------------
    def start(self):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(256)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept_loop, name="upstream-accept", daemon=True).start()
        return self

    def stop(self):
        self.stopping = True
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
        with self.log_lock:
            conns = list(self.conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def wait_idle(self, timeout: float) -> bool:
        """Waits until every request read so far was answered by moto (held ones included)."""
        deadline = time.monotonic() + timeout
        with self.idle:
            while self.pending > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.idle.wait(left)
        return True

    def snapshot(self) -> list:
        with self.log_lock:
            return [dict(e) for e in self.events]

    # connections ------------------------------------------------------------------------
    def _accept_loop(self):
        while not self.stopping:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self.log_lock:
                self.conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="upstream-conn", daemon=True).start()

    def _serve(self, conn: socket.socket):
        buf = b""
        try:
            while not self.stopping:
                try:
                    head, buf = self._read_head(conn, buf)
                except _Incomplete:
                    return
                t_arrival = time.monotonic()
                method, target, headers = self._parse_head(head)
                with self.log_lock:
                    self.pending += 1
                try:
                    keep = self._handle(conn, method, target, headers, buf, t_arrival)
                finally:
                    with self.idle:
                        self.pending -= 1
                        self.idle.notify_all()
                if keep is None:
                    return
                buf = keep
        finally:
            with self.log_lock:
                self.conns.discard(conn)
            try:
                conn.close()
            except OSError:
                pass

    def _read_head(self, conn, buf: bytes):
        conn.settimeout(IDLE_TIMEOUT_S)
        while b"\r\n\r\n" not in buf:
            if len(buf) > HEAD_BYTES_MAX:
                raise _Incomplete()
            try:
                chunk = conn.recv(65536)
            except OSError:
                raise _Incomplete() from None
            if not chunk:
                raise _Incomplete()
            buf += chunk
        head, _, rest = buf.partition(b"\r\n\r\n")
        return head, rest

    @staticmethod
    def _parse_head(head: bytes):
        lines = head.decode("latin-1").split("\r\n")
        method, target, _version = lines[0].split(" ", 2)
        headers = []
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers.append((name.strip(), value.strip()))
        return method, target, headers

    def _read_body(self, conn, headers: list, buf: bytes):
        """Returns (body, leftover bytes). Raises _Incomplete if the body never arrives whole."""
        h = {k.lower(): v for k, v in headers}
        conn.settimeout(BODY_READ_TIMEOUT_S)

        def more():
            try:
                chunk = conn.recv(65536)
            except OSError:
                raise _Incomplete() from None
            if not chunk:
                raise _Incomplete()
            return chunk

        if "chunked" in h.get("transfer-encoding", "").lower():
            body = b""
            while True:
                while b"\r\n" not in buf:
                    buf += more()
                size_line, _, buf = buf.partition(b"\r\n")
                size = int(size_line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while b"\r\n" not in buf:  # trailers end with an empty line
                        buf += more()
                    while not buf.startswith(b"\r\n"):
                        _, _, buf = buf.partition(b"\r\n")
                        while b"\r\n" not in buf:
                            buf += more()
                    return body, buf[2:]
                while len(buf) < size + 2:
                    buf += more()
                body += buf[:size]
                buf = buf[size + 2:]
        want = int(h.get("content-length", "0") or 0)
        while len(buf) < want:
            buf += more()
        return buf[:want], buf[want:]

    # one request ------------------------------------------------------------------------
    def _handle(self, conn, method, target, headers, buf, t_arrival):
        """Serves one request; returns the leftover bytes to keep the connection, or None."""
        path, _, query = target.partition("?")
        parts = urllib.parse.unquote(path).lstrip("/").split("/", 1)
        bucket, key = parts[0], (parts[1] if len(parts) > 1 else "")
        h = {k.lower(): v for k, v in headers}
        is_write = method in ("PUT", "POST", "DELETE")
        event = None
        if is_write:
            op = classify(method, key, query)
            stamp = h.get("x-amz-meta-fencing-token")
            event = {
                "seq": None, "method": method, "bucket": bucket, "key": key, "query": query,
                "op": op, "chaos_id": h.get("x-chaos-id") or h.get("x-amz-meta-chaos-id"),
                "stamp": int(stamp) if stamp and stamp.isdigit() else None,
                "keys": [key] if op in ("put", "delete") else [], "committed_keys": [],
                "status": None, "outcome": "truncated", "t_arrival": t_arrival, "t_body": None,
                "t_fwd": None, "t_done": None, "hold": 0.0, "client_gone": False, "late": False,
                "headers": {k: v for k, v in h.items() if k != "authorization"},
            }
            with self.log_lock:
                self.events.append(event)
        if h.get("expect", "").lower() == "100-continue":
            try:
                conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            except OSError:
                return None
        try:
            body, rest = self._read_body(conn, headers, buf)
        except _Incomplete:
            return None  # a truncated request is never forwarded
        if event is None:
            status, reason, resp_headers, data = self._forward(method, target, headers, body)
            return self._respond(conn, method, status, reason, resp_headers, data, h, rest)

        event["t_body"] = time.monotonic()
        if event["op"] == "delete_objects":
            event["keys"] = _s3_keys(body, "Object")
        with self.rng_lock:
            held = bucket == self.bucket and self.rng.random() < self.hold_fraction
            hold = self.rng.uniform(*self.hold_range) if held else 0.0
        if hold:
            event["hold"] = hold
            time.sleep(hold)  # whether or not fencegate is still there
        with self.commit_lock:
            event["client_gone"] = _peer_closed(conn)
            budget = self.commit_within
            if budget is not None and time.monotonic() - event["t_body"] > budget - MOTO_MARGIN_S:
                event["outcome"], event["status"] = "expired", 503
                resp_headers = [("Content-Type", "application/xml")]
                return self._respond(conn, method, 503, "Slow Down", resp_headers, EXPIRED_BODY, h, rest)
            with self.log_lock:
                self.seq += 1
                event["seq"] = self.seq
            event["t_fwd"] = time.monotonic()
            status, reason, resp_headers, data = self._forward(method, target, headers, body)
            event["t_done"] = time.monotonic()
        event["late"] = budget is not None and event["t_done"] - event["t_body"] > budget
        event["status"] = status
        if status is None:
            event["outcome"] = "unknown"
        elif 200 <= status < 300:
            event["outcome"] = "committed"
            if event["op"] == "delete_objects":
                event["committed_keys"] = _s3_keys(data, "Deleted")
            else:
                event["committed_keys"] = [key] if event["op"] != "other" else []
        else:
            event["outcome"] = "refused"
        return self._respond(conn, method, status, reason, resp_headers, data, h, rest)

    def _forward(self, method, target, headers, body):
        """One request to moto on a fresh connection: (status, reason, headers, body)."""
        c = http.client.HTTPConnection(*self.moto, timeout=MOTO_TIMEOUT_S)
        try:
            c.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
            for k, v in headers:
                if k.lower() not in HOP_BY_HOP:
                    c.putheader(k, v)
            if body or method in ("PUT", "POST"):
                c.putheader("Content-Length", str(len(body)))
            c.putheader("Connection", "close")
            c.endheaders(body if body else None)
            resp = c.getresponse()
            data = resp.read()
            return resp.status, resp.reason, resp.getheaders(), data
        except (OSError, http.client.HTTPException):
            return None, "Bad Gateway", [], b""
        finally:
            c.close()

    @staticmethod
    def _respond(conn, method, status, reason, resp_headers, data, req_headers, rest):
        if status is None:
            status, reason, resp_headers, data = 502, "Bad Gateway", [], b""
        lines = [f"HTTP/1.1 {status} {reason}"]
        for k, v in resp_headers:
            if k.lower() not in HOP_BY_HOP:
                lines.append(f"{k}: {v}")
        if method == "HEAD":
            length = next((v for k, v in resp_headers if k.lower() == "content-length"), "0")
            lines.append(f"Content-Length: {length}")
            data = b""
        elif status not in (204, 304):
            lines.append(f"Content-Length: {len(data)}")
        close = req_headers.get("connection", "").lower() == "close"
        if close:
            lines.append("Connection: close")
        try:
            conn.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + data)
        except OSError:
            return None  # fencegate hung up (it timed out or its client went away)
        return None if close else rest


def _peer_closed(conn: socket.socket) -> bool:
    """True if the client has closed its side (EOF or reset waiting on the socket)."""
    try:
        readable, _, _ = select.select([conn], [], [], 0)
        if not readable:
            return False
        conn.setblocking(False)
        try:
            return conn.recv(1, socket.MSG_PEEK) == b""
        finally:
            conn.setblocking(True)
    except (OSError, ValueError):
        return True
