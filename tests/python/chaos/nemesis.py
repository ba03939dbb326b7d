"""The nemesis (process faults, one at a time, bounded) and the fence sampler.

Faults (each chosen at random among those the topology allows):
- `kill9`: kill -9 a fencegate replica, restart it on the same data after a moment;
- `crash_restart_stop`: the operator's crash loop: kill -9 a replica, start it, stop it cleanly
  0.2-1 s later (inside the hold after the crash) and start it again; the hold must outlast
  the clean stop;
- `store_restore` (embedded store): the operator's restore of an older backup: stop a replica
  cleanly, copy its store directory, start it, let it commit for 0.5-2 s, stop it (cleanly or
  kill -9), put the copy back in place; the start must refuse (the store went back in time: its
  witness saw later commits) before admitting anything; the newest copy is put back and started;
- `stop_short` / `stop_long`: SIGSTOP a replica, SIGCONT it after 0.3-1.5 s, or after longer
  than a shared store keeps its registrations (11/8 of the in-flight deadline: a GC pause or VM
  suspend the others outlive);
- `redis_restart`: kill -9 redis-server and start it again (appendfsync always: no
  acknowledged write is lost);
- `pubsub_kill`: `CLIENT KILL TYPE pubsub` (every replica loses its advance subscription, and
  any announcement published before it resubscribes);
- `redis_flush`: `FLUSHALL` (the store loses every fence, lease, registration and epoch mark),
  half the time followed 0-2 s later by `fencegate init-store` with a replica's config, as an
  operator might run it after the loss;
- `redis_restart_empty`: kill -9 redis-server, delete its append-only files, start it again
  empty after 0.1-1 s (a restart without its data);
- `etcd_leader_kill9`: kill -9 the etcd member that leads now (asked through etcd's JSON
  gateway), restart it on its data after 0.2-1.5 s (the other two elect a leader meanwhile;
  Raft: no acknowledged write is lost), and wait until it answers and a leader is known.
Client-side faults (timeouts, hang-ups, slow bodies, stalls) are the writers' (writers.py).

Every kind with a weight is drawn once before any is drawn again (in a random order, as each is
allowed), so a run of the usual length exercises every fault it names; the harness reports a kind
that never ran.

The two store losses are logged with `loss` (the window in which the store lost its state) and
every replica restart in `restarts`: the checker needs both to know which fences a loss may
legitimately have taken (checker.py, the module doc).

A store loss and a replica's start (the run's, or a restart) are kept `SETTLE_S` apart (a loss
also its quiet period before a restart): a replica that has just started knows neither the
fences nor the epoch marks, and after a loss it relies on the emptied store until a replica with
marks repairs it, so it may grant a token again or below one granted before the loss, and admit
it. That is fencegate's documented limit (docs/operations.md, "Several replicas on Redis"; design.md
section 6), not a promise, so the run does not make it, as the upstream never breaks the timing
assumption.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path

import requests

from fencegate_testlib import bin_path, quote_resource

STORE_LOSSES = ("redis_flush", "redis_restart_empty")
# How long a restarted replica is given to learn every resource's fence and every slot's epoch
# mark (from the writers' calls through it and the advances announced) before a loss.
SETTLE_S = 8.0


class Nemesis(threading.Thread):
    def __init__(self, replicas: list, redis, weights: dict, deadline: float,
                 inflight_deadline_s: float, seed: int, faults_max: int = 60, etcd=None):
        super().__init__(name="nemesis", daemon=True)
        self.replicas = replicas
        self.redis = redis
        self.etcd = etcd
        self.weights = {k: w for k, w in weights.items() if w > 0}
        self.deadline = deadline
        self.long_stop = inflight_deadline_s * 11 / 8  # a registration's time to live (design.md 3a)
        self.rng = random.Random(seed)
        self.faults_max = faults_max
        self.log: list = []  # {kind, target, t_start, t_end, detail[, loss: (from, to)]}
        self.restarts: list = []  # {replica, t_from, t_to}: a replica killed and started again
        self.failure: BaseException | None = None
        self.t_begin = 0.0  # when the run (and every replica) began

    def run(self):
        self.t_begin = time.monotonic()
        try:
            # Leave the last seconds fault-free, so every fault has ended before the writers do.
            while len(self.log) < self.faults_max:
                time.sleep(self.rng.uniform(1.0, 3.5))
                if time.monotonic() > self.deadline - 8 or not self.weights:
                    return
                kinds = [k for k in sorted(self.weights) if self.allowed(k, time.monotonic())]
                if not kinds:
                    continue
                untried = [k for k in kinds if k not in self.tried()]
                kind = self.rng.choice(untried) if untried else \
                    self.rng.choices(kinds, [self.weights[k] for k in kinds])[0]
                entry = {"kind": kind, "target": "", "t_start": time.monotonic(), "detail": ""}
                getattr(self, kind)(entry)
                entry["t_end"] = time.monotonic()
                self.log.append(entry)
        except BaseException as exc:  # noqa: BLE001 - reported by the harness
            self.failure = exc
        finally:
            self.heal()

    def heal(self):
        """Every replica running and continued, Redis and every etcd member up: called at the
        end, whatever happened."""
        for r in self.replicas:
            if r.fg.alive():
                os.kill(r.fg.proc.pid, signal.SIGCONT)
                r.state = "up"
        if self.redis is not None and (self.redis.proc is None or self.redis.proc.poll() is not None):
            self.redis.start()
        if self.etcd is not None:
            self.etcd.heal()
        for r in self.replicas:
            if not r.fg.alive():
                t_from = time.monotonic()
                r.fg.start()
                r.state = "up"
                self.restarts.append({"replica": r.name, "t_from": t_from, "t_to": time.monotonic()})

    def allowed(self, kind: str, now: float) -> bool:
        """Whether `kind` may run now: store losses and replica restarts kept apart (module doc)."""
        if kind in STORE_LOSSES:
            return all(now - t >= SETTLE_S for t in [self.t_begin] + [r["t_to"] for r in self.restarts])
        if kind in ("kill9", "crash_restart_stop", "store_restore"):
            return all(now - to >= self.long_stop + SETTLE_S for _, to in self.losses())
        return True

    def tried(self) -> set:
        """The kinds that ran at least once."""
        return {e["kind"] for e in self.log}

    def never_ran(self) -> list:
        """The kinds with a weight that never ran."""
        return sorted(set(self.weights) - self.tried())

    def losses(self) -> list:
        """The windows (from, to) in which the store may have lost its state."""
        return [e["loss"] for e in self.log if "loss" in e]

    # faults -------------------------------------------------------------------------------
    def _restart(self, entry, steps):
        """A replica down while `steps(fg)` runs, up after; the window is a restart's."""
        r = self.rng.choice(self.replicas)
        entry["target"] = r.name
        r.state = "down"
        t_from = time.monotonic()
        try:
            steps(r.fg)
            r.state = "up"
        finally:
            self.restarts.append({"replica": r.name, "t_from": t_from, "t_to": time.monotonic()})

    def kill9(self, entry):
        def steps(fg):
            fg.kill9()
            time.sleep(self.rng.uniform(0.1, 1.0))
            fg.start()
        self._restart(entry, steps)

    def crash_restart_stop(self, entry):
        def steps(fg):
            fg.kill9()
            fg.start()
            time.sleep(self.rng.uniform(0.2, 1.0))
            fg.stop()
            fg.start()
        self._restart(entry, steps)

    def store_restore(self, entry):
        def steps(fg):
            store_dir = Path(fg.config["store"]["path"])
            fg.stop()
            older = {p.name: p.read_bytes() for p in store_dir.iterdir() if p.is_file()}
            fg.start()
            ran = self.rng.uniform(0.5, 2.0)
            time.sleep(ran)
            crashed = self.rng.random() < 0.5
            if crashed:
                fg.kill9()
            else:
                fg.stop()
            newest = {p.name: p.read_bytes() for p in store_dir.iterdir() if p.is_file()}
            for name, data in older.items():  # in place, as `cp` over the files does
                (store_dir / name).write_bytes(data)
            try:
                refused = subprocess.run([str(bin_path()), "serve", "--config", str(fg.config_path)],
                                         capture_output=True, text=True, timeout=20, stdin=subprocess.DEVNULL,
                                         cwd=str(fg.workdir))
            except subprocess.TimeoutExpired as served:
                raise AssertionError(f"an older copy of the store was served: {served.stdout!r}") from None
            if refused.returncode == 0 or "went back in time" not in refused.stderr:
                raise AssertionError(f"an older copy of the store was not refused ({refused.returncode}): "
                                     f"{refused.stderr[-2000:]}")
            for name, data in newest.items():
                (store_dir / name).write_bytes(data)
            fg.start()
            entry["detail"] = f"ran {ran:.2f}s on the newest copy, then {'kill -9' if crashed else 'a clean stop'}"
        self._restart(entry, steps)

    def _pause(self, entry, seconds: float):
        r = self.rng.choice(self.replicas)
        entry["target"], entry["detail"] = r.name, f"{seconds:.2f}s"
        r.state = "stopped"
        os.kill(r.fg.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            os.kill(r.fg.proc.pid, signal.SIGCONT)
            r.state = "up"

    def stop_short(self, entry):
        self._pause(entry, self.rng.uniform(0.3, 1.5))

    def stop_long(self, entry):
        self._pause(entry, self.long_stop + self.rng.uniform(0.5, 2.0))

    def redis_restart(self, entry):
        entry["target"] = "redis"
        self.redis.kill9()
        time.sleep(self.rng.uniform(0.1, 1.0))
        self.redis.start()

    def redis_flush(self, entry):
        entry["target"] = "redis"
        t_from = time.monotonic()
        reply = self.redis.command(b"FLUSHALL")
        entry["loss"] = (t_from, time.monotonic())
        if not reply.startswith(b"+OK"):
            raise AssertionError(f"FLUSHALL answered {reply!r}")
        if self.rng.random() < 0.5:
            entry["detail"] = "no init-store"
            return
        after = self.rng.uniform(0.0, 2.0)
        time.sleep(after)
        r = self.rng.choice(self.replicas)
        init = subprocess.run([str(bin_path()), "init-store", "--config", str(r.fg.config_path)],
                              capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
        if init.returncode != 0:
            raise AssertionError(f"init-store failed: {init.stderr.decode(errors='replace')[-2000:]}")
        entry["detail"] = f"init-store after {after:.2f}s: {init.stdout.decode(errors='replace').strip()}"

    def redis_restart_empty(self, entry):
        entry["target"] = "redis"
        t_from = time.monotonic()
        self.redis.kill9()
        gone = [p.name for p in self.redis.dir.iterdir() if p.name.startswith(("appendonly", "dump"))]
        for path in self.redis.dir.iterdir():
            if path.name.startswith(("appendonly", "dump")):
                if path.is_dir():
                    for f in path.iterdir():
                        f.unlink()
                    path.rmdir()
                else:
                    path.unlink()
        down = self.rng.uniform(0.1, 1.0)
        time.sleep(down)
        try:
            self.redis.start()
        finally:
            entry["loss"] = (t_from, time.monotonic())
        entry["detail"] = f"down {down:.2f}s, deleted {sorted(gone)}"

    def pubsub_kill(self, entry):
        entry["target"] = "redis"
        entry["detail"] = self.redis.command(b"CLIENT KILL TYPE pubsub").decode("latin-1").strip()

    def etcd_leader_kill9(self, entry):
        etcd = self.etcd
        i = etcd.wait_for_leader(timeout=10)
        if i is None:
            raise AssertionError("etcd had no leader for 10 s before a fault\n" + etcd.log_tail())
        m = etcd.members[i]
        entry["target"] = f"etcd {m.name}"
        etcd.kill9(i)
        down = self.rng.uniform(0.2, 1.5)
        time.sleep(down)
        # The time the survivors took to elect is visible here only roughly (polled).
        elected = etcd.leader()
        etcd.restart(i)
        after = etcd.wait_for_leader(timeout=10)
        if after is None:
            raise AssertionError(f"etcd had no leader 10 s after {m.name} came back\n"
                                 + etcd.log_tail())
        entry["detail"] = (f"down {down:.2f}s, leader while down: "
                           f"{'none' if elected is None else etcd.members[elected].name}, "
                           f"after: {etcd.members[after].name}")


class FenceSampler(threading.Thread):
    """Reads every resource's fence through a random running replica, a few times a second."""

    def __init__(self, replicas: list, resources: list, deadline: float, seed: int,
                 interval: float = 0.25):
        super().__init__(name="fence-sampler", daemon=True)
        self.replicas = replicas
        self.resources = resources
        self.deadline = deadline
        self.rng = random.Random(seed)
        self.interval = interval
        self.samples: list = []
        self.session = requests.Session()

    def read(self, replica, resource: str):
        """One read: a sample dict, or None if the replica did not answer 200/404."""
        t_send = time.monotonic()
        try:
            resp = self.session.get(f"{replica.admin_url}/v1/fences/{quote_resource(resource)}",
                                    timeout=1.0)
        except requests.RequestException:
            return None
        if resp.status_code not in (200, 404):
            return None
        token = resp.json()["token"] if resp.status_code == 200 else None
        return {"resource": resource, "t_send": t_send, "t_recv": time.monotonic(),
                "token": token, "replica": replica.name}

    def run(self):
        while time.monotonic() < self.deadline:
            for resource in self.resources:
                up = [r for r in self.replicas if r.state == "up"]
                if up:
                    sample = self.read(self.rng.choice(up), resource)
                    if sample is not None:
                        self.samples.append(sample)
            time.sleep(self.interval)
