"""Proves G3 at its bounds (docs/design.md section 3a): the faults are put at the bound, not
inside it. The one timing assumption: an upstream commits a
request it received whole within D (`fencing.inflight_deadline_ms`) of receiving it, or never.
Here every late commit lands at D minus 50 ms after the upstream received the request.

1. A 500, 502, 503 or 504 answer to a write is an unknown outcome, held for D: the upstream
   answers token 5's PUT at once with the 5xx and commits it 50 ms short of D later; token 6,
   sent right after the 5xx, must not commit before it (embedded store).
2. Across replicas (Redis), the latest hand-over a replica allows leaves the upstream D,
   whatever happens to the replica, its link or the store afterwards. A replica hands a body
   over only while the last renewal of its registration that it knows succeeded was SENT less
   than H = D/4 ago, and Redis keeps a registration E = 11D/8 after the renewal reached it.
   With r when A sent that renewal, r' >= r when Redis ran it, h the hand-over, a >= h when the
   upstream had the body whole (a - h is loopback transit, far below D/8) and S when Redis drops
   A's registration (its score, read until replica B is admitted):

       S >= r' + E >= r + E > (h - H) + E = h + D + D/8 > a + D

   so B's token 6, retried on another key of the resource until admitted, lands after the
   upstream's late commit of token 5. Each case puts its fault right after a renewal of A's
   token-5 registration reached A and checks (a) S >= a + D, (b) no token-5 write commits after
   a token-6 write, (c) A hands its last body byte over where the bound allows it (at the
   fault + H - 30 ms) and not where it does not:
     - A's link to Redis cut both ways; and, x_old, the last byte just inside 3D/4, past the window;
     - only Redis's answers to A lost (A's renewals still land, so S moves on; A never learns);
     - A's link delayed 2 s each way from that renewal on; and delayed from before A's admission
       (every answer is then older than H when it comes: nothing is handed over);
     - Redis paused by CLIENT PAUSE ALL past D, or asleep (DEBUG SLEEP) past E;
     - A killed (SIGKILL) or stopped (SIGSTOP) right after its hand-over, its renewals lost since r.

Every upstream is `holding_upstream.HoldingUpstream` in front of moto_server; its `writes()` log
is moto's commit order. Every key under `jobs/` belongs to resource `job`.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import pytest
from botocore.exceptions import ClientError

from fencegate_testlib import (
    FenceGate,
    RedisServer,
    RespClient,
    build_head,
    code_of,
    connect,
    merge,
    metric_samples,
    read_response,
    redis_version,
    sign_headers,
    signed_raw_request,
    status_of,
    unique,
    wait_until,
)
from holding_upstream import HELD_PREFIX, HELD_RESOURCE, HoldingUpstream
from tcp_link import TcpLink

D_MS = 2000  # fencing.inflight_deadline_ms in every test here
D_S = D_MS / 1000
COMMIT_AFTER_S = (D_MS - 50) / 1000  # the upstream's late commit: 50 ms short of the bound
RETRY_FOR_S = 3 * D_S + 10  # how long a newer token's writer keeps retrying 503s
RETRYABLE = {"SlowDown", "FenceStoreUnavailable"}
AMBIGUOUS = "fencegate_ambiguous_outcomes_total"


def committed(up: HoldingUpstream, bucket: str) -> list:
    """(seq, key, token) of every write moto answered 2xx under the bucket's `jobs/`, in commit
    order."""
    return [(w["seq"], w["path"].split("/", 2)[2], int(w["token"]))
            for w in up.writes(f"/{bucket}/{HELD_PREFIX}")
            if w["status"] is not None and 200 <= w["status"] < 300 and w["token"] is not None]


def older_after_newer(commits: list) -> list:
    """Every commit whose token is below a token that committed before it (G3's violation)."""
    out, top = [], None
    for seq, key, token in commits:
        if top is not None and token < top[2]:
            out.append(f"token {token} ({key}, #{seq}) committed after token {top[2]} ({top[1]}, #{top[0]})")
        if top is None or token > top[2]:
            top = (seq, key, token)
    return out


def put_until_admitted(fg, bucket: str, key: str, token: int, result: dict):
    """PUT `key` with `token` every ~50 ms while fencegate answers 503 SlowDown or
    FenceStoreUnavailable, at most RETRY_FOR_S; fills `result`."""
    client = fg.client(token=token, read_timeout=30)
    deadline = time.monotonic() + RETRY_FOR_S
    result["attempts"] = []
    while time.monotonic() < deadline:
        try:
            client.put_object(Bucket=bucket, Key=key, Body=f"token {token}".encode())
            result["status"] = 200
            result["t_ok_wall"] = time.time()
            return
        except ClientError as exc:
            result["attempts"].append((status_of(exc), code_of(exc)))
            if status_of(exc) != 503 or code_of(exc) not in RETRYABLE:
                result["status"] = status_of(exc)
                return
        except Exception as exc:  # noqa: BLE001 - a client timeout: retried, reported if it lasts
            result["attempts"].append(repr(exc)[:120])
        time.sleep(0.05)
    result["status"] = "gave up"


def ambiguous_total(fg) -> float:
    """`fencegate_ambiguous_outcomes_total` summed over every label set fencegate emits."""
    return sum(v for (name, _labels), v in metric_samples(fg).items() if name == AMBIGUOUS)


def ambiguous_series(fg) -> dict:
    return {tuple(sorted(labels)): v for (name, labels), v in metric_samples(fg).items() if name == AMBIGUOUS}


# --------------------------------------------------------------------------------------------
# 1. a 5xx answer is an unknown outcome, held for D
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [500, 502, 503, 504])
def test_a_5xx_answer_holds_the_write_for_the_inflight_deadline(held_s3, status):
    """The upstream answers token 5's PUT at once with `status` and commits it anyway at
    arrival + D - 50 ms: token 6, sent right after that answer (and retried while refused), does
    not commit before token 5 (no token < 6 commits after a token-6 write), and fencegate counts
    the write in `fencegate_ambiguous_outcomes_total`."""
    env = held_s3(fencing={"inflight_deadline_ms": D_MS}, bucket_prefix="bounds")
    late = env.up.answer_then_commit("PUT", env.path("jobs/a"), status, COMMIT_AFTER_S)
    before = ambiguous_total(env.fg)

    five = signed_raw_request(env.fg, "PUT", env.path("jobs/a"), {"Fencing-Token": "5"}, b"token five",
                              timeout=D_S + 10)
    assert late.arrived.is_set(), f"token 5's PUT never reached the upstream: {five.status} {five.body[:300]!r}"
    six: dict = {}
    put_until_admitted(env.fg, env.bucket, "jobs/b", 6, six)
    assert late.committed.wait(D_S + 10), "the upstream's late commit of token 5 did not happen"
    assert env.up.wait_idle(30)

    order = committed(env.up, env.bucket)
    detail = (f"token 5 answered {five.status} {five.code()!r}; token 6: {six}; commit order "
              f"(seq, key, token) = {order}")
    assert six.get("status") == 200, "token 6 was never admitted: " + detail
    assert [t for _, _, t in order] == [5, 6] and not older_after_newer(order), (
        f"token 6 committed before the {status}-answered token-5 write could land: "
        + "; ".join(older_after_newer(order)) + "; " + detail)
    assert five.status is not None and five.status >= 500, "fencegate told the client more than it knows: " + detail
    after = ambiguous_total(env.fg)
    assert after >= before + 1, (
        f"{AMBIGUOUS} did not count the {status} answer: {before} -> {after}; series {ambiguous_series(env.fg)}")


