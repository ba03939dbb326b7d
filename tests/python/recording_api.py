"""A stand-in for a third-party HTTP API behind an `idempotency-key` (or other) route: it records
what reaches it, answers as scripted, and holds a request on demand."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class ApiHold:
    def __init__(self):
        self.arrived = threading.Event()
        self.released = threading.Event()


class RecordingApi:
    """A tiny HTTP/1.1 API on 127.0.0.1: records every request that arrived whole, answers 201
    with a JSON body, or what `script(path, ...)` queued for that path; `hold(path)` holds the
    next request on it until released (at most 60 s). Given `sock` (from `reserve_port()`), it
    listens on that socket's port."""

    def __init__(self, sock: socket.socket | None = None):
        self.lock = threading.Lock()
        self.received: list = []
        self.scripts: dict = {}
        self.holds: dict = {}
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_args):
                pass

            def _serve(self):
                length = self.headers.get("Content-Length")
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                    body = b""
                    while True:
                        line = self.rfile.readline(1024)
                        if not line.endswith(b"\n"):
                            return  # the stream ended before its last chunk: not a request
                        size = int(line.split(b";")[0].strip(), 16)
                        if size == 0:
                            while True:  # trailers, up to the empty line
                                line = self.rfile.readline(8192)
                                if not line.endswith(b"\n"):
                                    return
                                if line in (b"\r\n", b"\n"):
                                    break
                            break
                        data = self.rfile.read(size)
                        if len(data) < size or not self.rfile.readline(8).endswith(b"\n"):
                            return
                        body += data
                else:
                    body = self.rfile.read(int(length)) if length else b""
                    if length and len(body) < int(length):
                        return  # never arrived whole: not a request
                entry = {"method": self.command, "path": self.path, "body": body,
                         "headers": {k.lower(): v for k, v in self.headers.items()}}
                with api.lock:
                    api.received.append(entry)
                    hold = api.holds.pop(self.path, None)
                    queued = api.scripts.get(self.path)
                    answer = queued.pop(0) if queued else None
                    n = len(api.received)
                if hold is not None:
                    hold.arrived.set()
                    hold.released.wait(60)
                status, headers, data = answer or (201, {"Content-Type": "application/json"},
                                                   json.dumps({"executed": n}).encode())
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_POST = do_PUT = do_DELETE = do_PATCH = do_GET = _serve

        if sock is None:
            self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        else:
            self.server = ThreadingHTTPServer(sock.getsockname(), Handler, bind_and_activate=False)
            self.server.socket.close()
            self.server.socket = sock
            self.server.server_activate()  # listen() on the reserved port
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, name="recording-api", daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def script(self, path: str, *answers):
        with self.lock:
            self.scripts.setdefault(path, []).extend(answers)

    def hold(self, path: str) -> ApiHold:
        h = ApiHold()
        with self.lock:
            self.holds[path] = h
        return h

    def requests(self, path: str | None = None) -> list:
        with self.lock:
            return [dict(e) for e in self.received if path is None or e["path"] == path]

    def stop(self):
        with self.lock:
            holds = list(self.holds.values())
            self.holds.clear()
        for h in holds:
            h.released.set()
        self.server.shutdown()
        self.server.server_close()
