"""An etcd cluster for the chaos test, on 127.0.0.1, stoppable from a finalizer. (moto_server
and redis-server are fencegate_testlib's MotoServer and RedisServer.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import requests

from fencegate_testlib import (
    PortTaken,
    ServerExited,
    free_ports,
    log_size,
    raise_if_exited,
    retry_if_port_taken,
    stop_process,
    wait_until,
)


class EtcdMember:
    """One member's identity: its ports (picked when the cluster first starts) and its data
    directory outlive its processes."""

    def __init__(self, name: str, data_dir: Path, log_path: Path):
        self.name = name
        self.client_port = 0
        self.peer_port = 0
        self.data_dir = data_dir
        self.log_path = log_path
        self.log_from = 0  # where the running process's part of the log begins
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
        self.initial_cluster = ""  # every member's peer URL: set by the first start
        self.token = ""
        self.lock = threading.Lock()
        self.closed = False

    @property
    def endpoints(self) -> list:
        return [m.client_url for m in self.members]

    def start(self):
        exe = shutil.which("etcd")
        if exe is None:
            raise AssertionError("etcd is not installed (apt-get install etcd-server)")
        retry_if_port_taken(self._start_new_cluster)
        for i, m in enumerate(self.members):
            status = wait_until(lambda i=i: self.status(i), timeout=20,
                                what=f"etcd {m.name} to answer")
            m.member_id = status["header"]["member_id"]
        return self

    def _start_new_cluster(self):
        """Every member on new ports (the cluster's membership names them all), on empty data
        dirs; returns once a leader is elected. PortTaken (the members ended, their data gone)
        if a member could not bind its port."""
        ports = free_ports(2 * len(self.members))
        for m, client, peer in zip(self.members, ports[0::2], ports[1::2]):
            m.client_port, m.peer_port = client, peer
        self.initial_cluster = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        self.token = f"chaos-{os.getpid()}-{self.members[0].peer_port}"
        try:
            for i in range(len(self.members)):
                self._spawn(i, "new")
            wait_until(self._leader_elected, timeout=30, what="the etcd cluster to elect a leader")
        except PortTaken:
            for i, m in enumerate(self.members):
                self.kill9(i)
                shutil.rmtree(m.data_dir, ignore_errors=True)
            raise
        except ServerExited:
            raise
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n" + self.log_tail()) from None

    def _leader_elected(self) -> bool:
        """Whether a member leads; ServerExited (the wait ends) if a member has exited."""
        for m in self.members:
            raise_if_exited(m.proc, f"etcd {m.name}", m.log_path, m.log_from)
        return self.leader() is not None

    def _spawn(self, i: int, state: str):
        m = self.members[i]
        with self.lock:
            if self.closed:
                raise AssertionError(f"etcd {m.name} not started: the cluster was stopped")
            m.starts += 1
            m.log_from = log_size(m.log_path)
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
        """The leader's index once one is known, or None after `timeout` seconds."""

        def known():
            i = self.leader()
            return None if i is None else (i,)  # a tuple: member 0 leading counts too

        try:
            return wait_until(known, timeout, what="an etcd leader")[0]
        except AssertionError:
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
        m = self.members[i]

        def answers():
            raise_if_exited(m.proc, f"etcd {m.name}", m.log_path, m.log_from)
            return self.status(i) is not None

        try:
            wait_until(answers, timeout, what=f"etcd {m.name} to answer after its restart")
        except AssertionError as exc:  # ServerExited too: the same ports are the only ones it may use
            raise AssertionError(f"{exc}\n" + self.log_tail()) from None

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
                stop_process(m.proc)
            except Exception:  # noqa: BLE001 - teardown must try every member
                if m.proc is not None and m.proc.poll() is None:
                    m.proc.kill()
        shutil.rmtree(self.data_root, ignore_errors=True)
