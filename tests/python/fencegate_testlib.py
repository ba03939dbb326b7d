"""Helpers shared by the black-box tests: processes, config, S3 clients, raw signed HTTP.

Everything here talks to 127.0.0.1 only, and every wait is bounded in time.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
import requests
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.config import Config
from botocore.credentials import Credentials
from botocore.exceptions import ClientError

REPO_ROOT = Path(__file__).resolve().parents[2]
ACCESS_KEY = "fencegate-dev"
SECRET_KEY = "fencegate-dev-secret"
REGION = "us-east-1"
READY_RE = re.compile(r"^fencegate ready: s3=(\S+) admin=(\S+)\s*$")
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0
MiB = 1024 * 1024


# --------------------------------------------------------------------------------------------
# small utilities
# --------------------------------------------------------------------------------------------


def free_ports(n: int) -> list:
    """`n` distinct ports of 127.0.0.1 that were free a moment ago. Another process can take one
    before the caller's server binds it: start such a server with `retry_if_port_taken`, or
    hold the port with `reserve_port`. (fencegate itself listens on port 0 and prints what it
    bound: `FenceGate.start` reads that.)"""
    socks = []
    try:
        for _ in range(n):  # all bound at once: the kernel hands out n different ports
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


def reserve_port() -> socket.socket:
    """A socket bound to a free port of 127.0.0.1 that does not listen yet: connections to the
    port are refused until its owner calls `listen()`, and no other process can take the port
    meanwhile (no SO_REUSEADDR, so no other socket may share it)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    return s


def wait_until(pred, timeout: float, interval: float = 0.05, what: str = "condition"):
    """Poll `pred` until it returns a truthy value, at most `timeout` seconds. An exception from
    `pred` counts as "not yet", except `ServerExited`: a process that is gone will not come."""
    deadline = time.monotonic() + timeout
    last_exc = None
    while time.monotonic() < deadline:
        try:
            value = pred()
            if value:
                return value
        except ServerExited:
            raise
        except Exception as exc:  # noqa: BLE001 - reported below on timeout
            last_exc = exc
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last error: {last_exc!r})")


def bin_path() -> Path:
    p = Path(os.environ.get("FENCEGATE_BIN", "target/debug/fencegate"))
    if not p.is_absolute():
        p = REPO_ROOT / p
    return p


# --------------------------------------------------------------------------------------------
# TOML writer (tomllib only reads)
# --------------------------------------------------------------------------------------------


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, (list, tuple)) and all(not isinstance(x, dict) for x in v):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as TOML")


def to_toml(doc: dict, prefix: str = "") -> str:
    scalars, tables, arrays = [], [], []
    for k, v in doc.items():
        if v is None:
            continue
        if isinstance(v, dict):
            tables.append((k, v))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            arrays.append((k, v))
        else:
            scalars.append((k, v))
    out = []
    for k, v in scalars:
        out.append(f"{k} = {_toml_value(v)}")
    for k, v in tables:
        name = f"{prefix}{k}"
        out.append(f"\n[{name}]")
        out.append(to_toml(v, name + "."))
    for k, items in arrays:
        name = f"{prefix}{k}"
        for item in items:
            out.append(f"\n[[{name}]]")
            out.append(to_toml(item, name + "."))
    return "\n".join(x for x in out if x != "")


# --------------------------------------------------------------------------------------------
# the fencegate process
# --------------------------------------------------------------------------------------------


