"""No secret in any output: a debug-level run's log and `fencegate check-config` hold no
configured secret, no admin token and no signature a client sent or the server expected."""

from __future__ import annotations

import re
import subprocess

import pytest
from botocore.exceptions import ClientError

from fencegate_testlib import ACCESS_KEY, SECRET_KEY, bin_path, s3_client, to_toml

ADMIN_TOKEN = "admin-token-that-must-not-leak-7f3a"
UPSTREAM_SECRET = "upstream-secret-that-must-not-leak-91c2"


def secrets_in(text: str, secrets: list[str]) -> list[str]:
    return [s for s in secrets if s in text]


def test_check_config_prints_no_secret(fencegate, tmp_path, moto_server):
    fg = fencegate(config={"server": {"admin_token": ADMIN_TOKEN}, "log": {"level": "debug"}})
    out = subprocess.run([str(bin_path()), "check-config", "--config", str(fg.config_path)],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "access_key_id" in out.stdout  # the config is printed...
    assert secrets_in(out.stdout + out.stderr, [SECRET_KEY, ADMIN_TOKEN]) == []  # ...without secrets

    upstream = dict(moto_server.upstream_config(), secret_access_key=UPSTREAM_SECRET)
    path = tmp_path / "s3.toml"
    config = dict(fg.config, upstream=upstream)
    path.write_text(to_toml(config))
    out = subprocess.run([str(bin_path()), "check-config", "--config", str(path)], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    assert secrets_in(out.stdout + out.stderr, [SECRET_KEY, ADMIN_TOKEN, UPSTREAM_SECRET]) == []


# RUST_LOG wins over log.level (the test library sets it to info by default). No value turns on
# the S3 library's signature logging: a directive for its module is more specific than any cap
# fencegate could add to the same filter, so the cap is a filter of its own.
RUST_LOGS = ["debug", "trace", "info,s3s::ops::signature=debug", "warn,s3s=trace,s3s::ops::signature=trace"]


@pytest.mark.parametrize("rust_log", RUST_LOGS)
def test_a_debug_log_holds_no_secret_and_no_signature(fencegate, rust_log):
    fg = fencegate(config={"server": {"admin_token": ADMIN_TOKEN}}, env={"RUST_LOG": rust_log})
    good = fg.client()
    good.create_bucket(Bucket="secrets")
    sent = []

    def remember_signature(request, **_kwargs):
        auth = request.headers.get("Authorization", b"")
        auth = auth.decode() if isinstance(auth, bytes) else auth
        match = re.search(r"Signature=([0-9a-f]{64})", auth)
        if match:
            sent.append(match.group(1))

    good.meta.events.register("before-send.s3.*", remember_signature)
    good.put_object(Bucket="secrets", Key="k", Body=b"x", Metadata={"fencing-token": "5"})
    # Signed with a wrong secret: the server computes the right signature to compare with.
    wrong = s3_client(f"http://{fg.s3_addr[0]}:{fg.s3_addr[1]}", access_key=ACCESS_KEY, secret_key="not-the-secret")
    wrong.meta.events.register("before-send.s3.*", remember_signature)
    with pytest.raises(ClientError) as exc_info:
        wrong.put_object(Bucket="secrets", Key="k", Body=b"y", Metadata={"fencing-token": "5"})
    assert exc_info.value.response["Error"]["Code"] == "SignatureDoesNotMatch"
    assert fg.admin("GET", "/metrics", token=ADMIN_TOKEN).status_code == 200
    assert len(sent) >= 2

    log = fg.log_tail(100000)
    if rust_log in ("debug", "trace"):
        assert " DEBUG " in log, "the run logged at debug level"
    assert re.findall(r"(?:DEBUG|TRACE) [^\n]*\bs3s::", log) == [], "the S3 library logged below info"
    assert secrets_in(log, [SECRET_KEY, ADMIN_TOKEN, *sent]) == []
    # No signature the server expected either: no 64-hex-digit run at all in the log.
    assert re.findall(r"\b[0-9a-f]{64}\b", log) == []
