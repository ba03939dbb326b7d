"""Proves the command line and configuration surface: `--help`, environment overrides, clear start-up errors."""

from __future__ import annotations

import subprocess

from fencegate_testlib import base_config, bin_path, to_toml


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
    fg = fencegate(env={"FENCEGATE_SERVER__ADMIN_TOKEN": "from-env"})
    assert fg.get_fence("job:e").status_code == 401
    assert fg.get_fence("job:e", token="from-env").status_code == 404


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


def test_bad_config_fails_fast(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[server]\nlisten = "127.0.0.1:0"\nadmin_listen = "127.0.0.1:0"\n[store]\nkind = "no-such-store"\n')
    p = subprocess.run(
        [str(bin_path()), "serve", "--config", str(cfg)],
        capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL,
    )
    assert p.returncode != 0
    assert "fencegate ready" not in p.stdout
    assert p.stderr.strip(), "no error message on a bad config"