@dataclass
class FenceGate:
    """One fencegate instance on its own data dirs. `restart()` keeps the dirs."""

    workdir: Path
    config: dict
    env: dict = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    s3_url: str = ""
    admin_url: str = ""
    s3_addr: tuple = ("127.0.0.1", 0)
    admin_addr: tuple = ("127.0.0.1", 0)
    starts: int = 0
    logs: list = field(default_factory=list)
    # A Redis store is marked new (`fencegate init-store`) before the first start, as an
    # operator does once when making it.
    init_store: bool = True

    @property
    def config_path(self) -> Path:
        return self.workdir / "fencegate.toml"

    @property
    def objects_dir(self) -> Path:
        return Path(self.config["upstream"].get("path", self.workdir / "objects"))

    def write_config(self):
        self.config_path.write_text(to_toml(self.config) + "\n")

    def start(self):
        binary = bin_path()
        if not binary.exists():
            raise AssertionError(
                f"fencegate binary not found at {binary}: run `cargo build --bin fencegate` "
                "or set FENCEGATE_BIN"
            )
        self.write_config()
        self.starts += 1
        log = self.workdir / f"fencegate-{self.starts}.log"
        self.logs.append(log)
        env = {k: v for k, v in os.environ.items() if not k.startswith("FENCEGATE_")}
        env.setdefault("RUST_LOG", "info")
        env.setdefault("RUST_BACKTRACE", "1")
        env.setdefault("NO_COLOR", "1")
        env.update(self.env)
        # Once, at the first start: a restart (after a store lost its state, say) must not mark
        # the store new again, as no operator would.
        if self.init_store and self.starts == 1 and self.config.get("store", {}).get("kind") == "redis":
            init = subprocess.run([str(binary), "init-store", "--config", str(self.config_path)], env=env,
                                  cwd=str(self.workdir), capture_output=True, timeout=READY_TIMEOUT_S)
            if init.returncode != 0:
                raise AssertionError(f"fencegate init-store failed: {init.stderr.decode(errors='replace')[-2000:]}")
        with open(log, "wb") as logf:
            self.proc = subprocess.Popen(
                [str(binary), "serve", "--config", str(self.config_path)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=logf,
                env=env,
                cwd=str(self.workdir),
            )
        lines: queue.Queue = queue.Queue()
        stdout = self.proc.stdout

        def pump():  # drains stdout for the life of the process
            for raw in iter(stdout.readline, b""):
                lines.put(raw.decode("utf-8", "replace").rstrip("\n"))
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + READY_TIMEOUT_S
        seen = []
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.stop()
                raise AssertionError(
                    f"fencegate printed no ready line within {READY_TIMEOUT_S}s; stdout={seen!r}\n"
                    + self.log_tail()
                )
            try:
                line = lines.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                continue
            if line is None:
                rc = self.proc.wait(timeout=STOP_TIMEOUT_S)
                raise AssertionError(
                    f"fencegate exited with {rc} before it was ready; stdout={seen!r}\n"
                    + self.log_tail()
                )
            seen.append(line)
            m = READY_RE.match(line)
            if m:
                self.s3_addr = _split_addr(m.group(1))
                self.admin_addr = _split_addr(m.group(2))
                self.s3_url = f"http://{m.group(1)}"
                self.admin_url = f"http://{m.group(2)}"
                return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self):
        """Graceful stop (SIGTERM), then SIGKILL if it does not exit in time."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=STOP_TIMEOUT_S)
        self._close()

    def kill9(self):
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        self._close()

    def _close(self):
        if self.proc is not None and self.proc.stdout is not None:
            try:
                self.proc.stdout.close()
            except OSError:
                pass

    def accept_restored_store(self) -> str:
        """`fencegate init-store --accept-restored` (the embedded store's files were put back or
        removed on purpose): what it printed."""
        done = subprocess.run([str(bin_path()), "init-store", "--accept-restored", "--config", str(self.config_path)],
                              capture_output=True, text=True, timeout=READY_TIMEOUT_S, cwd=str(self.workdir))
        if done.returncode != 0:
            raise AssertionError(f"fencegate init-store --accept-restored failed: {done.stderr[-2000:]}")
        return done.stdout

    def restart(self, kill: bool = False):
        """Stop (or kill -9) and start again on the same data dirs (new ports)."""
        if kill:
            self.kill9()
        else:
            self.stop()
        return self.start()

    def log_tail(self, n: int = 60) -> str:
        out = []
        for log in self.logs[-2:]:
            try:
                text = log.read_text(errors="replace").splitlines()
            except OSError:
                continue
            out.append(f"--- {log.name} (last {n} lines) ---")
            out.extend(text[-n:])
        return "\n".join(out)

    # convenience -----------------------------------------------------------------------
    def client(self, token=None, resource=None, **kw):
        return s3_client(self.s3_url, token=token, resource=resource, **kw)

    def admin(self, method: str, path: str, token: str | None = None, **kw) -> requests.Response:
        headers = kw.pop("headers", {})
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        return requests.request(method, self.admin_url + path, headers=headers, timeout=15, **kw)

    def get_fence(self, resource: str, token: str | None = None) -> requests.Response:
        return self.admin("GET", "/v1/fences/" + quote_resource(resource), token=token)

    def put_fence(self, resource: str, value, token: str | None = None) -> requests.Response:
        return self.admin(
            "PUT", "/v1/fences/" + quote_resource(resource), token=token, json={"token": value}
        )


def _split_addr(addr: str) -> tuple:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


def quote_resource(resource: str) -> str:
    return urllib.parse.quote(resource, safe="")


def base_config(workdir: Path) -> dict:
    (workdir / "objects").mkdir(parents=True, exist_ok=True)
    return {
        "server": {"listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0"},
        "store": {"kind": "embedded", "path": str(workdir / "fences")},
        "upstream": {"kind": "local", "path": str(workdir / "objects")},
        "credentials": [{"access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY, "role": "issuer"}],
        # The tests read the token that wrote an object through fencegate (hidden by default:
        # test_transparency.py checks that).
        "fencing": {"require_token": True, "show_stamp": True},
    }


def seed_local_buckets(objects_dir: Path, names) -> None:
    """Creates buckets in a local upstream's directory before the fencegate under test starts
    (its start-up probe may need one). The local store keeps buckets in its database, not as
    directories, so one short fencegate run on that directory creates them through S3."""
    names = tuple(names)
    if not names:
        return
    seed = objects_dir.parent / f".seed-{objects_dir.name}"
    seed.mkdir(parents=True, exist_ok=True)
    config = base_config(seed)
    config["upstream"]["path"] = str(objects_dir)
    fg = FenceGate(workdir=seed, config=config)
    fg.start()
    try:
        for name in names:
            fg.client().create_bucket(Bucket=name)
    finally:
        fg.stop()


def merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


# --------------------------------------------------------------------------------------------
# boto3: the token rides on botocore's event system (the example users copy)
# --------------------------------------------------------------------------------------------


def attach_fencing_token(client, token, resource: str | None = None):
    """Add `Fencing-Token` (and optionally `Fencing-Resource`) to every S3 request of `client`.

    The handler runs on `before-sign`, so the header is part of the SigV4 signature.
    Reads carry it too; fencegate ignores it there.
    """

    def add_fencing_headers(request, **_kwargs):
        request.headers["Fencing-Token"] = str(token)
        if resource is not None:
            request.headers["Fencing-Resource"] = resource

    client.meta.events.register("before-sign.s3.*", add_fencing_headers)
    return client


def s3_client(
    endpoint: str,
    token=None,
    resource: str | None = None,
    access_key: str = ACCESS_KEY,
    secret_key: str = SECRET_KEY,
    read_timeout: float = 60,
):
    cfg = Config(
        signature_version="s3v4",
        s3={"addressing_style": "path"},
        retries={"total_max_attempts": 1},
        connect_timeout=10,
        read_timeout=read_timeout,
    )
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        config=cfg,
    )
    if token is not None:
        attach_fencing_token(client, token, resource)
    return client


def status_of(exc: ClientError) -> int:
    return exc.response["ResponseMetadata"]["HTTPStatusCode"]


def code_of(exc: ClientError) -> str:
    return exc.response.get("Error", {}).get("Code", "")


def header_of(exc: ClientError, name: str):
    return exc.response["ResponseMetadata"].get("HTTPHeaders", {}).get(name.lower())


def head_status(client, bucket: str, key: str) -> int:
    try:
        return client.head_object(Bucket=bucket, Key=key)["ResponseMetadata"]["HTTPStatusCode"]
    except ClientError as exc:
        return status_of(exc)


def read_object(client, bucket: str, key: str) -> bytes:
    return client.get_object(Bucket=bucket, Key=key)["Body"].read()


def unique(prefix: str) -> str:
    """A bucket-name-safe unique string."""
    return f"{prefix}-{os.getpid()}-{time.monotonic_ns() % 10**12}"


_SAMPLE_RE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{([^}]*)\})?\s+(\S+)")
_LABEL_RE = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def metric_samples(fg: FenceGate, token: str | None = None) -> dict:
    """`GET /metrics` of this fencegate process: {(name, frozenset of (label, value)): value}.
    Compare two of these taken from the same process around the requests a test makes."""
    r = fg.admin("GET", "/metrics", token=token)
    assert r.status_code == 200, (r.status_code, r.text[:300])
    out = {}
    for line in r.text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE_RE.match(line)
        if m:
            out[(m.group(1), frozenset(_LABEL_RE.findall(m.group(2) or "")))] = float(m.group(3))
    return out


def metric(samples: dict, name: str, **labels) -> float:
    """The value of the series `name` with exactly `labels` in `samples`; 0 if not emitted."""
    return samples.get((name, frozenset(labels.items())), 0.0)


# --------------------------------------------------------------------------------------------
# raw signed HTTP (for requests boto3 will not send: half bodies, odd paths, odd headers)
# --------------------------------------------------------------------------------------------


class _S3PathSigV4(SigV4Auth):
    """SigV4 the way S3 does it: no dot-segment removal; the canonical path is the decoded
    path URI-encoded once (so `%2E%2E` and `..` sign alike, as a server computes it)."""

    def _normalize_url_path(self, path):
        return urllib.parse.quote(urllib.parse.unquote(path), safe="/~")


def sign_headers(
    method: str,
    host: str,
    port: int,
    path: str,
    headers: dict | None = None,
    access_key: str = ACCESS_KEY,
    secret_key: str = SECRET_KEY,
    payload: bytes | None = None,
    session_token: str | None = None,
) -> list[tuple[str, str]]:
    """Return the header list (Host first) of a SigV4-signed request with UNSIGNED-PAYLOAD, or
    with `payload`'s SHA-256 when given (fencegate's own endpoints take only signed bodies).

    `path` is sent and signed verbatim (it may hold a query string).
    """
    digest = "UNSIGNED-PAYLOAD" if payload is None else hashlib.sha256(payload).hexdigest()
    hdrs = {"Host": f"{host}:{port}", "x-amz-content-sha256": digest}
    hdrs.update(headers or {})
    req = AWSRequest(method=method, url=f"http://{host}:{port}{path}", headers=hdrs)
    _S3PathSigV4(Credentials(access_key, secret_key, session_token), "s3", REGION).add_auth(req)
    return list(req.headers.items())


def build_head(method: str, path: str, headers: list[tuple[str, str]]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1"]
    lines += [f"{k}: {v}" for k, v in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


@dataclass
class RawResponse:
    status: int | None  # None: no status line arrived
    headers: dict
    body: bytes
    error: str | None = None  # connection error while reading, if any

    def code(self) -> str:
        return s3_error_code(self.body)


def s3_error_code(body: bytes) -> str:
    try:
        root = ET.fromstring(body)
    except ET.ParseError:
        return ""
    el = root.find("Code")
    if el is None:
        el = root.find("{*}Code")
    return el.text if el is not None and el.text else ""


def read_response(sock: socket.socket, timeout: float = 30.0) -> RawResponse:
    """Read one HTTP/1.1 final response (status, headers, body), bounded in time.

    Interim `100 Continue` responses are skipped.
    """
    sock.settimeout(timeout)
    deadline = time.monotonic() + timeout
    buf = b""
    while True:
        while b"\r\n\r\n" not in buf:
            if time.monotonic() > deadline:
                return RawResponse(None, {}, buf, "timeout")
            try:
                chunk = sock.recv(65536)
            except socket.timeout:
                return RawResponse(None, {}, buf, "timeout")
            except OSError as exc:
                return RawResponse(None, {}, buf, f"{type(exc).__name__}: {exc}")
            if not chunk:
                return RawResponse(None, {}, buf, "closed")
            buf += chunk
        head, _, rest = buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        if 100 <= status < 200:
            buf = rest
            continue
        headers = {}
        for line in lines[1:]:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        return RawResponse(status, headers, _read_body(sock, rest, headers, deadline), None)


def _read_body(sock, rest: bytes, headers: dict, deadline: float) -> bytes:
    body = rest
    if "content-length" in headers:
        want = int(headers["content-length"])
        while len(body) < want and time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except (socket.timeout, OSError):
                break
            if not chunk:
                break
            body += chunk
        return body[:want]
    if headers.get("transfer-encoding", "").lower() == "chunked":
        raw = body
        out = b""
        while time.monotonic() < deadline:
            if b"\r\n" in raw:
                size_line, _, after = raw.partition(b"\r\n")
                try:
                    size = int(size_line.split(b";")[0], 16)
                except ValueError:
                    break
                if size == 0:
                    return out
                if len(after) >= size + 2:
                    out += after[:size]
                    raw = after[size + 2 :]
                    continue
            try:
                chunk = sock.recv(65536)
            except (socket.timeout, OSError):
                break
            if not chunk:
                break
            raw += chunk
        return out
    return body


def connect(addr: tuple, timeout: float = 10.0) -> socket.socket:
    return socket.create_connection(addr, timeout=timeout)


def raw_request(
    addr: tuple,
    method: str,
    path: str,
    headers: list[tuple[str, str]],
    body: bytes = b"",
    timeout: float = 30.0,
) -> RawResponse:
    """Send one complete request on a fresh connection and read the response."""
    with connect(addr) as sock:
        try:
            sock.sendall(build_head(method, path, headers) + body)
        except OSError as exc:
            resp = read_response(sock, timeout=5)
            if resp.status is None:
                resp.error = f"send failed: {exc!r}; then {resp.error}"
            return resp
        return read_response(sock, timeout=timeout)


def signed_raw_request(
    fg: FenceGate,
    method: str,
    path: str,
    headers: dict | None = None,
    body: bytes = b"",
    timeout: float = 30.0,
    **sign_kw,
) -> RawResponse:
    host, port = fg.s3_addr
    h = dict(headers or {})
    if method in ("PUT", "POST") or body:
        h.setdefault("Content-Length", str(len(body)))
    if path.startswith("/_fencegate/"):
        sign_kw.setdefault("payload", body)
    hdrs = sign_headers(method, host, port, path, h, **sign_kw)
    return raw_request(fg.s3_addr, method, path, hdrs, body, timeout=timeout)


def http_get_ok(url: str) -> bool:
    try:
        return requests.get(url, timeout=5).status_code == 200
    except requests.RequestException:
        return False


def assert_still_serving(fg: FenceGate, bucket: str):
    """fencegate is alive, healthy, and still accepts a fenced write and serves a read."""
    assert fg.alive(), "fencegate process died\n" + fg.log_tail()
    assert fg.admin("GET", "/healthz").status_code == 200
    key = unique("alive")
    c = fg.client(token=1, resource=unique("alive-res"))
    c.put_object(Bucket=bucket, Key=key, Body=b"still here")
    assert read_object(c, bucket, key) == b"still here"


# --------------------------------------------------------------------------------------------
# third-party servers (moto_server, redis-server, etcd): a port each, started and stopped
# --------------------------------------------------------------------------------------------

# These servers take a port on their command line, so a test picks one with `free_port()` and
# another process can take it before the server binds it. Every start goes through
# `retry_if_port_taken`: the server's own log says when that happened, and it starts again on
# a new port.
PORT_ATTEMPTS = 5
PORT_TAKEN_RE = re.compile(r"address already in use", re.IGNORECASE)  # redis, moto (werkzeug), etcd
SERVER_LOG_TAIL = 3000  # characters of a server's log quoted when it did not start


class ServerExited(AssertionError):
    """A server process ended before it was ready; the message has its log's tail."""