# --------------------------------------------------------------------------------------------
# 2. the latest hand-over a replica allows (two replicas on Redis)
# --------------------------------------------------------------------------------------------

H_NEW_S = D_S / 4  # the hand-over window: hand over while the last renewal was sent < D/4 ago
H_OLD_S = 3 * D_S / 4  # the window before: 3D/4 of a registration Redis kept D
E_MS = D_MS * 11 / 8  # how long Redis keeps a registration after a renewal reached it
WINDOWS = {"x_new": H_NEW_S - 0.030, "x_old": H_OLD_S - 0.030}  # last byte at cut + x
X_EDGE = WINDOWS["x_new"]  # the last byte at the edge of the window, in every other case
TRIALS = 3  # a trial whose renewal watch raced (A never saw the renewal) is run again
RELAY_WAIT_S = 0.02  # how long the cut waits for the renewal's answer to pass the link to A
DELAY_S = 2.0  # the delayed link: every chunk, each way
# store.timeout_ms of A behind the delayed link: a call answered 2 x DELAY_S after it was sent is
# taken (late), not timed out. Every other replica uses 200 ms: a renewal that fails must fail
# inside the hand-over window.
LATE_ANSWERS_TIMEOUT_MS = int(2 * DELAY_S * 1000 + 1000)
# CLIENT PAUSE: past D, and over before the upstream's late commit of a body handed over at the
# hand-over at 3D/4 (fault + ~0.5 s + D - 50 ms), which a store keeping registrations D would not cover.
PAUSE_MS = D_MS + 100
SLEEP_S = (E_MS + 250) / 1000  # DEBUG SLEEP: past E, Redis wakes with A's registration past its deadline
INFLIGHT_KEY = f"fg:{{{HELD_RESOURCE}}}:inflight"  # docs/design.md section 6


