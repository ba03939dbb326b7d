"""G6: the start-up probe says which conditional writes the upstream really refuses.

`fencegate probe --config F` runs the probe alone and prints one line. Three upstreams: the local
one (every conditional write enforced), moto (which ignores `If-Match` on CopyObject and
CompleteMultipartUpload), and moto behind a proxy that drops every precondition header, the
upstream G6 exists for: a warning with the embedded store, a refusal to start with
`upstream.probe = "require"` and with the Redis store.
"""

from __future__ import annotations

import http.server
import socketserver
import subprocess
import threading
import urllib.request

import pytest

from fencegate_testlib import base_config, bin_path, free_port, merge, seed_local_buckets, to_toml

PRECONDITIONS = ("if-match", "if-none-match")


def probe(tmp_path, config: dict) -> subprocess.CompletedProcess:
    path = tmp_path / "probe.toml"
    path.write_text(to_toml(config))
    return subprocess.run([str(bin_path()), "probe", "--config", str(path)], capture_output=True, text=True,
                          timeout=60)


def serve(tmp_path, config: dict) -> subprocess.CompletedProcess:
    """`fencegate serve` that is expected to refuse to start (bounded in time)."""
    path = tmp_path / "serve.toml"
    path.write_text(to_toml(config))
    return subprocess.run([str(bin_path()), "serve", "--config", str(path)], capture_output=True, text=True,
                          timeout=60)


@pytest.fixture
def probe_bucket(moto_server):
    name = f"probe-{free_port()}"
    moto_server.client().create_bucket(Bucket=name)
    return name


class _Stripping(http.server.BaseHTTPRequestHandler):
    """Forwards to moto without `If-Match` / `If-None-Match`: an upstream that ignores them."""

    protocol_version = "HTTP/1.1"
    target = ""

    def _forward(self):
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length) if length else None
        headers = {k: v for k, v in self.headers.items() if k.lower() not in PRECONDITIONS + ("host",)}
        req = urllib.request.Request(self.target + self.path, data=body, method=self.command, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                status, data, out = resp.status, resp.read(), resp.headers.items()
        except urllib.error.HTTPError as err:
            status, data, out = err.code, err.read(), err.headers.items()
        self.send_response(status)
        for k, v in out:
            if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                self.send_header(k, v)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

    def log_message(self, *_args):
        pass


@pytest.fixture
def stripping_upstream(moto_server):
    handler = type("Handler", (_Stripping,), {"target": moto_server.url})
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_the_local_upstream_enforces_every_conditional_write(tmp_path):
    config = base_config(tmp_path)
    seed_local_buckets(tmp_path / "objects", ["probe-local"])
    config["upstream"]["probe_bucket"] = "probe-local"
    out = probe(tmp_path, config)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (
        "upstream enforces preconditions on PutObject, CopyObject, CompleteMultipartUpload, DeleteObject"
    )


def test_moto_is_reported_as_ignoring_copy_and_completion_preconditions(tmp_path, moto_server, probe_bucket):
    config = base_config(tmp_path)
    config["upstream"] = dict(moto_server.upstream_config(), probe_bucket=probe_bucket)
    out = probe(tmp_path, config)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (
        "upstream enforces preconditions on PutObject; ignores them on: CopyObject, CompleteMultipartUpload"
    )
    assert "ignores them on the operations named" in out.stderr
    # The probe cleans up after itself.
    listed = moto_server.client().list_objects_v2(Bucket=probe_bucket).get("KeyCount")
    assert listed == 0


def test_an_upstream_without_preconditions_warns_then_refuses_where_it_matters(
        tmp_path, moto_server, probe_bucket, stripping_upstream, redis_server):
    upstream = dict(moto_server.upstream_config(), endpoint=stripping_upstream, probe_bucket=probe_bucket)
    config = dict(base_config(tmp_path), upstream=upstream)

    # Embedded store (one process): a loud warning, and the probe says it failed.
    out = probe(tmp_path, config)
    assert out.returncode == 0, out.stderr
    assert "UPSTREAM PRECONDITION PROBE FAILED" in out.stderr
    assert "ignores `If-None-Match: *`" in out.stderr
    assert out.stdout.strip() == "upstream probe did not run (see the log)"

    # `upstream.probe = "require"`: refuses to start, in one line.
    out = serve(tmp_path, merge(config, {"upstream": {"probe": "require"}}))
    assert out.returncode != 0
    assert "refusing to start" in out.stderr and "If-None-Match" in out.stderr
    assert "fencegate ready" not in out.stdout

    # A shared store (several replicas): refuses too, unless the risk is accepted.
    shared = merge(config, {"store": {"kind": "redis", "url": redis_server.url}})
    del shared["store"]["path"]
    out = serve(tmp_path, shared)
    assert out.returncode != 0
    assert "refusing to start" in out.stderr