class PortTaken(ServerExited):
    """A server ended because its port was in use: another process took it after `free_port()`
    let it go. `retry_if_port_taken` starts it again on a new port."""


def log_size(path: Path) -> int:
    """How long `path` is now: where the next start's part of an appended log begins."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def log_since(path: Path, offset: int = 0) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def raise_if_exited(proc: subprocess.Popen, what: str, log_path: Path, log_from: int = 0):
    """PortTaken if `proc` has exited and its log (from byte `log_from`: this start's part) says
    its port was in use; ServerExited if it has exited otherwise; nothing while it runs."""
    if proc.poll() is None:
        return
    text = log_since(log_path, log_from)
    kind = PortTaken if PORT_TAKEN_RE.search(text) else ServerExited
    raise kind(f"{what} exited with {proc.returncode} before it was ready; its log:\n"
               + text[-SERVER_LOG_TAIL:])


def wait_for_server(proc: subprocess.Popen, ready, what: str, log_path: Path, log_from: int = 0,
                    timeout: float = 30.0):
    """Polls `ready()` until it is true; ends at once (`raise_if_exited`) if `proc` exits first."""

    def up():
        raise_if_exited(proc, what, log_path, log_from)
        answered = ready()
        raise_if_exited(proc, what, log_path, log_from)  # what answered was not `proc`
        return answered

    try:
        wait_until(up, timeout, what=f"{what} to be ready")
    except ServerExited:
        raise
    except AssertionError as exc:
        raise AssertionError(f"{exc}; its log:\n" + log_since(log_path, log_from)[-SERVER_LOG_TAIL:]) from None


def retry_if_port_taken(launch, attempts: int = PORT_ATTEMPTS):
    """Runs `launch()`, which picks its ports with `free_port()` and starts a server on them, and
    runs it again (so on new ports) while the server could not bind one (PortTaken), at most
    `attempts` times. Returns what `launch()` returns."""
    for attempt in range(1, attempts + 1):
        try:
            return launch()
        except PortTaken:
            if attempt == attempts:
                raise


def stop_process(proc: subprocess.Popen | None):
    """SIGTERM (after SIGCONT: a stopped process cannot act on it), then SIGKILL if it does not
    exit in time."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGCONT)
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


MOTO_ACCESS_KEY = "testing"
MOTO_SECRET_KEY = "testing"


class MotoServer:
    """A moto_server of its own on 127.0.0.1, its log in `workdir`."""

    def __init__(self, workdir: Path):
        self.log_path = workdir / "moto.log"
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self):
        retry_if_port_taken(self._launch)
        return self

    def _launch(self):
        exe = shutil.which("moto_server")
        cmd = [exe] if exe else [sys.executable, "-m", "moto.server"]
        port = free_port()
        log_from = log_size(self.log_path)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd + ["-H", "127.0.0.1", "-p", str(port)],
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{port}"
        try:
            wait_for_server(self.proc, lambda: http_get_ok(self.url + "/moto-api/"), "moto_server",
                            self.log_path, log_from, timeout=30)
        except BaseException:
            stop_process(self.proc)
            raise

    def stop(self):
        stop_process(self.proc)

    def client(self):
        return s3_client(self.url, access_key=MOTO_ACCESS_KEY, secret_key=MOTO_SECRET_KEY)

    def upstream_config(self) -> dict:
        return {
            "kind": "s3",
            "endpoint": self.url,
            "region": "us-east-1",
            "access_key_id": MOTO_ACCESS_KEY,
            "secret_access_key": MOTO_SECRET_KEY,
        }


