"""Proves the command line and configuration surface: `--help`, environment overrides, clear start-up errors."""

from __future__ import annotations

import os
import subprocess

import pytest

from fencegate_testlib import base_config, bin_path, merge, to_toml


def test_help_lists_serve():
    p = subprocess.run([str(bin_path()), "--help"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    assert "serve" in p.stdout


def test_environment_overrides_config_file(fencegate):
    # The file's listen addresses are unusable; the environment's win.
    fg = fencegate(
        config={"server": {"listen": "not-an-address", "admin_listen": "not-an-address"}},
        env={
            "FENCEGATE_SERVER__LISTEN": "127.0.0.1:0",
            "FENCEGATE_SERVER__ADMIN_LISTEN": "127.0.0.1:0",
        },
    )
    assert fg.admin("GET", "/healthz").status_code == 200
    fg.client().create_bucket(Bucket="envbkt")
    fg.client(token=1).put_object(Bucket="envbkt", Key="k", Body=b"x")


def test_environment_sets_admin_token(fencegate):
    fg = fencegate(env={"FENCEGATE_SERVER__ADMIN_TOKEN": "from-the-environment"})
    assert fg.get_fence("job:e").status_code == 401
    assert fg.get_fence("job:e", token="from-the-environment").status_code == 404


def test_an_open_admin_listener_needs_a_token(tmp_path):
    """Whoever reaches the admin API can raise any fence for good: not on a non-loopback address
    without `server.admin_token`."""
    cfg = tmp_path / "open.toml"
    cfg.write_text(to_toml(dict(base_config(tmp_path), server={"listen": "127.0.0.1:0",
                                                                "admin_listen": "0.0.0.0:0"})))
    p = subprocess.run([str(bin_path()), "serve", "--config", str(cfg)], capture_output=True, text=True,
                       timeout=30, stdin=subprocess.DEVNULL)
    assert p.returncode != 0
    assert "fencegate ready" not in p.stdout
    assert "server.admin_token" in p.stderr and "loopback" in p.stderr, p.stderr


BAD_CONFIGS = {
    # id: (TOML added to a valid config, environment, the key the error must name, and the
    # other source it names besides the file, if any)
    "bad-store-kind": ('[store]\nkind = "no-such-store"\n', {}, "store.kind", None),
    "unknown-key": ("[fencing]\nbogus_key = 1\n", {}, "fencing.bogus_key", None),
    "wrong-type": ('[fencing]\nrequire_token = "yes"\n', {}, "fencing.require_token", None),
    "bad-store-kind-from-env": ("", {"FENCEGATE_STORE__KIND": "nope"}, "store.kind", "(from the environment: FENCEGATE_STORE__KIND)"),
    "unknown-key-from-env": ("", {"FENCEGATE_SERVER__BOGUS": "1"}, "server.bogus", "(from the environment: FENCEGATE_SERVER__BOGUS*)"),
    # A value that parses but fails validation is reported against the file, even when the
    # environment set it.
    "below-minimum-from-env": ("", {"FENCEGATE_SERVER__HEADER_BYTES_MAX": "100"}, "server.header_bytes_max", None),
    # A word that is no level would be read as a log target and silence every other log.
    "unknown-log-level": ('[log]\nlevel = "verbose"\n', {}, "log.level", None),
    "log-directive-without-level": ('[log]\nlevel = "info,fencegate=loud"\n', {}, "log.level", None),
    # Below the longest an admitted completion may take (fencing.inflight_deadline_ms), the
    # sweep could abort an upload whose completion may still commit.
    "stale-upload-delay-below-the-deadline": ("", {"FENCEGATE_FENCING__ABORT_STALE_UPLOADS_AFTER_MS": "1000"},
                                              "fencing.abort_stale_uploads_after_ms", None),
}


@pytest.mark.parametrize("extra,env,key,source", list(BAD_CONFIGS.values()), ids=list(BAD_CONFIGS.keys()))
def test_bad_config_fails_fast(tmp_path, extra, env, key, source):
    """A bad key stops the start with one error that names the key as the file writes it and
    the file (and the environment variable when the bad key came from it), once. Before: the
    error was printed twice in one line, the key behind figment's `default.` profile."""
    cfg = tmp_path / "bad.toml"
    good = base_config(tmp_path)
    if extra:
        for table in ("store", "fencing"):
            if f"[{table}]" in extra:
                good.pop(table)  # the extra text redefines the table
    cfg.write_text(to_toml(good) + "\n" + extra)
    p = subprocess.run(
        [str(bin_path()), "serve", "--config", str(cfg)],
        capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("FENCEGATE_")}, **env},
    )
    assert p.returncode != 0
    assert "fencegate ready" not in p.stdout
    assert f"`{key}`" in p.stderr, f"the error does not name {key}: {p.stderr!r}"
    assert p.stderr.count(str(cfg)) == 1, f"the error does not name the file once: {p.stderr!r}"
    assert "default." not in p.stderr and p.stderr.count(key) == 1, p.stderr
    if source is not None:
        assert source in p.stderr, f"the error does not name {source}: {p.stderr!r}"


