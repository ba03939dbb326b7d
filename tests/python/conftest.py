"""Fixtures that start fencegate, moto_server, redis-server and Ceph RGW as real processes and
always stop them."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ceph_rgw import CephRgw, missing_ceph_programs  # noqa: E402
from fencegate_testlib import (  # noqa: E402
    FenceGate,
    MotoServer,
    RedisServer,
    base_config,
    merge,
    seed_local_buckets,
    unique,
)
from holding_upstream import HELD_PREFIX, HELD_RESOURCE, HeldS3, HoldingUpstream  # noqa: E402
from recording_api import RecordingApi  # noqa: E402

# Keep the user's own AWS configuration out of every client the tests make.
os.environ["AWS_CONFIG_FILE"] = os.devnull
os.environ["AWS_SHARED_CREDENTIALS_FILE"] = os.devnull
for _var in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_DEFAULT_PROFILE"):
    os.environ.pop(_var, None)


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory):
    """One moto_server for the session (tests use buckets of their own)."""
    server = MotoServer(tmp_path_factory.mktemp("moto"))
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture(scope="session")
def ceph_rgw(tmp_path_factory):
    """One Ceph RGW for the session (`ceph_rgw.CephRgw`: a real S3 server; tests use buckets of
    their own). Without Ceph installed its tests fail (scripts/test installs it), unless
    FENCEGATE_SKIP_RGW=1 skips them."""
    if missing_ceph_programs() and os.environ.get("FENCEGATE_SKIP_RGW") == "1":
        pytest.skip(f"FENCEGATE_SKIP_RGW=1 and not installed: {', '.join(missing_ceph_programs())}")
    server = CephRgw(tmp_path_factory.mktemp("rgw"))
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture
def api():
    """A stand-in third-party API (`recording_api.RecordingApi`) of the test's own."""
    server = RecordingApi()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_server(tmp_path):
    """A redis-server of the test's own; the test may kill9(), start() (same port and data),
    freeze() and thaw() it."""
    d = tmp_path / "redis"
    d.mkdir()
    server = RedisServer(d)
    try:
        yield server.start()
    finally:
        server.kill9()


@pytest.fixture
def fencegate(tmp_path):
    """Factory: `fencegate(**overrides)` starts an instance and returns a FenceGate.

    Keyword arguments:
      config   -- dict merged over the default config (e.g. {"fencing": {"require_token": False}})
      upstream -- replaces the [upstream] table
      env      -- extra environment variables for the process
      local_buckets -- buckets to create in the local upstream before start
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
        seed_local_buckets(workdir / "objects", local_buckets)
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
def held_s3(fencegate, moto_server):
    """Factory: `held_s3(**overrides)` starts a HoldingUpstream in front of moto_server (or takes
    `proxy`), makes a fresh bucket at moto, and starts a fencegate using the proxy as its S3
    upstream; every key under `jobs/` of the bucket belongs to resource `job`. Returns a HeldS3.

    Keyword arguments:
      upstream -- merged over the [upstream] table (moto's, with the proxy as `endpoint` and the
                  fresh bucket as `probe_bucket`)
      fencing  -- merged over [fencing] (which has the `jobs/` rule)
      config   -- merged over the whole config (after `fencing`)
      proxy    -- a HoldingUpstream of the test's own (e.g. only `reserve()`d, started later)
      bucket_prefix -- the start of the bucket's name
    At teardown every proxy is closed (its holds released, its requests in flight answered)
    before fencegate stops.
    """
    proxies: list[HoldingUpstream] = []

    def start(
        upstream: dict | None = None,
        fencing: dict | None = None,
        config: dict | None = None,
        proxy: HoldingUpstream | None = None,
        bucket_prefix: str = "held",
    ) -> HeldS3:
        up = proxy or HoldingUpstream(moto_server.url).start()
        proxies.append(up)
        bucket = unique(bucket_prefix)
        moto = moto_server.client()
        moto.create_bucket(Bucket=bucket)
        rule = {"bucket": bucket, "prefix": HELD_PREFIX, "resource": HELD_RESOURCE}
        cfg = merge({"fencing": {"rules": [rule]}}, {"fencing": fencing or {}})
        cfg = merge(cfg, config or {})
        upstream_cfg = dict(moto_server.upstream_config(), endpoint=up.url, probe_bucket=bucket)
        upstream_cfg.update(upstream or {})
        fg = fencegate(upstream=upstream_cfg, config=cfg)
        return HeldS3(fg=fg, up=up, bucket=bucket, moto=moto)

    try:
        yield start
    finally:
        for up in proxies:
            up.close()


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
