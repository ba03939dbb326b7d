"""Helpers shared by the black-box tests: processes, config, S3 clients, raw signed HTTP.

Everything here talks to 127.0.0.1 only, and every wait is bounded in time.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(pred, timeout: float, interval: float = 0.05, what: str = "condition"):
    """Poll `pred` until it returns a truthy value, at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last_exc = None
    while time.monotonic() < deadline:
        try:
            value = pred()
            if value:
                return value
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
        "credentials": [{"access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY}],
        "fencing": {"require_token": True},
    }


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
) -> list[tuple[str, str]]:
    """Return the header list (Host first) of a SigV4-signed request with UNSIGNED-PAYLOAD.

    `path` is sent and signed verbatim (it may hold a query string).
    """
    hdrs = {"Host": f"{host}:{port}", "x-amz-content-sha256": "UNSIGNED-PAYLOAD"}
    hdrs.update(headers or {})
    req = AWSRequest(method=method, url=f"http://{host}:{port}{path}", headers=hdrs)
    _S3PathSigV4(Credentials(access_key, secret_key), "s3", REGION).add_auth(req)
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
