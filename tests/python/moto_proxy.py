"""An HTTP/1.1 proxy (keep-alive, threaded) in front of a real moto_server that has every request
whole before it forwards it: what the tests' S3 upstreams share. `holding_upstream.HoldingUpstream`
holds chosen requests until the test releases them; `chaos/upstream.ChaosUpstream` holds random
writes for a random time and logs the order in which moto committed them.

A request is forwarded unchanged (the Host header too: fencegate signed for the proxy's address,
and moto does not verify signatures) except for connection management and body framing (a
chunked body is forwarded with its Content-Length). A request whose body never arrived whole is
not forwarded (S3 commits nothing for a truncated body). A subclass forwards its writes under
ONE lock (`commit_lock`), so the order in which it forwards them is the order moto commits them.

Everything listens on and talks to 127.0.0.1; every wait is bounded.
"""

from __future__ import annotations

import http.client
import select
import socket
import threading
import time
import urllib.parse
from contextlib import contextmanager
from dataclasses import dataclass, field

HOP_BY_HOP = {
    "connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
    "upgrade", "expect", "content-length",
}
HEAD_BYTES_MAX = 64 * 1024
BODY_READ_TIMEOUT_S = 60.0  # a client streaming a body this slowly is treated as gone
IDLE_TIMEOUT_S = 120.0  # a pooled connection with no request for this long is closed
MOTO_TIMEOUT_S = 30.0


class Incomplete(Exception):
    """The client closed or stalled before the request was whole."""


@dataclass
class Request:
    """One request as it arrived: its head, and its body once `MotoProxy.read_body` read it."""

    method: str
    target: str  # as sent: the path (still quoted) and the query
    headers: list  # (name, value) pairs, as sent
    t_arrival: float  # when its head was whole
    body: bytes = b""
    h: dict = field(init=False)  # lower-case names

    def __post_init__(self):
        self.h = {k.lower(): v for k, v in self.headers}

    @property
    def path(self) -> str:
        """The decoded path, without the query."""
        return urllib.parse.unquote(self.target.partition("?")[0])

    @property
    def query(self) -> str:
        return self.target.partition("?")[2]

    def logged_headers(self) -> dict:
        """The headers as a log keeps them: lower-case names, no Authorization."""
        return {k: v for k, v in self.h.items() if k != "authorization"}


@dataclass
class Answer:
    """What moto (or the proxy itself) answers; status None: moto could not be reached."""

    status: int | None
    reason: str
    headers: list
    body: bytes


BAD_GATEWAY = Answer(502, "Bad Gateway", [], b"")


