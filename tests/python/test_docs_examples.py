"""Proves that the examples of README.md and the pages under docs/ (`docs_examples.DOCS`) work as written: each
marked block is read from the markdown file and run for real (shell blocks with bash -e, Python
blocks with python3, fencegate TOML through `fencegate check-config` and `serve`) against
fencegate on the shipped config/fencegate.toml, real redis-server, moto_server, boto3 and the aws
CLI (the lease recipes against real Redis, PostgreSQL, etcd and ZooKeeper servers). What a test
changes in an example: the docs' addresses (127.0.0.1:9000 and :9001) become the test instance's, and a `cargo build` line is left to scripts/test (a test never runs cargo);
some Python examples get the test's own checks appended, run after them in the same process.
Every check looks at what landed: exit codes, HTTP statuses, the objects and stamps at the
upstream, the fences. And every code block of those files is either
such an example or says, visibly, why it is untested (`docs_examples.py` says how blocks are
marked).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import requests
from botocore.exceptions import ClientError

from docs_examples import DOCS, REPO_ROOT, block, blocks, localize
from fencegate_testlib import (
    FenceGate,
    bin_path,
    code_of,
    quote_resource,
    s3_client,
    s3_client_ex,
    signed_raw_request,
    status_of,
)
from lease_recipes import EXAMPLE as RECIPE_EXAMPLES
from lease_recipes import SERVICES as RECIPE_SERVICES
from lease_recipes import SHELL_LOOP, Workers, need, running_issuer

SHIPPED_CONFIG = REPO_ROOT / "config" / "fencegate.toml"
EXAMPLE_TIMEOUT_S = 120  # one example, start to end
WORKER_BIN = REPO_ROOT / "target" / "debug" / "fencegate-worker"  # built by scripts/test (cargo test --workspace)

# (doc, example name) of every example a test below runs.
RUN: set = set()


def runs(doc: str, *names: str):
    """Marks a test as the one that runs these examples of `doc`."""
    for name in names:
        RUN.add((doc, name))
    return lambda fn: fn


# --------------------------------------------------------------------------------------------
# fencegate from a config file as it is (the shipped one, or one taken from the docs)
# --------------------------------------------------------------------------------------------


class FileFenceGate(FenceGate):
    """fencegate on a config file used as it is; the environment overrides the listen addresses
    (port 0). It runs in its own directory, so the file's relative paths (`data/...`) land there."""

    file: Path = SHIPPED_CONFIG

    @property
    def config_path(self) -> Path:
        return self.file

    def write_config(self):
        pass  # the file is used as it is

    @property
    def objects_dir(self) -> Path:
        return self.workdir / tomllib.loads(self.file.read_text())["upstream"]["path"]


# Any free ports; and the stamp shown, so that the tests can read which token wrote an object
# (`fencing.show_stamp`, off in the shipped config).
LISTEN_ON_ANY_PORT = {"FENCEGATE_SERVER__LISTEN": "127.0.0.1:0", "FENCEGATE_SERVER__ADMIN_LISTEN": "127.0.0.1:0",
                      "FENCEGATE_FENCING__SHOW_STAMP": "true"}


def tls_env(tls) -> dict:
    return {"FENCEGATE_SERVER__TLS_CERT_PATH": str(tls.cert), "FENCEGATE_SERVER__TLS_KEY_PATH": str(tls.key)}


@pytest.fixture
def start(tmp_path):
    """Factory: `start(file=..., env=..., tls=...)` runs fencegate on `file` (default: the shipped
    config); every instance is stopped at teardown and its log tail printed."""
    started: list[FileFenceGate] = []

    def run(file: Path = SHIPPED_CONFIG, env: dict | None = None, tls=None) -> FileFenceGate:
        workdir = tmp_path / f"fg{len(started)}"
        workdir.mkdir()
        fg = FileFenceGate(workdir=workdir, config={}, env={**LISTEN_ON_ANY_PORT, **(tls_env(tls) if tls else {}),
                                                            **(env or {})})
        fg.file = file
        started.append(fg)
        fg.start()
        if tls:
            fg.s3_url = fg.s3_url.replace("http://", "https://", 1)
        return fg

    try:
        yield run
    finally:
        for fg in started:
            try:
                fg.stop()
            except Exception:  # noqa: BLE001 - teardown must try every instance
                fg.kill9()
            print(fg.log_tail(40))


# --------------------------------------------------------------------------------------------
# running an example, and looking at what it did
# --------------------------------------------------------------------------------------------


def example_env(cwd: Path, extra: dict | None = None) -> dict:
    """The environment of an example: the test's, with its own HOME (no ~/.aws, ~/.curlrc)."""
    home = cwd / "home"
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FENCEGATE_")}
    env.update(HOME=str(home), AWS_MAX_ATTEMPTS="1", AWS_PAGER="")
    env.update(extra or {})
    return {k: v for k, v in env.items() if v is not None}


