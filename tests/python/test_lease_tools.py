"""Unmodified S3 tools under `fencegate-lease run` (docs/leases.md, "Lease credentials: unmodified tools").

`fencegate-lease run NAME -- COMMAND` takes lease NAME with credentials and runs COMMAND with
them in its environment. Here COMMAND is a real tool that knows nothing of fencegate: the aws
CLI (v1, multipart cp, sync, recursive rm), boto3's managed transfer, and the MinIO Python SDK.
Everything runs against fencegate in front of moto_server, on 127.0.0.1. Each test is one
promise, and what would break it:

- the tools' uploads (single and multipart, many files, concurrent parts) arrive byte for byte
  at the upstream, stamped with the lease's token;
- a recursive delete works inside the lease's prefix and deletes nothing outside it;
- the classic scenario with an unmodified tool: worker A stalls past its TTL, worker B takes the
  lease and writes, A wakes up: A is stopped (75) and whatever A writes late is refused, while
  B's object stays intact at the upstream;
- a lost lease stops the command; exit statuses pass through; a held lease exits 69; the
  lease is released when the command ends.

The tool under test is found through FENCEGATE_LEASE_BIN (default target/debug/fencegate-lease).
Run `pytest -s` to see the classic scenario's output.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from fencegate_testlib import (
    ACCESS_KEY,
    MiB,
    REPO_ROOT,
    SECRET_KEY,
    metric,
    metric_samples,
    quote_resource,
    signed_raw_request,
    unique,
    wait_until,
)

# Exit statuses of `fencegate-lease run` (its doc comment).
EXIT_HELD = 69
EXIT_LOST = 75

ACQUIRED_RE = re.compile(r"^fencegate-lease: acquired (\S+) token=(\d+) ", re.M)
TOOL_TIMEOUT_S = 120


def lease_bin() -> Path:
    p = Path(os.environ.get("FENCEGATE_LEASE_BIN", "target/debug/fencegate-lease"))
    if not p.is_absolute():
        p = REPO_ROOT / p
    if not p.exists():
        raise AssertionError(
            f"fencegate-lease binary not found at {p}: run `cargo build --bins` or set FENCEGATE_LEASE_BIN"
        )
    return p


def aws_cli() -> str:
    exe = shutil.which("aws")
    assert exe, "the aws CLI (pip awscli, tests/python/requirements.txt) is not installed"
    return exe


# --------------------------------------------------------------------------------------------
# fencegate in front of moto, and the tools' environment
# --------------------------------------------------------------------------------------------


@pytest.fixture
def gate(fencegate, moto_server):
    """fencegate in front of moto with a bucket of its own (`fg.bucket`): its `data/` prefix is
    resource `job:tools`, everything else falls back to per-object resources."""
    bucket = unique("tools")
    rules = [{"bucket": bucket, "prefix": "data/", "resource": "job:tools"}]
    fg = fencegate(upstream=moto_server.upstream_config(), config={"fencing": {"rules": rules}})
    fg.bucket = bucket
    fg.moto = moto_server.client()
    fg.client().create_bucket(Bucket=bucket)
    return fg


@pytest.fixture(params=["moto", "local"])
def any_gate(request, fencegate, moto_server):
    """`gate` in front of moto, or of the local upstream. The local upstream is read through
    fencegate (its reads pass through as they are); `fg.moto` is that client then."""
    if request.param == "moto":
        return request.getfixturevalue("gate")
    bucket = unique("tools")
    rules = [{"bucket": bucket, "prefix": "data/", "resource": "job:tools"}]
    fg = fencegate(config={"fencing": {"rules": rules}}, local_buckets=(bucket,))
    fg.bucket = bucket
    fg.moto = fg.client()
    return fg


def tool_env(fg, **extra) -> dict:
    """The environment a user gives fencegate-lease: the issuer credential and the endpoint, no
    AWS configuration files, nothing else of AWS (fencegate-lease sets the rest for COMMAND)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "FENCEGATE_"))}
    env.update(
        AWS_CONFIG_FILE=os.devnull,
        AWS_SHARED_CREDENTIALS_FILE=os.devnull,
        AWS_EC2_METADATA_DISABLED="true",
        AWS_ACCESS_KEY_ID=ACCESS_KEY,
        AWS_SECRET_ACCESS_KEY=SECRET_KEY,
        FENCEGATE_ENDPOINT=fg.s3_url,
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


def lease_cmd(name: str, *options: str, command: list) -> list:
    return [str(lease_bin()), "run", name, *options, "--", *command]


def run_leased(fg, name: str, command: list, *options: str, cwd=None, timeout: float = TOOL_TIMEOUT_S):
    """Runs `fencegate-lease run NAME OPTIONS -- COMMAND` to its end; (returncode, stdout, stderr)."""
    r = subprocess.run(
        lease_cmd(name, *options, command=command),
        env=tool_env(fg),
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return r.returncode, r.stdout, r.stderr


def granted_token(stderr: str, name: str) -> int:
    m = ACQUIRED_RE.search(stderr)
    assert m and m.group(1) == name, f"no 'acquired {name}' line in:\n{stderr}"
    return int(m.group(2))


def explain(fg, rc, out, err) -> str:
    return f"rc={rc}\n--- stdout ---\n{out[-4000:]}\n--- stderr ---\n{err[-4000:]}\n{fg.log_tail(30)}"


def upstream_bytes(fg, key: str) -> bytes:
    return fg.moto.get_object(Bucket=fg.bucket, Key=key)["Body"].read()


def upstream_head(fg, key: str) -> dict:
    return fg.moto.head_object(Bucket=fg.bucket, Key=key)


def upstream_keys(fg, prefix: str) -> list:
    keys = []
    for page in fg.moto.get_paginator("list_objects_v2").paginate(Bucket=fg.bucket, Prefix=prefix):
        keys += [o["Key"] for o in page.get("Contents", [])]
    return sorted(keys)


def stamp_through_gate(fg, key: str):
    return fg.client().head_object(Bucket=fg.bucket, Key=key)["Metadata"].get("fencing-token")


def fence_of(fg, resource: str) -> int:
    r = fg.get_fence(resource)
    assert r.status_code == 200, (r.status_code, r.text)
    return r.json()["token"]


def raise_fence(fg, resource: str, token: int):
    """What the issuer does to supersede a holder: registers a higher token for the resource."""
    r = signed_raw_request(fg, "PUT", "/_fencegate/v1/fences/" + quote_resource(resource),
                           {"Content-Type": "application/json"}, json.dumps({"token": token}).encode())
    assert r.status == 200, (r.status, r.body)


def lease_renewals(fg) -> float:
    """How many lease renewals this fencegate has answered."""
    return metric(metric_samples(fg), "fencegate_lease_events_total", event="renewed")


def lease_call(fg, method: str, name: str, body: dict):
    return signed_raw_request(fg, method, "/_fencegate/v1/leases/" + quote_resource(name),
                              {"Content-Type": "application/json"}, json.dumps(body).encode())


# --------------------------------------------------------------------------------------------
# processes: a session of our own per background run, frozen and ended by its ids only
# --------------------------------------------------------------------------------------------


def session_procs(sid: int) -> dict:
    """{pid: (pgrp, state)} of every live process in session `sid` (from /proc)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        state, pgrp, session = fields[0], int(fields[2]), int(fields[3])
        if session == sid and state != "Z":
            out[int(entry)] = (pgrp, state)
    return out


def signal_session(sid: int, sig: int):
    """`sig` to every process group of session `sid`, then to every process (a group signal
    reaches the whole group at once, so nothing forks past it)."""
    procs = session_procs(sid)
    for pgrp in sorted({g for g, _ in procs.values()}):
        try:
            os.killpg(pgrp, sig)
        except ProcessLookupError:
            pass
    for pid in procs:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def freeze_session(sid: int):
    """SIGSTOP every process of session `sid`, and wait until all of them are stopped."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        signal_session(sid, signal.SIGSTOP)
        time.sleep(0.05)
        procs = session_procs(sid)
        if procs and all(state == "T" for _, state in procs.values()):
            return procs
    raise AssertionError(f"session {sid} did not stop: {session_procs(sid)}")


class Background:
    """`fencegate-lease run ...` in a session of its own, output in files."""

    def __init__(self, argv: list, env: dict, workdir: Path, label: str, cwd=None):
        self.label = label
        self.out_path = workdir / f"{label}.out"
        self.err_path = workdir / f"{label}.err"
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=err, start_new_session=True)
        self.sid = self.proc.pid

    def out(self) -> str:
        return self.out_path.read_text(errors="replace")

    def err(self) -> str:
        return self.err_path.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def cleanup(self):
        """Ends whatever is left of this run's session (only processes of this session)."""
        if session_procs(self.sid):
            signal_session(self.sid, signal.SIGKILL)
            signal_session(self.sid, signal.SIGCONT)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture
def background(tmp_path):
    started: list[Background] = []

    def start(argv: list, env: dict, label: str, cwd=None) -> Background:
        bg = Background(argv, env, tmp_path, label, cwd=cwd)
        started.append(bg)
        return bg

    try:
        yield start
    finally:
        for bg in started:
            bg.cleanup()


# --------------------------------------------------------------------------------------------
# 1-3: the aws CLI
# --------------------------------------------------------------------------------------------


def test_aws_cli_multipart_cp_of_50_mib(gate, tmp_path):
    fg = gate
    data = os.urandom(50 * MiB)
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    key = "data/big.bin"
    rc, out, err = run_leased(fg, "job:tools",
                              [aws_cli(), "s3", "cp", "--only-show-errors", str(src), f"s3://{fg.bucket}/{key}"])
    assert rc == 0, explain(fg, rc, out, err)
    token = granted_token(err, "job:tools")
    assert upstream_bytes(fg, key) == data
    head = upstream_head(fg, key)
    assert head["ContentLength"] == 50 * MiB
    # The CLI's default 8 MiB parts: it was a multipart upload of 7 parts.
    assert head["ETag"].strip('"').endswith("-7"), head["ETag"]
    assert head["Metadata"].get("fencing-token") == str(token)
    assert stamp_through_gate(fg, key) == str(token)
    assert "fencegate-lease: released job:tools" in err, err


def test_aws_cli_sync_of_200_files(gate, tmp_path):
    fg = gate
    src = tmp_path / "many"
    src.mkdir()
    files = {}
    for i in range(200):
        body = f"file {i}\n".encode() + os.urandom(64 + i)
        (src / f"f{i:03d}.txt").write_bytes(body)
        files[f"data/many/f{i:03d}.txt"] = body
    rc, out, err = run_leased(fg, "job:tools",
                              [aws_cli(), "s3", "sync", "--only-show-errors", str(src), f"s3://{fg.bucket}/data/many/"])
    assert rc == 0, explain(fg, rc, out, err)
    token = granted_token(err, "job:tools")
    assert upstream_keys(fg, "data/") == sorted(files)
    for key, body in files.items():
        assert upstream_bytes(fg, key) == body, key
        assert upstream_head(fg, key)["Metadata"].get("fencing-token") == str(token), key
    assert fence_of(fg, "job:tools") == token


def test_aws_cli_recursive_rm_inside_and_outside_the_lease(gate):
    fg = gate
    inside = {f"data/rm/{i:02d}.txt": f"inside {i}".encode() for i in range(30)}
    outside = {f"other/{i}.txt": f"outside {i}".encode() for i in range(3)}
    for key, body in {**inside, **outside}.items():  # put at the upstream directly
        fg.moto.put_object(Bucket=fg.bucket, Key=key, Body=body)

    # Outside the lease's prefix: every delete refused, nothing deleted, the CLI fails.
    rc, out, err = run_leased(fg, "job:tools",
                              [aws_cli(), "s3", "rm", "--recursive", "--only-show-errors", f"s3://{fg.bucket}/other/"])
    assert rc == 1, explain(fg, rc, out, err)
    refused = re.findall(r"delete failed: s3://\S+ An error occurred \(AccessDenied\) when calling the DeleteObject", out + err)
    assert len(refused) == len(outside), explain(fg, rc, out, err)
    assert upstream_keys(fg, "other/") == sorted(outside)
    for key, body in outside.items():
        assert upstream_bytes(fg, key) == body

    # Inside: everything deleted, the outside untouched.
    rc, out, err = run_leased(fg, "job:tools",
                              [aws_cli(), "s3", "rm", "--recursive", "--only-show-errors", f"s3://{fg.bucket}/data/"])
    assert rc == 0, explain(fg, rc, out, err)
    assert upstream_keys(fg, "data/") == []
    assert upstream_keys(fg, "") == sorted(outside)
    for key, body in outside.items():
        assert upstream_bytes(fg, key) == body


# --------------------------------------------------------------------------------------------
# 4-5: SDKs that build their client from the environment
# --------------------------------------------------------------------------------------------

BOTO3_UPLOAD = textwrap.dedent(
    """
    import sys
    import boto3
    from boto3.s3.transfer import TransferConfig

    s3 = boto3.client("s3")  # keys, session token, endpoint and region: the environment's
    config = TransferConfig(max_concurrency=8, multipart_threshold=8 * 1024 * 1024,
                            multipart_chunksize=8 * 1024 * 1024)
    try:
        s3.upload_file(sys.argv[1], sys.argv[2], sys.argv[3], Config=config)
    except boto3.exceptions.S3UploadFailedError as exc:
        print("failed:", exc)
        sys.exit(4)
    print("uploaded", sys.argv[3])
    """
)


def test_boto3_upload_file_concurrent_multipart(gate, tmp_path):
    fg = gate
    script = tmp_path / "upload.py"
    script.write_text(BOTO3_UPLOAD)
    data = os.urandom(40 * MiB)
    src = tmp_path / "forty.bin"
    src.write_bytes(data)
    key = "data/forty.bin"
    rc, out, err = run_leased(fg, "job:tools", [sys.executable, str(script), str(src), fg.bucket, key])
    assert rc == 0, explain(fg, rc, out, err)
    assert out.strip() == f"uploaded {key}"
    token = granted_token(err, "job:tools")
    assert upstream_bytes(fg, key) == data
    head = upstream_head(fg, key)
    assert head["ETag"].strip('"').endswith("-5"), head["ETag"]
    assert head["Metadata"].get("fencing-token") == str(token)
    # Outside the lease's prefix the multipart upload does not even start.
    rc, out, err = run_leased(fg, "job:tools", [sys.executable, str(script), str(src), fg.bucket, "elsewhere/forty.bin"])
    assert rc == 4, explain(fg, rc, out, err)
    assert "An error occurred (AccessDenied) when calling the CreateMultipartUpload operation" in out, out
    assert upstream_keys(fg, "elsewhere/") == []
    assert fg.moto.list_multipart_uploads(Bucket=fg.bucket).get("Uploads", []) == []


MINIO_UPLOAD = textwrap.dedent(
    """
    import io
    import os
    import sys
    from urllib.parse import urlparse

    from minio import Minio

    endpoint = urlparse(os.environ["AWS_ENDPOINT_URL"])
    client = Minio(
        endpoint.netloc,
        access_key=os.environ["AWS_ACCESS_KEY_ID"],
        secret_key=os.environ["AWS_SECRET_ACCESS_KEY"],
        session_token=os.environ["AWS_SESSION_TOKEN"],
        secure=False,
    )
    bucket, big_key, path, small_key = sys.argv[1:5]
    result = client.fput_object(bucket, big_key, path, part_size=5 * 1024 * 1024)
    print("fput", result.etag)
    small = b"a small object from the MinIO SDK\\n"
    result = client.put_object(bucket, small_key, io.BytesIO(small), len(small))
    print("put", result.etag)
    """
)


def test_minio_sdk_fput_and_put(gate, tmp_path):
    fg = gate
    script = tmp_path / "minio_upload.py"
    script.write_text(MINIO_UPLOAD)
    data = os.urandom(12 * MiB)
    src = tmp_path / "twelve.bin"
    src.write_bytes(data)
    rc, out, err = run_leased(fg, "job:tools",
                              [sys.executable, str(script), fg.bucket, "data/twelve.bin", str(src), "data/small.txt"])
    assert rc == 0, explain(fg, rc, out, err)
    token = granted_token(err, "job:tools")
    assert upstream_bytes(fg, "data/twelve.bin") == data
    assert upstream_bytes(fg, "data/small.txt") == b"a small object from the MinIO SDK\n"
    big = upstream_head(fg, "data/twelve.bin")
    assert big["ETag"].strip('"').endswith("-3"), big["ETag"]  # 5 + 5 + 2 MiB
    for key in ("data/twelve.bin", "data/small.txt"):
        assert upstream_head(fg, key)["Metadata"].get("fencing-token") == str(token), key


# --------------------------------------------------------------------------------------------
# 6: the classic scenario with an unmodified tool
# --------------------------------------------------------------------------------------------


A_TTL_MS = 1500  # worker A's lease: B can take it over this long after A froze


def stay_frozen_past_ttl(sid: int, frozen_at: float, ttl_s: float):
    """A stayed frozen all along (B ran meanwhile), and for longer than its TTL."""
    procs = session_procs(sid)
    assert procs and all(state == "T" for _, state in procs.values()), procs
    left = frozen_at + ttl_s + 0.1 - time.monotonic()
    if left > 0:
        time.sleep(left)


def start_worker_a(fg, background, script: str, a_src: Path, dst: str, grace_ms: int, label: str):
    """Worker A: `sh -c script` under `fencegate-lease run job:tools` (TTL A_TTL_MS), with the
    aws CLI, A's file and the destination in $AWS, $SRC and $DST."""
    env_a = tool_env(fg, AWS=aws_cli(), SRC=str(a_src), DST=dst)
    return background(lease_cmd("job:tools", "--ttl-ms", str(A_TTL_MS), "--grace-ms", str(grace_ms),
                                "--holder", "worker-a", command=["sh", "-c", script]), env_a, label)


@dataclass
class Takeover:
    """The classic scenario's middle: B's run while A was frozen, and A's end once resumed."""

    rc_b: int
    out_b: str
    err_b: str
    b_token: int
    stale_for: float  # how long A was frozen, in seconds
    rc_a: int | None  # None: A did not end in time after it was resumed
    out_a: str
    err_a: str

    def print_runs(self):
        print(f"--- A (exit {self.rc_a}) stdout ---\n{self.out_a}--- A stderr ---\n{self.err_a}")
        print(f"--- B (exit {self.rc_b}) stdout ---\n{self.out_b}--- B stderr ---\n{self.err_b}")


def b_takes_over_from_frozen_a(fg, a, frozen_at: float, b_src: Path, dst: str, wait_ms: int,
                               a_exit_timeout: float) -> Takeover:
    """B waits for A's lease to run out (A cannot renew: it is frozen), takes it and copies
    `b_src` to `dst` with the aws CLI; A stays frozen past its TTL, is resumed, and gets
    `a_exit_timeout` seconds to end."""
    rc_b, out_b, err_b = run_leased(fg, "job:tools",
                                    [aws_cli(), "s3", "cp", "--only-show-errors", str(b_src), dst],
                                    "--wait-ms", str(wait_ms), "--holder", "worker-b")
    b_token = granted_token(err_b, "job:tools")
    stay_frozen_past_ttl(a.sid, frozen_at, A_TTL_MS / 1000)
    stale_for = time.monotonic() - frozen_at
    signal_session(a.sid, signal.SIGCONT)
    try:
        rc_a = a.wait(timeout=a_exit_timeout)
    except subprocess.TimeoutExpired:
        rc_a = None
    return Takeover(rc_b, out_b, err_b, b_token, stale_for, rc_a, a.out(), a.err())


def assert_b_kept_the_key(fg, t: Takeover, a_token: int, final: bytes, stamp, b_data: bytes, overwritten: str):
    """B's write went through with the newer token, and B's object is the one at the upstream."""
    assert t.rc_b == 0, explain(fg, t.rc_b, t.out_b, t.err_b)
    assert t.b_token > a_token
    assert final == b_data, overwritten
    assert stamp == str(t.b_token)


# Worker A: a bounded loop of `{copy}` writing A's content to one key. "stubborn" ignores SIGTERM
# (a worker that does not stop when told), so its late writes reach fencegate.
WORKER_A_LOOP = """
{trap}
i=0
while [ $i -lt 60 ]; do
  i=$((i + 1))
  if {copy}; then
    echo "A: write $i ok"
  else
    echo "A: write $i refused"
    exit 3
  fi
  sleep 0.2
done
echo "A: loop ended"
"""
# With the aws CLI (`{trap}` left to fill).
WORKER_A = WORKER_A_LOOP.replace("{copy}", '"$AWS" s3 cp --only-show-errors "$SRC" "$DST"')


@pytest.mark.parametrize("worker", ["obedient", "stubborn"])
def test_classic_scenario_with_the_aws_cli(any_gate, tmp_path, background, worker):
    fg = any_gate
    key = "data/classic.txt"
    dst = f"s3://{fg.bucket}/{key}"
    a_src, b_src = tmp_path / "a.txt", tmp_path / "b.txt"
    a_data = b"written by worker A\n" + os.urandom(1024)
    b_data = b"written by worker B\n" + os.urandom(1024)
    a_src.write_bytes(a_data)
    b_src.write_bytes(b_data)
    script = WORKER_A.format(trap="trap '' TERM" if worker == "stubborn" else "")
    a = start_worker_a(fg, background, script, a_src, dst, grace_ms=8000, label=f"worker-a-{worker}")
    wait_until(lambda: "A: write 1 ok" in a.out() or a.proc.poll() is not None, timeout=30,
               what="worker A's first write")
    assert a.proc.poll() is None, f"A ended early: rc={a.proc.returncode}\n{a.out()}\n{a.err()}"
    a_token = granted_token(a.err(), "job:tools")
    assert upstream_bytes(fg, key) == a_data

    frozen = freeze_session(a.sid)
    frozen_at = time.monotonic()
    ok_before = a.out().count(" ok\n")
    t = b_takes_over_from_frozen_a(fg, a, frozen_at, b_src, dst, wait_ms=5000, a_exit_timeout=30)
    rc_a, out_a, err_a = t.rc_a, t.out_a, t.err_a
    print(f"\n===== classic scenario ({worker} worker A) =====")
    print(f"A frozen for {t.stale_for:.1f}s (ttl {A_TTL_MS / 1000}s), processes {sorted(frozen)}")
    t.print_runs()
    final = upstream_bytes(fg, key)
    stamp = upstream_head(fg, key)["Metadata"].get("fencing-token")
    print(f"--- upstream {key}: {'B' if final == b_data else 'A' if final == a_data else '?'}'s content, "
          f"fencing-token={stamp}")

    assert_b_kept_the_key(fg, t, a_token, final, stamp, b_data, "B's object was overwritten after A woke up")
    assert rc_a is not None, "worker A did not end within 30 s after it was resumed"
    assert not session_procs(a.sid), f"A's processes outlived it: {session_procs(a.sid)}"
    late = out_a.count(" ok\n") - ok_before
    refusals = re.findall(r"\((FencingTokenStale|ExpiredToken)\)", out_a + err_a)
    if worker == "stubborn":
        # A goes on writing after it wakes: fencegate refuses it, and fencegate-lease reports
        # the lost lease.
        # (3: its refused write ended the command before fencegate-lease saw the lease was gone)
        assert rc_a == EXIT_LOST or rc_a == 3, (rc_a, out_a, err_a)
        assert rc_a == 3 or "fencegate-lease: lease job:tools lost" in err_a, err_a
        assert re.search(r"A: write \d+ refused", out_a) and refusals, (out_a, err_a)
    else:
        # A is stopped when fencegate-lease sees the lease is gone; a write it may still have
        # sent in between is refused (a refused write ends the loop with 3).
        assert rc_a == EXIT_LOST or (rc_a == 3 and refusals), (rc_a, out_a, err_a)
    # A write that completed while A was frozen would be one that fencegate accepted from a
    # stale lease: at most the one that was in flight when A was frozen may finish later.
    assert late <= 1, out_a
    assert final == b_data


def test_classic_scenario_mid_multipart_upload(any_gate, tmp_path, background):
    """A is frozen in the middle of an `aws s3 cp` multipart upload (parts in flight), B takes
    over and writes the key, A wakes up: nothing of A's upload is committed, B's object stays."""
    fg = any_gate
    key = "data/classic-multipart.bin"
    dst = f"s3://{fg.bucket}/{key}"
    a_src, b_src = tmp_path / "a.bin", tmp_path / "b.txt"
    a_data = os.urandom(80 * MiB)
    b_data = b"written by worker B\n" + os.urandom(1024)
    a_src.write_bytes(a_data)
    b_src.write_bytes(b_data)
    # A ignores SIGTERM, so the upload goes on after it wakes up (fencegate must refuse it).
    script = 'trap "" TERM; "$AWS" s3 cp --only-show-errors "$SRC" "$DST"; echo "A: cp exit $?"'
    a = start_worker_a(fg, background, script, a_src, dst, grace_ms=20000, label="worker-a-multipart")

    def uploading():
        assert a.proc.poll() is None, f"A ended early: rc={a.proc.returncode}\n{a.out()}\n{a.err()}"
        uploads = fg.moto.list_multipart_uploads(Bucket=fg.bucket).get("Uploads", [])
        if not uploads:
            return None
        parts = fg.moto.list_parts(Bucket=fg.bucket, Key=key, UploadId=uploads[0]["UploadId"]).get("Parts", [])
        return len(parts) if parts else None

    parts_done = wait_until(uploading, timeout=30, interval=0.02, what="A's first uploaded part")
    frozen = freeze_session(a.sid)
    frozen_at = time.monotonic()
    assert key not in upstream_keys(fg, "data/"), "A's upload completed before it could be frozen"
    a_token = granted_token(a.err(), "job:tools")
    t = b_takes_over_from_frozen_a(fg, a, frozen_at, b_src, dst, wait_ms=8000, a_exit_timeout=40)
    final = upstream_bytes(fg, key)
    stamp = upstream_head(fg, key)["Metadata"].get("fencing-token")
    leftover = fg.moto.list_multipart_uploads(Bucket=fg.bucket).get("Uploads", [])
    print("\n===== classic scenario (worker A frozen mid multipart upload) =====")
    print(f"A frozen after {parts_done} part(s) of 10 for {t.stale_for:.1f}s (ttl {A_TTL_MS / 1000}s), "
          f"processes {sorted(frozen)}")
    t.print_runs()
    print(f"--- upstream {key}: {len(final)} bytes, {'B' if final == b_data else '?'}'s content, "
          f"fencing-token={stamp}; multipart uploads left at the upstream: {len(leftover)}")

    assert_b_kept_the_key(fg, t, a_token, final, stamp, b_data, "B's object was overwritten by A's late multipart upload")
    assert t.rc_a == EXIT_LOST, (t.rc_a, t.out_a, t.err_a)
    assert "A: cp exit 1" in t.out_a, t.out_a
    assert re.search(r"upload failed: .* \((FencingTokenStale|ExpiredToken)\) when calling the "
                     r"(UploadPart|CompleteMultipartUpload) operation", t.err_a), t.err_a
    assert not session_procs(a.sid)
    # The CLI aborts its failed upload with its lease credentials: allowed, though its lease
    # lapsed, because the upload is its own (before, the abort was refused and the upload and
    # its parts stayed at the upstream).
    assert leftover == [], leftover


# --------------------------------------------------------------------------------------------
# 7: lost lease, exit statuses, held lease, release
# --------------------------------------------------------------------------------------------


def test_a_lost_lease_stops_the_command(gate, background):
    fg = gate
    renewed_before = lease_renewals(fg)
    bg = background(lease_cmd("job:sleeper", "--ttl-ms", "1000", command=["sleep", "30"]), tool_env(fg), "sleeper")
    wait_until(lambda: ACQUIRED_RE.search(bg.err()) or bg.proc.poll() is not None, timeout=15,
               what="the lease to be acquired")
    token = granted_token(bg.err(), "job:sleeper")
    sleepers = wait_until(
        lambda: [p for p in session_procs(bg.sid) if p != bg.sid
                 and Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[0].endswith(b"sleep")],
        timeout=5, what="the sleep process")
    wait_until(lambda: lease_renewals(fg) - renewed_before >= 2, timeout=10, what="two renewals of the lease")
    assert bg.proc.poll() is None, bg.err()
    raise_fence(fg, "job:sleeper", token + 10)  # the issuer supersedes the holder
    superseded_at = time.monotonic()
    rc = bg.wait(timeout=10)
    took = time.monotonic() - superseded_at
    assert rc == EXIT_LOST, (rc, bg.err())
    assert took < 3.0, f"fencegate-lease took {took:.1f}s to stop the command"
    assert "fencegate-lease: lease job:sleeper lost" in bg.err()
    left = session_procs(bg.sid)
    assert not set(sleepers) & set(left) and left == {}, (sleepers, left)


def test_exit_status_passes_through(gate):
    fg = gate
    rc, out, err = run_leased(fg, "job:status", ["sh", "-c", "exit 7"])
    assert rc == 7, explain(fg, rc, out, err)
    rc, out, err = run_leased(fg, "job:status", ["sh", "-c", "echo $FENCEGATE_LEASE_NAME $FENCEGATE_LEASE_TOKEN; kill -TERM $$"])
    assert rc == 128 + signal.SIGTERM, explain(fg, rc, out, err)
    assert out.split() == ["job:status", str(granted_token(err, "job:status"))]
    rc, out, err = run_leased(fg, "job:status", ["true"])
    assert rc == 0, explain(fg, rc, out, err)


def test_a_held_lease_exits_69_without_running_the_command(gate, tmp_path):
    fg = gate
    r = lease_call(fg, "POST", "job:held", {"holder": "someone-else", "ttl_ms": 60_000})
    assert r.status == 201, (r.status, r.body)
    marker = tmp_path / "ran"
    started = time.monotonic()
    rc, out, err = run_leased(fg, "job:held", ["touch", str(marker)], "--wait-ms", "0")
    assert rc == EXIT_HELD, explain(fg, rc, out, err)
    assert time.monotonic() - started < 10
    assert "held by someone-else" in err, err
    assert not marker.exists()


def test_the_lease_is_released_when_the_command_ends(gate):
    fg = gate
    rc, out, err = run_leased(fg, "job:release", ["sh", "-c", "exit 0"], "--ttl-ms", "60000")
    assert rc == 0, explain(fg, rc, out, err)
    token = granted_token(err, "job:release")
    assert "fencegate-lease: released job:release" in err, err
    # The TTL is a minute: only a release lets a new grant through at once.
    r = lease_call(fg, "POST", "job:release", {"holder": "next", "ttl_ms": 60_000})
    assert r.status == 201, (r.status, r.body)
    assert json.loads(r.body)["token"] > token
    # Also after a failing command.
    r2 = lease_call(fg, "DELETE", "job:release", {"lease_id": json.loads(r.body)["lease_id"]})
    assert r2.status == 204, (r2.status, r2.body)
    rc, out, err = run_leased(fg, "job:release", ["sh", "-c", "exit 4"], "--ttl-ms", "60000")
    assert rc == 4, explain(fg, rc, out, err)
    r = lease_call(fg, "POST", "job:release", {"holder": "next", "ttl_ms": 60_000})
    assert r.status == 201, (r.status, r.body)


def test_what_the_command_left_running_ends_before_the_release(gate, tmp_path):
    """A command that leaves a job in the background (`job &`, not waited for) ends normally;
    the job holds the lease's credentials. Before: it ran on after fencegate-lease released the
    lease and exited. Now it is stopped before the release (SIGTERM, SIGKILL after the grace),
    one that ignores SIGTERM too."""
    fg = gate
    pids = tmp_path / "pids"
    # Their output goes elsewhere: they would hold this test's pipes open.
    script = (f"sleep 300 >/dev/null 2>&1 & echo $! >> {pids}; "
              f"sh -c 'trap \"\" TERM; while :; do sleep 0.1; done' >/dev/null 2>&1 & echo $! >> {pids}; exit 0")
    started = time.monotonic()
    rc, out, err = run_leased(fg, "job:leftovers", ["sh", "-c", script], "--ttl-ms", "60000", "--grace-ms", "1000")
    assert rc == 0, explain(fg, rc, out, err)
    assert "the command left processes running; stopping them" in err, err
    assert err.index("stopping them") < err.index("fencegate-lease: released job:leftovers"), err
    left = [int(p) for p in pids.read_text().split()]
    assert len(left) == 2
    alive = [p for p in left if Path(f"/proc/{p}").exists() and "Z" not in
             Path(f"/proc/{p}/stat").read_text().split(")")[-1].split()[:1]]
    assert alive == [], f"left running after fencegate-lease exited: {alive}"
    assert time.monotonic() - started < 30


# --------------------------------------------------------------------------------------------
# a worker's key, exits and messages (the lease workflow without loose ends)
# --------------------------------------------------------------------------------------------

LESSEE = ("tools-lessee", "tools-lessee-secret-0001")


@pytest.fixture
def lessee_gate(fencegate, moto_server):
    """`gate` with a `role = "lessee"` credential for the workers."""
    bucket = unique("tools")
    rules = [{"bucket": bucket, "prefix": "data/", "resource": "job:tools"}]
    credentials = [{"access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY, "role": "issuer"},
                   {"access_key_id": LESSEE[0], "secret_access_key": LESSEE[1], "role": "lessee"}]
    fg = fencegate(upstream=moto_server.upstream_config(), config={"fencing": {"rules": rules},
                                                                   "credentials": credentials})
    fg.bucket = bucket
    fg.moto = moto_server.client()
    fg.client().create_bucket(Bucket=bucket)
    return fg


def test_a_worker_runs_under_a_lease_with_a_lessee_key(lessee_gate):
    """A worker needs no key that can register: `fencegate-lease run` with a `role = "lessee"`
    key acquires the lease, the command writes with its lease credentials, and the lease is
    released; the same key cannot register a token (403)."""
    fg = lessee_gate
    env = tool_env(fg, AWS_ACCESS_KEY_ID=LESSEE[0], AWS_SECRET_ACCESS_KEY=LESSEE[1])
    script = f"import boto3; boto3.client('s3').put_object(Bucket='{fg.bucket}', Key='data/by-lessee', Body=b'ok')"
    r = subprocess.run(lease_cmd("job:tools", "--ttl-ms", "10000", command=[sys.executable, "-c", script]),
                       env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    assert r.returncode == 0, explain(fg, r.returncode, r.stdout, r.stderr)
    assert upstream_bytes(fg, "data/by-lessee") == b"ok"
    assert "fencegate-lease: released job:tools" in r.stderr, r.stderr
    registration = signed_raw_request(fg, "PUT", "/_fencegate/v1/fences/" + quote_resource("job:tools"),
                                      {"Content-Type": "application/json"}, json.dumps({"token": 2**64 - 1}).encode(),
                                      access_key=LESSEE[0], secret_key=LESSEE[1])
    assert registration.status == 403, (registration.status, registration.body)
    assert fence_of(fg, "job:tools") == granted_token(r.stderr, "job:tools")


def test_acquire_env_then_release_in_the_same_shell(lessee_gate, tmp_path):
    """Before: after `eval "$(fencegate-lease acquire NAME --env)"` the shell's AWS keys were the
    lease credential's, so `fencegate-lease release` in the same shell was refused, and no
    `AWS_ENDPOINT_URL` was printed for the AWS tools. Now the exports include the endpoint, the
    tools write with them, and the lease credential renews and releases its own lease (and
    nothing else: it cannot take another lease)."""
    fg = lessee_gate
    env = tool_env(fg, AWS_ACCESS_KEY_ID=LESSEE[0], AWS_SECRET_ACCESS_KEY=LESSEE[1])
    lease = str(lease_bin())
    script = textwrap.dedent(f"""\
        set -e
        eval "$({lease} acquire job:tools --ttl-ms 30000 --env)"
        test "$AWS_ENDPOINT_URL" = "{fg.s3_url}"
        {sys.executable} -c "import boto3; boto3.client('s3').put_object(Bucket='{fg.bucket}', Key='data/env', Body=b'env')"
        {lease} renew "$FENCEGATE_LEASE_NAME" "$FENCEGATE_LEASE_ID" > /dev/null
        if {lease} acquire job:other --ttl-ms 1000 2> other.err; then echo "a lease credential took a lease"; exit 1; fi
        {lease} release "$FENCEGATE_LEASE_NAME" "$FENCEGATE_LEASE_ID"
        echo released
        """)
    r = subprocess.run(["sh", "-c", script], env=env, cwd=tmp_path, stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    assert r.returncode == 0 and "released" in r.stdout, explain(fg, r.returncode, r.stdout, r.stderr)
    assert "403" in (tmp_path / "other.err").read_text(), (tmp_path / "other.err").read_text()
    assert upstream_bytes(fg, "data/env") == b"env"
    # Released: the next grant goes through at once, though the TTL was 30 s.
    again = lease_call(fg, "POST", "job:tools", {"holder": "next", "ttl_ms": 1000})
    assert again.status == 201, (again.status, again.body)


def test_a_lease_that_lapsed_while_frozen_exits_75_even_if_the_command_finished(gate, background):
    """Before: `fencegate-lease` frozen past its lease's TTL, whose command finished meanwhile,
    exited with the command's 0 when it woke (3 of 3): the caller took the work for done under
    the lease. Now it exits 75 whenever the lease lapsed while the command ran."""
    fg = gate
    bg = background(lease_cmd("job:frozen", "--ttl-ms", "1000", command=["sleep", "1.5"]), tool_env(fg), "frozen")
    wait_until(lambda: ACQUIRED_RE.search(bg.err()) or bg.proc.poll() is not None, timeout=15,
               what="the lease to be acquired")
    os.kill(bg.proc.pid, signal.SIGSTOP)  # fencegate-lease only: its command runs on and ends
    try:
        time.sleep(2.5)  # past the TTL, and past the command's end
    finally:
        os.kill(bg.proc.pid, signal.SIGCONT)
    rc = bg.wait(timeout=10)
    assert rc == EXIT_LOST, (rc, bg.err())
    assert "lapsed while the command ran" in bg.err() or "lost" in bg.err(), bg.err()


def test_an_unreachable_fencegate_is_named_with_its_cause(gate, tmp_path):
    """Before: "request to fencegate failed", nothing more. Now the message names the address
    and the cause (here: nothing listens there)."""
    fg = gate
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    endpoint = f"http://127.0.0.1:{port}"
    r = subprocess.run([str(lease_bin()), "acquire", "job:nowhere"], env=tool_env(fg, FENCEGATE_ENDPOINT=endpoint),
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert endpoint in r.stderr and "refused" in r.stderr.lower(), r.stderr


def test_a_killed_fencegate_lease_takes_its_command_with_it(gate, background):
    """Before: `fencegate-lease` killed with SIGKILL left its command running: writing until the
    lease ran out (then refused), and running for ever after. Now a watchdog beside the command
    stops the command's process group when `fencegate-lease` ends without doing so itself."""
    fg = gate
    bg = background(lease_cmd("job:killed", "--ttl-ms", "60000", "--grace-ms", "1000", command=["sleep", "30"]),
                    tool_env(fg), "killed")
    wait_until(lambda: ACQUIRED_RE.search(bg.err()) or bg.proc.poll() is not None, timeout=15,
               what="the lease to be acquired")
    sleepers = wait_until(
        lambda: [p for p in session_procs(bg.sid) if p != bg.sid
                 and Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[0].endswith(b"sleep")],
        timeout=5, what="the sleep process")
    os.kill(bg.proc.pid, signal.SIGKILL)
    bg.proc.wait(timeout=5)
    gone = wait_until(lambda: not (set(sleepers) & set(session_procs(bg.sid))) or None, timeout=5,
                      what="the command to be stopped")
    assert gone, session_procs(bg.sid)


def test_s3cmd_with_its_default_region_corrects_itself(gate, tmp_path):
    """Before: s3cmd signs for region "US" by default, and fencegate (its S3 library) answered
    400 `InvalidRequest` ("invalid region"), which s3cmd cannot act on: every command failed.
    Now fencegate answers as S3 does, 400 `AuthorizationHeaderMalformed` with the region to
    sign for in `<Region>`, and s3cmd signs again for it: a fenced put and a listing work."""
    fg = gate
    if shutil.which("s3cmd") is None:
        pytest.skip("s3cmd is not installed (apt-get install s3cmd)")
    host, port = fg.s3_addr
    cfg = tmp_path / "s3cfg"
    cfg.write_text(f"[default]\naccess_key = {ACCESS_KEY}\nsecret_key = {SECRET_KEY}\nhost_base = {host}:{port}\n"
                   f"host_bucket = {host}:{port}\nuse_https = False\nsignature_v2 = False\n")
    src = tmp_path / "report.txt"
    src.write_bytes(b"s3cmd's report")

    def s3cmd(*args):
        return subprocess.run(["s3cmd", "-c", str(cfg), *args], capture_output=True, text=True,
                              timeout=TOOL_TIMEOUT_S, stdin=subprocess.DEVNULL)

    # A bucket s3cmd has not seen: it signs for "US" until told the region.
    fresh = unique("s3cmd")
    r = s3cmd("mb", f"s3://{fresh}")
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    r = s3cmd("put", str(src), f"s3://{fresh}/x.txt", "--add-header=Fencing-Token:1")
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    r = s3cmd("put", str(src), f"s3://{fg.bucket}/data/s3cmd.txt", "--add-header=Fencing-Token:4")
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    assert upstream_bytes(fg, "data/s3cmd.txt") == b"s3cmd's report"
    assert fence_of(fg, "job:tools") == 4
    r = s3cmd("put", str(src), f"s3://{fg.bucket}/data/s3cmd.txt", "--add-header=Fencing-Token:3")
    assert r.returncode != 0 and "FencingTokenStale" in r.stderr, (r.returncode, r.stdout, r.stderr)
    r = s3cmd("ls", f"s3://{fg.bucket}/data/")
    assert r.returncode == 0 and "data/s3cmd.txt" in r.stdout, (r.returncode, r.stdout, r.stderr)


# Worker A of the classic scenario with another tool (stubborn): `$COPY` copies A's content.
WORKER_A_TOOL = WORKER_A_LOOP.format(trap="trap '' TERM", copy='sh -c "$COPY"')


def tool_copy(tool: str, fg, tmp_path: Path, key: str) -> tuple:
    """The shell command that copies $SRC to `key` with `tool` under the lease credentials
    `fencegate-lease` puts in the environment, and the variables it needs."""
    host, port = fg.s3_addr
    if tool == "rclone":
        env = {"RCLONE_CONFIG_FG_TYPE": "s3", "RCLONE_CONFIG_FG_PROVIDER": "Other", "RCLONE_CONFIG_FG_ENV_AUTH": "true",
               "RCLONE_CONFIG_FG_ENDPOINT": fg.s3_url, "RCLONE_CONFIG_FG_REGION": "us-east-1",
               "RCLONE_CONFIG": os.devnull}
        return f'rclone copyto --s3-no-check-bucket "$SRC" "fg:{fg.bucket}/{key}"', env
    cfg = tmp_path / "s3cfg"
    # No keys in the file: s3cmd takes the lease credential from the environment.
    cfg.write_text(f"[default]\nhost_base = {host}:{port}\nhost_bucket = {host}:{port}\nuse_https = False\n"
                   "signature_v2 = False\n")
    return f's3cmd -c {cfg} --no-progress put "$SRC" "s3://{fg.bucket}/{key}"', {}


@pytest.mark.parametrize("tool", ["rclone", "s3cmd"])
def test_classic_scenario_with_rclone_and_s3cmd(any_gate, tmp_path, background, tool):
    """The classic scenario with tools nobody on the project tuned for, unmodified under
    `fencegate-lease run`: A (which ignores SIGTERM) writes with `tool`, is frozen past its TTL,
    B takes over and writes with the aws CLI, A wakes and writes again: refused, B's bytes stay
    at the upstream, A's run exits 75 (or 3, its own refused write first), nothing of A's
    outlives it."""
    if shutil.which(tool) is None:
        pytest.skip(f"{tool} is not installed (apt-get install {tool})")
    fg = any_gate
    key = f"data/classic-{tool}.txt"
    a_src, b_src = tmp_path / "a.txt", tmp_path / "b.txt"
    a_data = b"written by worker A\n" + os.urandom(1024)
    b_data = b"written by worker B\n" + os.urandom(1024)
    a_src.write_bytes(a_data)
    b_src.write_bytes(b_data)
    copy, extra = tool_copy(tool, fg, tmp_path, key)
    env_a = tool_env(fg, SRC=str(a_src), COPY=copy, **extra)
    a = background(lease_cmd("job:tools", "--ttl-ms", str(A_TTL_MS), "--grace-ms", "8000", "--holder", "worker-a",
                             command=["sh", "-c", WORKER_A_TOOL]), env_a, f"worker-a-{tool}")
    wait_until(lambda: "A: write 1 ok" in a.out() or a.proc.poll() is not None, timeout=30,
               what="worker A's first write")
    assert a.proc.poll() is None, f"A ended early: rc={a.proc.returncode}\n{a.out()}\n{a.err()}"
    a_token = granted_token(a.err(), "job:tools")
    assert upstream_bytes(fg, key) == a_data

    freeze_session(a.sid)
    frozen_at = time.monotonic()
    ok_before = a.out().count(" ok\n")
    t = b_takes_over_from_frozen_a(fg, a, frozen_at, b_src, f"s3://{fg.bucket}/{key}", wait_ms=5000,
                                   a_exit_timeout=30)
    print(f"\n===== classic scenario ({tool}) =====")
    t.print_runs()
    final = upstream_bytes(fg, key)
    stamp = upstream_head(fg, key)["Metadata"].get("fencing-token")
    assert_b_kept_the_key(fg, t, a_token, final, stamp, b_data, f"B's object was overwritten after A ({tool}) woke up")
    assert t.rc_a in (EXIT_LOST, 3), (t.rc_a, t.out_a, t.err_a)
    assert re.search(r"A: write \d+ refused", t.out_a), t.out_a
    assert t.out_a.count(" ok\n") - ok_before <= 1, t.out_a
    assert not session_procs(a.sid), f"A's processes outlived it: {session_procs(a.sid)}"
    # Nothing of A's left behind: no unfinished upload (the tools write these small files whole).
    assert not fg.moto.list_multipart_uploads(Bucket=fg.bucket).get("Uploads"), "an upload was left behind"


def test_a_newer_token_registered_mid_run_exits_75_and_says_so(gate, background):
    """An operator (or the lease service) registers a newer token on the lease's resource while
    the command runs: every write of the lease is refused from then on, and when the command
    ends `fencegate-lease` exits 75 naming the newer token. Before: the command's status (0 here)
    and "released", as if the work had been done under the lease."""
    fg = gate
    bg = background(lease_cmd("job:overtaken", "--ttl-ms", "60000", command=["sleep", "1.5"]), tool_env(fg),
                    "overtaken")
    acquired = wait_until(lambda: ACQUIRED_RE.search(bg.err()) or bg.proc.poll() is not None, timeout=15,
                          what="the lease to be acquired")
    token = int(acquired.group(2))
    assert fg.put_fence("job:overtaken", token + 5).status_code == 200
    rc = bg.wait(timeout=15)
    assert rc == EXIT_LOST, (rc, bg.err())
    assert f"superseded: a newer token ({token + 5})" in bg.err(), bg.err()
    assert "fencegate-lease: released" not in bg.err(), bg.err()


@pytest.mark.parametrize("ends", ["command-ends", "lease-lost", "fencegate-lease-killed"])
def test_a_process_that_left_the_commands_group_is_stopped_too(gate, background, ends):
    """The command starts a process in a session of its own (`setsid`), out of its process group,
    and its shell ends at once (the process is an orphan): when the command ends, or when the
    lease is lost, `fencegate-lease` stops it as well and names it; when `fencegate-lease` itself
    is killed (SIGKILL: the orphan goes to init), its watchdog stops it. Before: it kept running
    with the lease's credentials (and, after the SIGKILL, the watchdog stopped only the group)."""
    fg = gate
    marker = f"{31 + len(ends)}.{os.getpid() % 1000:03d}"  # a sleep of its own, to find it by
    # Lost: a renewal every second finds the newer token while the command still runs.
    ttl_ms, runs_s = {"command-ends": ("60000", "1.5"), "lease-lost": ("3000", "20"),
                      "fencegate-lease-killed": ("60000", "20")}[ends]
    command = ["sh", "-c", f"setsid sleep {marker} </dev/null >/dev/null 2>&1 & sleep {runs_s}"]
    bg = background(lease_cmd("job:escaped-" + ends, "--ttl-ms", ttl_ms, "--grace-ms", "1000", command=command),
                    tool_env(fg), "escaped")
    acquired = wait_until(lambda: ACQUIRED_RE.search(bg.err()) or bg.proc.poll() is not None, timeout=15,
                          what="the lease to be acquired")

    def sleepers():
        found = []
        for stat in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                if stat.read_bytes().split(b"\0")[:2] == [b"sleep", marker.encode()]:
                    found.append(int(stat.parent.name))
            except OSError:
                pass
        return found

    escaped = wait_until(sleepers, timeout=5, what="the escaped sleep")
    if ends == "fencegate-lease-killed":
        time.sleep(0.5)  # the watchdog notes what is below fencegate-lease every 100 ms
        os.kill(bg.proc.pid, signal.SIGKILL)
        bg.proc.wait(timeout=5)
        gone = wait_until(lambda: not (set(escaped) & set(sleepers())) or None, timeout=10,
                          what="the escaped sleep to be stopped by the watchdog")
        assert gone, sleepers()
        wait_until(lambda: "outside its group" in bg.err(), timeout=5, what="the watchdog to name it")
        return
    if ends == "lease-lost":
        assert fg.put_fence("job:escaped-" + ends, int(acquired.group(2)) + 1).status_code == 200
    rc = bg.wait(timeout=30)
    if ends == "lease-lost":
        assert rc == EXIT_LOST and "stopping the command" in bg.err(), (rc, bg.err())
    gone = wait_until(lambda: not (set(escaped) & set(sleepers())) or None, timeout=5,
                      what="the escaped sleep to be stopped")
    assert gone, sleepers()
    assert "outside its group" in bg.err() and "sleep" in bg.err(), bg.err()


def test_a_watchdog_whose_parent_is_not_the_run_it_names_stops_nothing_else():
    """The watchdog notes what is below `fencegate-lease run` only while that very process (pid
    and start time, passed by `run`) is its parent. Before: it noted whatever was below its
    parent at the time, so one whose `run` had already died (its parent init or an outer
    subreaper) killed that parent's other children."""
    neighbour = subprocess.Popen(["sleep", "300"])
    try:
        stat = Path(f"/proc/{neighbour.pid}/stat").read_text()
        started = stat[stat.rfind(")") + 2:].split()[19]
        # It names the neighbour as its run: its parent (this test) is not that process.
        watchdog = subprocess.run([str(lease_bin()), "--access-key-id", "k", "--secret-access-key", "s", "__watch",
                                   "999999", "100", str(neighbour.pid), started],
                                  stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=20)
        assert watchdog.returncode == 0, watchdog.stderr
        time.sleep(0.3)
        assert neighbour.poll() is None, f"the watchdog stopped a process it does not watch: {watchdog.stderr}"
        assert "outside its group" not in watchdog.stderr, watchdog.stderr
    finally:
        neighbour.kill()
        neighbour.wait()
