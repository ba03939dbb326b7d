"""G6: the start-up probe says which conditional writes the upstream really judges, both ways.

`fencegate probe --config F` runs the probe alone, prints one line and exits 0 when it passed; a
probe that failed or could not run says why and exits 1. Upstreams: the local one (every
conditional write enforced), moto (which ignores `If-Match` on CopyObject and
CompleteMultipartUpload), and moto behind stand-ins: one that drops every precondition header
(the upstream G6 exists for), one that refuses every `If-Match` (a met precondition refused),
one that compares `If-Match` with the bare ETag as Ceph RGW 16 does on writes. Against the real
RGW: tests/python/test_rgw.py.
"""

from __future__ import annotations

import http.server
import socketserver
import subprocess
import threading
import urllib.request

import pytest

from botocore.exceptions import ClientError

from fencegate_testlib import base_config, bin_path, code_of, free_port, merge, seed_local_buckets, status_of, to_toml

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


class _Rewriting(http.server.BaseHTTPRequestHandler):
    """Forwards to moto, judging a write's preconditions as `mode` says:
    "strip"  -- drops `If-Match` / `If-None-Match`: an upstream that ignores them;
    "refuse" -- answers 412 to every write with `If-Match`, even the right ETag;
    "bare"   -- answers 412 to a write's quoted `If-Match` and forwards a bare one quoted, as
                Ceph RGW 16 compares (moto compares the quoted form).
    """

    protocol_version = "HTTP/1.1"
    target = ""
    mode = "strip"

    def _forward(self):
        body = self._body()
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "transfer-encoding")}
        if_match = next((k for k in headers if k.lower() == "if-match"), None)
        write = self.command in ("PUT", "POST", "DELETE")
        if self.mode == "strip":
            headers = {k: v for k, v in headers.items() if k.lower() not in PRECONDITIONS}
        elif write and if_match and (self.mode == "refuse" or headers[if_match].startswith('"')):
            return self._answer(412, b"<Error><Code>PreconditionFailed</Code></Error>", [])
        elif write and if_match and headers[if_match] != "*":
            headers[if_match] = f'"{headers[if_match]}"'
        if body is not None and not any(k.lower() == "content-type" for k in headers):
            # urllib would name a body of no type a form, which moto then reads as one.
            headers["Content-Type"] = "binary/octet-stream"
        req = urllib.request.Request(self.target + self.path, data=body, method=self.command, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                status, data, out = resp.status, resp.read(), resp.headers.items()
        except urllib.error.HTTPError as err:
            status, data, out = err.code, err.read(), err.headers.items()
        self._answer(status, data, out)

    def _body(self) -> bytes | None:
        """The request's body, whole (fencegate streams a write's body chunked)."""
        if self.headers.get("transfer-encoding", "").lower() != "chunked":
            length = int(self.headers.get("content-length") or 0)
            return self.rfile.read(length) if length else None
        chunks = []
        while size := int(self.rfile.readline().split(b";")[0], 16):
            chunks.append(self.rfile.read(size))
            self.rfile.readline()
        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
            pass
        return b"".join(chunks)

    def _answer(self, status: int, data: bytes, headers):
        self.send_response(status)
        for k, v in headers:
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
def rewriting_upstream(moto_server):
    """Factory: `rewriting_upstream(mode)` starts a `_Rewriting` stand-in before moto; its URL."""
    servers = []

    def start(mode: str) -> str:
        handler = type("Handler", (_Rewriting,), {"target": moto_server.url, "mode": mode})
        server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    try:
        yield start
    finally:
        for server in servers:
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
    """moto refuses a wrong `If-Match` on PutObject and DeleteObject only; the probe says so and cleans up."""
    config = base_config(tmp_path)
    config["upstream"] = dict(moto_server.upstream_config(), probe_bucket=probe_bucket)
    out = probe(tmp_path, config)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (
        "upstream enforces preconditions on PutObject; ignores them on: CopyObject, CompleteMultipartUpload"
    )
    # The probe cleans up after itself: objects and uploads.
    moto = moto_server.client()
    assert moto.list_objects_v2(Bucket=probe_bucket).get("KeyCount") == 0
    assert not moto.list_multipart_uploads(Bucket=probe_bucket).get("Uploads")


def test_an_upstream_without_preconditions_fails_the_probe_and_refuses_where_it_matters(
        tmp_path, fencegate, moto_server, probe_bucket, rewriting_upstream, redis_server):
    """Preconditions dropped: the probe exits 1 naming the header, serve warns (one process) or refuses."""
    upstream = dict(moto_server.upstream_config(), endpoint=rewriting_upstream("strip"), probe_bucket=probe_bucket)
    config = dict(base_config(tmp_path), upstream=upstream)

    out = probe(tmp_path, config)
    assert out.returncode == 1
    assert "upstream precondition probe failed: the upstream ignores `If-None-Match: *`" in out.stderr
    assert out.stdout == ""

    # Embedded store (one process): it serves, with a loud warning.
    fg = fencegate(upstream=upstream)
    assert "UPSTREAM PRECONDITION PROBE FAILED" in fg.log_tail(200)

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
    assert "refusing to start (several replicas need an upstream that enforces preconditions" in out.stderr


def test_an_upstream_that_refuses_the_right_etag_is_never_taken_for_one_that_enforces(
        tmp_path, moto_server, probe_bucket, rewriting_upstream):
    """A wrong ETag refused proves nothing when the right one is refused too: the probe fails on it."""
    upstream = dict(moto_server.upstream_config(), endpoint=rewriting_upstream("refuse"), probe_bucket=probe_bucket)
    out = probe(tmp_path, dict(base_config(tmp_path), upstream=upstream))
    assert out.returncode == 1, out.stdout
    assert "refuses a met precondition: PutObject with the object's ETag answered 412" in out.stderr
    out = serve(tmp_path, dict(base_config(tmp_path), upstream=dict(upstream, probe="require")))
    assert out.returncode != 0 and "refuses a met precondition" in out.stderr


def test_an_upstream_that_compares_bare_etags_is_sent_bare_etags(
        tmp_path, fencegate, moto_server, probe_bucket, rewriting_upstream):
    """As on Ceph RGW 16: the probe finds the bare form, and an overwrite through fencegate commits."""
    upstream = dict(moto_server.upstream_config(), endpoint=rewriting_upstream("bare"), probe_bucket=probe_bucket)
    out = probe(tmp_path, dict(base_config(tmp_path), upstream=upstream))
    assert out.returncode == 0, out.stderr
    assert "(If-Match sent with the bare ETag, the form this upstream compares)" in out.stdout

    fg = fencegate(upstream=upstream)
    s3 = fg.client(token=3)
    s3.put_object(Bucket=probe_bucket, Key="bare/k", Body=b"one")
    s3.put_object(Bucket=probe_bucket, Key="bare/k", Body=b"two")
    fg.client(token=4).put_object(Bucket=probe_bucket, Key="bare/k", Body=b"three")
    assert moto_server.client().get_object(Bucket=probe_bucket, Key="bare/k")["Body"].read() == b"three"


def test_unprobed_the_form_is_learned_from_the_refusals_of_an_unchanged_object(
        tmp_path, fencegate, moto_server, probe_bucket, rewriting_upstream):
    """The probe off, an upstream that compares bare ETags: the overwrite is refused twice on an
    unchanged object, goes once more with the bare ETag, commits, and later writes are sent so."""
    upstream = dict(moto_server.upstream_config(), endpoint=rewriting_upstream("bare"), probe_bucket=probe_bucket,
                    probe="off")
    fg = fencegate(upstream=upstream)
    s3 = fg.client(token=3)
    s3.put_object(Bucket=probe_bucket, Key="unprobed/k", Body=b"one")
    s3.put_object(Bucket=probe_bucket, Key="unprobed/k", Body=b"two")
    assert "sending bare ETags from now on" in fg.log_tail(200)
    s3.put_object(Bucket=probe_bucket, Key="unprobed/k", Body=b"three")
    assert moto_server.client().get_object(Bucket=probe_bucket, Key="unprobed/k")["Body"].read() == b"three"


def test_a_412_that_only_fencegate_caused_is_a_502_that_says_so(
        tmp_path, fencegate, moto_server, probe_bucket, rewriting_upstream):
    """The probe off, an upstream that refuses every If-Match, in either form: an overwrite is a
    502 naming the cause, not a 503 SlowDown that blames a concurrent writer."""
    upstream = dict(moto_server.upstream_config(), endpoint=rewriting_upstream("refuse"), probe_bucket=probe_bucket,
                    probe="off")
    fg = fencegate(upstream=upstream)
    s3 = fg.client(token=3)
    s3.put_object(Bucket=probe_bucket, Key="unprobed/k", Body=b"one")
    with pytest.raises(ClientError) as refused:
        s3.put_object(Bucket=probe_bucket, Key="unprobed/k", Body=b"two")
    assert status_of(refused.value) == 502
    assert code_of(refused.value) == "UpstreamPreconditionRefused"
    assert moto_server.client().get_object(Bucket=probe_bucket, Key="unprobed/k")["Body"].read() == b"one"


@pytest.mark.parametrize("cause", ["unreachable", "missing bucket"])
def test_a_probe_that_could_not_run_says_why_and_exits_1(tmp_path, fencegate, moto_server, cause):
    """No port to reach, or no such bucket: the cause in one line, exit 1; serve says it could not run."""
    upstream = dict(moto_server.upstream_config(), probe_bucket="no-such-probe-bucket")
    expected = "the probe bucket \"no-such-probe-bucket\" does not exist at the upstream"
    if cause == "unreachable":
        upstream["endpoint"] = f"http://127.0.0.1:{free_port()}"
        expected = "the upstream could not be reached"
    out = probe(tmp_path, dict(base_config(tmp_path), upstream=upstream))
    assert out.returncode == 1
    assert f"upstream probe could not run: {expected}" in out.stderr
    fg = fencegate(upstream=upstream)
    log = fg.log_tail(200)
    assert "UPSTREAM PROBE COULD NOT RUN" in log and "PRECONDITION PROBE FAILED" not in log
