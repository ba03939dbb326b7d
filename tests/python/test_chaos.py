"""Proves G3 under faults: a bounded chaos run per topology, judged by a history checker.

A slow, logging upstream (chaos/upstream.py) sits between fencegate and a real moto_server and
forwards every write to moto under one lock, so its log is the exact commit order; it holds some
writes after their body arrived (a slow S3 commit) and forwards them even if fencegate hung up.
Six writers hand leases over constantly and write with their tokens (some slowly, some hanging
up, some stalling past their lease); a nemesis kills, stops and restarts fencegate replicas,
Redis, and the etcd leader, and makes Redis lose its state (FLUSHALL, with or without an
operator's `init-store` after it, or a restart without its data). The checker (chaos/checker.py,
unit-tested below) then proves from the log that no older token committed after a newer one on
the same resource was forwarded, across store losses too; that every acknowledged write is in the
log; that fences never went down and lease grants never repeated a token or went below one
granted, registered, read or committed before, except where a store loss lies between them and
fencegate does not promise it (a replica's own grants stay above every token it granted or
admitted, losses or not).

Three runs by default (about 70 s each): one fencegate on the embedded store, three replicas on
one redis-server, and three replicas on a three-member etcd cluster (skipped without `etcd` or
with a fencegate built without the `etcd` feature). `FENCEGATE_CHAOS_SECONDS` sets the length of
each run, `FENCEGATE_CHAOS_SEED` replays a run's random choices (process timing still varies).
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess

import pytest

from chaos.checker import check, render
from chaos.harness import ChaosRun, RunSpec
from fencegate_testlib import MotoServer, base_config, bin_path, merge, to_toml

CHAOS_SECONDS = float(os.environ.get("FENCEGATE_CHAOS_SECONDS", "70"))

RULES = [{"bucket": "b", "prefix": "r1/", "resource": "job:r1"}]


# --------------------------------------------------------------------------------------------
# the checker on hand-made histories
# --------------------------------------------------------------------------------------------


def ev(seq, wid, key, token=None, method="PUT", arrival=0.0, fwd=None, done=None,
       outcome="committed", keys=None):
    """An upstream event (see chaos/checker.py): PUTs carry the stamp, DELETEs do not."""
    op = {"PUT": "put", "DELETE": "delete", "POST": "delete_objects"}[method]
    keys = keys if keys is not None else [key]
    return {
        "seq": seq, "method": method, "bucket": "b", "key": key if op != "delete_objects" else "",
        "query": "delete" if op == "delete_objects" else "", "op": op, "chaos_id": wid,
        "stamp": token if op == "put" else None, "keys": keys,
        "committed_keys": keys if outcome == "committed" else [], "status": 200 if outcome == "committed" else None,
        "outcome": outcome, "t_arrival": arrival, "t_body": arrival,
        "t_fwd": fwd if fwd is not None else arrival + 0.01,
        "t_done": done if done is not None else (fwd if fwd is not None else arrival + 0.01) + 0.01,
        "hold": 0.0, "client_gone": False,
    }


def wr(wid, keys, token, status=200, op="put", start=0.0, end=None, mode="normal", resource="job:r1",
       acked=None, body_complete=True):
    """A writer's record of one write."""
    return {
        "id": wid, "writer": wid.split("-")[0], "replica": "fg0", "resource": resource, "op": op,
        "bucket": "b", "keys": keys, "token": token, "mode": mode, "body_complete": body_complete,
        "t_start": start, "t_end": end if end is not None else start + 1.0, "status": status,
        "error": None if status else "client-timeout",
        "acked_keys": (acked if acked is not None else keys) if status and status < 300 else [],
        "refused_keys": {},
    }


def kinds(report) -> list:
    return sorted(v.kind for v in report.violations)