class Redis(RespClient):
    """The test's own view of the store."""

    def members(self) -> dict:
        """{member: expiry score in ms on Redis's clock} of the resource's registrations."""
        flat = self.call("ZRANGE", INFLIGHT_KEY, 0, -1, "WITHSCORES")
        return {flat[i]: float(flat[i + 1]) for i in range(0, len(flat), 2)}

    def time_ms(self) -> float:
        secs, micros = self.call("TIME")
        return int(secs) * 1000 + int(micros) / 1000


class ScoreWatch:
    """Reads a member's score every 10 ms on a connection of its own until stopped (a read
    blocks while Redis is paused): the highest one seen is the latest S Redis had."""

    def __init__(self, port: int, member: str):
        self.redis = Redis(port, timeout=SLEEP_S + 10)
        self.member = member
        self.top = 0.0
        self.error: str | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="bounds-score-watch")

    def start(self) -> "ScoreWatch":
        self.thread.start()
        return self

    def _run(self):
        deadline = time.monotonic() + RETRY_FOR_S + 60
        while not self.done.is_set() and time.monotonic() < deadline:
            try:
                score = self.redis.members().get(self.member)
            except Exception as exc:  # noqa: BLE001 - reported in the trial's summary
                self.error = repr(exc)[:120]
                return
            if score is not None:
                self.top = max(self.top, score)
            self.done.wait(0.01)

    def stop(self) -> float:
        self.done.set()
        if self.thread.ident is not None:
            self.thread.join(timeout=SLEEP_S + 15)
        self.redis.close()
        return self.top


def start_replica(fencegate, redis_url: str, up: HoldingUpstream, moto_server, bucket: str, name: str,
                  store_timeout_ms: int = 200, env: dict | None = None):
    rule = {"bucket": bucket, "prefix": HELD_PREFIX, "resource": HELD_RESOURCE}
    upstream = dict(moto_server.upstream_config(), endpoint=up.url, probe_bucket=bucket)
    # store.timeout_ms: a renewal (every D/8) that fails must fail inside the hand-over window.
    store = {"kind": "redis", "url": redis_url, "path": None, "replica_id": name, "timeout_ms": store_timeout_ms}
    return fencegate(upstream=upstream, env=env,
                     config=merge({"store": store}, {"fencing": {"inflight_deadline_ms": D_MS, "rules": [rule]}}))


@dataclass
class Bench:
    """Replica a reaches Redis through `link`, replica b directly; both in front of `up`."""

    a: FenceGate
    b: FenceGate
    link: TcpLink
    redis: Redis
    redis_port: int
    control: RespClient  # CLIENT PAUSE and DEBUG SLEEP go on a connection of their own
    up: HoldingUpstream
    bucket: str
    a_stopped: bool = False

    def resume_a(self):
        if self.a_stopped:
            self.a_stopped = False
            if self.a.alive():
                os.kill(self.a.proc.pid, signal.SIGCONT)


@dataclass
class Case:
    """A fault at the bound: `fault` runs right after a renewal's answer reached A (`before`,
    before A's PUT is sent), A's last body byte is sent at that moment + `x`, and
    `after_handover` runs once the upstream has A's body whole (or failed to get it)."""

    x: float
    handover: bool  # whether the bound lets A hand over there
    fault: Callable[[Bench], None] | None = None
    before: Callable[[Bench], None] | None = None
    after_handover: Callable[[Bench], None] | None = None
    at_end: Callable[[Bench], None] | None = None  # once B was admitted, before A's answer is read
    expires_only: bool = False  # nobody can withdraw A's registration: it goes at S, no earlier
    b_after_handover: bool = False  # B starts after `after_handover`, not at the fault
    a_store_timeout_ms: int = 200


def kill_a(bench: Bench):
    bench.a.kill9()
    bench.link.restore()  # the link heals at once: A, dead, neither renews nor withdraws