class MotoProxy:
    """The proxy's plumbing. `start()` listens on a free port of 127.0.0.1 (or on the one
    `reserve()` took); `url` is its endpoint. A subclass answers each request in
    `handle(conn, request, buf)`, with `read_body`, `forward` and `respond`."""

    def __init__(self, moto_url: str, backlog: int = 128):
        parsed = urllib.parse.urlsplit(moto_url)
        self.moto = (parsed.hostname, parsed.port)
        self.backlog = backlog
        self.commit_lock = threading.Lock()  # the ONE lock: forwarding writes to moto
        self.lock = threading.Lock()  # the subclass's log, and the open connections
        self.idle = threading.Condition(self.lock)
        self.pending = 0  # requests counted by `answering()` and not answered yet
        self.sock: socket.socket | None = None
        self.conns: set = set()
        self.stopping = False
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # lifecycle --------------------------------------------------------------------------
    def reserve(self):
        """Takes the port now without listening: until `start()`, connections to `url` are
        refused (an upstream that is down), and no other process can take the port."""
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        return self

    def start(self):
        if self.sock is None:
            self.reserve()
        self.sock.listen(self.backlog)
        name = type(self).__name__
        threading.Thread(target=self._accept_loop, name=f"{name}-accept", daemon=True).start()
        return self

    def stop(self):
        self.stopping = True
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
        with self.lock:
            conns = list(self.conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    @contextmanager
    def answering(self):
        """Counts a request as pending (for `wait_idle`) while the block runs."""
        with self.lock:
            self.pending += 1
        try:
            yield
        finally:
            with self.idle:
                self.pending -= 1
                self.idle.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Waits until every pending request was answered (held ones included)."""
        deadline = time.monotonic() + timeout
        with self.idle:
            while self.pending > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.idle.wait(left)
        return True

    # connections ------------------------------------------------------------------------
    def _accept_loop(self):
        while not self.stopping:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self.lock:
                self.conns.add(conn)
            name = f"{type(self).__name__}-conn"
            threading.Thread(target=self._serve, args=(conn,), name=name, daemon=True).start()

    def _serve(self, conn: socket.socket):
        buf = b""
        try:
            while not self.stopping:
                try:
                    head, buf = _read_head(conn, buf)
                except Incomplete:
                    return
                keep = self.handle(conn, _parse_head(head, time.monotonic()), buf)
                if keep is None:
                    return
                buf = keep
        finally:
            with self.lock:
                self.conns.discard(conn)
            try:
                conn.close()
            except OSError:
                pass

    # one request: the subclass's ---------------------------------------------------------
    def handle(self, conn: socket.socket, req: Request, buf: bytes):
        """Serves one request; returns the leftover bytes to keep the connection, or None."""
        raise NotImplementedError

    @staticmethod
    def read_body(conn: socket.socket, req: Request, buf: bytes):
        """Answers `Expect: 100-continue`, then reads the body into `req.body`; returns the
        leftover bytes, or None if the body never arrived whole (or the client went away)."""
        if req.h.get("expect", "").lower() == "100-continue":
            try:
                conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            except OSError:
                return None
        try:
            req.body, rest = _read_body(conn, req.h, buf)
        except Incomplete:
            return None
        return rest

    def forward(self, req: Request) -> Answer:
        """One request to moto on a fresh connection."""
        c = http.client.HTTPConnection(*self.moto, timeout=MOTO_TIMEOUT_S)
        try:
            c.putrequest(req.method, req.target, skip_host=True, skip_accept_encoding=True)
            for k, v in req.headers:
                if k.lower() not in HOP_BY_HOP:
                    c.putheader(k, v)
            if req.body or req.method.upper() in ("PUT", "POST"):
                c.putheader("Content-Length", str(len(req.body)))
            c.putheader("Connection", "close")
            c.endheaders(req.body if req.body else None)
            resp = c.getresponse()
            data = resp.read()
            return Answer(resp.status, resp.reason, resp.getheaders(), data)
        except (OSError, http.client.HTTPException):
            return Answer(None, "Bad Gateway", [], b"")
        finally:
            c.close()

    @staticmethod
    def respond(conn: socket.socket, req: Request, answer: Answer, rest: bytes):
        """Sends `answer` (502 if moto could not be reached); returns `rest` to keep the
        connection, or None."""
        if answer.status is None:
            answer = BAD_GATEWAY
        data = answer.body
        lines = [f"HTTP/1.1 {answer.status} {answer.reason}"]
        for k, v in answer.headers:
            if k.lower() not in HOP_BY_HOP:
                lines.append(f"{k}: {v}")
        if req.method == "HEAD":
            length = next((v for k, v in answer.headers if k.lower() == "content-length"), "0")
            lines.append(f"Content-Length: {length}")
            data = b""
        elif answer.status not in (204, 304):
            lines.append(f"Content-Length: {len(data)}")
        close = req.h.get("connection", "").lower() == "close"
        if close:
            lines.append("Connection: close")
        try:
            conn.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + data)
        except OSError:
            return None  # fencegate hung up (it timed out or its client went away)
        return None if close else rest


def _recv(conn: socket.socket) -> bytes:
    """The client's next bytes; Incomplete if it closed, reset or stalled past the timeout."""
    try:
        chunk = conn.recv(65536)
    except OSError:
        raise Incomplete() from None
    if not chunk:
        raise Incomplete()
    return chunk


def _read_head(conn: socket.socket, buf: bytes):
    conn.settimeout(IDLE_TIMEOUT_S)
    while b"\r\n\r\n" not in buf:
        if len(buf) > HEAD_BYTES_MAX:
            raise Incomplete()
        buf += _recv(conn)
    head, _, rest = buf.partition(b"\r\n\r\n")
    return head, rest


def _parse_head(head: bytes, t_arrival: float) -> Request:
    lines = head.decode("latin-1").split("\r\n")
    method, target, _version = lines[0].split(" ", 2)
    headers = []
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers.append((name.strip(), value.strip()))
    return Request(method, target, headers, t_arrival)


def _read_body(conn: socket.socket, h: dict, buf: bytes):
    """Returns (body, leftover bytes). Raises Incomplete if the body never arrives whole."""
    conn.settimeout(BODY_READ_TIMEOUT_S)

    def more():
        return _recv(conn)

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


def peer_closed(conn: socket.socket) -> bool:
    """True if the client has closed its side (EOF or reset waiting on the socket)."""
    try:
        readable, _, _ = select.select([conn], [], [], 0)
        if not readable:
            return False
        conn.setblocking(False)
        try:
            return conn.recv(1, socket.MSG_PEEK) == b""
        except BlockingIOError:
            return False
        finally:
            conn.setblocking(True)
    except (OSError, ValueError):
        return True