def test_checker_catches_an_older_token_committed_after_a_newer_one():
    # w2 (token 4) was held at the upstream; w1 (token 5) arrived later on another key of the
    # same resource and committed first; then w2's held write committed.
    events = [
        ev(2, "w2-1", "r1/k1", 4, arrival=1.0, fwd=3.5),
        ev(1, "w1-1", "r1/k0", 5, arrival=2.0, fwd=2.1),
    ]
    writes = [wr("w2-1", ["r1/k1"], 4, status=None, start=0.9, end=1.9),
              wr("w1-1", ["r1/k0"], 5, start=1.95, end=2.2)]
    report = check(events, writes, [], {"job:r1": 5}, RULES, "b")
    assert kinds(report) == ["commit-order"], render(report, "unit")
    v = report.violations[0]
    assert v.resource == "job:r1" and "token 4 committed on r1/k1 after token 5" in v.message
    assert any("#2" in line and "w2-1" in line for line in v.evidence)


def test_checker_catches_an_older_commit_after_a_newer_write_was_forwarded():
    # Token 7 reached the upstream (and was never committed: its client hung up mid-body), and
    # only then did the upstream start committing the held token 6 write on another key.
    events = [
        ev(None, "w1-1", "r1/k0", 7, arrival=2.0, outcome="truncated"),
        ev(1, "w2-1", "r1/k1", 6, arrival=1.0, fwd=2.5),
    ]
    writes = [wr("w1-1", ["r1/k0"], 7, status=None, mode="cut", body_complete=False, start=1.9),
              wr("w2-1", ["r1/k1"], 6, status=None, mode="timeout", start=0.9)]
    report = check(events, writes, [], {"job:r1": 7}, RULES, "b")
    assert kinds(report) == ["forwarded-before-commit"], render(report, "unit")


def test_checker_accepts_a_legal_history_with_equal_tokens_interleaved():
    events = [
        # Two holders of token 5 (a lease and a same-number registration) interleave freely,
        # across keys and across each other's slow commits.
        ev(1, "w1-1", "r1/k0", 5, arrival=1.0),
        ev(3, "w2-1", "r1/k1", 5, arrival=1.1, fwd=1.9),
        ev(2, "w1-2", "r1/k0", 5, arrival=1.2, fwd=1.3),
        ev(4, "w2-2", "r1/k0", 5, method="DELETE", arrival=2.0),
        # Token 6 is forwarded only after every token 5 write was answered.
        ev(5, "w3-1", "r1/k1", 6, arrival=2.5),
        # A client that hung up while its write was held: no answer, but it committed (allowed).
        ev(6, "w3-2", "r1/k2", 6, arrival=2.6, fwd=4.0),
        ev(7, "w3-3", None, 6, method="POST", arrival=4.1, keys=["r1/k1", "r1/k2"]),
    ]
    writes = [
        wr("w1-1", ["r1/k0"], 5, start=0.9, end=1.05),
        wr("w2-1", ["r1/k1"], 5, start=1.0, end=1.95),
        wr("w1-2", ["r1/k0"], 5, start=1.1, end=1.35),
        wr("w2-2", ["r1/k0"], 5, op="delete", status=204, start=1.9, end=2.1),
        wr("w3-1", ["r1/k1"], 6, start=2.4, end=2.6),
        wr("w3-2", ["r1/k2"], 6, status=None, mode="timeout", start=2.5, end=3.0),
        wr("w3-3", ["r1/k1", "r1/k2"], 6, op="delete_objects", start=4.0, end=4.2),
        # A DELETE of a key that was never written, answered by fencegate without the upstream.
        wr("w3-4", ["r1/k3"], 6, op="delete", status=204, start=4.3, end=4.4),
        # A stale writer refused (409) and a hung-up mid-body write: neither reached moto.
        wr("w1-3", ["r1/k0"], 5, status=409, start=3.0, end=3.1),
        wr("w3-5", ["r1/k0"], 6, status=None, mode="cut", body_complete=False, start=4.5, end=4.6),
    ]
    samples = [
        {"resource": "job:r1", "t_send": 0.5, "t_recv": 0.6, "token": None, "replica": "fg0"},
        {"resource": "job:r1", "t_send": 1.5, "t_recv": 1.6, "token": 5, "replica": "fg1"},
        {"resource": "job:r1", "t_send": 3.2, "t_recv": 3.3, "token": 6, "replica": "fg2"},
    ]
    report = check(events, writes, samples, {"job:r1": 6}, RULES, "b")
    assert report.ok, render(report, "unit")
    assert report.stats["commits"] == 8