class RedisServer:
    """A redis-server on 127.0.0.1 with an fsync-always append-only file in `workdir`, so a
    restart (after `kill9()` too) keeps every acknowledged write. The first `start()` picks the
    port (a new one if another process took it meanwhile); later ones come back on that port,
    which fencegate's config names. `freeze()` (SIGSTOP) makes it hold its connections open and
    answer nothing until `thaw()`."""

    def __init__(self, workdir: Path, name: str = "redis"):
        self.dir = workdir
        self.name = name
        self.port = 0
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.dir / "redis.log"

    def start(self, *extra: str):
        """Starts it (with `extra` arguments) and returns once it answers PING."""
        if shutil.which("redis-server") is None:
            raise AssertionError("redis-server is not installed (scripts/test installs it)")
        if self.port:
            self._launch(self.port, extra)
        else:
            retry_if_port_taken(lambda: self._launch(free_port(), extra))
        return self

    def _launch(self, port: int, extra: tuple):
        self.port = port
        log_from = log_size(self.log_path)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1",
                 "--dir", str(self.dir), "--save", "", "--appendonly", "yes", "--appendfsync", "always",
                 "--daemonize", "no", *extra],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        wait_for_server(self.proc, self._answers_as_itself, f"redis-server {self.name}", self.log_path,
                        log_from, timeout=20)

    def _answers_as_itself(self) -> bool:
        """It answers, and as this process (not another server that took the port first)."""
        return f"process_id:{self.proc.pid}\r\n".encode() in self.command(b"INFO server", timeout=1)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def command(self, line: bytes, timeout: float = 2.0) -> bytes:
        """One inline command; its raw reply (b"" if Redis does not answer)."""
        if not self.running():
            raise AssertionError(f"redis-server {self.name} is not running:\n" + self.log_tail())
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as s:
                s.sendall(line + b"\r\n")
                return s.recv(4096)
        except OSError:
            return b""

    def ping(self) -> bool:
        return self.command(b"PING").startswith(b"+PONG")

    def freeze(self):
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self):
        if self.running():
            os.kill(self.proc.pid, signal.SIGCONT)

    def kill9(self):
        if self.running():
            self.thaw()  # a stopped process would not take the kill until continued
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self):
        stop_process(self.proc)

    def log_tail(self) -> str:
        return log_since(self.log_path)[-2000:]


