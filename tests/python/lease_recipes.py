"""The lease recipes of docs/leases.md ("Tokens issued elsewhere") as workers, and the servers they
take their leases from, for `test_lease_recipes.py` and `test_docs_examples.py`.

A worker is the page's code as it is (the shell recipes: a service's block, then the loop's), with
only the docs' fencegate addresses replaced by a test instance's. The servers are Debian's, on
127.0.0.1, their data under a temporary directory: `redis-server` (fencegate_testlib's
RedisServer), PostgreSQL (`initdb` and `pg_ctl` from /usr/lib/postgresql/*/bin, as the `postgres`
user when the tests run as root), a three-member etcd cluster (chaos/processes.py's Etcd) and a
standalone ZooKeeper (`java ... ZooKeeperServerMain` on a generated zoo.cfg).
"""

from __future__ import annotations

import glob
import math
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from chaos.processes import Etcd
from docs_examples import REPO_ROOT, block, localize
from fencegate_testlib import (
    PortTaken,
    RedisServer,
    ServerExited,
    free_port,
    log_since,
    log_size,
    retry_if_port_taken,
    stop_process,
    wait_for_server,
    wait_until,
)

DOC = "docs/leases.md"
SERVICES = ("redis", "postgres", "etcd", "zookeeper")
SHELL_LOOP = "lease-worker-loop"
INTEROP = REPO_ROOT / "client" / "examples" / "interop"
# Each service's example name in the page, and its script in client/examples/interop/.
EXAMPLE = {s: f"{s}-lease" for s in SERVICES}
SCRIPT = {"redis": "redis-lease.sh", "postgres": "postgres-lease.sh", "etcd": "etcd-lease.sh",
          "zookeeper": "zookeeper-lease.py"}
WORKER_EXIT_TIMEOUT_S = 60  # one worker, start to end


# --------------------------------------------------------------------------------------------
# the recipes
# --------------------------------------------------------------------------------------------


def recipe_code(service: str) -> str:
    """The worker as the page has it: Python for ZooKeeper, else the service's shell functions
    followed by the shared loop."""
    code = block(DOC, EXAMPLE[service]).code
    if service == "zookeeper":
        return code
    return code + "\n" + block(DOC, SHELL_LOOP).code


def interop_body(path: Path) -> str:
    """An interop script without its header (the `#!` line and the comment lines after it, up to
    the first blank line)."""
    text = path.read_text()
    head, sep, body = text.partition("\n\n")
    assert sep and head.startswith("#!"), f"{path}: expected a #! line and a comment, then a blank line"
    return body


def missing(service: str) -> str:
    """Why `service`'s recipe cannot run here ("" if it can)."""
    tools = {"redis": ["redis-server", "redis-cli", "curl", "jq"], "postgres": ["psql", "curl", "jq"],
             "etcd": ["etcd", "etcdctl", "curl", "jq"], "zookeeper": ["java"]}[service]
    absent = [t for t in tools if shutil.which(t) is None]
    if service == "postgres" and not pg_bin_dir():
        absent.append("initdb (/usr/lib/postgresql/*/bin)")
    if service == "zookeeper":
        if not Path(ZOOKEEPER_JAR).is_file():
            absent.append(ZOOKEEPER_JAR)
        try:
            import kazoo  # noqa: F401
        except ImportError:
            absent.append("kazoo (pip)")
    return f"{service}: missing {', '.join(absent)}" if absent else ""


def need(service: str):
    """Skips the test if `service`'s recipe cannot run here; under CI=true (scripts/test installs
    every server) fails it instead."""
    import pytest

    why = missing(service)
    if why:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{why}: scripts/test installs it under CI")
        pytest.skip(why)


# --------------------------------------------------------------------------------------------
# a worker process
# --------------------------------------------------------------------------------------------