def test_checker_catches_lost_acks_refused_commits_and_falling_fences():
    events = [
        ev(1, "w1-1", "r1/k0", 5, arrival=1.0),
        ev(2, "w1-3", "r1/k1", 4, arrival=1.5),  # answered 409, yet committed
        ev(3, "w1-4", "r1/k2", 5, arrival=2.0),  # the client hung up mid-body, yet committed
    ]
    writes = [
        wr("w1-1", ["r1/k0"], 5, start=0.9, end=1.1),
        wr("w1-2", ["r1/k0"], 5, start=1.2, end=1.3),  # answered 200, never committed
        # A DELETE answered 204 while r1/k0 existed throughout, and never forwarded.
        wr("w1-5", ["r1/k0"], 5, op="delete", status=204, start=1.4, end=1.45),
        wr("w1-3", ["r1/k1"], 4, status=409, start=1.4, end=1.6),
        wr("w1-4", ["r1/k2"], 5, status=None, mode="cut", body_complete=False, start=1.9, end=2.1),
    ]
    samples = [
        {"resource": "job:r1", "t_send": 2.5, "t_recv": 2.6, "token": 5, "replica": "fg0"},
        {"resource": "job:r1", "t_send": 2.7, "t_recv": 2.8, "token": 3, "replica": "fg1"},
    ]
    report = check(events, writes, samples, {"job:r1": 5}, RULES, "b")
    assert kinds(report) == sorted([
        "commit-order", "acked-not-committed", "acked-not-committed", "committed-after-refusal",
        "truncated-committed", "fence-decreased", "fence-below-commit",
    ]), render(report, "unit")


def grant(kind, token, sent, answered=None, resource="job:r1", writer="w1"):
    return {"resource": resource, "kind": kind, "token": token, "t_send": sent,
            "t_recv": answered if answered is not None else sent + 0.1, "writer": writer,
            "replica": "fg0"}


def test_checker_accepts_grants_that_increase_and_overlapping_ones_that_differ():
    grants = [
        grant("lease", 1, 0.0),
        grant("lease", 3, 0.2, 0.5),  # overlaps the next: any order, as long as they differ
        grant("lease", 2, 0.3, 0.4),
        grant("read", 3, 0.6),
        grant("registration", 4, 0.8, writer="w2"),
        grant("lease", 4, 0.85, 0.95),  # asked for before the registration was answered
        grant("registration", 5, 1.0),
        grant("lease", 6, 1.2),
        grant("lease", 1, 1.3, resource="job:r2"),  # another resource counts on its own
    ]
    samples = [{"resource": "job:r1", "t_send": 1.15, "t_recv": 1.19, "token": 5, "replica": "fg1"}]
    report = check([], [], samples, {}, RULES, "b", grants=grants)
    assert report.ok, render(report, "unit")
    assert report.stats["grants"] == {"lease": 6, "read": 1, "registration": 2}


def test_checker_catches_repeated_and_falling_grants():
    grants = [
        grant("lease", 5, 0.0, 0.1),
        grant("lease", 5, 0.05, 0.15, writer="w2"),  # concurrent, the same token: repeated
        grant("lease", 4, 0.3),  # below a grant answered before it was asked for
        grant("registration", 9, 0.5),
        grant("lease", 9, 0.7),  # not above a registration answered before
    ]
    samples = [{"resource": "job:r1", "t_send": 0.9, "t_recv": 0.95, "token": 12, "replica": "fg1"}]
    events = [ev(1, "w1-1", "r1/k0", 14, arrival=1.1, fwd=1.2, done=1.3)]
    writes = [wr("w1-1", ["r1/k0"], 14, start=1.0, end=1.35)]
    grants += [grant("lease", 10, 1.0, 1.05),  # below a fence read answered before
               grant("lease", 13, 1.4)]  # below a commit moto had answered
    report = check(events, writes, samples, {"job:r1": 14}, RULES, "b", grants=grants)
    assert kinds(report) == ["grant-order"] * 4 + ["grant-repeated"], render(report, "unit")
    assert any("not above token 12" in v.message for v in report.violations), render(report, "unit")
    assert any("not above token 14" in v.message for v in report.violations), render(report, "unit")