def run_sh(code: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    script = cwd / "example.sh"
    script.write_text(code)
    return subprocess.run(["bash", "-e", "-o", "pipefail", str(script)], cwd=cwd, env=example_env(cwd, env),
                          capture_output=True, text=True, timeout=EXAMPLE_TIMEOUT_S)


def run_python(code: str, cwd: Path, env: dict | None = None, check: str = "") -> subprocess.CompletedProcess:
    """Runs the example with python3; `check` (the test's own code, using the example's names) runs
    after it in the same process."""
    script = cwd / "example.py"
    script.write_text(code + ("\n# ---- the test's check, after the example ----\n" + check if check else ""))
    return subprocess.run([sys.executable, str(script)], cwd=cwd, env=example_env(cwd, env),
                          capture_output=True, text=True, timeout=EXAMPLE_TIMEOUT_S)


def check_config(file: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """`fencegate check-config` on `file`, with a HOME of its own outside the file's folder (a
    shipped config's folder is the repository's)."""
    import tempfile

    cmd = [str(bin_path()), "check-config", "--config", str(file)]
    with tempfile.TemporaryDirectory() as home:
        return subprocess.run(cmd, cwd=file.parent, env=example_env(Path(home), env), capture_output=True,
                              text=True, timeout=60)


def risks(r: subprocess.CompletedProcess) -> list:
    return [line for line in r.stdout.splitlines() if line.startswith("# risk:")]


def ok(r: subprocess.CompletedProcess):
    assert r.returncode == 0, f"exit {r.returncode}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}"
    return r


def fence(fg: FenceGate, resource: str, admin_token: str | None = None):
    r = fg.get_fence(resource, token=admin_token)
    assert r.status_code in (200, 404), r.text
    return r.json()["token"] if r.status_code == 200 else None


def at_upstream(fg: FileFenceGate, bucket: str, key: str, verify=None):
    """The object's bytes in the local upstream, or None (read through fencegate: reads pass
    unfenced, and the local upstream runs inside it)."""
    try:
        return s3_client_ex(fg.s3_url, verify=verify).get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError as e:
        if e.response["Error"]["Code"] == "NoSuchKey":
            return None
        raise


def stamp(fg: FenceGate, bucket: str, key: str):
    """The object's `fencing-token` metadata (read through fencegate: reads pass unfenced)."""
    return s3_client(fg.s3_url).head_object(Bucket=bucket, Key=key)["Metadata"].get("fencing-token")


def make_bucket(fg: FenceGate, name: str = "reports", verify=None):
    s3_client_ex(fg.s3_url, verify=verify).create_bucket(Bucket=name)


# Appended to the boto3 examples: their hook must leave presigned URLs usable by a caller that
# sends no header (a signed-in header breaks them). SigV2 is off on the shipped config (400).
PRESIGNED_READ_CHECK = """
import requests as _requests
from botocore.config import Config as _Config

for _version, _expected in (("s3v4", 200), ("s3", 400)):
    _signer = boto3.client("s3", endpoint_url=s3.meta.endpoint_url, region_name="us-east-1",
                           config=_Config(signature_version=_version))
    _signer.meta.events.register("before-sign.s3.*", add_fencing_token)
    _url = _signer.generate_presigned_url("get_object", Params={"Bucket": _BUCKET, "Key": _KEY}, ExpiresIn=300)
    assert "fencing-token" not in _url.lower(), _url
    _r = _requests.get(_url, timeout=30)
    assert _r.status_code == _expected, (_version, _r.status_code, _r.text)
    print(f"presigned {_version} read: {_r.status_code}")
"""


# --------------------------------------------------------------------------------------------
# README.md
# --------------------------------------------------------------------------------------------


@runs("README.md", "quick-try")
def test_readme_quick_try(start, tmp_path):
    """The quick start's first example: a bucket, B's write with token 12, A's with token 11
    refused; the statuses printed are the ones its comments give, and B's bytes stay."""
    fg = start()
    r = ok(run_sh(localize(block("README.md", "quick-try").code, fg.s3_addr, fg.admin_addr), tmp_path))
    assert r.stdout.split() == ["200", "200", "409"], r.stdout
    assert at_upstream(fg, "reports", "summary.txt") == b"from B\n"
    assert stamp(fg, "reports", "summary.txt") == "12"


@runs("README.md", "boto3")
def test_readme_boto3(start, tmp_path):
    """The boto3 hook writes with its token, and leaves presigned URLs usable without a header."""
    fg = start()
    code = localize(block("README.md", "boto3").code, fg.s3_addr, fg.admin_addr)
    check = '_BUCKET, _KEY = "reports", "2026/11.csv"\n' + PRESIGNED_READ_CHECK
    r = ok(run_python(code, tmp_path, env={"AWS_ACCESS_KEY_ID": "fencegate-dev",
                                           "AWS_SECRET_ACCESS_KEY": "fencegate-dev-secret"}, check=check))
    assert r.stdout.count("read: 200") == 1 and "presigned s3 read: 400" in r.stdout, r.stdout
    assert at_upstream(fg, "reports", "2026/11.csv") == b"..."
    assert stamp(fg, "reports", "2026/11.csv") == "12"
    assert fence(fg, "reports/2026/11.csv") == 12


# --------------------------------------------------------------------------------------------
# docs/operations.md and docs/gateway.md
# --------------------------------------------------------------------------------------------


@runs("docs/operations.md", "register")
def test_operations_register_a_token(start, tmp_path):
    """The admin registration example raises the fence it names."""
    fg = start()
    r = ok(run_sh(localize(block("docs/operations.md", "register").code, fg.s3_addr, fg.admin_addr), tmp_path))
    assert json.loads(r.stdout) == {"resource": "job:invoices", "token": 13}
    assert fence(fg, "job:invoices") == 13


@runs("docs/operations.md", "reconcile")
def test_operations_reconcile_a_bucket(start, tmp_path):
    """The reconcile example scans a bucket written through fencegate and finds nothing (exit
    0). The command reads the config file, so it is pointed at the test instance's admin
    listener by an override, as any would be."""
    fg = start()
    s3 = fg.client(token=3)
    s3.create_bucket(Bucket="bkt1")
    s3.put_object(Bucket="bkt1", Key="reports/a.csv", Body=b"a")
    code = block("docs/operations.md", "reconcile").code.replace("config/fencegate.toml", str(SHIPPED_CONFIG))
    env = {"FENCEGATE_SERVER__ADMIN_LISTEN": "%s:%d" % fg.admin_addr, "PATH": f"{bin_path().parent}:{os.environ['PATH']}"}
    r = ok(run_sh(code, tmp_path, env))
    assert "0 found in 0 gateway records, 0 uploads and 1 objects" in r.stdout, r.stdout


@runs("docs/operations.md", "accept-restored")
def test_operations_accept_a_restored_store(start, tmp_path):
    """An older copy of `data/fences` put back is refused at start; the example takes it as it
    is, and the next start serves it, holding grants as after a crash."""
    fg = start(env={"FENCEGATE_FENCING__INFLIGHT_DEADLINE_MS": "30000"})
    assert fg.put_fence("job:restored", 5).status_code == 200
    fg.stop()
    store = fg.workdir / "data" / "fences"
    older = {p.name: p.read_bytes() for p in store.iterdir()}
    fg.start()
    assert fg.put_fence("job:restored", 7).status_code == 200
    fg.stop()
    for name, data in older.items():
        (store / name).write_bytes(data)
    env = {"PATH": f"{bin_path().parent}:{os.environ['PATH']}"}
    refused = run_sh(f"fencegate serve --config {SHIPPED_CONFIG}", fg.workdir, env)
    assert refused.returncode != 0 and "went back in time" in refused.stderr, refused.stderr

    code = block("docs/operations.md", "accept-restored").code.replace("config/fencegate.toml", str(SHIPPED_CONFIG))
    r = ok(run_sh(code, fg.workdir, env))
    assert "accepted" in r.stdout, r.stdout
    fg.start()
    assert fence(fg, "job:restored") == 5
    grant = signed_raw_request(fg, "POST", "/_fencegate/v1/leases/" + quote_resource("job:restored"),
                               {"Content-Type": "application/json"},
                               json.dumps({"holder": "worker", "ttl_ms": 10000}).encode())
    assert grant.status == 503 and "retry-after" in grant.headers, (grant.status, grant.body)


@runs("docs/operations.md", "prometheus-scrape")
def test_operations_prometheus_scrapes_with_the_read_token(start, tmp_path):
    """The scrape job, pointed at the test instance and its token file, gets the metrics with
    the read token as Prometheus sends it; the same token can neither raise a fence nor start a
    reconciliation (401), and reads the fences."""
    import yaml

    admin, read = "the-admin-token-of-16b", "the-read-token-of-16b"
    fg = start(env={"FENCEGATE_SERVER__ADMIN_TOKEN": admin, "FENCEGATE_SERVER__ADMIN_READ_TOKEN": read})
    job = yaml.safe_load(block("docs/operations.md", "prometheus-scrape").code)["scrape_configs"][0]
    auth = job["authorization"]
    token_file = tmp_path / "fencegate-read-token"
    token_file.write_text(read + "\n")
    assert auth["credentials_file"].endswith("fencegate-read-token")
    assert job["static_configs"][0]["targets"] == ["127.0.0.1:9001"]
    target = "%s:%d" % fg.admin_addr  # the docs' address, localized
    # As Prometheus does: the file's content, trimmed, after the type.
    bearer = {"Authorization": f"{auth['type']} {token_file.read_text().strip()}"}
    metrics = requests.get(f"http://{target}/metrics", headers=bearer, timeout=10)
    assert metrics.status_code == 200 and "fencegate_decisions_total" in metrics.text, metrics.text[:200]
    assert requests.get(f"http://{target}/metrics", timeout=10).status_code == 401
    raise_fence = requests.put(f"http://{target}/v1/fences/job%3Ax", json={"token": 2**63}, headers=bearer, timeout=10)
    assert raise_fence.status_code == 401, raise_fence.text
    recon = requests.post(f"http://{target}/v1/reconcile", json={"bucket": "b"}, headers=bearer, timeout=10)
    assert recon.status_code == 401, recon.text
    assert requests.get(f"http://{target}/v1/fences/job%3Ax", headers=bearer, timeout=10).status_code == 404
    raised = requests.put(f"http://{target}/v1/fences/job%3Ax", json={"token": 3},
                          headers={"Authorization": f"Bearer {admin}"}, timeout=10)
    assert raised.status_code == 200, raised.text


def replicas_file(directory: Path, text: str | None = None) -> Path:
    path = directory / "replicas.toml"
    path.write_text(text if text is not None else block("docs/operations.md", "redis-replicas").code)
    return path


@runs("docs/operations.md", "redis-replicas", "etcd-store")
def test_operations_replica_configs_pass_check_config(tmp_path):
    """The replicas file (Redis, and with the etcd [store]) passes check-config with no risk line,
    and the timeout rule it states is the one check-config enforces."""
    text = block("docs/operations.md", "redis-replicas").code
    r = ok(check_config(replicas_file(tmp_path, text)))
    assert 'kind = "redis"' in r.stdout and risks(r) == [], r.stdout
    # Its commented wait_replicas line, switched on, still passes (the wait stays below timeout_ms).
    switched = text.replace("# wait_replicas = 1", "wait_replicas = 1")
    assert switched != text
    r = ok(check_config(replicas_file(tmp_path, switched)))
    assert "wait_replicas = 1" in r.stdout and risks(r) == [], r.stdout
    # The rule the page states is the one check-config enforces: above the deadline, a risk;
    # without the line, the default follows the deadline (no risk).
    unruled = re.sub(r"\nrequest_timeout_ms = .*", "", text)
    assert unruled != text
    r = ok(check_config(replicas_file(tmp_path, unruled)))
    assert risks(r) == [] and "request_timeout_ms = 30000" in r.stdout, r.stdout
    above = re.sub(r"\nrequest_timeout_ms = .*", "\nrequest_timeout_ms = 40000", text)
    r = ok(check_config(replicas_file(tmp_path, above)))
    assert any("request_timeout_ms" in line for line in risks(r)), r.stdout

    # The etcd section: the same file with its [store] table.
    etcd_store = block("docs/operations.md", "etcd-store").code
    with_etcd = re.sub(r"\[store\]\n.*?(?=\n\[)", lambda _m: etcd_store.strip() + "\n", text, flags=re.S)
    assert 'kind = "etcd"' in with_etcd and 'kind = "redis"' not in with_etcd
    r = ok(check_config(replicas_file(tmp_path, with_etcd)))
    assert 'kind = "etcd"' in r.stdout and "10.0.0.3:2379" in r.stdout and risks(r) == [], r.stdout


@runs("docs/operations.md", "init-store")
def test_operations_redis_replicas_serve(tmp_path, redis_server, moto_server, tls_files):
    """docs/operations.md's replicas file, as it is, runs two replicas sharing Redis (what a real
    deployment differs in comes from the environment: addresses, certificates, the upstream's
    key), once the Redis is marked new as the page says, and they share the fence."""
    file = replicas_file(tmp_path)
    doc = tomllib.loads(file.read_text())
    try:
        moto_server.client().create_bucket(Bucket=doc["upstream"]["probe_bucket"])
    except ClientError as exc:
        assert code_of(exc) in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"), exc
    env = {
        **LISTEN_ON_ANY_PORT, **tls_env(tls_files),
        "FENCEGATE_STORE__URL": redis_server.url,
        "FENCEGATE_UPSTREAM__ENDPOINT": moto_server.url,
        "FENCEGATE_UPSTREAM__ACCESS_KEY_ID": "testing",
        "FENCEGATE_UPSTREAM__SECRET_ACCESS_KEY": "testing",
    }
    command = block("docs/operations.md", "init-store").code.strip().split()
    assert command[:2] == ["fencegate", "init-store"] and command[-1] == "fencegate.toml", command
    init = subprocess.run([str(bin_path()), *command[1:-1], str(file)], cwd=tmp_path, capture_output=True, text=True,
                          env=example_env(tmp_path, env), timeout=60)
    assert init.returncode == 0 and "marked 16384 slots" in init.stdout, (init.stdout, init.stderr)
    replicas = []
    try:
        for n in range(2):
            (tmp_path / f"replica{n}").mkdir()
            fg = FileFenceGate(workdir=tmp_path / f"replica{n}", config={}, env=env)
            fg.file = file
            replicas.append(fg)
            fg.start()
            fg.s3_url = fg.s3_url.replace("http://", "https://", 1)
        cred = doc["credentials"][0]
        bucket, key = doc["upstream"]["probe_bucket"], "replicas/one.txt"

        def client(fg, token):
            return s3_client_ex(fg.s3_url, token=token, verify=tls_files.ca,
                                access_key=cred["access_key_id"], secret_key=cred["secret_access_key"])

        client(replicas[0], 5).put_object(Bucket=bucket, Key=key, Body=b"token 5 on replica 0")
        with pytest.raises(ClientError) as refused:
            client(replicas[1], 4).put_object(Bucket=bucket, Key=key, Body=b"token 4 on replica 1")
        assert (status_of(refused.value), code_of(refused.value)) == (409, "FencingTokenStale")
        body = moto_server.client().get_object(Bucket=bucket, Key=key)["Body"].read()
        assert body == b"token 5 on replica 0"
    finally:
        for fg in replicas:
            fg.stop()
            print(fg.log_tail(30))


@runs("docs/gateway.md", "route")
def test_gateway_route(start, tmp_path):
    """The route block, added to the shipped config, passes check-config and is live: writes are
    judged by the gate before anything is sent to the API (unregistered tokens cannot raise the
    fence of a route by default)."""
    route = tmp_path / "route.toml"
    route.write_text(block("docs/gateway.md", "route").code)
    r = ok(check_config(SHIPPED_CONFIG, env={"FENCEGATE_INCLUDE": str(route)}))
    assert 'prefix = "/payments/"' in r.stdout, r.stdout
    fg = start(env={"FENCEGATE_INCLUDE": str(route)})
    url = fg.s3_url + "/payments/42"
    for headers, status, code in [({}, 428, "FencingTokenRequired"),
                                  ({"Fencing-Token": "7"}, 409, "FencingTokenUnregistered")]:
        resp = requests.post(url, data=b'{"amount": 1}', headers=headers, timeout=30)
        assert resp.status_code == status, resp.text
        assert resp.headers["content-type"].startswith("application/problem+json"), resp.headers
        assert resp.json()["type"].endswith(code), resp.text
    assert fence(fg, "payment:42") is None


# --------------------------------------------------------------------------------------------
# docs/clients.md
# --------------------------------------------------------------------------------------------


@runs("docs/clients.md", "boto3-hook", "boto3-presigned")
def test_clients_boto3_hook_and_presigned_urls(start, tmp_path):
    """The hook fences A off after B, the presigned write carries its token as signed metadata,
    and the hook signs no header into presigned URLs (SigV4 and SigV2)."""
    fg = start()
    make_bucket(fg)
    code = block("docs/clients.md", "boto3-hook").code + "\n" + block("docs/clients.md", "boto3-presigned").code
    check = '_BUCKET, _KEY = bucket, key\nlease["token"] = 12\n' + PRESIGNED_READ_CHECK
    r = ok(run_python(code, tmp_path, check=check, env={
        "FENCEGATE_ENDPOINT": fg.s3_url,
        "AWS_ACCESS_KEY_ID": "fencegate-dev", "AWS_SECRET_ACCESS_KEY": "fencegate-dev-secret",
    }))
    assert "lease lost: the fence is at 12" in r.stdout, r.stdout
    assert "b\"B's next report\"" in r.stdout, r.stdout
    assert r.stdout.count("read: 200") == 1 and "presigned s3 read: 400" in r.stdout, r.stdout
    assert at_upstream(fg, "reports", "reports/2026/11.csv") == b"B's report"
    assert stamp(fg, "reports", "reports/2026/11.csv") == "12"
    assert at_upstream(fg, "reports", "reports/2026/12.csv") == b"B's next report"
    assert stamp(fg, "reports", "reports/2026/12.csv") == "12"


@runs("docs/clients.md", "aws-cli-metadata", "aws-cli-plugin", "aws-cli-plugin-config", "aws-cli-plugin-run")
def test_clients_aws_cli_and_plugin(start, tmp_path):
    """The aws CLI v1 examples in one shell, in order, with the plugin and ~/.aws/config exactly
    as the page says (a config the CLI cannot load fails every command, so this fails too)."""
    fg = start()
    make_bucket(fg)
    env = {"AWS_CONFIG_FILE": None}  # the CLI reads ~/.aws/config
    (tmp_path / "11.csv").write_bytes(b"metadata token\n")
    ok(run_sh(localize(block("docs/clients.md", "aws-cli-metadata").code, fg.s3_addr, fg.admin_addr), tmp_path,
              env=env))
    assert at_upstream(fg, "reports", "2026/11.csv") == b"metadata token\n"
    assert stamp(fg, "reports", "2026/11.csv") == "12"

    home = tmp_path / "home"
    (home / ".aws" / "plugins").mkdir(parents=True)
    (home / ".aws" / "plugins" / "fencing_token_plugin.py").write_text(block("docs/clients.md", "aws-cli-plugin").code)
    (home / ".aws" / "config").write_text(block("docs/clients.md", "aws-cli-plugin-config").code)
    big = os.urandom(9 * 1024 * 1024)  # above the CLI's 8 MiB multipart threshold
    (tmp_path / "big.bin").write_bytes(big)
    # The credentials come from the metadata example's `export`, as in one shell session.
    script = block("docs/clients.md", "aws-cli-metadata").code.splitlines()[0] + "\n"
    script += block("docs/clients.md", "aws-cli-plugin-run").code
    ok(run_sh(localize(script, fg.s3_addr, fg.admin_addr), tmp_path, env=env))
    assert at_upstream(fg, "reports", "big.bin") == big
    assert stamp(fg, "reports", "big.bin") == "12"
    assert fence(fg, "reports/2026/11.csv") == 12  # put with metadata, then deleted with the header
    assert at_upstream(fg, "reports", "2026/11.csv") is None

    # The header is the plugin's: an older token is refused, no token is refused.
    cli = f"aws --endpoint-url {fg.s3_url} s3api delete-object --bucket reports --key big.bin"
    plugin_env = {**env, "PYTHONPATH": str(home / ".aws" / "plugins"),
                  "AWS_ACCESS_KEY_ID": "fencegate-dev", "AWS_SECRET_ACCESS_KEY": "fencegate-dev-secret",
                  "AWS_DEFAULT_REGION": "us-east-1"}
    r = run_sh(cli, tmp_path, env={**plugin_env, "FENCING_TOKEN": "11"})
    assert r.returncode != 0 and "FencingTokenStale" in r.stderr, (r.stdout, r.stderr)
    r = run_sh(cli, tmp_path, env=plugin_env)
    assert r.returncode != 0 and "FencingTokenRequired" in r.stderr, (r.stdout, r.stderr)
    assert at_upstream(fg, "reports", "big.bin") == big

    # `aws s3 presign` with FENCING_TOKEN set, signing SigV4: the URL works without any header.
    (home / ".aws" / "config").write_text(block("docs/clients.md", "aws-cli-plugin-config").code
                                          + "\n[default]\ns3 =\n    signature_version = s3v4\n")
    r = ok(run_sh(f"aws --endpoint-url {fg.s3_url} s3 presign s3://reports/big.bin", tmp_path,
                  env={**plugin_env, "FENCING_TOKEN": "12"}))
    url = r.stdout.strip()
    assert "X-Amz-SignedHeaders=host" in url and "fencing-token" not in url.lower(), url
    got = requests.get(url, timeout=60)
    assert (got.status_code, got.content == big) == (200, True), got.text[:300]


@runs("docs/clients.md", "aws-cli-stale", "curl")
def test_clients_aws_cli_stale_and_curl(start, tmp_path):
    """After the aws CLI metadata example writes and stamps the object with token 12, its stale
    write with token 11 is refused (409 FencingTokenStale, as the comment shows) and changes
    nothing; the curl (token header) example writes it again and prints 200."""
    fg = start()
    make_bucket(fg)
    (tmp_path / "11.csv").write_bytes(b"id,amount\n1,100\n")
    script = block("docs/clients.md", "aws-cli-metadata").code + block("docs/clients.md", "aws-cli-stale").code
    r = ok(run_sh(localize(script, fg.s3_addr, fg.admin_addr), tmp_path))
    assert at_upstream(fg, "reports", "2026/11.csv") == b"id,amount\n1,100\n"
    assert stamp(fg, "reports", "2026/11.csv") == "12"
    assert "refused: token 11 is older than the fence" in r.stdout, r.stdout
    assert "(FencingTokenStale)" in r.stderr and "fencing token 11 is older than the current fence 12" in r.stderr, r.stderr

    (tmp_path / "11.csv").write_bytes(b"from curl\n")
    r = ok(run_sh(localize(block("docs/clients.md", "curl").code, fg.s3_addr, fg.admin_addr), tmp_path))
    assert r.stdout.strip().endswith("200"), r.stdout
    assert at_upstream(fg, "reports", "2026/11.csv") == b"from curl\n"
    assert stamp(fg, "reports", "2026/11.csv") == "12"
    assert fence(fg, "reports/2026/11.csv") == 12


@runs("docs/clients.md", "curl-https")
def test_clients_curl_https(start, tmp_path, tls_files):
    """curl over HTTPS and HTTP/2, trusting the CA in ca.pem, writes with its token."""
    fg = start(tls=tls_files)
    make_bucket(fg, verify=tls_files.ca)
    shutil.copy(tls_files.ca, tmp_path / "ca.pem")
    (tmp_path / "11.csv").write_bytes(b"over HTTP/2\n")
    ok(run_sh(localize(block("docs/clients.md", "curl-https").code, fg.s3_addr, fg.admin_addr), tmp_path))
    assert at_upstream(fg, "reports", "2026/11.csv", verify=tls_files.ca) == b"over HTTP/2\n"
    assert fence(fg, "reports/2026/11.csv") == 12


# --------------------------------------------------------------------------------------------
# docs/leases.md
# --------------------------------------------------------------------------------------------


@runs("docs/leases.md", "client-dependency")
def test_leases_client_dependency_names_the_crate():
    """The dependency line (for a Cargo.toml, not runnable here) names the client crate where it
    is, and the feature it mentions is that crate's default."""
    dep = tomllib.loads(block("docs/leases.md", "client-dependency").code)["dependencies"]["fencegate-client"]
    manifest = tomllib.loads((REPO_ROOT / dep["path"] / "Cargo.toml").read_text())
    assert manifest["package"]["name"] == "fencegate-client"
    assert "worker" in manifest["features"]["default"]


@runs("docs/leases.md", "lease-http-api")
def test_leases_http_api(start, tmp_path):
    """The curl lease calls grant (and fence), renew and release: another holder gets it at once."""
    fg = start()
    r = ok(run_sh(localize(block("docs/leases.md", "lease-http-api").code, fg.s3_addr, fg.admin_addr), tmp_path))
    lines = r.stdout.splitlines()
    grant = json.loads(lines[0])
    assert (grant["name"], grant["holder"], grant["ttl_ms"]) == ("job:invoices", "w1", 10000), grant
    renewed = json.loads(lines[1])
    assert renewed["lease_id"] == grant["lease_id"], r.stdout
    assert fence(fg, "job:invoices") == grant["token"]
    # Released: another holder gets the lease at once, with a newer token.
    body = json.dumps({"holder": "w2", "ttl_ms": 1000}).encode()
    again = signed_raw_request(fg, "POST", "/_fencegate/v1/leases/" + quote_resource("job:invoices"),
                               {"Content-Type": "application/json"}, body)
    assert again.status == 201, again.body
    assert json.loads(again.body)["token"] > grant["token"]


@runs("docs/leases.md", "classic-worker")
def test_leases_classic_worker(start, tmp_path):
    """The classic scenario as the page plays it, with the worker of this workspace's build (the
    block's `cargo build` line is left to scripts/test: a test never runs cargo)."""
    assert WORKER_BIN.is_file(), f"{WORKER_BIN} is missing: build the workspace (scripts/test does)"
    fg = start()
    make_bucket(fg)
    (tmp_path / "target" / "debug").mkdir(parents=True)
    (tmp_path / "target" / "debug" / "fencegate-worker").symlink_to(WORKER_BIN)
    code = block("docs/leases.md", "classic-worker").code
    assert code.startswith("cargo build -p fencegate-client --bin fencegate-worker\n"), code
    code = code.split("\n", 1)[1]
    r = ok(run_sh(localize(code, fg.s3_addr, fg.admin_addr), tmp_path))
    print(r.stdout)
    lines = r.stdout.splitlines()
    assert "A exited with 4" in lines, r.stdout
    a_story = lines[lines.index("A exited with 4") + 1:]
    assert a_story[0].startswith("acquired name=job:report holder=a token=1 "), r.stdout
    for line in ("lease lost reason=deadline",
                 "write rejected key=report.csv status=409 code=FencingTokenStale current=2"):
        assert line in a_story, r.stdout
    assert at_upstream(fg, "reports", "report.csv") == b"B"
    assert stamp(fg, "reports", "report.csv") == "2"


@runs("docs/leases.md", "lease-run")
def test_leases_fencegate_lease_run(start, tmp_path):
    """`fencegate-lease run` around an unmodified `aws s3 cp` (multipart): the object lands
    stamped with the lease's token; outside the lease the same command fails and writes nothing."""
    lease_bin = Path(os.environ.get("FENCEGATE_LEASE_BIN", REPO_ROOT / "target" / "debug" / "fencegate-lease"))
    assert lease_bin.is_file(), f"{lease_bin} is missing: build the workspace (scripts/test does)"
    fg = start()
    make_bucket(fg)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "fencegate-lease").symlink_to(lease_bin)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    r = ok(run_sh(localize(block("docs/leases.md", "lease-run").code, fg.s3_addr, fg.admin_addr), tmp_path, env))
    assert at_upstream(fg, "reports", "summary.bin") == (tmp_path / "summary.bin").read_bytes()
    # Stamped by the first lease (token 1); the second grant raised the fence to 2.
    assert stamp(fg, "reports", "summary.bin") == "1"
    assert fence(fg, "reports/summary.bin") == 2
    assert at_upstream(fg, "reports", "other.bin") is None
    assert "AccessDenied" in r.stderr, r.stderr


@runs("docs/leases.md", "rclone-config", "rclone-run")
def test_leases_rclone_directory_under_one_lease(start, tmp_path):
    """The worked rclone example: fencegate with the page's `workers.toml` included, the bucket
    made with the operator's key, a directory copied by rclone under one lease taken with the
    lessee key; every object lands stamped with the lease's token, and the lessee key cannot
    register a token."""
    if shutil.which("rclone") is None:
        pytest.skip("rclone is not installed (apt-get install rclone; scripts/test does)")
    lease_bin = Path(os.environ.get("FENCEGATE_LEASE_BIN", REPO_ROOT / "target" / "debug" / "fencegate-lease"))
    workers = tmp_path / "workers.toml"
    workers.write_text(block("docs/leases.md", "rclone-config").code)
    fg = start(env={"FENCEGATE_INCLUDE": str(workers)})
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "fencegate-lease").symlink_to(lease_bin)
    # No CA bundle of this machine's: rclone (its AWS SDK) refuses one with its own transport.
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "RCLONE_CONFIG": os.devnull, "AWS_CA_BUNDLE": ""}
    r = ok(run_sh(localize(block("docs/leases.md", "rclone-run").code, fg.s3_addr, fg.admin_addr), tmp_path, env))
    token = fence(fg, "job:reports-2026")
    assert token == 1, (token, r.stderr)
    ops = s3_client_ex(fg.s3_url, access_key="ops", secret_key="ops-secret-of-your-own")
    for i in (1, 2, 3):
        got = ops.get_object(Bucket="reports", Key=f"2026/part-{i}.csv")
        assert got["Body"].read() == f"row {i}\n".encode()
        assert got["Metadata"].get("fencing-token") == "1", got["Metadata"]
    host, port = fg.s3_addr
    register = subprocess.run(
        ["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "--aws-sigv4", "aws:amz:us-east-1:s3",
         "--user", "worker-1:worker-secret-of-your-own", "-H", "Content-Type: application/json",
         "-H", "x-amz-content-sha256: " + hashlib.sha256(b'{"token": 99}').hexdigest(),
         "-X", "PUT", "--data-binary", '{"token": 99}',
         f"http://{host}:{port}/_fencegate/v1/fences/job%3Areports-2026"],
        capture_output=True, text=True, timeout=30)
    assert register.stdout == "403", (register.stdout, register.stderr)
    assert fence(fg, "job:reports-2026") == 1


