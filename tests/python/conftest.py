"""Fixtures that start fencegate and moto_server as real processes and always stop them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fencegate_testlib import (  # noqa: E402
    FenceGate,
    base_config,
    free_port,
    http_get_ok,
    merge,
    s3_client,
)

# Keep the user's own AWS configuration out of every client the tests make.
os.environ["AWS_CONFIG_FILE"] = os.devnull
os.environ["AWS_SHARED_CREDENTIALS_FILE"] = os.devnull
for _var in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_DEFAULT_PROFILE"):
    os.environ.pop(_var, None)

MOTO_ACCESS_KEY = "testing"
MOTO_SECRET_KEY = "testing"


class MotoServer:
    def __init__(self, url: str, proc: subprocess.Popen):
        self.url = url
        self.proc = proc

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


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory):
    exe = shutil.which("moto_server")
    cmd = [exe] if exe else [sys.executable, "-m", "moto.server"]
    log_path = tmp_path_factory.mktemp("moto") / "moto.log"
    proc = None
    url = None
    for _attempt in range(3):  # a free port can be taken between probe and bind
        port = free_port()
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                cmd + ["-H", "127.0.0.1", "-p", str(port)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proc.poll() is None:
            if http_get_ok(url + "/moto-api/"):
                break
            time.sleep(0.2)
        if proc.poll() is None and http_get_ok(url + "/moto-api/"):
            break
        _stop(proc)
        proc = None
    if proc is None:
        pytest.fail("moto_server did not start:\n" + log_path.read_text(errors="replace")[-3000:])
    try:
        yield MotoServer(url, proc)
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen):
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture
def fencegate(tmp_path):
    """Factory: `fencegate(**overrides)` starts an instance and returns a FenceGate.

    Keyword arguments:
      config   -- dict merged over the default config (e.g. {"fencing": {"require_token": False}})
      upstream -- replaces the [upstream] table
      env      -- extra environment variables for the process
      local_buckets -- buckets to create as directories of the local upstream before start
    Every instance is stopped at teardown; its log tail is printed (pytest shows it on failure).
    """
    started: list[FenceGate] = []

    def start(
        config: dict | None = None,
        upstream: dict | None = None,
        env: dict | None = None,
        local_buckets: tuple = (),
    ):
        workdir = tmp_path / f"fg{len(started)}"
        workdir.mkdir()
        cfg = base_config(workdir)
        for name in local_buckets:
            (workdir / "objects" / name).mkdir(parents=True)
        if upstream is not None:
            cfg["upstream"] = upstream
        if config:
            cfg = merge(cfg, config)
        fg = FenceGate(workdir=workdir, config=cfg, env=dict(env or {}))
        started.append(fg)
        fg.start()
        return fg

    try:
        yield start
    finally:
        for fg in started:
            try:
                fg.stop()
            except Exception:  # noqa: BLE001 - teardown must try every instance
                fg.kill9()
            print(fg.log_tail(40))


@pytest.fixture
def fg(fencegate):
    """A default fencegate: embedded store, local upstream, require_token = true."""
    return fencegate()


@pytest.fixture
def bucket(fg):
    """A bucket created through fencegate on the default instance."""
    name = "bkt1"
    fg.client().create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory):
    """A throwaway test CA and server certificate (127.0.0.1, localhost, s3.fencegate.test and
    *.s3.fencegate.test), made with openssl for this run only."""
    from fencegate_testlib import make_test_tls

    return make_test_tls(tmp_path_factory.mktemp("tls"))