def stop_a(bench: Bench):
    os.kill(bench.a.proc.pid, signal.SIGSTOP)
    bench.a_stopped = True
    bench.link.restore()  # the link heals at once: A, stopped, neither renews nor withdraws


@dataclass
class Trial:
    token: int
    x: float
    member: str = ""
    raced: bool = False  # the renewal's answer was not seen passing to A before the cut
    score_at_cut: float = 0.0  # when Redis drops A's registration (ms, Redis's clock) at the cut
    score_final: float = 0.0  # S: the latest such score Redis had, read until B was admitted
    watch_error: str | None = None
    redis_time_at_cut: float = 0.0
    cut_after_renewal_ms: float = 0.0  # from the poll before the renewal ran to the cut (upper bound)
    last_byte_after_cut_ms: float = 0.0
    arrived_before_fault: bool | None = None
    handed_over: bool = False
    arrival_ms: float | None = None  # when the upstream had A's body whole (ms, wall = Redis's clock)
    a_status: int | None = None
    a_code: str = ""
    a_error: str | None = None
    a_answered_ms: float | None = None  # from A's PUT head sent to A's answer
    b: dict = field(default_factory=dict)

    def summary(self) -> str:
        margin = ""
        if self.arrival_ms is not None:
            margin = (f", S - (arrival + D) = {self.score_final - self.arrival_ms - D_MS:+.0f} ms (at the cut "
                      f"{self.score_at_cut - self.arrival_ms - D_MS:+.0f} ms)")
        watch = f" ({self.watch_error})" if self.watch_error else ""
        return (f"token {self.token}: x={self.x * 1000:.0f} ms, raced={self.raced}, cut <= "
                f"{self.cut_after_renewal_ms:.1f} ms after the renewal, S - TIME at cut = "
                f"{self.score_at_cut - self.redis_time_at_cut:.0f} ms, S moved on by "
                f"{self.score_final - self.score_at_cut:.0f} ms{watch}, last byte at cut + {self.last_byte_after_cut_ms:.0f} ms, handed over={self.handed_over}"
                f"{margin}, A answered {self.a_status} {self.a_code!r} {self.a_error or ''}"
                f"{'' if self.a_answered_ms is None else f' {self.a_answered_ms:.0f} ms after its head'}, B: "
                f"{self.b.get('status')} after {len(self.b.get('attempts', []))} refusals "
                f"{sorted(set(map(str, self.b.get('attempts', []))))}")


def wait_for_renewal(redis: Redis, member: str, score0: float, prev_send: float) -> float:
    """Until the next change of `member`'s score: a renewal that just ran in Redis. Returns when
    the poll before it ran was sent (the renewal ran after that)."""
    deadline = time.monotonic() + 3.0
    while True:
        assert time.monotonic() < deadline, f"no renewal of {member} within 3 s"
        t_send = time.monotonic()
        score = redis.members().get(member)
        assert score is not None, f"{member} left Redis before it was renewed"
        if score != score0:
            return prev_send
        prev_send = t_send
        time.sleep(0.002)


