"""moto_server, redis-server and an etcd cluster for the chaos test, on 127.0.0.1, each
stoppable from a finalizer."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

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


class EtcdMember:
    """One member's fixed identity (its ports and data directory outlive its processes)."""

    def __init__(self, name: str, data_dir: Path, log_path: Path):
        self.name = name
        self.client_port = free_port()
        self.peer_port = free_port()
        self.data_dir = data_dir
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.member_id = ""  # etcd's id of the member (decimal, as the JSON gateway writes it)
        self.starts = 0

    @property
    def client_url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Etcd:
    """A cluster of etcd members on loopback (Debian's `etcd`), data on a RAM disk when there is
    one. `kill9(i)` and `restart(i)` (same ports and data dir, `--initial-cluster-state existing`)
    are the nemesis's; `leader()` asks the members through etcd's JSON gateway
    (`POST /v3/maintenance/status`), so no `etcdctl` is needed. After `stop()` nothing starts a
    member again (a nemesis thread still running cannot leave an etcd behind)."""

    def __init__(self, workdir: Path, members: int = 3):
        self.dir = workdir
        shm = Path("/dev/shm")
        self.data_root = Path(tempfile.mkdtemp(prefix="chaos-etcd-",
                                               dir=shm if shm.is_dir() else None))
        self.members = [EtcdMember(f"m{i}", self.data_root / f"m{i}", workdir / f"etcd-m{i}.log")
                        for i in range(members)]
        self.initial_cluster = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        self.token = f"chaos-{os.getpid()}-{self.members[0].peer_port}"
        self.lock = threading.Lock()
        self.closed = False

    @property
    def endpoints(self) -> list:
        return [m.client_url for m in self.members]

    def start(self):
        exe = shutil.which("etcd")
        if exe is None:
            raise AssertionError("etcd is not installed (apt-get install etcd-server)")
        for i in range(len(self.members)):
            self._spawn(i, "new")
        leader = self.wait_for_leader(timeout=30)
        if leader is None:
            raise AssertionError("the etcd cluster elected no leader within 30 s\n"
                                 + self.log_tail())
        for i, m in enumerate(self.members):
            status = wait_until(lambda i=i: self.status(i), timeout=20,
                                what=f"etcd {m.name} to answer")
            m.member_id = status["header"]["member_id"]
        return self

    def _spawn(self, i: int, state: str):
        m = self.members[i]
        with self.lock:
            if self.closed:
                raise AssertionError(f"etcd {m.name} not started: the cluster was stopped")
            m.starts += 1
            with open(m.log_path, "ab") as log:
                log.write(f"--- start {m.starts} ({state}) ---\n".encode())
                log.flush()
                m.proc = subprocess.Popen(
                    [shutil.which("etcd") or "etcd", "--name", m.name,
                     "--data-dir", str(m.data_dir),
                     "--listen-client-urls", m.client_url, "--advertise-client-urls", m.client_url,
                     "--listen-peer-urls", m.peer_url, "--initial-advertise-peer-urls", m.peer_url,
                     "--initial-cluster", self.initial_cluster, "--initial-cluster-state", state,
                     "--initial-cluster-token", self.token,
                     "--heartbeat-interval", "50", "--election-timeout", "500",
                     "--logger", "zap", "--log-level", "error"],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)

    def status(self, i: int, timeout: float = 0.5) -> dict | None:
        """Member i's own status (`header.member_id`, `leader`), or None if it does not answer."""
        m = self.members[i]
        if not m.running():
            return None
        try:
            resp = requests.post(m.client_url + "/v3/maintenance/status", data=b"{}",
                                     timeout=timeout)
            doc = resp.json() if resp.status_code == 200 else None
        except (requests.RequestException, ValueError):
            return None
        if not isinstance(doc, dict) or "member_id" not in doc.get("header", {}):
            return None
        return doc

    def leader(self) -> int | None:
        """The index of the member that says it leads now, or None (an election, or no quorum)."""
        for i in range(len(self.members)):
            doc = self.status(i)
            if doc is not None and doc.get("leader", "0") not in ("", "0") \
                    and doc["leader"] == doc["header"]["member_id"]:
                return i
        return None

    def wait_for_leader(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            i = self.leader()
            if i is not None:
                return i
            time.sleep(0.05)
        return None

    def kill9(self, i: int):
        m = self.members[i]
        if m.running():
            m.proc.kill()
            m.proc.wait(timeout=10)

    def restart(self, i: int, timeout: float = 20):
        """Starts member i again on its data (`existing`); returns once it answers status."""
        self.kill9(i)
        self._spawn(i, "existing")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.status(i) is not None:
                return
            if not self.members[i].running():
                break
            time.sleep(0.05)
        raise AssertionError(f"etcd {self.members[i].name} did not answer within {timeout}s of its "
                             f"restart\n" + self.log_tail())

    def heal(self):
        """Every member running (called by the nemesis at the end, whatever happened)."""
        for i, m in enumerate(self.members):
            if not self.closed and not m.running():
                self.restart(i)

    def log_tail(self, n: int = 20) -> str:
        out = []
        for m in self.members:
            try:
                lines = m.log_path.read_text(errors="replace").splitlines()[-n:]
            except OSError:
                lines = []
            out.append(f"--- {m.log_path.name} (last {n} lines) ---")
            out.extend(lines)
        return "\n".join(out)

    def stop(self):
        """Stops every member and removes the data (safe to call twice, and after a failure)."""
        with self.lock:
            self.closed = True
        for m in self.members:
            try:
                _stop(m.proc)
            except Exception:  # noqa: BLE001 - teardown must try every member
                if m.proc is not None and m.proc.poll() is None:
                    m.proc.kill()
        shutil.rmtree(self.data_root, ignore_errors=True)
