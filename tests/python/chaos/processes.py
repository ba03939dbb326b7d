"""moto_server and redis-server for the chaos test, on 127.0.0.1, each stoppable from a finalizer."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from fencegate_testlib import free_port, http_get_ok, wait_until

MOTO_ACCESS_KEY = "testing"
MOTO_SECRET_KEY = "testing"


def _stop(proc: subprocess.Popen | None):
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


class Moto:
    """A moto_server of its own (the commit log must hold only this test's writes)."""

    def __init__(self, workdir: Path):
        self.log_path = workdir / "moto.log"
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self):
        exe = shutil.which("moto_server")
        cmd = [exe] if exe else [sys.executable, "-m", "moto.server"]
        for _attempt in range(3):  # a free port can be taken between probe and bind
            port = free_port()
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(cmd + ["-H", "127.0.0.1", "-p", str(port)],
                                             stdin=subprocess.DEVNULL, stdout=log,
                                             stderr=subprocess.STDOUT)
            self.url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and self.proc.poll() is None:
                if http_get_ok(self.url + "/moto-api/"):
                    return self
                time.sleep(0.2)
            _stop(self.proc)
        raise AssertionError("moto_server did not start:\n" + self.log_path.read_text(errors="replace")[-3000:])

    def stop(self):
        _stop(self.proc)


class Redis:
    """A redis-server with an fsync-always append-only file, so a kill -9 loses no
    acknowledged fence; `restart()` comes back on the same port with the same data."""

    def __init__(self, workdir: Path):
        self.dir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self):
        exe = shutil.which("redis-server")
        if exe is None:
            raise AssertionError("redis-server is not installed (scripts/test installs it)")
        with open(self.dir / "redis.log", "ab") as log:
            self.proc = subprocess.Popen(
                [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                 "--save", "", "--appendonly", "yes", "--appendfsync", "always",
                 "--daemonize", "no"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        wait_until(lambda: self.command(b"PING").startswith(b"+PONG"), timeout=20,
                   what="redis-server to answer PING")
        return self

    def command(self, line: bytes) -> bytes:
        """One inline command; its raw reply (b"" if Redis is not reachable)."""
        if self.proc is None or self.proc.poll() is not None:
            raise AssertionError("redis-server exited:\n" + (self.dir / "redis.log").read_text()[-2000:])
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
                s.sendall(line + b"\r\n")
                return s.recv(4096)
        except OSError:
            return b""

    def kill9(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self):
        _stop(self.proc)