def run_trial(bench: Bench, case: Case, n: int) -> Trial:
    """One hand-over at the fault + x: tokens 5 and 6 on the first trial, 15 and 16 on the
    second..."""
    five, six = 5 + 10 * n, 6 + 10 * n
    key_a, key_b = f"{HELD_PREFIX}a{n}", f"{HELD_PREFIX}b{n}"
    path_a = f"/{bench.bucket}/{key_a}"
    trial = Trial(token=five, x=case.x)
    hold = bench.up.hold_next("PUT", path_a, commit_after_s=COMMIT_AFTER_S)
    redis, link = bench.redis, bench.link

    body = b"token five"
    host, port = bench.a.s3_addr
    headers = sign_headers("PUT", host, port, path_a, {"Fencing-Token": str(five), "Content-Length": str(len(body))})
    sock = connect(bench.a.s3_addr, timeout=30)
    watch: ScoreWatch | None = None
    answer: dict = {}
    try:
        if case.before:
            case.before(bench)
        sock.sendall(build_head("PUT", path_a, headers) + body[:-1])
        t_head = time.monotonic()

        def read_answer():  # A's answer, whenever it comes (a stopped A answers once continued)
            answer["resp"] = read_response(sock, timeout=RETRY_FOR_S + 60)
            answer["t"] = time.monotonic()

        reader = threading.Thread(target=read_answer, daemon=True, name="bounds-a-answer")
        reader.start()

        # A registered token `five`: its write is in flight, its body not complete.
        polls = [time.monotonic()]

        def registered():
            polls.append(time.monotonic())
            mine = {m: s for m, s in redis.members().items() if m.startswith("a:") and m.endswith(f":{five}")}
            return (polls[-1], *next(iter(mine.items()))) if mine else None

        prev_send, trial.member, score0 = wait_until(registered, 10 + 2 * DELAY_S, interval=0.002,
                                                     what=f"replica a's registration of token {five}")
        if case.before:
            # Redis ran the admission after the poll before the one that saw it; its answer
            # reaches A DELAY_S after it left Redis, when the admission is 2 x DELAY_S old.
            prev_send = polls[-2]
            answered_by = prev_send + DELAY_S
        else:
            # The next change of its score is a renewal that just ran in Redis; its answer passes
            # the link to A after the previous poll ran.
            prev_send = wait_for_renewal(redis, trial.member, score0, prev_send)
            answered_by = prev_send
        relay_by = time.monotonic() + RELAY_WAIT_S + (DELAY_S if case.before else 0.0)
        while link.last_down <= answered_by and time.monotonic() < relay_by:
            time.sleep(0.0002)
        trial.raced = link.last_down <= answered_by
        # Read before the fault: a paused Redis answers nothing.
        trial.redis_time_at_cut = redis.time_ms()
        trial.score_at_cut = redis.members().get(trial.member, 0.0)
        watch = ScoreWatch(bench.redis_port, trial.member)
        if case.fault:
            case.fault(bench)
        t_cut = time.monotonic()
        trial.cut_after_renewal_ms = (t_cut - prev_send) * 1000
        watch.start()

        # B advances to `six` (unheard by A) and retries until admitted.
        b_thread = threading.Thread(target=put_until_admitted, args=(bench.b, bench.bucket, key_b, six, trial.b),
                                    daemon=True)
        if not case.b_after_handover:
            b_thread.start()

        time.sleep(max(0.0, t_cut + case.x - time.monotonic()))
        if "resp" not in answer:  # A may have answered (and closed) already
            try:
                sock.sendall(body[-1:])
            except OSError as exc:
                trial.a_error = f"last byte not sent: {exc!r}"
        trial.last_byte_after_cut_ms = (time.monotonic() - t_cut) * 1000
        if case.after_handover:
            trial.arrived_before_fault = hold.wait_arrived(5.0)
            case.after_handover(bench)
        if case.b_after_handover:
            b_thread.start()
        b_thread.join(timeout=RETRY_FOR_S + 35)
        assert not b_thread.is_alive(), "replica b's writer did not finish"
        trial.score_final = max(trial.score_at_cut, watch.stop())
        trial.watch_error = watch.error
        if case.at_end:
            case.at_end(bench)
        reader.join(timeout=D_S + 15)
        assert "resp" in answer, "replica a did not answer token 5's PUT"
        resp = answer["resp"]
        trial.a_status, trial.a_code = resp.status, resp.code()
        trial.a_error = trial.a_error or resp.error
        trial.a_answered_ms = (answer["t"] - t_head) * 1000
    finally:
        try:
            sock.shutdown(socket.SHUT_RDWR)  # wakes the reader of A's answer
        except OSError:
            pass
        sock.close()
        if watch is not None:
            watch.stop()
    assert bench.up.wait_idle(30), "the upstream did not finish its requests"

    arrived = [r for r in bench.up.requests(path_a) if r["method"] == "PUT"]
    trial.handed_over = bool(arrived)
    if arrived:
        trial.arrival_ms = arrived[0]["t_arrived_wall"] * 1000
    link.restore()
    return trial