def redis_version() -> tuple:
    """The installed redis-server's version, e.g. (7, 0, 15); (0,) if it says none."""
    if shutil.which("redis-server") is None:
        return (0,)
    out = subprocess.run([shutil.which("redis-server"), "--version"], capture_output=True, text=True,
                         timeout=10).stdout
    m = re.search(r"v=(\d+)\.(\d+)\.(\d+)", out)
    return tuple(int(g) for g in m.groups()) if m else (0,)


class RespError(Exception):
    """An error reply (`-ERR ...`) from Redis."""


class RespClient:
    """A RESP client on one connection to 127.0.0.1:`port`; every read is bounded by `timeout`.
    `call()` sends a command and returns its decoded reply (an error reply raises RespError);
    `send()` and `read()` split the two, for a command that blocks Redis (DEBUG SLEEP)."""

    def __init__(self, port: int, timeout: float = 5.0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def send(self, *args):
        parts = [a if isinstance(a, bytes) else str(a).encode() for a in args]
        self.sock.sendall(b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts))

    def call(self, *args):
        self.send(*args)
        return self.read()

    def _fill(self):
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("redis closed the connection")
        self.buf += chunk

    def _line(self) -> bytes:
        while b"\r\n" not in self.buf:
            self._fill()
        line, _, self.buf = self.buf.partition(b"\r\n")
        return line

    def read(self):
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            raise RespError(rest.decode())
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            while len(self.buf) < n + 2:
                self._fill()
            data, self.buf = self.buf[:n], self.buf[n + 2:]
            return data.decode()
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self.read() for _ in range(n)]
        raise AssertionError(f"unexpected RESP line {line!r}")

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass


def redis_call(port: int, *args, timeout: float = 5.0):
    """One command on a fresh connection to 127.0.0.1:`port`; its decoded reply."""
    client = RespClient(port, timeout=timeout)
    try:
        return client.call(*args)
    finally:
        client.close()


# --------------------------------------------------------------------------------------------
# HTTPS, checksums and aws-chunked bodies (test_s3_surface.py, test_transparency.py)
# --------------------------------------------------------------------------------------------

import base64 as _base64
import hashlib as _hashlib
import hmac as _hmac
import ssl as _ssl
import zlib as _zlib

# Names the test certificate covers: loopback, and the virtual-hosted test domain.
TEST_DOMAIN = "s3.fencegate.test"


@dataclass
class TlsFiles:
    """A throwaway CA and a server certificate it signed (never committed: made per run)."""

    ca: Path
    cert: Path
    key: Path


