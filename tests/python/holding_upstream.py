"""A holding S3 upstream: a threaded HTTP/1.1 proxy (keep-alive) in front of a real moto_server.

It forwards every request to moto unchanged (the Host header too: fencegate signed for this
proxy's address, and moto does not verify signatures), except for connection management and
body framing (a chunked body is forwarded with its Content-Length). A test can make it hold
one request:

    up = HoldingUpstream(moto_url).start()
    hold = up.hold_next("PUT", "jobs/a")      # the next PUT whose path contains "jobs/a"
    ...                                        # fencegate forwards it
    assert hold.wait_arrived(10)               # its whole body is here; it is held
    ...
    hold.release()                             # now it goes to moto

A held request is forwarded after its release even if its client (fencegate) hung up
meanwhile, exactly like S3 committing a request whose client went away. A request whose body
never arrived whole is not forwarded (S3 commits nothing for a truncated body).

Writes (every method but GET, HEAD and OPTIONS, so also a non-standard `put`) are forwarded to
moto under ONE lock, so the order of `writes()` (the requests moto answered, in forwarding order)
is the order in which moto committed them. Holding happens before that lock is taken: a held
write does not block the others. `requests()` lists every request that arrived whole (reads
too), in arrival order.

Everything listens on and talks to 127.0.0.1; every wait is bounded.
"""

from __future__ import annotations

import http.client
import select
import socket
import threading
import time
import urllib.parse

HOP_BY_HOP = {
    "connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
    "upgrade", "expect", "content-length",
}
READ_METHODS = {"GET", "HEAD", "OPTIONS"}
HEAD_BYTES_MAX = 64 * 1024
BODY_READ_TIMEOUT_S = 60.0  # a client streaming a body this slowly is treated as gone
IDLE_TIMEOUT_S = 120.0  # a pooled connection with no request for this long is closed
MOTO_TIMEOUT_S = 30.0
HOLD_MAX_S = 120.0  # a hold nobody releases ends by itself (the test has failed by then)


class _Incomplete(Exception):
    """The client closed or stalled before the request was whole."""


class Hold:
    """One registered hold: the next request with `method` whose path contains `key`
    (and whose query contains `query`, if given) is held after its whole body arrived."""

    def __init__(self, method: str | None, key: str, query: str | None):
        self.method = method
        self.key = key
        self.query = query
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


class HoldingUpstream:
    """The proxy. `start()` listens on a free port of 127.0.0.1; `url` is its endpoint."""

    def __init__(self, moto_url: str):
        parsed = urllib.parse.urlsplit(moto_url)
        self.moto = (parsed.hostname, parsed.port)
        self.commit_lock = threading.Lock()  # the ONE lock: forwarding writes to moto
        self.lock = threading.Lock()  # the log and the rules
        self.idle = threading.Condition(self.lock)
        self._requests: list = []
        self._writes: list = []
        self._holds: list = []
        self.pending = 0  # requests that arrived whole and are not answered yet
        self.sock: socket.socket | None = None
        self.conns: set = set()
        self.stopping = False
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # rules and log ----------------------------------------------------------------------
    def hold_next(self, method: str | None, key: str, query: str | None = None) -> Hold:
        """Hold the next request matching (method, path substring[, query substring])."""
        hold = Hold(method, key, query)
        with self.lock:
            self._holds.append(hold)
        return hold

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

    def wait_idle(self, timeout: float) -> bool:
        """Waits until every request that arrived whole was answered (held ones included)."""
        deadline = time.monotonic() + timeout
        with self.idle:
            while self.pending > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.idle.wait(left)
        return True

    # lifecycle --------------------------------------------------------------------------
    def start(self):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept_loop, name="holding-accept", daemon=True).start()
        return self

    def stop(self):
        self.stopping = True
        self.release_all()
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
            threading.Thread(target=self._serve, args=(conn,), name="holding-conn", daemon=True).start()

    def _serve(self, conn: socket.socket):
        buf = b""
        try:
            while not self.stopping:
                try:
                    head, buf = _read_head(conn, buf)
                except _Incomplete:
                    return
                method, target, headers = _parse_head(head)
                keep = self._handle(conn, method, target, headers, buf)
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

    # one request ------------------------------------------------------------------------
    def _handle(self, conn, method, target, headers, buf):
        """Serves one request; returns the leftover bytes to keep the connection, or None."""
        path, _, query = target.partition("?")
        h = {k.lower(): v for k, v in headers}
        if h.get("expect", "").lower() == "100-continue":
            try:
                conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            except OSError:
                return None
        try:
            body, rest = _read_body(conn, h, buf)
        except _Incomplete:
            return None  # a truncated request is never forwarded
        entry = {
            "seq": None, "method": method, "path": urllib.parse.unquote(path), "query": query,
            "token": h.get("x-amz-meta-fencing-token"), "status": None, "held": False,
            "client_gone": False, "t_arrived": time.monotonic(), "t_forwarded": None,
            "t_answered": None, "headers": {k: v for k, v in h.items() if k != "authorization"},
            "body_bytes": len(body),
        }
        with self.lock:
            self._requests.append(entry)
            self.pending += 1
            hold = next((x for x in self._holds if x.matches(method, entry["path"], query)), None)
            if hold is not None:
                self._holds.remove(hold)
        try:
            if hold is not None:
                entry["held"] = True
                hold.entry = entry
                hold.arrived.set()
                deadline = time.monotonic() + HOLD_MAX_S
                while not hold.released.wait(0.05) and time.monotonic() < deadline:
                    if not entry["client_gone"] and _peer_closed(conn):
                        entry["client_gone"] = True
                # Forwarded whether or not fencegate is still there.
            if method.upper() in READ_METHODS and method.isupper():
                entry["t_forwarded"] = time.monotonic()
                status, reason, resp_headers, data = self._forward(method, target, headers, body)
                entry["t_answered"] = time.monotonic()
                entry["status"] = status
            else:
                with self.commit_lock:
                    entry["t_forwarded"] = time.monotonic()
                    status, reason, resp_headers, data = self._forward(method, target, headers, body)
                    entry["t_answered"] = time.monotonic()
                    entry["status"] = status
                    with self.lock:
                        entry["seq"] = len(self._writes) + 1
                        self._writes.append(entry)
        finally:
            with self.idle:
                self.pending -= 1
                self.idle.notify_all()
        return _respond(conn, method, status, reason, resp_headers, data, h, rest)

    def _forward(self, method, target, headers, body):
        """One request to moto on a fresh connection: (status, reason, headers, body)."""
        c = http.client.HTTPConnection(*self.moto, timeout=MOTO_TIMEOUT_S)
        try:
            c.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
            for k, v in headers:
                if k.lower() not in HOP_BY_HOP:
                    c.putheader(k, v)
            if body or method.upper() in ("PUT", "POST"):
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


def _read_head(conn, buf: bytes):
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


def _parse_head(head: bytes):
    lines = head.decode("latin-1").split("\r\n")
    method, target, _version = lines[0].split(" ", 2)
    headers = []
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers.append((name.strip(), value.strip()))
    return method, target, headers


def _read_body(conn, h: dict, buf: bytes):
    """Returns (body, leftover bytes). Raises _Incomplete if the body never arrives whole."""
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
        except BlockingIOError:
            return False
        finally:
            conn.setblocking(True)
    except (OSError, ValueError):
        return True