def run_case(fencegate, moto_server, redis_server, case: Case) -> tuple[list, list]:
    """Replicas a (behind a TcpLink to Redis) and b, then trials of `case` until one did not
    race (at most TRIALS). Returns (trials, commit order)."""
    up = HoldingUpstream(moto_server.url).start()
    link = TcpLink(redis_server.port, "a-redis")
    redis = Redis(redis_server.port)
    control = RespClient(redis_server.port, timeout=SLEEP_S + 10)
    replicas: list[FenceGate] = []
    trials: list[Trial] = []
    bench: Bench | None = None
    try:
        bucket = unique("bounds")
        moto_server.client().create_bucket(Bucket=bucket)
        replicas.append(start_replica(fencegate, f"redis://127.0.0.1:{link.port}", up, moto_server, bucket, "a",
                                      case.a_store_timeout_ms))
        replicas.append(start_replica(fencegate, redis_server.url, up, moto_server, bucket, "b"))
        bench = Bench(a=replicas[0], b=replicas[1], link=link, redis=redis, redis_port=redis_server.port,
                      control=control, up=up, bucket=bucket)
        if case.before:
            # A write through A's undelayed link first: Redis then has the store's scripts, and A
            # its connections (loading a script takes three round trips, over 5 s delayed).
            bench.a.client(token=1).put_object(Bucket=bucket, Key=f"{HELD_PREFIX}warm-up", Body=b"token 1")
            wait_until(lambda: not redis.members(), 15, what="the warm-up write's registration to go")
        for n in range(TRIALS):
            if n:
                if not bench.a.alive():
                    bench.a.restart(kill=True)
                wait_until(lambda: not redis.members(), 15, what="the previous trial's registrations to go")
                wait_until(lambda: bench.a.admin("GET", "/readyz").status_code == 200, 20,
                           what="replica a to reach Redis again")
            trial = run_trial(bench, case, n)
            trials.append(trial)
            print(f"trial {n}: {trial.summary()}")
            if not trial.raced and (trial.handed_over or not case.handover):
                break
        order = committed(up, bucket)
    finally:
        if bench is not None:
            bench.resume_a()
        link.restore()
        for fg in replicas:
            try:
                fg.stop()
            except Exception:  # noqa: BLE001 - teardown must try every replica
                fg.kill9()
        up.close()
        link.close()
        redis.close()
        control.close()
    return trials, order


def check_case(case: Case, trials: list, order: list):
    """(a) S >= arrival + D for every hand-over, (b) no older token committed after a newer one,
    (c) the last trial handed over iff the bound allows it there; and B was admitted."""
    detail = "\n  ".join(["trials:"] + [t.summary() for t in trials] + [f"commit order (seq, key, token): {order}"])
    for t in trials:
        assert t.b.get("status") == 200, f"replica b never got token {t.token + 1} admitted\n  " + detail
        if case.expires_only:
            # Nobody could withdraw A's registration: B's admission needs it past its deadline.
            # On one host, wall clock = Redis's.
            assert t.b["t_ok_wall"] * 1000 >= t.score_final, (
                f"token {t.token + 1} was admitted while A's token-{t.token} registration was in Redis\n  " + detail)
    # (a) the inequality: the store keeps the registration at least D past the hand-over.
    short = [t for t in trials if t.handed_over and t.score_final < t.arrival_ms + D_MS]
    # (b) G3: no older token commits after a newer one.
    late = older_after_newer(order)
    assert not short and not late, (
        "Redis dropped A's registration less than D after A handed its body over"
        f" ({len(short)} of {len(trials)} trials); " + ("; ".join(late) or "no commit-order violation")
        + "\n  " + detail)
    final = trials[-1]
    assert not final.raced, f"the renewal watch raced in all {len(trials)} trials\n  " + detail
    if case.handover:
        # (c) the test proves something only if A handed the body over at the bound.
        assert final.handed_over, (
            f"A refused a hand-over inside the window (cut + {final.x * 1000:.0f} ms)\n  " + detail)
    else:
        assert not final.handed_over, (
            f"A handed over at cut + {final.x * 1000:.0f} ms, outside the window\n  " + detail)
        assert (final.a_status, final.a_code) == (503, "FenceStoreUnavailable") or final.a_status is None, (
            "A's refused write was not answered 503 FenceStoreUnavailable (or cut off)\n  " + detail)


@pytest.mark.parametrize("window", list(WINDOWS))
def test_the_latest_handover_leaves_the_upstream_the_inflight_deadline(
        fencegate, redis_server, moto_server, window):
    """A's link to Redis cut both ways right after a renewal: Redis keeps A's registration D past
    A's latest hand-over, and the hand-over window is D/4, not 3D/4.

    The last byte of A's token-5 PUT arrives at cut + `window` (x_new: just inside the new
    hand-over window D/4; x_old: just inside 3D/4, which the window must not reach), while replica B retries token 6
    on another key. Nothing reaches Redis from A after the cut, so S = r' + E and

        x_new:  h = cut + H - 30 ms < r + H, and
                S = r' + E >= r + E > (h - H) + E = h + D + D/8 >= a + D     (a - h <= D/8: loopback)
        x_old:  h = cut + 3D/4 - 30 ms >= r + H           (A must refuse: 503 FenceStoreUnavailable or cut off)

    and no token-5 write commits after a token-6 write although the upstream commits token 5
    at a + D - 50 ms."""
    case = Case(x=WINDOWS[window], handover=window == "x_new", fault=lambda bench: bench.link.cut(),
                expires_only=True)
    check_case(case, *run_case(fencegate, moto_server, redis_server, case))


