"""G2, durable advance, shown on the system calls: an advance is on disk (`fdatasync` of the
fence store returned) before any byte of a write carrying the new token reaches the upstream.

`kill -9` cannot show this: the kernel's page cache survives a killed process, so a store that
forwarded before syncing would still pass a crash test. Here fencegate runs under `strace`, and
the order of its system calls is the proof: every advancing write's object file (the local
upstream writes it in-process) is created only after a completed `fdatasync` of `fences.redb`
that began after the previous write's object; writes that do not advance need none.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time

import pytest

from fencegate_testlib import READY_RE, base_config, bin_path, s3_client, to_toml

pytestmark = pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed (scripts/test installs it)")


def _traced(tmp_path):
    cfg = base_config(tmp_path)
    path = tmp_path / "fencegate.toml"
    path.write_text(to_toml(cfg) + "\n")
    trace = tmp_path / "trace"
    proc = subprocess.Popen(
        ["strace", "-f", "-qq", "-e", "trace=fdatasync,fsync,openat,rename,renameat,renameat2", "-o", str(trace),
         str(bin_path()), "serve", "--config", str(path)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        match = READY_RE.match(line.strip()) if line else None
        if match:
            return proc, f"http://{match.group(1)}", trace, tmp_path / "objects"
        if proc.poll() is not None:
            break
    proc.kill()
    pytest.fail("fencegate did not start under strace")


def _stop(proc):
    """Stops fencegate itself (strace's child) and then strace, bounded."""
    children = f"/proc/{proc.pid}/task/{proc.pid}/children"
    try:
        with open(children) as f:
            pids = [int(p) for p in f.read().split()]
    except OSError:
        pids = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.kill()
        proc.wait(timeout=10)


def _events(trace, objects_dir):
    """The trace as ("sync", start, end) of the fence store's fd (line numbers), ("tmp", line,
    path) for a temporary file the local upstream opens to receive a write, and ("commit", line,
    (temporary path, key)) for the rename that puts an object in place, in trace order."""
    lines = trace.read_text().splitlines()
    store_fd = None
    pending = {}  # pid -> start line of an unfinished fdatasync on the store
    events = []
    for n, line in enumerate(lines):
        if store_fd is None:
            m = re.search(r'openat\(.*"[^"]*fences\.redb".*= (\d+)$', line)
            if m:
                store_fd = m.group(1)
            continue
        pid = line.split()[0]
        if re.search(rf"\b(fdatasync|fsync)\({store_fd}\)\s+= 0", line):
            events.append(("sync", n, n))
        elif re.search(rf"\b(fdatasync|fsync)\({store_fd} <unfinished", line):
            pending[pid] = n
        elif re.search(r"<\.\.\. (fdatasync|fsync) resumed>.*= 0", line) and pid in pending:
            events.append(("sync", pending.pop(pid), n))
        elif "openat(" in line and str(objects_dir) in line and "/.tmp." in line:
            events.append(("tmp", n, re.findall(r'"([^"]*)"', line)[0]))
        elif "rename" in line and str(objects_dir / "durable") in line:
            source, target = re.findall(r'"([^"]*)"', line)[-2:]
            events.append(("commit", n, (source, target.rsplit("/", 1)[-1])))
    assert store_fd is not None, "the trace shows the fence store being opened"
    return events


def _puts(events):
    """Each committed object: its key, the line of the previous object's commit, the line its
    own temporary file was opened (its upload reaching the upstream), and its commit line."""
    opened = {}
    puts, previous = [], -1
    for kind, n, detail in events:
        if kind == "tmp":
            opened[detail] = n
        elif kind == "commit":
            source, key = detail
            puts.append((key, previous, opened.get(source, n), n))
            previous = n
    return puts


def test_an_advance_is_synced_before_its_write_reaches_the_upstream(tmp_path):
    proc, endpoint, trace, objects_dir = _traced(tmp_path)
    try:
        s3_client(endpoint).create_bucket(Bucket="durable")
        marker = "job:g2"
        # Each write a new token: each must be preceded by its own completed sync.
        for token in range(1, 9):
            s3_client(endpoint, token=token, resource=marker).put_object(
                Bucket="durable", Key=f"advance-{token}", Body=b"x")
        # The same token again: nothing to make durable, so no sync is needed (or made).
        for i in range(4):
            s3_client(endpoint, token=8, resource=marker).put_object(Bucket="durable", Key=f"same-{i}", Body=b"x")
    finally:
        _stop(proc)
    events = _events(trace, objects_dir)
    puts = _puts(events)
    syncs = [(start, end) for kind, start, end in events if kind == "sync"]
    advancing = [p for p in puts if p[0].startswith("advance-")]
    same = [p for p in puts if p[0].startswith("same-")]
    assert [p[0] for p in advancing] == [f"advance-{t}" for t in range(1, 9)], puts
    assert len(same) == 4, puts
    for key, previous, began, _ in advancing:
        synced = [s for s in syncs if s[0] > previous and s[1] < began]
        assert synced, f"{key} reached the upstream before its advance was synced (previous commit at line " \
                       f"{previous}, upload began at line {began})"
    first, last = same[0][2], same[-1][3]
    assert not [s for s in syncs if first < s[0] < last], "writes that do not advance cost no sync"
