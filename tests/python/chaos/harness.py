"""One chaos run: the upstream wrapper in front of moto, fencegate replicas (embedded store,
several on one redis-server, or several on a three-member etcd cluster), writers, nemesis and
fence sampler for a bounded time; then the history goes to the checker.

Timing (defaults; every wait below is bounded):
- the wrapper holds a third of the writes for 0.2 s up to the in-flight deadline after their
  body arrived, longer than `upstream.request_timeout_ms` (1.5 s, so fencegate's upstream calls
  time out while the write may still commit) and longer than the writers' "timeout" patience
  (0.2-1.5 s, so clients hang up while their write is held); a third of the held writes are
  answered 500, 502, 503 or 504 at once and still commit after their hold.
- it commits a write within `fencing.inflight_deadline_ms` (D, 3 s) of its body's arrival, or
  never (held too long: answered 503 and dropped): anywhere up to the bound of fencegate's one
  timing assumption (docs/design.md, section 3a), minus moto's own time. With every commit
  inside it, a violation is never an upstream breaking fencegate's stated assumption.
- a long stop lasts longer than the in-flight deadline.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from fencegate_testlib import (
    MOTO_ACCESS_KEY,
    MOTO_SECRET_KEY,
    FenceGate,
    MotoServer,
    RedisServer,
    base_config,
    merge,
    s3_client,
    wait_until,
)

from .checker import Violation, check, render
from .nemesis import FenceSampler, Nemesis
from .processes import Etcd
from .upstream import ChaosUpstream
from .writers import Writer

PROBE_BUCKET = "chaos-probe"


@dataclass
class RunSpec:
    name: str  # also the bucket's name
    topology: str  # "embedded" | "redis" | "etcd"
    seconds: float
    replicas: int = 1
    writers: int = 6
    seed: int = 0
    inflight_deadline_ms: int = 3000
    request_timeout_ms: int = 1500
    hold_fraction: float = 0.35
    # None: from 0.2 s to the in-flight deadline (the commit budget below cuts the longest ones).
    hold_range: tuple | None = None
    # Of the held writes, those answered 500, 502, 503 or 504 before they commit.
    early_fraction: float = 0.3
    # The wrapper's commit bound after a body arrived (None: the in-flight deadline, fencegate's
    # assumption; a larger value breaks the assumption on purpose).
    commit_within_s: float | None = None
    lease_ttl_ms: int = 800
    faults: dict = field(default_factory=dict)  # nemesis fault kind -> weight

    @property
    def bucket(self) -> str:
        return self.name

    def rules(self) -> list:
        """Two prefix resources of four keys each, and two objects that are their own resource."""
        return [{"bucket": self.bucket, "prefix": "r1/", "resource": "job:r1"},
                {"bucket": self.bucket, "prefix": "r2/", "resource": "job:r2"}]

    def resources(self) -> dict:
        res = {"job:r1": [f"r1/k{i}" for i in range(4)], "job:r2": [f"r2/k{i}" for i in range(4)]}
        for key in ("solo/a", "solo/b"):
            res[f"{self.bucket}/{key}"] = [key]
        return res


class Replica:
    """A fencegate process as the writers see it: a name, its current addresses, and a state
    (up | stopped | down) the nemesis sets."""

    def __init__(self, name: str, fg: FenceGate):
        self.name = name
        self.fg = fg
        self.state = "up"

    @property
    def s3_addr(self) -> tuple:
        return self.fg.s3_addr

    @property
    def admin_url(self) -> str:
        return self.fg.admin_url


class ChaosRun:
    """Owns every process and thread of one run; `close()` (from a finalizer) stops them all."""

    def __init__(self, spec: RunSpec, moto: MotoServer, workdir: Path):
        self.spec = spec
        self.moto = moto
        self.workdir = workdir
        self.upstream: ChaosUpstream | None = None
        self.redis: RedisServer | None = None
        self.etcd: Etcd | None = None
        self.replicas: list = []
        self.nemesis: Nemesis | None = None

    # set-up ------------------------------------------------------------------------------
    def start(self):
        spec = self.spec
        s3 = s3_client(self.moto.url, access_key=MOTO_ACCESS_KEY, secret_key=MOTO_SECRET_KEY)
        for name in (spec.bucket, PROBE_BUCKET):
            try:
                s3.create_bucket(Bucket=name)
            except s3.exceptions.BucketAlreadyOwnedByYou:
                pass
        s3.put_bucket_versioning(Bucket=spec.bucket, VersioningConfiguration={"Status": "Enabled"})
        commit_within = spec.commit_within_s or spec.inflight_deadline_ms / 1000
        self.upstream = ChaosUpstream(self.moto.url, spec.bucket, spec.hold_fraction,
                                      self.hold_range, commit_within=commit_within,
                                      seed=spec.seed, early_fraction=spec.early_fraction).start()
        if spec.topology == "redis":
            d = self.workdir / "redis"
            d.mkdir(parents=True)
            self.redis = RedisServer(d)  # assigned first: close() stops it if start() fails
            self.redis.start()
        elif spec.topology == "etcd":
            d = self.workdir / "etcd"
            d.mkdir(parents=True)
            self.etcd = Etcd(d)
            self.etcd.start()
        for i in range(spec.replicas):
            fg = FenceGate(workdir=self._mkdir(f"fg{i}"), config=self._config(i))
            self.replicas.append(Replica(f"fg{i}", fg))
            fg.start()
        return self

    @property
    def hold_range(self) -> tuple:
        return self.spec.hold_range or (0.2, self.spec.inflight_deadline_ms / 1000)

    def _mkdir(self, name: str) -> Path:
        d = self.workdir / name
        d.mkdir(parents=True)
        return d

    def _config(self, i: int) -> dict:
        spec = self.spec
        cfg = base_config(self.workdir / f"fg{i}")
        cfg["upstream"] = {
            "kind": "s3", "endpoint": self.upstream.url, "region": "us-east-1",
            "access_key_id": MOTO_ACCESS_KEY, "secret_access_key": MOTO_SECRET_KEY,
            "request_timeout_ms": spec.request_timeout_ms, "connect_timeout_ms": 1000,
            "probe_bucket": PROBE_BUCKET,
        }
        over = {"fencing": {"inflight_deadline_ms": spec.inflight_deadline_ms, "rules": spec.rules()},
                "store": {"timeout_ms": 1000}}
        if spec.topology == "redis":
            over["store"].update(kind="redis", url=self.redis.url, path=None, replica_id=f"fg{i}")
        elif spec.topology == "etcd":
            over["store"].update(kind="etcd", endpoints=self.etcd.endpoints, path=None,
                                 replica_id=f"fg{i}")
        return merge(cfg, over)

    # the run -----------------------------------------------------------------------------
    def run(self) -> tuple:
        """Runs for `spec.seconds`; returns (report, printed summary, history path)."""
        spec = self.spec
        rng = random.Random(spec.seed)
        t_start = time.monotonic()
        deadline = t_start + spec.seconds
        resources = spec.resources()
        writers = [Writer(f"w{i}", spec.name, self.replicas, spec.bucket, resources, deadline,
                          seed=rng.randrange(2**32), lease_ttl_ms=spec.lease_ttl_ms)
                   for i in range(spec.writers)]
        self.nemesis = Nemesis(self.replicas, self.redis, spec.faults, deadline,
                               spec.inflight_deadline_ms / 1000, seed=rng.randrange(2**32),
                               etcd=self.etcd)
        sampler = FenceSampler(self.replicas, sorted(resources), deadline, seed=rng.randrange(2**32))
        for t in writers + [self.nemesis, sampler]:
            t.start()
        for t in writers + [self.nemesis, sampler]:
            t.join(timeout=max(0.0, deadline - time.monotonic()) + 60)
        problems = [f"{t.name} is still running" for t in writers + [self.nemesis] if t.is_alive()]
        problems += [f"{t.name} failed: {t.failure!r}" for t in writers + [self.nemesis] if t.failure]
        if self.nemesis.never_ran() and spec.seconds >= 60:
            problems.append(f"fault kinds that never ran: {', '.join(self.nemesis.never_ran())}")

        # Every held write reaches moto before the history is judged.
        hold_max = self.hold_range[1]
        idle = self.upstream.wait_idle(timeout=hold_max + 30)
        if not idle:
            problems.append("the upstream wrapper still had requests in flight")
        idle_at = time.monotonic() if idle else None
        finals = self._final_fences(sorted(resources))
        events = self.upstream.snapshot()
        records = [r for w in writers for r in w.records]
        grants = [g for w in writers for g in w.grants]
        report = check(events, records, sampler.samples, finals, spec.rules(), spec.bucket,
                       grants=grants, losses=self.nemesis.losses(), restarts=self.nemesis.restarts)
        report.violations += self._sanity(events, idle_at)
        t0 = min([e["t_arrival"] for e in events] + [r["t_start"] for r in records]
                 + [g["t_send"] for g in grants] or [t_start])  # the checker's clock
        for v in report.violations:
            v.evidence += self._faults_around(v.window, t0)

        faults = Counter(e["kind"] for e in self.nemesis.log)
        faults.update({
            "client_timeout": sum(1 for r in records if r.get("error") == "client-timeout"),
            "client_cut": sum(1 for r in records if r["mode"] == "cut"),
            "slow_body": sum(1 for r in records if r["mode"] == "slow"),
            "writer_stall": sum(w.counts["stalls"] for w in writers),
        })
        taken = Counter()
        for w in writers:
            taken.update(w.counts)
        title = (f"{spec.name} ({spec.topology}, {spec.replicas} fencegate, {spec.seconds:.0f}s, "
                 f"seed {spec.seed}, {os.environ.get('FENCEGATE_BIN', 'target/debug/fencegate')})")
        text = render(report, title, faults)
        text += f"\n   tokens taken {dict(taken)}"
        for p in problems:
            text += f"\n   HARNESS PROBLEM: {p}"
        history = self.workdir / "history.json"
        history.write_text(json.dumps({
            "spec": {k: v for k, v in vars(spec).items()}, "t_start": t_start,
            "events": events,
            "writes": records, "grants": grants, "samples": sampler.samples, "final_fences": finals,
            "faults": self.nemesis.log, "restarts": self.nemesis.restarts,
            "violations": [vars(v) for v in report.violations],
        }, indent=1, default=str))
        text += f"\n   history: {history}"
        if problems:
            report.violations.append(Violation("harness", "-", "; ".join(problems)))
        return report, text, history

    def _faults_around(self, window, t0: float) -> list:
        """The nemesis faults that overlap a violation's events (1 s either side), as lines
        with times on the checker's clock (relative to the first event)."""
        if window is None:
            return []
        lines = []
        for f in self.nemesis.log:
            if f["t_start"] - 1 <= window[1] and f.get("t_end", f["t_start"]) + 1 >= window[0]:
                lines.append(f"nemesis: {f['kind']} {f['target']} {f['detail']} from "
                             f"{f['t_start'] - t0:8.3f} to {f.get('t_end', f['t_start']) - t0:8.3f}")
        return lines or ["nemesis: no process fault near these events"]

    def _final_fences(self, resources: list) -> dict:
        """Each resource's fence once the run is quiet (through the first replica)."""
        sampler = FenceSampler(self.replicas, resources, 0, seed=0)
        finals = {}
        for res in resources:
            try:
                s = wait_until(lambda res=res: sampler.read(self.replicas[0], res), timeout=10, interval=0.5,
                               what=f"the fence of {res}")
            except AssertionError:
                continue  # not read within 10 s: the checker leaves its final-fence check out
            finals[res] = s["token"]
        return finals

    def _sanity(self, events: list, idle_at: float | None) -> list:
        """Checks the wrapper's log against moto itself: every PutObject that the log says
        committed is a version in the (versioned) bucket, and no other. A mismatch means the
        log, and so the verdict, cannot be trusted; its evidence is every write of the keys
        that differ, the writes of unknown outcome, and any write that reached the wrapper
        after it was idle (`idle_at`, on the monotonic clock of the events' times; None if it
        never was), for the triage of a harness fault."""
        s3 = s3_client(self.moto.url, access_key=MOTO_ACCESS_KEY, secret_key=MOTO_SECRET_KEY)
        versions = Counter()
        pages = s3.get_paginator("list_object_versions").paginate(Bucket=self.spec.bucket)
        for page in pages:
            for v in page.get("Versions", []):
                versions[v["Key"]] += 1
        logged = Counter(e["key"] for e in events
                         if e["bucket"] == self.spec.bucket and e["op"] == "put" and e["outcome"] == "committed")
        if versions == logged and not any(e["outcome"] == "unknown" for e in events):
            return []
        differ = {k for k in set(versions) | set(logged) if versions[k] != logged[k]}
        now = self.upstream.snapshot()  # writes that arrived since `events` was taken included
        after_idle = (lambda e: False) if idle_at is None else (lambda e: e["t_arrival"] > idle_at)
        suspects = [e for e in now if e["key"] in differ or e["outcome"] == "unknown" or after_idle(e)]
        # The rendering keeps a few lines: the likeliest first (late, unknown, then not settled).
        suspects.sort(key=lambda e: (not after_idle(e), e["outcome"] != "unknown",
                                     e["outcome"] in ("committed", "refused"), e["t_arrival"]))
        fields = ("seq", "method", "key", "query", "op", "outcome", "status", "stamp", "chaos_id", "hold",
                  "client_gone", "late", "t_arrival", "t_body", "t_fwd", "t_done")
        evidence = [f"moto versions per key {dict(versions)}", f"logged PUT commits {dict(logged)}",
                    ("the wrapper never went idle" if idle_at is None else
                     f"the wrapper was idle at monotonic t={idle_at:.3f}")
                    + f"; {len(now) - len(events)} writes arrived after the log was read"]
        evidence += [repr({f: e.get(f) for f in fields}) for e in suspects]
        return [Violation("harness", "-", "the wrapper's log does not match moto's versions", evidence)]

    def close(self):
        """Stops every process (safe to call twice, and after a failure)."""
        if self.nemesis is not None and self.nemesis.is_alive():
            self.nemesis.deadline = 0
            # Let a fault under way end (and restart what it killed) before stopping everything;
            # bounded: a long stop, an etcd restart and its leader wait.
            self.nemesis.join(timeout=self.spec.inflight_deadline_ms / 1000 + 45)
        for r in self.replicas:
            try:
                if r.fg.alive():
                    os.kill(r.fg.proc.pid, signal.SIGCONT)  # a stopped process ignores SIGTERM
                r.fg.stop()
            except Exception:  # noqa: BLE001 - teardown must try every process
                r.fg.kill9()
        if self.redis is not None:
            self.redis.stop()
        if self.etcd is not None:
            self.etcd.stop()
        if self.upstream is not None:
            self.upstream.stop()
