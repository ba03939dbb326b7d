"""Ceph RGW as a real S3 server for the black-box tests: one monitor, one OSD keeping its objects
in memory (memstore) and one radosgw, all on 127.0.0.1, every file of theirs in one directory.

Debian's radosgw can keep objects only in RADOS (it has no dbstore), hence the small cluster.
Its configuration is passed to every program with `-c`: nothing under /etc/ceph or
/var/lib/ceph is read or written, and no systemd unit is involved.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import uuid
from pathlib import Path

import requests

from fencegate_testlib import (
    SERVER_LOG_TAIL,
    free_port,
    log_since,
    log_size,
    retry_if_port_taken,
    s3_client,
    stop_process,
    wait_for_server,
)

CEPH_PROGRAMS = ("ceph", "ceph-mon", "ceph-osd", "monmaptool", "radosgw", "radosgw-admin")
RGW_ACCESS_KEY = "fencegate-rgw"
RGW_SECRET_KEY = "fencegate-rgw-secret"
STEP_TIMEOUT_S = 60.0  # any one step of the start (a command, or a daemon becoming ready)
MEMSTORE_BYTES = 1024**3  # a cap on what the OSD keeps in memory, not an allocation
VERSION_RE = re.compile(r"ceph version (\S+)")


def missing_ceph_programs() -> list:
    """The programs CephRgw runs that are not installed (scripts/test installs them)."""
    return [p for p in CEPH_PROGRAMS if shutil.which(p) is None]


class CephRgw:
    """A Ceph RGW of its own, its cluster's files and logs in `workdir`; one user whose keys are
    `access_key` / `secret_key`. `start()` raises with the tail of the log of the step that
    failed; `stop()` ends every daemon it started, after a failed start too."""

    def __init__(self, workdir: Path):
        self.dir = Path(workdir)
        self.fsid = str(uuid.uuid4())
        self.procs: dict = {}  # daemon name -> its Popen (each runs in the foreground, `-f`)
        self.mon_port = 0
        self.port = 0
        self.version = ""
        self.access_key = RGW_ACCESS_KEY
        self.secret_key = RGW_SECRET_KEY

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def conf(self) -> Path:
        return self.dir / "ceph.conf"

    def log_path(self, name: str) -> Path:
        return self.dir / "log" / f"{name}.log"

    def start(self):
        """Starts the monitor, the OSD and radosgw, makes the user, and returns self."""
        missing = missing_ceph_programs()
        if missing:
            raise AssertionError(f"{', '.join(missing)} not installed: run scripts/test, which installs "
                                 "them (or set FENCEGATE_SKIP_RGW=1 to skip the tests that need RGW)")
        try:
            self.version = VERSION_RE.search(self._run("radosgw", "--version")).group(1)
            retry_if_port_taken(self._start_mon)
            self._start_osd()
            # The user first: had a radosgw that found its port taken watched the cluster, every
            # change of metadata (a user's too) would wait for its watch to time out (30 s).
            self._run("radosgw-admin", "-c", str(self.conf), "user", "create", "--uid", "fencegate",
                      "--display-name", "fencegate", "--access-key", self.access_key,
                      "--secret", self.secret_key)
            retry_if_port_taken(self._start_rgw)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self):
        """Stops the daemons in the reverse order of their start (`stop_process`: SIGTERM, then
        SIGKILL after 10 s): a radosgw whose cluster is gone takes 5 s to go."""
        for proc in reversed(list(self.procs.values())):
            stop_process(proc)

    def client(self):
        return s3_client(self.url, access_key=self.access_key, secret_key=self.secret_key)

    def upstream_config(self) -> dict:
        return {
            "kind": "s3",
            "endpoint": self.url,
            "region": "us-east-1",
            "access_key_id": self.access_key,
            "secret_access_key": self.secret_key,
        }

    def make_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    # ---------------------------------------------------------------------------------------

    def _start_mon(self):
        self.mon_port = free_port()
        shutil.rmtree(self.dir / "mon", ignore_errors=True)  # an attempt whose port was taken
        self._write_conf()
        monmap = str(self.dir / "monmap")
        # `--addv` with v1 only: `--add` on a port other than 6789 makes it a v2 address, which
        # the clients, told `mon_host = v1:...`, would not find.
        self._run("monmaptool", "-c", str(self.conf), "--create", "--clobber", "--fsid", self.fsid,
                  "--addv", "a", f"[v1:127.0.0.1:{self.mon_port}]", monmap)
        self._run("ceph-mon", "-c", str(self.conf), "-i", "a", "--mkfs", "--monmap", monmap)
        self._spawn("mon.a", ["ceph-mon", "-i", "a"], self._mon_leads)

    def _start_osd(self):
        osd_uuid = str(uuid.uuid4())
        self._ceph("osd", "new", osd_uuid, "0")
        self._run("ceph-osd", "-c", str(self.conf), "-i", "0", "--mkfs", "--osd-uuid", osd_uuid)
        # Placed here, not by the OSD at its start: without cephx the OSD's first command to the
        # monitor goes before it knows the cluster's fsid, is refused, and the OSD exits.
        self._ceph("osd", "crush", "add", "osd.0", "1", "root=default")
        self._spawn("osd.0", ["ceph-osd", "-i", "0"], self._osd_up)

    def _start_rgw(self):
        self.port = free_port()
        frontend = f"beast endpoint=127.0.0.1:{self.port}"
        self._spawn("client.rgw", ["radosgw", "-n", "client.rgw", "--rgw-frontends", frontend],
                    self._rgw_answers)

    def _mon_leads(self) -> bool:
        """Asked on its admin socket, not its port: another process may have taken that."""
        status = self._run("ceph", "--admin-daemon", str(self.dir / "run" / "mon.a.asok"), "mon_status")
        return json.loads(status)["state"] == "leader"

    def _osd_up(self) -> bool:
        return json.loads(self._ceph("osd", "stat", "--format", "json"))["num_up_osds"] == 1

    def _rgw_answers(self) -> bool:
        """An anonymous bucket listing from RGW itself (whose owner is `anonymous`), not from
        another server that took the port while radosgw was still starting."""
        resp = requests.get(self.url, timeout=5)
        return resp.status_code == 200 and "<ID>anonymous</ID>" in resp.text

    def _spawn(self, name: str, cmd: list, ready):
        """Starts daemon `name` in the foreground (so its pid is the one to signal), its output
        appended to its own log, and waits until `ready()` is true."""
        log = self.log_path(name)
        log_from = log_size(log)
        with open(log, "ab") as out:
            proc = subprocess.Popen([shutil.which(cmd[0]), "-c", str(self.conf), "-f", *cmd[1:]],
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    env=self._env(), cwd=self.dir)
        self.procs[name] = proc
        wait_for_server(proc, ready, name, log, log_from, timeout=STEP_TIMEOUT_S)

    def _ceph(self, *args: str) -> str:
        return self._run("ceph", "-c", str(self.conf), "--connect-timeout", "10", *args)

    def _run(self, *cmd: str) -> str:
        """Runs a command to its end (killed after STEP_TIMEOUT_S); its stdout, or an error with
        its output and the monitor's log tail."""
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, env=self._env(), cwd=self.dir,
                                  timeout=STEP_TIMEOUT_S, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"{' '.join(cmd)} did not end in {STEP_TIMEOUT_S}s\n{self._mon_log()}") from exc
        if done.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited with {done.returncode}:\n{done.stdout}{done.stderr}"
                                 f"\n{self._mon_log()}")
        return done.stdout

    def _mon_log(self) -> str:
        return "mon.a's log:\n" + log_since(self.log_path("mon.a"))[-SERVER_LOG_TAIL:]

    def _env(self) -> dict:
        # CEPH_ARGS of the caller's shell would be added to every command line.
        env = {k: v for k, v in os.environ.items() if not k.startswith("CEPH_")}
        env["CEPH_CONF"] = str(self.conf)
        return env

    def _write_conf(self):
        for sub in ("log", "run", "osd", "rgw", "crash"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        d = self.dir
        self.conf.write_text(f"""\
[global]
fsid = {self.fsid}
mon_host = v1:127.0.0.1:{self.mon_port}
public_addr = 127.0.0.1
ms_bind_ipv6 = false
# A port another process took is given up after one try (`retry_if_port_taken` picks a new one).
ms_bind_retry_count = 1
# Errors are in the log file already, to which stderr goes too.
err_to_stderr = false
# A cluster private to one test run, on loopback only.
auth_cluster_required = none
auth_service_required = none
auth_client_required = none
keyring = {d}/keyring
run_dir = {d}/run
admin_socket = {d}/run/$name.asok
pid_file = {d}/run/$name.pid
log_file = {d}/log/$name.log
mon_cluster_log_file = {d}/log/cluster.log
crash_dir = {d}/crash
mon_data = {d}/mon
osd_data = {d}/osd
rgw_data = {d}/rgw
# The monitor stops when its disk is 95% full; it writes a few MB.
mon_data_avail_crit = 0
# One OSD: one copy of everything, placed on no host, few placement groups, no autoscaler
# (which needs a manager).
osd_pool_default_size = 1
osd_pool_default_min_size = 1
mon_allow_pool_size_one = true
mon_warn_on_pool_no_redundancy = false
osd_crush_chooseleaf_type = 0
osd_pool_default_pg_num = 8
osd_pool_default_pgp_num = 8
osd_pool_default_pg_autoscale_mode = off
osd_objectstore = memstore
memstore_device_bytes = {MEMSTORE_BYTES}
# The OSD is placed by `_start_osd`.
osd_class_update_on_start = false
osd_crush_update_on_start = false
# Every pool radosgw makes takes two new osdmaps, each of which the monitor would batch for 1 s.
paxos_propose_interval = 0.05
paxos_min_wait = 0.01
# Lifecycle rules run between midnight and 6 am only, and its threads hold radosgw's exit for 5 s.
rgw_enable_lc_threads = false
""")