def make_test_tls(directory: Path) -> TlsFiles:
    """Creates a test CA and a server certificate for 127.0.0.1, localhost, the test domain and
    `*.<test domain>`, with the `openssl` CLI. The CA is what clients trust: rustls (webpki)
    does not accept a self-signed leaf that is its own CA."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca = directory / "ca.key", directory / "ca.pem"
    key, csr, cert = directory / "server.key", directory / "server.csr", directory / "server.pem"
    ext = directory / "server.ext"
    ext.write_text(
        "basicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature\n"
        "extendedKeyUsage=serverAuth\n"
        f"subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:{TEST_DOMAIN},DNS:*.{TEST_DOMAIN}\n"
    )
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    steps = [
        ["openssl", "req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", "2",
         "-subj", "/CN=fencegate throwaway test CA"],
        ["openssl", "req", "-new", *ec, "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1"],
        ["openssl", "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key,
         "-set_serial", str(int.from_bytes(os.urandom(8), "big")), "-days", "2",
         "-out", cert, "-extfile", ext],
    ]
    for cmd in steps:
        r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise AssertionError(f"{' '.join(map(str, cmd))} failed: {r.stderr}")
    return TlsFiles(ca=ca, cert=cert, key=key)


def tls_config(tls: TlsFiles) -> dict:
    """The `[server]` keys that turn fencegate's S3 listener into HTTPS."""
    return {"server": {"tls_cert_path": str(tls.cert), "tls_key_path": str(tls.key)}}


def start_fencegate(workdir: Path, config: dict | None = None, upstream: dict | None = None,
                    https: TlsFiles | None = None) -> FenceGate:
    """Starts a FenceGate outside the function-scoped `fencegate` fixture (module fixtures).
    With `https`, the S3 listener speaks TLS and `s3_url` is an https:// URL."""
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = base_config(workdir)
    if upstream is not None:
        cfg["upstream"] = upstream
    if https is not None:
        cfg = merge(cfg, tls_config(https))
    if config:
        cfg = merge(cfg, config)
    fg = FenceGate(workdir=workdir, config=cfg)
    fg.start()
    if https is not None:
        fg.s3_url = fg.s3_url.replace("http://", "https://", 1)
    return fg


def s3_client_ex(
    endpoint: str,
    token=None,
    verify=None,
    access_key: str = ACCESS_KEY,
    secret_key: str = SECRET_KEY,
    addressing_style: str = "path",
    signature_version: str = "s3v4",
    **config_kw,
):
    """Like `s3_client`, plus a CA bundle (`verify`), the addressing style, the signature
    version and any other botocore Config keyword (e.g. request_checksum_calculation)."""
    cfg = Config(
        signature_version=signature_version,
        s3={"addressing_style": addressing_style},
        retries={"total_max_attempts": 1},
        connect_timeout=10,
        read_timeout=60,
        **config_kw,
    )
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        config=cfg,
        verify=str(verify) if verify is not None else None,
    )
    if token is not None:
        attach_fencing_token(client, token)
    return client


def _crc_table(poly: int, width: int) -> list:
    table = []
    for i in range(256):
        crc = i
        for _ in range(8):
            crc = (crc >> 1) ^ poly if crc & 1 else crc >> 1
        table.append(crc & ((1 << width) - 1))
    return table


_CRC32C_TABLE = _crc_table(0x82F63B78, 32)
_CRC64NVME_TABLE = _crc_table(0x9A6C9329AC4BC9B5, 64)


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc = _CRC32C_TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def crc64nvme(data: bytes) -> int:
    crc = 0xFFFFFFFFFFFFFFFF
    for b in data:
        crc = _CRC64NVME_TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFFFFFFFFFF


assert crc32c(b"123456789") == 0xE3069283
assert crc64nvme(b"123456789") == 0xAE8B14860A799888

# Checksum algorithms of S3: name -> (trailer header, digest function returning bytes).
CHECKSUMS = {
    "CRC32": ("x-amz-checksum-crc32", lambda d: _zlib.crc32(d).to_bytes(4, "big")),
    "CRC32C": ("x-amz-checksum-crc32c", lambda d: crc32c(d).to_bytes(4, "big")),
    "CRC64NVME": ("x-amz-checksum-crc64nvme", lambda d: crc64nvme(d).to_bytes(8, "big")),
    "SHA1": ("x-amz-checksum-sha1", lambda d: _hashlib.sha1(d).digest()),
    "SHA256": ("x-amz-checksum-sha256", lambda d: _hashlib.sha256(d).digest()),
}


def checksum_b64(algorithm: str, data: bytes) -> str:
    return _base64.b64encode(CHECKSUMS[algorithm][1](data)).decode()


def wrong_checksum_b64(algorithm: str, data: bytes) -> str:
    """A well-formed checksum of the right length that does not match `data`."""
    digest = bytearray(CHECKSUMS[algorithm][1](data))
    digest[-1] ^= 0x01
    return _base64.b64encode(bytes(digest)).decode()


def aws_chunked_unsigned(data: bytes, trailer: str, value_b64: str, chunk: int = 64 * 1024) -> bytes:
    """`STREAMING-UNSIGNED-PAYLOAD-TRAILER` framing (what SDKs send over HTTPS by default)."""
    out = bytearray()
    for i in range(0, len(data), chunk):
        part = data[i : i + chunk]
        out += f"{len(part):x}\r\n".encode() + part + b"\r\n"
    out += b"0\r\n" + f"{trailer}:{value_b64}\r\n\r\n".encode()
    return bytes(out)


def aws_chunked_headers(data: bytes, trailer: str, algorithm: str | None = None) -> dict:
    h = {
        "x-amz-content-sha256": "STREAMING-UNSIGNED-PAYLOAD-TRAILER",
        "Content-Encoding": "aws-chunked",
        "x-amz-decoded-content-length": str(len(data)),
        "x-amz-trailer": trailer,
    }
    if algorithm:
        h["x-amz-sdk-checksum-algorithm"] = algorithm
    return h


def _sha256_hex(data: bytes) -> str:
    return _hashlib.sha256(data).hexdigest()