def _without_credentials(tmp_path):
    cfg = base_config(tmp_path)
    del cfg["credentials"]
    path = tmp_path / "no-credentials.toml"
    path.write_text(to_toml(cfg) + "\n")
    return path


def _check_config(path, env):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FENCEGATE_")}
    return subprocess.run([str(bin_path()), "check-config", "--config", str(path)],
                          capture_output=True, text=True, timeout=30, env={**clean, **env})


def test_credentials_come_from_the_environment_or_an_included_file(tmp_path):
    """A container image carries no credential: they come from FENCEGATE_CREDENTIALS (inline
    TOML) or a file named by FENCEGATE_INCLUDE, and without either fencegate refuses to start."""
    path = _without_credentials(tmp_path)
    refused = _check_config(path, {})
    assert refused.returncode != 0 and "credentials" in refused.stderr, refused.stderr

    from_env = _check_config(path, {
        "FENCEGATE_CREDENTIALS": '[{access_key_id="env-key", secret_access_key="env-secret-value", role="issuer"}]'})
    assert from_env.returncode == 0, from_env.stderr
    assert 'access_key_id = "env-key"' in from_env.stdout and 'role = "issuer"' in from_env.stdout
    assert "env-secret-value" not in from_env.stdout + from_env.stderr

    included = tmp_path / "secrets.toml"
    included.write_text('[[credentials]]\naccess_key_id = "file-key"\nsecret_access_key = "file-secret-value"\n')
    from_file = _check_config(path, {"FENCEGATE_INCLUDE": str(included)})
    assert from_file.returncode == 0, from_file.stderr
    assert 'access_key_id = "file-key"' in from_file.stdout and 'role = "writer"' in from_file.stdout
    assert "file-secret-value" not in from_file.stdout + from_file.stderr

    missing = _check_config(path, {"FENCEGATE_INCLUDE": str(tmp_path / "absent.toml")})
    assert missing.returncode != 0 and "absent.toml" in missing.stderr, missing.stderr


def test_health_answers_from_readyz(fencegate, tmp_path):
    fg = fencegate()  # on port 0: `health` is given a config naming the admin port it bound
    host, port = fg.admin_addr
    up = tmp_path / "up.toml"
    up.write_text(to_toml(merge(fg.config, {"server": {"admin_listen": f"{host}:{port}"}})) + "\n")
    ok = subprocess.run([str(bin_path()), "health", "--config", str(up)],
                        capture_output=True, text=True, timeout=30)
    assert (ok.returncode, ok.stdout.strip()) == (0, "ready"), ok.stderr
    # Nothing listens there: not healthy.
    cfg = base_config(tmp_path)
    cfg["server"]["admin_listen"] = "127.0.0.1:9"
    down = tmp_path / "down.toml"
    down.write_text(to_toml(cfg) + "\n")
    bad = subprocess.run([str(bin_path()), "health", "--config", str(down)], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 1, (bad.stdout, bad.stderr)
