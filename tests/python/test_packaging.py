"""What ships beside the binary works as the operator will use it (docs/operations.md, "Alerts"
and "Running under systemd"): the Prometheus alerting rules pass `promtool check rules` and their
unit tests (`promtool test rules`: each alert fires on the series that should page and stays
quiet on a healthy replica), and the systemd unit passes `systemd-analyze verify` without a
word (it warns on stderr and still exits 0), with a stop timeout above fencegate's own drain."""

from __future__ import annotations

import re
import shutil
import subprocess

from fencegate_testlib import REPO_ROOT, bin_path

DEPLOY = REPO_ROOT / "deploy"


def run(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_the_alerting_rules_pass_promtool_and_their_unit_tests():
    promtool = shutil.which("promtool")
    assert promtool, "promtool is not installed (scripts/test installs Debian's prometheus)"
    rules = DEPLOY / "prometheus"
    checked = run(promtool, "check", "rules", rules / "fencegate-alerts.yml")
    assert checked.returncode == 0 and "SUCCESS: 9 rules found" in checked.stdout, checked.stdout + checked.stderr
    tested = run(promtool, "test", "rules", "fencegate-alerts.test.yml", cwd=rules)
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr


def test_every_alert_reads_metrics_fencegate_exports(fencegate):
    """A rule on a metric fencegate never exports would stay quiet for ever (after one write:
    a latency histogram appears with its first sample)."""
    fg = fencegate(local_buckets=("alerts",))
    fg.client(token=1, resource="job:alerts").put_object(Bucket="alerts", Key="k", Body=b"x")
    exported = {line.split()[2] for line in fg.admin("GET", "/metrics").text.splitlines()
                if line.startswith("# TYPE ")}
    exported |= {name + suffix for name in exported for suffix in ("_count", "_sum", "_bucket")}
    text = (DEPLOY / "prometheus" / "fencegate-alerts.yml").read_text()
    used = set(re.findall(r"\b(fencegate_[a-z0-9_]+)", text))
    assert used, "no metric read"
    assert used <= exported, f"not exported: {sorted(used - exported)}"


def test_the_systemd_unit_verifies_clean(tmp_path):
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is not installed"
    unit = (DEPLOY / "systemd" / "fencegate.service").read_text()
    # Verified against the binary the suite built, where the unit expects it installed.
    binary = tmp_path / "fencegate"
    shutil.copy(bin_path(), binary)
    local = tmp_path / "fencegate.service"
    local.write_text(unit.replace("/usr/local/bin/fencegate", str(binary)))
    verified = run(analyze, "verify", local)
    assert verified.returncode == 0 and verified.stderr.strip() == "", verified.stderr
    stop_s = int(re.search(r"^TimeoutStopSec=(\d+)$", unit, re.M).group(1))
    reference = (REPO_ROOT / "docs" / "configuration.md").read_text()
    drain_ms = int(re.search(r"^\| `server.shutdown_timeout_ms` \| (\d+) \|", reference, re.M).group(1))
    assert stop_s * 1000 > drain_ms, "systemd would SIGKILL a stop that is still draining"


def test_every_dashboard_panel_is_filtered_by_job_and_replica_and_parses(tmp_path):
    """docs/grafana-dashboard.json has a job and an instance (replica) variable, every metric
    every panel reads is filtered by both, and every query, its variables filled in as Grafana
    fills them, is PromQL that promtool parses."""
    import json

    dashboard = json.loads((REPO_ROOT / "docs" / "grafana-dashboard.json").read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert {"job", "instance"} <= set(variables), sorted(variables)
    assert "$job" in variables["instance"]["definition"], "the replicas offered are the chosen job's"
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 20, len(exprs)
    for expr in exprs:
        for selector in re.findall(r"\bfencegate_[a-z0-9_]+(\{[^}]*\})?", expr):
            assert selector.startswith('{job=~"$job", instance=~"$instance"'), expr
    filled = [e.replace("$__rate_interval", "1m").replace("$__range", "1h").replace("$job", ".*")
              .replace("$instance", ".*") for e in exprs]
    rules = tmp_path / "dashboard-queries.yml"
    rules.write_text("groups:\n  - name: dashboard\n    rules:\n" + "".join(
        f"      - record: dashboard:query_{i}\n        expr: {json.dumps(e)}\n" for i, e in enumerate(filled)))
    promtool = shutil.which("promtool")
    assert promtool, "promtool is not installed (scripts/test installs Debian's prometheus)"
    checked = run(promtool, "check", "rules", rules)
    assert checked.returncode == 0 and f"SUCCESS: {len(exprs)} rules found" in checked.stdout, \
        checked.stdout + checked.stderr