def _signing_key(secret_key: str, date: str, region: str = REGION, service: str = "s3") -> bytes:
    k = _hmac.new(("AWS4" + secret_key).encode(), date.encode(), _hashlib.sha256).digest()
    for part in (region, service, "aws4_request"):
        k = _hmac.new(k, part.encode(), _hashlib.sha256).digest()
    return k


def signed_chunked_request(
    host: str,
    port: int,
    path: str,
    data: bytes,
    extra_headers: dict | None = None,
    trailer: tuple | None = None,
    chunk: int = 64 * 1024,
    tamper_chunk: int | None = None,
    tamper_trailer_signature: bool = False,
    access_key: str = ACCESS_KEY,
    secret_key: str = SECRET_KEY,
) -> tuple:
    """A PUT with SigV4 chunk signatures (`STREAMING-AWS4-HMAC-SHA256-PAYLOAD`, or
    `...-PAYLOAD-TRAILER` when `trailer=(name, base64 value)` is given).

    `tamper_chunk=i` flips one byte of chunk `i` after it was signed (its signature no longer
    matches); `tamper_trailer_signature` breaks the trailer's signature. Returns (headers, body).
    """
    sha_mode = "STREAMING-AWS4-HMAC-SHA256-PAYLOAD-TRAILER" if trailer else "STREAMING-AWS4-HMAC-SHA256-PAYLOAD"
    chunks = [data[i : i + chunk] for i in range(0, len(data), chunk)] + [b""]

    def frame_len(n: int) -> int:
        return len(f"{n:x};chunk-signature=".encode()) + 64 + 2 + n + (2 if n else 0)

    length = sum(frame_len(len(c)) for c in chunks)
    trailer_text = b""
    if trailer:
        trailer_text = f"{trailer[0]}:{trailer[1]}".encode()
        length += len(trailer_text) + 2 + len(b"x-amz-trailer-signature:") + 64 + 2 + 2
    else:
        length += 2
    headers = {
        "x-amz-content-sha256": sha_mode,
        "Content-Encoding": "aws-chunked",
        "x-amz-decoded-content-length": str(len(data)),
        "Content-Length": str(length),
    }
    if trailer:
        headers["x-amz-trailer"] = trailer[0]
    headers.update(extra_headers or {})
    signed = sign_headers("PUT", host, port, path, headers, access_key=access_key, secret_key=secret_key)
    hmap = {k.lower(): v for k, v in signed}
    amz_date = hmap["x-amz-date"]
    scope = f"{amz_date[:8]}/{REGION}/s3/aws4_request"
    prev = hmap["authorization"].rsplit("Signature=", 1)[1]
    key = _signing_key(secret_key, amz_date[:8])
    empty = _sha256_hex(b"")
    body = bytearray()
    for i, c in enumerate(chunks):
        sts = "\n".join(["AWS4-HMAC-SHA256-PAYLOAD", amz_date, scope, prev, empty, _sha256_hex(c)])
        sig = _hmac.new(key, sts.encode(), _hashlib.sha256).hexdigest()
        prev = sig
        sent = c
        if tamper_chunk == i and c:
            sent = bytes([c[0] ^ 0x01]) + c[1:]
        body += f"{len(c):x};chunk-signature={sig}\r\n".encode() + sent + (b"\r\n" if c else b"")
    if trailer:
        sts = "\n".join(["AWS4-HMAC-SHA256-TRAILER", amz_date, scope, prev, _sha256_hex(trailer_text + b"\n")])
        sig = _hmac.new(key, sts.encode(), _hashlib.sha256).hexdigest()
        if tamper_trailer_signature:
            sig = ("0" if sig[0] != "0" else "1") + sig[1:]
        body += trailer_text + b"\r\n" + f"x-amz-trailer-signature:{sig}\r\n\r\n".encode()
    else:
        body += b"\r\n"
    assert len(body) == length, (len(body), length)
    return signed, bytes(body)


def connect_any(addr: tuple, ca: Path | None = None, server_hostname: str | None = None,
                timeout: float = 10.0, alpn: list | None = None):
    """A TCP connection, wrapped in TLS (trusting `ca`) when `ca` is given."""
    sock = socket.create_connection(addr, timeout=timeout)
    if ca is None:
        return sock
    ctx = _ssl.create_default_context(cafile=str(ca))
    if alpn:
        ctx.set_alpn_protocols(alpn)
    return ctx.wrap_socket(sock, server_hostname=server_hostname or addr[0])


def raw_request_any(addr: tuple, method: str, path: str, headers: list, body: bytes = b"",
                    ca: Path | None = None, server_hostname: str | None = None,
                    timeout: float = 30.0) -> RawResponse:
    """`raw_request`, over TLS when `ca` is given."""
    with connect_any(addr, ca, server_hostname) as sock:
        try:
            sock.sendall(build_head(method, path, headers) + body)
        except OSError as exc:
            resp = read_response(sock, timeout=5)
            if resp.status is None:
                resp.error = f"send failed: {exc!r}; then {resp.error}"
            return resp
        return read_response(sock, timeout=timeout)


# --------------------------------------------------------------------------------------------
# a minimal HTTP/2 client (frames, not a library): what exactly the server sends on a stream
# --------------------------------------------------------------------------------------------

H2_FRAME_NAMES = {0: "DATA", 1: "HEADERS", 3: "RST_STREAM", 4: "SETTINGS", 6: "PING", 7: "GOAWAY",
                  8: "WINDOW_UPDATE"}


def _hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = bytearray([first | limit])
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _hpack_literal(name: str, value: str) -> bytes:
    """Literal header field without indexing, new name, no Huffman coding (RFC 7541 6.2.2)."""
    n, v = name.lower().encode(), value.encode()
    return b"\x00" + _hpack_int(len(n), 7) + n + _hpack_int(len(v), 7) + v


