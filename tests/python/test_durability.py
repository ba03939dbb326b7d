"""G2, durable advance, shown on the system calls: an advance is on disk (`fdatasync` of the
fence store returned), and so is its witness (the record of the store's last commit beside it,
by which an older copy put back is refused), before any byte of a write carrying the new token
reaches the upstream.

`kill -9` cannot show this: the kernel's page cache survives a killed process, so a store that
forwarded before syncing would still pass a crash test. Here fencegate runs under `strace`, and
the order of its system calls is the proof: every advancing write's data file (the local
upstream writes it in-process) is created only after a completed `fdatasync` of `fences.redb`
that began after the previous write's commit; writes that do not advance need none.
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
    """The trace, in order, as ("sync", start, end) for a completed sync of the fence store's
    fd (line numbers), ("witness", start, end) for one of its witness's, ("data", line, path) for a data file the local upstream creates to
    receive a write's body, and ("commit", start, end) for a completed sync of the local
    upstream's database (a write's commit)."""
    lines = trace.read_text().splitlines()
    fds = {}  # "fence" / "local" -> fd
    pending = {}  # pid -> (which, start line) of an unfinished sync
    events = []
    data_dir = str(objects_dir / "data") + "/"

    def which(fd):
        return next((name for name, known in fds.items() if known == fd), None)

    for n, line in enumerate(lines):
        pid = line.split()[0]
        opened = re.search(r'openat\(.*"([^"]*)".*= (\d+)$', line)
        # A data file's creation counts from the call's start: strace splits a call that
        # another thread interrupts into "<unfinished ...>" and "<... openat resumed>" lines.
        creating = re.search(r'openat\(.*"([^"]*)".*O_CREAT', line)
        if opened and opened.group(1).endswith("/fences.redb"):
            fds["fence"] = opened.group(2)
        elif opened and opened.group(1).endswith("/fences.witness"):
            fds["witness"] = opened.group(2)
        elif opened and opened.group(1).endswith("/local.redb"):
            fds["local"] = opened.group(2)
        elif creating and creating.group(1).startswith(data_dir):
            events.append(("data", n, creating.group(1)))
        done = re.search(r"\b(?:fdatasync|fsync)\((\d+)\)\s+= 0", line)
        began = re.search(r"\b(?:fdatasync|fsync)\((\d+) <unfinished", line)
        kinds = {"fence": "sync", "witness": "witness", "local": "commit"}
        if done and which(done.group(1)):
            events.append((kinds[which(done.group(1))], n, n))
        elif began and which(began.group(1)):
            pending[pid] = (which(began.group(1)), n)
        elif re.search(r"<\.\.\. (fdatasync|fsync) resumed>.*= 0", line) and pid in pending:
            name, start = pending.pop(pid)
            events.append((kinds[name], start, n))
    assert {"fence", "witness", "local"} <= set(fds), f"the trace shows both stores and the witness opened: {fds}"
    return events


def _puts(events):
    """Each committed object write, in order: the line of the previous write's commit, the line
    its own data file was created (its body reaching the upstream), and its commit's end."""
    puts, previous, began = [], -1, None
    for kind, start, end in events:
        if kind == "data" and began is None:
            began = start
        elif kind == "commit" and began is not None and start > began:
            puts.append((previous, began, end))
            previous, began = end, None
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
    witnessed = [(start, end) for kind, start, end in events if kind == "witness"]
    assert len(puts) == 12, puts  # the PUTs run one after another: 8 advancing, then 4 not
    advancing, same = puts[:8], puts[8:]
    for token, (previous, began, _) in enumerate(advancing, start=1):
        synced = [s for s in syncs if s[0] > previous and s[1] < began]
        assert synced, f"advance-{token} reached the upstream before its advance was synced (previous commit " \
                       f"at line {previous}, upload began at line {began})"
        after_commit = [w for w in witnessed if w[0] > synced[0][1] and w[1] < began]
        assert after_commit, f"advance-{token} reached the upstream before its commit was witnessed (store " \
                             f"synced at line {synced[0][1]}, upload began at line {began})"
    first, last = same[0][1], same[-1][2]
    assert not [s for s in syncs + witnessed if first < s[0] < last], "writes that do not advance cost no sync"