def read(token, sent, replica, resource="job:r1"):
    """A fence read through the admin API (the sampler's)."""
    return {"resource": resource, "t_send": sent, "t_recv": sent + 0.05, "token": token, "replica": replica}


def test_checker_accepts_fences_and_grants_a_store_loss_took():
    """Across a loss, lower fence reads and a grant repeating a token another (restarted) replica
    granted are what fencegate documents; the same history without the loss is four violations."""
    # Redis lost everything at 3.0 (FLUSHALL), after token 5 was granted (fg2) and committed.
    # fg2 was restarted before the loss, so nothing it or the store knew binds it afterwards.
    events = [ev(1, "w1-1", "r1/k0", 5, arrival=1.0, fwd=1.05, done=1.1),
              ev(2, "w2-1", "r1/k1", 5, arrival=5.6, fwd=5.65, done=5.7)]
    writes = [wr("w1-1", ["r1/k0"], 5, start=0.9, end=1.2), wr("w2-1", ["r1/k1"], 5, start=5.5, end=5.8)]
    grants = [grant("lease", 5, 0.5, 0.6, writer="w1") | {"replica": "fg2"},
              # After the quiet period: the restarted replica grants the lost token again.
              grant("lease", 5, 5.0, 5.1, writer="w2") | {"replica": "fg2"}]
    samples = [
        read(5, 2.0, "fg1"),
        read(5, 3.3, "fg0"),  # its mark, above the empty store
        read(None, 3.6, "fg2"),  # the store as it is now: lower, and legitimately so
        read(5, 6.0, "fg0"),
    ]
    losses = [(3.0, 3.1)]
    restarts = [{"replica": "fg2", "t_from": 2.5, "t_to": 2.8}]
    report = check(events, writes, samples, {"job:r1": 5}, RULES, "b", grants=grants,
                   losses=losses, restarts=restarts)
    assert report.ok, render(report, "unit")
    # Without the loss, the same history breaks the fence and grant rules.
    report = check(events, writes, samples, {"job:r1": 5}, RULES, "b", grants=grants, restarts=restarts)
    assert kinds(report) == ["fence-below-commit", "fence-decreased", "grant-order", "grant-repeated"], \
        render(report, "unit")


def test_checker_still_judges_commit_order_fences_and_a_replicas_own_grants_across_a_loss():
    """A loss excuses nothing else: G3 across it, fences inside one epoch (one replica's reads, or
    a read whose replica started after the loss), a commit admitted after it, and a replica's
    grant that repeats its own token from before it."""
    losses = [(3.0, 3.1)]
    restarts = [{"replica": "fg2", "t_from": 3.5, "t_to": 3.8}]  # after the loss: its marks are new
    events = [
        ev(1, "w1-1", "r1/k1", 6, arrival=1.0, fwd=1.1, done=1.2),
        # Committed after the loss (and after the quiet period): G3 holds across losses.
        ev(2, "w1-2", "r1/k2", 4, arrival=4.1, fwd=4.2, done=4.3),
        ev(3, "w2-1", "r1/k0", 8, arrival=5.1, fwd=5.15, done=5.2),
    ]
    writes = [wr("w1-1", ["r1/k1"], 6, start=0.9, end=1.3), wr("w1-2", ["r1/k2"], 4, start=4.0, end=4.4),
              wr("w2-1", ["r1/k0"], 8, start=5.0, end=5.3)]
    samples = [
        # One replica's reads inside the new epoch: they never go down.
        read(7, 4.0, "fg1"), read(5, 4.5, "fg1"),
        # Token 8 was admitted after the loss: no read after its commit is below it.
        read(6, 5.5, "fg0"),
        # fg2 started after the loss, so its read is the store's: another replica's may not go below.
        read(7, 4.0, "fg2", "job:r2"), read(3, 4.5, "fg0", "job:r2"),
    ]
    grants = [
        grant("lease", 10, 1.0, 1.1, resource="job:r3"),
        # The same replica (fg0, never restarted) grants 10 again after the loss: its mark holds 10.
        grant("lease", 10, 6.0, 6.1, resource="job:r3", writer="w2"),
        grant("lease", 11, 7.0, 7.1, resource="job:r3") | {"replica": "fg1"},
    ]
    report = check(events, writes, samples, {}, RULES, "b", grants=grants, losses=losses,
                   restarts=restarts)
    assert kinds(report) == ["commit-order", "fence-below-commit", "fence-decreased", "fence-decreased",
                             "grant-order", "grant-repeated"], render(report, "unit")
    assert {v.resource for v in report.violations if v.kind == "fence-decreased"} == {"job:r1", "job:r2"}