def test_a_replica_that_never_hears_redis_answer_hands_over_only_inside_the_window(
        fencegate, redis_server, moto_server):
    """Only Redis's answers to A are lost (a one-way cut): A's renewals still reach Redis and
    push S on, but A never learns, so it hands over by the last renewal it knew, and Redis still
    keeps A's registration D past that hand-over.

    With r the last renewal A heard of (sent before the cut) and S read when B is admitted
    (A's later renewals only move it on):

        S >= r' + E >= r + E > (h - H) + E = h + D + D/8 >= a + D     (a - h <= D/8: loopback)

    The last byte arrives at cut + H - 30 ms: A hands over; no token-5 write commits after a
    token-6 write."""
    case = Case(x=X_EDGE, handover=True, fault=lambda bench: bench.link.cut(up=False))
    check_case(case, *run_case(fencegate, moto_server, redis_server, case))


def test_a_delayed_link_leaves_the_upstream_the_inflight_deadline(fencegate, redis_server, moto_server):
    """A's link to Redis delays every chunk by 2 s each way from right after a renewal: A hands
    over by the renewal it sent before the delay, and Redis keeps A's registration D past that.

    A takes late answers (store.timeout_ms 5 s): its next renewal, sent at r1 = r + D/8 + one
    50 ms tick, reaches Redis at r1 + 2 s (S moves on) and is answered at r1 + 4 s, when its age
    r1 + 4 s - r1 = 4 s > H allows nothing. So the latest hand-over is by r, and

        S >= r' + E >= r + E > (h - H) + E = h + D + D/8 >= a + D     (a - h <= D/8: loopback)

    The last byte arrives at the delay's start + H - 30 ms: A hands over; no token-5 write
    commits after a token-6 write."""
    case = Case(x=X_EDGE, handover=True, fault=lambda bench: bench.link.delay(DELAY_S),
                a_store_timeout_ms=LATE_ANSWERS_TIMEOUT_MS)
    check_case(case, *run_case(fencegate, moto_server, redis_server, case))


def test_an_answer_older_than_the_window_when_it_comes_allows_no_handover(fencegate, redis_server, moto_server):
    """A's link to Redis delays every chunk by 2 s each way from before A's token-5 admission:
    A counts its registration from when the admission was SENT, not answered, so it never hands
    the body over, and B's token 6 commits alone.

    The admission is sent at s, runs in Redis at s + 2 s (S = s + 2 s + E) and is answered at
    s + 4 s; the last byte arrives 50 ms later, at age

        h - s >= 4 s + 50 ms > H = D/4 = 500 ms          (A must refuse: 503 or cut off)

    An A that counted from the answer would hand over at s + 4.05 s, and the upstream would
    commit at s + 6 s > S = s + 4.75 s: after B's token 6."""
    case = Case(x=0.050, handover=False, before=lambda bench: bench.link.delay(DELAY_S),
                a_store_timeout_ms=LATE_ANSWERS_TIMEOUT_MS)
    trials, order = run_case(fencegate, moto_server, redis_server, case)
    check_case(case, trials, order)
    # The case tests a late answer only if A took it: a timed-out admission answers at the
    # store's timeout (5 s), a late-answered one is refused once its answer came (4 s).
    assert trials[-1].a_answered_ms < LATE_ANSWERS_TIMEOUT_MS, (
        "A's admission timed out instead of being answered late: " + trials[-1].summary())