def _h2_frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


@dataclass
class H2Frame:
    kind: str
    flags: int
    stream: int
    payload: bytes

    @property
    def end_stream(self) -> bool:
        return self.kind in ("DATA", "HEADERS") and bool(self.flags & 0x1)

    @property
    def error_code(self):
        if self.kind == "RST_STREAM":
            return int.from_bytes(self.payload[:4], "big")
        if self.kind == "GOAWAY":
            return int.from_bytes(self.payload[4:8], "big")
        return None


def h2_request(addr: tuple, method: str, path: str, headers: list, first_data: bytes = b"",
               end_stream: bool = False, ca: Path | None = None, wait: float = 3.0) -> list:
    """Sends one request on a fresh HTTP/2 connection (h2c prior knowledge, or TLS with ALPN h2
    when `ca` is given): HEADERS, then `first_data` in DATA frames of at most 16 KiB (with
    END_STREAM when `end_stream`). Returns every frame the server sent in `wait` seconds (or
    until the connection closed), in order. `headers` is a signed list whose Host becomes
    :authority."""
    sock = connect_any(addr, ca, alpn=["h2"] if ca else None, timeout=wait)
    if ca is not None:
        assert sock.selected_alpn_protocol() == "h2", sock.selected_alpn_protocol()
    authority = next((v for k, v in headers if k.lower() == "host"), f"{addr[0]}:{addr[1]}")
    block = (_hpack_literal(":method", method) + _hpack_literal(":scheme", "https" if ca else "http")
             + _hpack_literal(":path", path) + _hpack_literal(":authority", authority))
    for k, v in headers:
        if k.lower() not in ("host", "connection", "expect"):
            block += _hpack_literal(k, v)
    no_body = end_stream and not first_data
    out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _h2_frame(4, 0, 0, b"")
    out += _h2_frame(1, 0x4 | (0x1 if no_body else 0), 1, block)
    chunks = [first_data[i : i + 16384] for i in range(0, len(first_data), 16384)]
    for i, c in enumerate(chunks):
        last = end_stream and i == len(chunks) - 1
        out += _h2_frame(0, 0x1 if last else 0, 1, c)
    frames: list = []
    buf = b""
    deadline = time.monotonic() + wait
    try:
        sock.sendall(out)
        while time.monotonic() < deadline:
            sock.settimeout(max(0.05, deadline - time.monotonic()))
            try:
                data = sock.recv(65536)
            except (socket.timeout, _ssl.SSLError, OSError):
                break
            if not data:
                frames.append(H2Frame("EOF", 0, 0, b""))
                break
            buf += data
            while len(buf) >= 9:
                length = int.from_bytes(buf[:3], "big")
                if len(buf) < 9 + length:
                    break
                kind, flags = buf[3], buf[4]
                stream = int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF
                payload, buf = buf[9 : 9 + length], buf[9 + length :]
                frames.append(H2Frame(H2_FRAME_NAMES.get(kind, str(kind)), flags, stream, payload))
                if kind == 4 and not flags & 0x1:
                    sock.sendall(_h2_frame(4, 0x1, 0, b""))  # SETTINGS ack
                if kind == 6 and not flags & 0x1:
                    sock.sendall(_h2_frame(6, 0x1, 0, payload))  # PING ack
            if any(f.stream == 1 and f.kind == "RST_STREAM" for f in frames):
                break
            if any(f.stream == 1 and f.end_stream for f in frames):
                deadline = min(deadline, time.monotonic() + 0.5)  # a reset may still follow
    finally:
        sock.close()
    return frames


_HUFFMAN_DIGITS = {"00000": "0", "00001": "1", "00010": "2", "011001": "3", "011010": "4", "011011": "5",
                   "011100": "6", "011101": "7", "011110": "8", "011111": "9"}


def _huffman_digits(data: bytes) -> str:
    """Decodes an HPACK Huffman string made of digits only (enough for :status)."""
    bits = "".join(f"{b:08b}" for b in data)
    out, cur = "", ""
    for bit in bits:
        cur += bit
        if cur in _HUFFMAN_DIGITS:
            out += _HUFFMAN_DIGITS[cur]
            cur = ""
    assert set(cur) <= {"1"} and len(cur) < 8, f"not a digit string: {data!r}"
    return out


def h2_status(frames: list):
    """The :status of stream 1's first HEADERS frame. Handles the encodings a server uses for
    :status on a fresh connection: an indexed static entry, or a literal with the static name
    index 8 (raw or Huffman-coded digits)."""
    for f in frames:
        if f.stream == 1 and f.kind == "HEADERS":
            p = f.payload
            if f.flags & 0x8:  # PADDED
                p = p[1 : len(p) - p[0]]
            if f.flags & 0x20:  # PRIORITY
                p = p[5:]
            static = {0x88: 200, 0x89: 204, 0x8A: 206, 0x8B: 304, 0x8C: 400, 0x8D: 404, 0x8E: 500}
            if p[0] in static:
                return static[p[0]]
            if p[0] in (0x48, 0x08, 0x18, 0x49, 0x09, 0x19, 0x4A, 0x0A, 0x1A, 0x4B, 0x0B, 0x1B, 0x4C, 0x0C,
                        0x1C, 0x4D, 0x0D, 0x1D, 0x4E, 0x0E, 0x1E):
                huffman, length = p[1] & 0x80, p[1] & 0x7F
                raw = p[2 : 2 + length]
                return int(_huffman_digits(raw) if huffman else raw.decode())
            raise AssertionError(f"cannot read :status from {p[:16]!r}")
    return None


def h2_body(frames: list) -> bytes:
    return b"".join(f.payload for f in frames if f.stream == 1 and f.kind == "DATA")