# --------------------------------------------------------------------------------------------
# the chaos runs
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moto(tmp_path_factory):
    server = MotoServer(tmp_path_factory.mktemp("chaos-moto")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def chaos_run(moto, tmp_path):
    """Factory: `chaos_run(spec)` starts a run's processes; all are stopped at teardown."""
    runs = []

    def start(spec: RunSpec) -> ChaosRun:
        run = ChaosRun(spec, moto, tmp_path / spec.name)
        runs.append(run)
        return run.start()

    try:
        yield start
    finally:
        for run in runs:
            run.close()


def seed() -> int:
    return int(os.environ.get("FENCEGATE_CHAOS_SEED") or random.randrange(2**31))


def judge(run: ChaosRun):
    report, text, _history = run.run()
    print("\n" + text)
    assert report.ok, "G3 chaos run found violations:\n" + text


def test_chaos_one_replica_embedded_store(chaos_run):
    spec = RunSpec(name="chaos-embedded", topology="embedded", seconds=CHAOS_SECONDS, replicas=1,
                   seed=seed(), faults={"kill9": 1, "crash_restart_stop": 1, "store_restore": 1, "stop_short": 2,
                           "stop_long": 1})
    judge(chaos_run(spec))


def test_chaos_three_replicas_on_redis(chaos_run):
    spec = RunSpec(name="chaos-redis", topology="redis", seconds=CHAOS_SECONDS, replicas=3,
                   seed=seed(), faults={"kill9": 1, "stop_short": 1, "stop_long": 1,
                                        "redis_restart": 1, "pubsub_kill": 2,
                                        "redis_flush": 1, "redis_restart_empty": 1})
    judge(chaos_run(spec))


def etcd_missing(workdir) -> str:
    """Why the etcd run cannot run here ("" if it can)."""
    if shutil.which("etcd") is None:
        return "etcd is not installed (apt-get install etcd-server)"
    if not bin_path().exists():
        return ""  # the run fails with fencegate's own message
    # A fencegate built without the `etcd` feature refuses an etcd store when it loads the config.
    cfg = merge(base_config(workdir), {"store": {"kind": "etcd", "path": None,
                                                  "endpoints": ["http://127.0.0.1:9"]}})
    path = workdir / "etcd-probe.toml"
    path.write_text(to_toml(cfg) + "\n")
    probe = subprocess.run([str(bin_path()), "check-config", "--config", str(path)],
                           capture_output=True, timeout=30, stdin=subprocess.DEVNULL)
    if probe.returncode != 0 and b"without etcd support" in probe.stderr + probe.stdout:
        return "this fencegate was built without the etcd feature"
    return ""


def test_chaos_three_replicas_on_etcd(chaos_run, tmp_path):
    why = etcd_missing(tmp_path)
    if why:
        pytest.skip(why)
    spec = RunSpec(name="chaos-etcd", topology="etcd", seconds=CHAOS_SECONDS, replicas=3,
                   seed=seed(), faults={"kill9": 1, "stop_short": 1, "stop_long": 1,
                                        "etcd_leader_kill9": 2})
    judge(chaos_run(spec))