# Put first in PATH of a worker that must stall: the first upload (`curl ... -T`) stops the
# worker's whole process group (its loop and its heartbeat) right before it is sent, as a GC
# pause or a suspended VM would, after every check the worker makes.
CURL_STALL = """#!/bin/sh
case " $* " in
  *" -T "*) if [ -e "$STALL_FLAG" ]; then rm -f "$STALL_FLAG"; kill -STOP 0; fi ;;
esac
exec {curl} "$@"
"""

# The same for the Python worker: its first PUT stops the process once signed, before it is sent.
PY_STALL = """import os, runpy, signal, sys
import botocore.endpoint

_send = botocore.endpoint.Endpoint._send


def _send_after_a_stall(self, request):
    if request.method == "PUT" and os.path.exists(os.environ["STALL_FLAG"]):
        os.remove(os.environ["STALL_FLAG"])
        os.kill(os.getpid(), signal.SIGSTOP)
    return _send(self, request)


botocore.endpoint.Endpoint._send = _send_after_a_stall
worker = sys.argv.pop(1)
runpy.run_path(worker, run_name="__main__")
"""


@dataclass
class Worker:
    """One recipe worker, in a process group of its own; its output (stdout and stderr) in a file."""

    name: str
    proc: subprocess.Popen
    out: Path

    @property
    def output(self) -> str:
        return self.out.read_text(errors="replace")

    def lines(self, prefix: str) -> list:
        return [line for line in self.output.splitlines() if line.startswith(prefix)]

    def token(self) -> int:
        """The token of its last `lease_acquired` line."""
        found = self.lines("lease_acquired ")
        assert found, f"worker {self.name} acquired nothing:\n{self.output}"
        return int(re.search(r"token=(\d+)", found[-1]).group(1))

    def heartbeats_ms(self) -> list:
        return [float(line.split("ms=")[1]) for line in self.lines("heartbeat_latency ")]

    def stopped(self) -> bool:
        """Whether the worker's process is stopped (SIGSTOP), as /proc says."""
        try:
            stat = Path(f"/proc/{self.proc.pid}/stat").read_text()
        except OSError:
            return False
        return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")

    def wait_stopped(self, timeout: float = 20):
        def stopped():
            if self.proc.poll() is not None:
                raise ServerExited(f"worker {self.name} exited {self.proc.returncode}:\n{self.output}")
            return self.stopped()

        wait_until(stopped, timeout, what=f"worker {self.name} to stall")

    def stop(self):
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def cont(self):
        os.killpg(self.proc.pid, signal.SIGCONT)

    def wait(self, timeout: float = WORKER_EXIT_TIMEOUT_S) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"worker {self.name} did not end within {timeout}s:\n{self.output}") from None

    def kill(self):
        """Ends the worker's process group (its own: started with a new session)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)


class Workers:
    """Starts workers of one recipe against one fencegate; `close()` kills what is still running."""

    def __init__(self, service: str, fg, directory: Path, env: dict):
        self.service = service
        self.dir = directory
        self.env = env
        self.started: list[Worker] = []
        code = localize(recipe_code(service), fg.s3_addr, fg.admin_addr)
        self.script = directory / ("worker.py" if service == "zookeeper" else "worker.sh")
        self.script.write_text(code)
        self.stall_dir = directory / "stall"
        self.stall_dir.mkdir(exist_ok=True)
        (self.stall_dir / "curl").write_text(CURL_STALL.format(curl=shutil.which("curl")))
        (self.stall_dir / "curl").chmod(0o755)
        (self.stall_dir / "stall.py").write_text(PY_STALL)

    def start(self, name: str, steps: list, stall: bool = False, **env) -> Worker:
        """A worker named `name` (its HOLDER) running `steps`; `stall`: it stops itself right
        before its first write is sent."""
        flag = self.dir / f"{name}.stall"
        if stall:
            flag.write_text("")
        full = {k: v for k, v in os.environ.items() if not k.startswith("FENCEGATE_")}
        full.update(HOLDER=name, STALL_FLAG=str(flag), **self.env)
        full.update({k: str(v) for k, v in env.items()})
        if self.service == "zookeeper":
            cmd = [sys.executable, *([str(self.stall_dir / "stall.py")] if stall else []), str(self.script)]
        else:
            cmd = ["sh", str(self.script)]
            if stall:
                full["PATH"] = f"{self.stall_dir}{os.pathsep}{full['PATH']}"
        out = self.dir / f"{name}.out"
        with open(out, "wb") as f:
            proc = subprocess.Popen(cmd + list(steps), cwd=self.dir, env=full, stdin=subprocess.DEVNULL,
                                    stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        worker = Worker(name, proc, out)
        self.started.append(worker)
        return worker

    def run(self, name: str, steps: list, timeout: float = WORKER_EXIT_TIMEOUT_S, **env) -> Worker:
        """A worker started and waited for (at most `timeout` seconds)."""
        worker = self.start(name, steps, **env)
        worker.wait(timeout)
        return worker

    def close(self):
        for w in self.started:
            w.kill()


# --------------------------------------------------------------------------------------------
# PostgreSQL
# --------------------------------------------------------------------------------------------


def pg_bin_dir() -> str:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    return str(Path(found[-1]).parent) if found else ""


class PostgresServer:
    """A PostgreSQL cluster of its own on 127.0.0.1 (no Unix socket), `trust` authentication.
    `crash()` is `pg_ctl stop -m immediate` (no shutdown checkpoint: recovery replays the WAL at
    the next start); `start()` again keeps the port and the data."""

    def __init__(self):
        # Under /tmp, not the test's own directory: the `postgres` user must reach it.
        self.data = Path(tempfile.mkdtemp(prefix="fg-pg-"))
        self.log_path = self.data.parent / (self.data.name + ".log")
        self.port = 0
        self.bin = pg_bin_dir()
        self.user = "postgres" if os.geteuid() == 0 else None
        if self.user:
            entry = pwd.getpwnam(self.user)
            os.chown(self.data, entry.pw_uid, entry.pw_gid)
            self.log_path.touch()
            os.chown(self.log_path, entry.pw_uid, entry.pw_gid)
        self.initialized = False

    @property
    def url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([f"{self.bin}/{args[0]}", *args[1:]], user=self.user, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL, cwd="/")

    def start(self):
        if not self.initialized:
            r = self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "--no-sync", "-E", "UTF8")
            assert r.returncode == 0, f"initdb failed:\n{r.stdout}\n{r.stderr}"
            self.initialized = True
        if self.port:
            self._launch(self.port)
        else:
            retry_if_port_taken(lambda: self._launch(free_port()))
        return self

    def _launch(self, port: int):
        self.port = port
        log_from = log_size(self.log_path)
        options = f"-c listen_addresses=127.0.0.1 -p {port} -c unix_socket_directories=''"
        r = self._run("pg_ctl", "start", "-w", "-t", "60", "-D", str(self.data), "-l", str(self.log_path),
                      "-o", options, timeout=90)
        if r.returncode != 0:
            text = log_since(self.log_path, log_from)
            kind = PortTaken if "already in use" in text else ServerExited
            raise kind(f"pg_ctl start failed:\n{r.stdout}\n{r.stderr}\n{text[-3000:]}")

    def crash(self):
        r = self._run("pg_ctl", "stop", "-m", "immediate", "-w", "-D", str(self.data))
        assert r.returncode == 0, r.stderr

    def stop(self):
        if self.initialized:
            self._run("pg_ctl", "stop", "-m", "fast", "-w", "-D", str(self.data))
        shutil.rmtree(self.data, ignore_errors=True)
        self.log_path.unlink(missing_ok=True)


# --------------------------------------------------------------------------------------------
# ZooKeeper
# --------------------------------------------------------------------------------------------

ZOOKEEPER_JAR = "/usr/share/java/zookeeper.jar"
ZOOKEEPER_TICK_MS = 500  # sessions may last 1 to 10 s (2 and 20 ticks)


class ZooKeeperServer:
    """A standalone ZooKeeper on 127.0.0.1 (Debian's jars), its data in `workdir`; `kill9()` then
    `start()` keeps the port and the data (the transaction log is fsynced: `forceSync` is on)."""

    def __init__(self, workdir: Path):
        self.dir = workdir
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.log_path = workdir / "zookeeper.log"

    @property
    def hosts(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self):
        if self.port:
            self._launch(self.port)
        else:
            retry_if_port_taken(lambda: self._launch(free_port()))
        return self

    def _launch(self, port: int):
        self.port = port
        (self.dir / "data").mkdir(exist_ok=True)
        cfg = self.dir / "zoo.cfg"
        cfg.write_text(f"tickTime={ZOOKEEPER_TICK_MS}\ndataDir={self.dir / 'data'}\nclientPort={port}\n"
                       "clientPortAddress=127.0.0.1\nadmin.enableServer=false\n4lw.commands.whitelist=ruok\n")
        log_from = log_size(self.log_path)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                ["java", "-Xmx128m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
                 "-Dzookeeper.admin.enableServer=false", "-Dzookeeper.root.logger=INFO,CONSOLE",
                 "-cp", f"{ZOOKEEPER_JAR}:/etc/zookeeper/conf",
                 "org.apache.zookeeper.server.ZooKeeperServerMain", str(cfg)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        wait_for_server(self.proc, self._ok, "zookeeper", self.log_path, log_from, timeout=60)

    def _ok(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"ruok")
                return s.recv(16) == b"imok"
        except OSError:
            return False

    def kill9(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self):
        stop_process(self.proc)


# --------------------------------------------------------------------------------------------
# an issuer: a running server, what a worker needs to reach it, and its restart
# --------------------------------------------------------------------------------------------


@dataclass
class Issuer:
    service: str
    env: dict  # for the workers: how the recipe's client reaches the server
    restart: Callable[[], None]  # the issuer's restart or failover
    server: object


@contextmanager
def running_issuer(service: str, workdir: Path, etcd_members: int = 3):
    """Starts `service`'s server in `workdir` and yields an Issuer; stops the server after."""
    workdir.mkdir(parents=True, exist_ok=True)
    if service == "redis":
        server = RedisServer(workdir).start()  # AOF, appendfsync always
        bindir = workdir / "bin"
        bindir.mkdir(exist_ok=True)
        (bindir / "redis-cli").write_text(f'#!/bin/sh\nexec {shutil.which("redis-cli")} -p {server.port} "$@"\n')
        (bindir / "redis-cli").chmod(0o755)
        env = {"PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}

        def restart():
            server.kill9()
            server.start()

        stop = server.kill9
    elif service == "postgres":
        server = PostgresServer().start()
        env = {"PGURL": server.url, "PGCONNECT_TIMEOUT": "2"}

        def restart():
            server.crash()
            server.start()

        stop = server.stop
    elif service == "etcd":
        server = Etcd(workdir, members=etcd_members).start()
        env = {"ETCDCTL_ENDPOINTS": ",".join(server.endpoints)}

        def restart():  # the leader killed: another member takes over
            leader = server.wait_for_leader(20)
            assert leader is not None, server.log_tail()
            server.kill9(leader)
            assert server.wait_for_leader(20) not in (None, leader), server.log_tail()

        stop = server.stop
    else:
        server = ZooKeeperServer(workdir).start()
        env = {"ZK_HOSTS": server.hosts}

        def restart():
            server.kill9()
            server.start()

        stop = server.stop
    try:
        yield Issuer(service, env, restart, server)
    finally:
        stop()


def percentile(values: list, p: float) -> float:
    """The nearest-rank percentile of `values` (p in 0..100)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(len(ordered) * p / 100) - 1)] if ordered else float("nan")