@pytest.mark.skipif(redis_version() < (6, 2), reason="CLIENT PAUSE ... ALL needs Redis 6.2")
def test_a_paused_redis_leaves_the_upstream_the_inflight_deadline(fencegate, redis_server, moto_server):
    """Redis paused (`CLIENT PAUSE 2100 ALL`, past D) right after a renewal reached A: A's
    renewals time out, A hands over by the renewal before the pause, and Redis keeps A's
    registration D past that hand-over.

    Redis's clock runs on while it is paused; the renewals A sent meanwhile run when the pause
    ends (at r + D + 100 ms < r' + E, A's registration still there) and only move S on:

        S >= r' + E >= r + E > (h - H) + E = h + D + D/8 >= a + D     (a - h <= D/8: loopback)

    The last byte arrives at the pause + H - 30 ms: A hands over; no token-5 write commits after
    a token-6 write (a store keeping registrations D would admit B when the pause ended, before the
    upstream's commit at h + D - 50 ms)."""

    def pause(bench: Bench):
        assert bench.control.call("CLIENT", "PAUSE", PAUSE_MS, "ALL") == "OK"

    case = Case(x=X_EDGE, handover=True, fault=pause)
    check_case(case, *run_case(fencegate, moto_server, redis_server, case))


@pytest.fixture
def debug_redis(tmp_path):
    """A redis-server of the test's own that takes DEBUG (off by default since Redis 7)."""
    d = tmp_path / "redis-debug"
    d.mkdir()
    server = RedisServer(d, "redis-debug")
    try:
        yield server.start(*(("--enable-debug-command", "local") if redis_version() >= (7,) else ()))
    finally:
        server.kill9()


def test_a_sleeping_redis_leaves_the_upstream_the_inflight_deadline(fencegate, debug_redis, moto_server):
    """Redis asleep (`DEBUG SLEEP 3`, past E) right after a renewal reached A: A hands over by
    the renewal before the sleep, and Redis, which wakes with A's registration past its deadline,
    still kept it D past that hand-over.

    Redis runs nothing while asleep; it wakes at r' + 3 s > r' + E = S, so A's renewals sent
    meanwhile find the registration gone, and

        S = r' + E >= r + E > (h - H) + E = h + D + D/8 >= a + D     (a - h <= D/8: loopback)

    The last byte arrives at the sleep + H - 30 ms: A hands over; no token-5 write commits after
    a token-6 write."""

    def sleep(bench: Bench):
        bench.control.send("DEBUG", "SLEEP", f"{SLEEP_S:.3f}")

    def woke(bench: Bench):
        assert bench.control.read() == "OK"

    case = Case(x=X_EDGE, handover=True, fault=sleep, at_end=woke)
    check_case(case, *run_case(fencegate, moto_server, debug_redis, case))


def test_a_replica_killed_after_its_handover_leaves_the_upstream_the_inflight_deadline(
        fencegate, redis_server, moto_server):
    """A killed (SIGKILL) right after its hand-over at the edge of the window: it neither renews
    nor withdraws, and Redis keeps its registration D past the hand-over.

    A's requests to Redis are lost from right after a renewal r (a one-way cut: nothing renews
    after r); its last byte arrives at the cut + H - 30 ms; once the upstream has the body whole,
    A is killed, the link heals, and B starts (before, A would have heard B's advance and cut its
    write off). Then S = r' + E and

        S = r' + E >= r + E > (h - H) + E = h + D + D/8 >= a + D     (a - h <= D/8: loopback)

    and the upstream's commit at a + D - 50 ms lands before B's token 6."""
    case = Case(x=X_EDGE, handover=True, fault=lambda bench: bench.link.cut(down=False),
                after_handover=kill_a, expires_only=True, b_after_handover=True)
    check_case(case, *run_case(fencegate, moto_server, redis_server, case))


def test_a_replica_stopped_after_its_handover_leaves_the_upstream_the_inflight_deadline(
        fencegate, redis_server, moto_server):
    """A stopped (SIGSTOP) right after its hand-over at the edge of the window, continued only
    at the end: it neither renews nor withdraws meanwhile, and Redis keeps its registration D
    past the hand-over.

    As for SIGKILL: A's requests to Redis are lost from right after a renewal r, its last byte
    arrives at the cut + H - 30 ms, and once the upstream has the body whole A is stopped, the
    link heals and B starts. Then S = r' + E and

        S = r' + E >= r + E > (h - H) + E = h + D + D/8 >= a + D     (a - h <= D/8: loopback)

    and the upstream's commit at a + D - 50 ms lands before B's token 6; SIGCONT comes after
    B was admitted."""
    case = Case(x=X_EDGE, handover=True, fault=lambda bench: bench.link.cut(down=False),
                after_handover=stop_a, at_end=Bench.resume_a, expires_only=True, b_after_handover=True)
    check_case(case, *run_case(fencegate, moto_server, redis_server, case))