@runs("docs/leases.md", SHELL_LOOP, *RECIPE_EXAMPLES.values())
@pytest.mark.parametrize("service", RECIPE_SERVICES)
def test_leases_issuer_recipes(service, start, tmp_path):
    """Each issuer recipe as the page has it (a shell one: the service's functions, then the loop),
    on the shipped config and its defaults (`job:invoices`, bucket `reports`), against the real
    server (Redis, PostgreSQL, one etcd member, ZooKeeper): the lease granted and its token
    registered, a heartbeat, a fenced write stamped with the token, and a release that frees the
    lease (the next worker gets it at once, with a higher token). `test_lease_recipes.py` plays
    the classic scenario and the issuers' restarts with the same workers."""
    need(service)
    admin = "docs-recipes-admin-token-32-bytes"  # as in production: the recipes never use it
    fg = start(env={"FENCEGATE_SERVER__ADMIN_TOKEN": admin})
    make_bucket(fg)
    (tmp_path / "invoices.txt").write_bytes(b"invoices of the day\n")
    with running_issuer(service, tmp_path / service, etcd_members=1) as issuer:
        workers = Workers(service, fg, tmp_path, {**issuer.env, "TTL_MS": "1500"})
        try:
            first = workers.run("worker-1", ["write:invoices.txt=invoices.txt", "sleep:1200"])
            second = workers.run("worker-2", [])  # no waiting: the release must have freed it
        finally:
            workers.close()
    assert first.proc.returncode == 0 and second.proc.returncode == 0, (first.output, second.output)
    token = first.token()
    for line in (f"lease_acquired token={token} holder=worker-1", f"wrote key=invoices.txt token={token}",
                 "released"):
        assert line in first.output.splitlines(), first.output
    assert first.heartbeats_ms() and first.lines("lease_lost") == [], first.output
    assert second.token() > token, second.output
    assert fence(fg, "job:invoices", admin) == second.token()
    assert at_upstream(fg, "reports", "invoices.txt") == b"invoices of the day\n"
    assert stamp(fg, "reports", "invoices.txt") == str(token)


# --------------------------------------------------------------------------------------------
# every code block is run above or says why not
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("doc", DOCS)
def test_every_code_block_is_run_or_says_why_not(doc):
    """Each code block is a marked example a test here runs, says "Untested here: WHY", or is a
    `text` illustration; so a new, unmarked example fails this test."""
    found = blocks(doc)
    names = [b.name for b in found if b.name]
    assert len(names) == len(set(names)), f"{doc}: an example name is used twice: {names}"
    problems = []
    for b in found:
        if b.name:
            if (doc, b.name) not in RUN:
                problems.append(f"{b.where}: example {b.name!r} is marked, but no test runs it")
        elif b.lang != "text" and not b.untested:
            problems.append(f"{b.where}: a {b.lang or 'plain'} block that is neither a marked example "
                            "(<!-- example: NAME -->) nor says 'Untested here: WHY' (a `text` block is an illustration)")
    stale = sorted(name for d, name in RUN if d == doc and name not in names)
    assert not stale, f"{doc}: tests run examples the page no longer has: {stale}"
    assert not problems, "\n".join(problems)
