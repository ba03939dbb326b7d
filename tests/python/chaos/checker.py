"""The history checker for G3: a pure function over plain data, no I/O.

Inputs (lists of plain dicts, as the harness records them; times are `time.monotonic()` of one
process, so the wrapper's and the writers' times compare directly):

`events`: every write request that reached the upstream wrapper (see `upstream.py`), in any order:
    seq            int | None  position in the commit order (set when the wrapper started to
                               forward it to moto under its one global lock), None if never forwarded
    method, bucket, key, query
    op             "put" | "delete" | "delete_objects" | "other"
    chaos_id       the writer's unique id of the request (x-chaos-id), or None
    stamp          the `x-amz-meta-fencing-token` fencegate stamped on it, or None (DELETEs)
    keys           the keys it would change (DeleteObjects: the keys fencegate forwarded)
    committed_keys the keys moto changed (2xx answer; DeleteObjects: its <Deleted> entries)
    outcome        "committed" (moto answered 2xx) | "refused" (moto answered non-2xx) |
                   "truncated" (the body never arrived whole: not forwarded) |
                   "expired" (its commit budget was spent while held: not forwarded) |
                   "unknown" (forwarding to moto failed after sending: may have committed)
    t_body         when its body had arrived whole
    t_arrival      when its request head reached the wrapper (= fencegate had forwarded it)
    t_fwd, t_done  when the wrapper started forwarding it to moto, and when moto answered
    hold, client_gone, late  diagnostics (the slow commit it got; whether fencegate had hung up
                   before it was forwarded; whether it committed later after its body arrived
                   than fencegate assumes an upstream takes)

`writes`: one record per write a writer attempted:
    id, writer, replica, resource, op, bucket, keys, token, mode
                   mode: "normal" | "slow" (body in pieces) | "timeout" (client gave up waiting
                   after sending the whole body) | "cut" (client hung up mid-body)
    body_complete  the client sent the whole body
    t_start, t_end, status (int | None: no answer), error
    acked_keys     keys the answer said were written/deleted (2xx; DeleteObjects: <Deleted>)
    refused_keys   {key: code} of DeleteObjects' per-key <Error> entries

`samples`: fence reads over time: resource, t_send, t_recv, token (None: 404), replica.
`grants`: tokens the writers were given or read (optional): resource, kind ("lease": a lease
    grant answered 201; "registration": an admin `PUT /v1/fences` answered 200, so the fence was
    at least its token; "read": the fence read before a registration), token, t_send, t_recv,
    writer, replica.
`final_fences`: {resource: token | None} read after the run went quiet.
`rules`: [{"bucket", "prefix", "resource"}], the `[[fencing.rules]]` of the run.
`losses` (optional): [(t_from, t_to)], the windows in which the store may have lost its state
    (a Redis `FLUSHALL`, or a Redis restarted without its data).
`restarts` (optional): [{replica, t_from, t_to}], the windows in which a replica was killed and
    started again (a new process: the marks it kept in memory are gone).

The rules (each violation names one):

- `commit-order` (G3, as the commit log shows it): per resource, in commit order, a commit with
  token t' after a commit with token t > t'. Equal tokens may interleave in any order.
- `forwarded-before-commit` (G3, literally: "no write with a token < t commits at the upstream
  after a write with token t was forwarded"): a commit with token t' whose forwarding to moto
  started after a write with token t > t' on the same resource had already arrived at the
  wrapper, whatever became of that newer write (it may be held, fail, or be cut). The older
  write's commit lies in [t_fwd, t_done], so t_arrival(newer) < t_fwd(older) proves the order
  without any clock uncertainty. (An older write whose body was still streaming when the newer
  one was forwarded is fine if it is cut off: then it never commits and is not in the log.)
- `fence-decreased` (G1): a fence read lower than one read before it (the admin API reads the
  shared store on every replica, so reads from different replicas compare).
- `fence-below-commit` (G1/G2): a fence read, sent after moto had answered a commit with token
  t, that is below t (the advance had to be durable before that write was forwarded).
- `acked-not-committed`: a write answered 2xx that is not in the commit log. The log is
  append-only and records every commit, so being overwritten later ("superseded") does not
  excuse a missing PUT: it would be a lost acknowledged write. One absence is allowed: a DELETE
  (or a DeleteObjects key) answered 2xx may never reach the upstream if the key was already
  absent at some instant between the request's start and its answer (fencegate may answer a
  DELETE of an absent object itself). "Possibly absent" is judged generously: the state after
  the last commit that finished before the request started, or after any commit that overlaps
  the request's window.
- `committed-after-refusal`: a write answered 409 (or a DeleteObjects key answered
  `FencingTokenStale`) is in the commit log: fencegate said it was refused.
- `truncated-committed`: a write whose client hung up mid-body is in the commit log.
- `stamp-mismatch`: a PUT committed with a stamp other than the token its writer sent.
- `unattributed-commit`: a commit in the chaos bucket without a known chaos id (the checker
  cannot judge it; it means fencegate dropped the writer's header or wrote on its own).
- `grant-repeated`: two lease grants on one resource with the same token (concurrent or not).
- `grant-order`: a lease grant whose token is not above a token known on its resource before the
  grant was asked for: a grant or registration answered, a fence read answered, or a commit
  answered by moto, before the grant's request was sent ("the token is above every token ever
  granted or seen"). So grants strictly increase in grant order; overlapping grants are only
  required to differ. A registration may equal a grant's token (a same-number registration).

A write with no 2xx answer MAY be in the commit log (timeouts, disconnects, 503/504: the
outcome was unknown to the client), and nothing requires it to be absent.

A store that lost its state (`losses`; docs/design.md section 6, "A store that lost its state")
keeps none of its fences, leases or registrations; fencegate promises what follows, and the
checker demands exactly that (`_Continuity.binds`):
- G3 (`commit-order`, `forwarded-before-commit`) and the acknowledgement rules are judged across
  the whole run, losses or not: the quiet period is what keeps G3 then.
- A token put in the store (a grant, a registration, an admission, so a commit) binds a later
  fence read or grant only if no loss may lie between the start of the call that put it there
  and the later one's answer. A fence read is what its replica says: the store's fence or,
  if higher, the replica's mark (the highest token it has seen in its life, all taken from the
  store); it binds a later read or grant on any replica if no loss may lie between its
  replica's start and the later answer (so the mark too came from the store as it is now), and
  one on the same replica, in the same process, if no loss may lie between the two.
- A lease grant is above the mark of the replica that grants it, losses or not (docs/operations.md: "a
  grant after a rollback never repeats or lowers a token that replica has granted or seen"):
  every token that replica granted, registered or admitted in the same process binds its
  later grants, across any loss.
A replica's restart (`restarts`) ends what its marks bind. Without losses every token binds
every later read and grant, as the rules above say.
"""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict
from dataclasses import dataclass, field

Event = dict
Write = dict

MAX_EVIDENCE_LINES = 12


def resource_of(bucket: str, key: str, rules: list) -> str:
    """fencegate's mapping: the longest matching rule prefix, else the object itself."""
    best = None
    for rule in rules:
        if rule["bucket"] == bucket and key.startswith(rule["prefix"]):
            if best is None or len(rule["prefix"]) > len(best["prefix"]):
                best = rule
    return best["resource"] if best else f"{bucket}/{key}"


@dataclass
class Violation:
    kind: str
    resource: str
    message: str
    evidence: list = field(default_factory=list)
    window: tuple | None = None  # (from, to): the times of the events involved, for triage

    def render(self) -> str:
        lines = [f"[{self.kind}] {self.resource}: {self.message}"]
        lines += [f"      {line}" for line in self.evidence[:MAX_EVIDENCE_LINES]]
        return "\n".join(lines)


@dataclass
class Report:
    violations: list
    stats: dict

    @property
    def ok(self) -> bool:
        return not self.violations

    def by_kind(self) -> Counter:
        return Counter(v.kind for v in self.violations)


@dataclass
class _Op:
    """One event's effect on one key (DeleteObjects has one per key)."""

    event: Event
    resource: str
    key: str
    kind: str  # "put" | "delete"
    token: int | None


class _Fmt:
    """Renders log lines with times relative to the start of the history."""

    def __init__(self, t0: float):
        self.t0 = t0

    def t(self, x) -> str:
        return "-" if x is None else f"{x - self.t0:8.3f}"

    def event(self, ev: Event, token=None) -> str:
        path = f"/{ev['bucket']}/{ev['key']}" + (f"?{ev['query']}" if ev.get("query") else "")
        keys = ",".join(ev.get("committed_keys") or ev.get("keys") or [])
        seq = "-" if ev.get("seq") is None else f"#{ev['seq']}"
        latency = ""
        if ev.get("t_done") is not None and ev.get("t_body") is not None:
            latency = f" commit_latency={ev['t_done'] - ev['t_body']:.3f}{' LATE' if ev.get('late') else ''}"
        return (
            f"upstream {seq:>6} {ev['method']:<6} {path} keys={keys} token={token} "
            f"stamp={ev.get('stamp')} id={ev.get('chaos_id')} moto={ev.get('status')} "
            f"{ev.get('outcome')} arrival={self.t(ev.get('t_arrival'))} "
            f"fwd={self.t(ev.get('t_fwd'))} done={self.t(ev.get('t_done'))} "
            f"hold={ev.get('hold', 0):.2f}{latency} fencegate_gone={ev.get('client_gone')}"
        )

    def write(self, w: Write | None) -> str:
        if w is None:
            return "writer: (no record)"
        return (
            f"writer {w['id']} via {w.get('replica')} {w['op']} {','.join(w['keys'])} "
            f"token={w['token']} mode={w.get('mode')} status={w.get('status')} "
            f"error={w.get('error')} start={self.t(w.get('t_start'))} end={self.t(w.get('t_end'))}"
        )


def _is_2xx(status) -> bool:
    return status is not None and 200 <= status < 300


def check(
    events: list,
    writes: list,
    samples: list,
    final_fences: dict,
    rules: list,
    bucket: str,
    grants: list | None = None,
    losses: list | None = None,
    restarts: list | None = None,
) -> Report:
    """Judges one run's history (see the module doc for the data and the rules)."""
    grants = grants or []
    by_id = {w["id"]: w for w in writes}
    times = [e["t_arrival"] for e in events if e.get("t_arrival") is not None]
    times += [w["t_start"] for w in writes if w.get("t_start") is not None]
    times += [g["t_send"] for g in grants]
    fmt = _Fmt(min(times) if times else 0.0)
    violations: list[Violation] = []

    ours = [e for e in events if e["bucket"] == bucket and e["op"] != "other"]

    # Every event's token: the stamp fencegate put on it, else its writer's token.
    def token_of(ev: Event):
        if ev.get("stamp") is not None:
            return ev["stamp"]
        w = by_id.get(ev.get("chaos_id"))
        return w["token"] if w else None

    # ---- attribution and stamps --------------------------------------------------------
    for ev in ours:
        if ev["outcome"] != "committed":
            continue
        w = by_id.get(ev.get("chaos_id"))
        if w is None:
            res = resource_of(bucket, (ev.get("committed_keys") or [ev["key"]])[0], rules)
            violations.append(Violation("unattributed-commit", res,
                                        "a commit no writer made (or whose chaos id was lost)",
                                        [fmt.event(ev)]))
        elif ev["op"] == "put" and ev.get("stamp") != w["token"]:
            violations.append(Violation("stamp-mismatch", w["resource"],
                                        f"stamped {ev.get('stamp')}, the writer sent {w['token']}",
                                        [fmt.event(ev, ev.get("stamp")), fmt.write(w)]))

    # ---- the ops per resource: arrivals (forwarded) and commits -------------------------
    arrivals: dict = defaultdict(list)  # resource -> [(t_arrival, token, event)]
    commits: list[_Op] = []
    def keys_of(ev: Event) -> list:
        # A DeleteObjects whose body never arrived has no parsed keys: its writer knows them.
        w = by_id.get(ev.get("chaos_id"))
        return ev.get("keys") or (w["keys"] if w else []) or [ev["key"]]

    for ev in ours:
        token = token_of(ev)
        kind = "put" if ev["op"] == "put" else "delete"
        for res in sorted({resource_of(bucket, k, rules) for k in keys_of(ev)}):
            if token is not None and ev.get("t_arrival") is not None:
                arrivals[res].append((ev["t_arrival"], token, ev))
        if ev["outcome"] == "committed":
            for k in ev.get("committed_keys") or []:
                commits.append(_Op(ev, resource_of(bucket, k, rules), k, kind, token))
    commits.sort(key=lambda op: (op.event["seq"], op.key))

    # ---- G3: commit order ---------------------------------------------------------------
    flagged: set = set()
    highest: dict = {}  # resource -> the _Op with the highest token committed so far
    for op in commits:
        if op.token is None:
            continue
        top = highest.get(op.resource)
        if top is not None and op.token < top.token:
            flagged.add(id(op.event))
            violations.append(Violation(
                "commit-order", op.resource,
                f"token {op.token} committed on {op.key} after token {top.token} committed on {top.key}",
                [fmt.event(top.event, top.token), fmt.write(by_id.get(top.event.get("chaos_id"))),
                 fmt.event(op.event, op.token), fmt.write(by_id.get(op.event.get("chaos_id")))],
                window=(min(top.event["t_arrival"], op.event["t_arrival"]), op.event["t_done"]),
            ))
        if top is None or op.token > top.token:
            highest[op.resource] = op

    # ---- G3: no older commit after a newer write was forwarded --------------------------
    prefix: dict = {}  # resource -> (arrival times sorted, running max (token, event))
    for res, items in arrivals.items():
        items.sort(key=lambda x: x[0])
        running, best = [], None
        for _, token, ev in items:
            if best is None or token > best[0]:
                best = (token, ev)
            running.append(best)
        prefix[res] = ([x[0] for x in items], running)
    seen_pairs: set = set()
    for op in commits:
        if op.token is None or id(op.event) in flagged or op.resource not in prefix:
            continue
        times_sorted, running = prefix[op.resource]
        i = bisect.bisect_left(times_sorted, op.event["t_fwd"])
        if i == 0:
            continue
        newer_token, newer = running[i - 1]
        if newer_token > op.token and (id(op.event), op.resource) not in seen_pairs:
            seen_pairs.add((id(op.event), op.resource))
            violations.append(Violation(
                "forwarded-before-commit", op.resource,
                f"token {op.token} committed on {op.key} after a token {newer_token} write had been "
                f"forwarded ({op.event['t_fwd'] - newer['t_arrival']:.3f}s before)",
                [fmt.event(newer, newer_token), fmt.write(by_id.get(newer.get("chaos_id"))),
                 fmt.event(op.event, op.token), fmt.write(by_id.get(op.event.get("chaos_id")))],
                window=(op.event["t_arrival"], op.event["t_done"]),
            ))

    # ---- fences: never decrease, never below a committed token --------------------------
    continuity = _Continuity(losses or [], restarts or [])
    commits_by_res: dict = defaultdict(list)  # resource -> [_Known] of commits
    for op in commits:
        if op.token is not None:
            commits_by_res[op.resource].append(_committed(op, by_id, fmt))
    by_res_samples: dict = defaultdict(list)
    for s in samples:
        by_res_samples[s["resource"]].append(s)
    for res, items in by_res_samples.items():
        items.sort(key=lambda s: s["t_send"])
        done_commits = sorted(commits_by_res.get(res, []), key=lambda k: k.t)
        done_reads: list = []  # [_Known] of the reads before this one
        reported_decrease = reported_below = False
        for s in items:
            value = s["token"] or 0
            if not reported_decrease:
                prev = _top(done_reads, s["t_send"], s.get("replica"), s["t_recv"], continuity, grant=False)
                if prev is not None and value < prev.token:
                    reported_decrease = True
                    violations.append(Violation(
                        "fence-decreased", res,
                        f"read {s['token']} via {s.get('replica')} at {fmt.t(s['t_send'])}, "
                        f"after {prev.token} was read at {fmt.t(prev.t)}", [prev.line]))
            done_reads.append(_read(s, value, continuity, fmt))
            if not reported_below:
                top = _top(done_commits, s["t_send"], s.get("replica"), s["t_recv"], continuity, grant=False)
                if top is not None and top.token > value:
                    reported_below = True
                    violations.append(Violation(
                        "fence-below-commit", res,
                        f"fence read {s['token']} via {s.get('replica')} at {fmt.t(s['t_send'])}, "
                        f"after token {top.token} had committed", [top.line]))
    # The final fences were read after everything else (the checker is not told through which
    # replica).
    end = float("inf")
    for res, known in commits_by_res.items():
        top = _top(known, end, None, end, continuity, grant=False)
        final = final_fences.get(res)
        if res in final_fences and top is not None and (final or 0) < top.token:
            violations.append(Violation("fence-below-commit", res,
                                        f"final fence {final} is below the committed token {top.token}",
                                        [top.line]))
    for res, items in by_res_samples.items():
        top = _top([_read(s, s["token"] or 0, continuity, fmt) for s in items], end, None, end,
                   continuity, grant=False)
        final = final_fences.get(res)
        if res in final_fences and top is not None and (final or 0) < top.token:
            violations.append(Violation("fence-decreased", res,
                                        f"final fence {final} is below a fence read earlier ({top.token})",
                                        [top.line]))

    # ---- acknowledged writes are in the log; refused and cut ones are not ---------------
    committed_by_id: dict = defaultdict(set)  # chaos id -> keys committed under it
    events_by_id: dict = defaultdict(list)
    for ev in ours:
        events_by_id[ev.get("chaos_id")].append(ev)
        if ev["outcome"] == "committed":
            committed_by_id[ev.get("chaos_id")].update(ev.get("committed_keys") or [])
    key_history: dict = defaultdict(list)  # key -> [(seq, t_fwd, t_done, kind)]
    for op in commits:
        key_history[op.key].append((op.event["seq"], op.event["t_fwd"], op.event["t_done"], op.kind))

    def possibly_absent(key: str, start: float, end: float) -> bool:
        before, during = "delete", []  # a fresh bucket: every key starts absent
        for _, t_fwd, t_done, kind in key_history.get(key, []):
            if t_done <= start:
                before = kind
            elif t_fwd < end:
                during.append(kind)
        return before == "delete" or "delete" in during

    for w in writes:
        if w["bucket"] != bucket:
            continue
        done = committed_by_id.get(w["id"], set())
        evidence = [fmt.write(w)] + [fmt.event(e, w["token"]) for e in events_by_id.get(w["id"], [])]
        if _is_2xx(w.get("status")):
            for key in w.get("acked_keys") or []:
                if key in done:
                    continue
                if w["op"] in ("delete", "delete_objects") and possibly_absent(key, w["t_start"], w["t_end"]):
                    continue
                violations.append(Violation(
                    "acked-not-committed", w["resource"],
                    f"{w['op']} of {key} answered {w['status']} but never committed upstream", evidence))
        refused = set()
        if w.get("status") == 409:
            refused = set(w["keys"])
        refused |= {k for k, code in (w.get("refused_keys") or {}).items() if code == "FencingTokenStale"}
        for key in sorted(refused & done):
            violations.append(Violation("committed-after-refusal", w["resource"],
                                        f"{w['op']} of {key} was answered as refused but committed",
                                        evidence))
        if not w.get("body_complete", True) and done:
            violations.append(Violation("truncated-committed", w["resource"],
                                        "the client hung up mid-body, yet the write committed", evidence))

    # ---- grants: never repeated, above every token known before ---------------------------
    violations += _check_grants(grants, samples, commits, by_id, fmt, continuity)

    # ---- figures ------------------------------------------------------------------------
    statuses = Counter()
    for w in writes:
        s = w.get("status")
        statuses["2xx" if _is_2xx(s) else ("409" if s == 409 else "other")] += 1
    other = Counter(str(w.get("status") or w.get("error") or "none") for w in writes
                    if not _is_2xx(w.get("status")) and w.get("status") != 409)
    stats = {
        "writes": len(writes),
        "answered": dict(statuses),
        "other_answers": dict(other.most_common(8)),
        "ops": dict(Counter(w["op"] for w in writes)),
        "modes": dict(Counter(w.get("mode") for w in writes)),
        "upstream_writes": len(ours),
        "upstream_outcomes": dict(Counter(e["outcome"] for e in ours)),
        "commits": len(commits),
        "held": sum(1 for e in ours if e.get("hold")),
        "late_commits": sum(1 for e in ours if e["outcome"] == "committed" and e.get("late")),
        "max_commit_latency": max((e["t_done"] - e["t_body"] for e in ours
                                   if e["outcome"] == "committed" and e.get("t_body") is not None),
                                  default=0.0),
        "forwarded_after_fencegate_hung_up": sum(1 for e in ours if e.get("client_gone")),
        "resources": len({op.resource for op in commits}),
        # How often, per resource in commit order, the committed token changed: lease handovers
        # that reached the upstream (the situations G3 is about).
        "handovers": _handovers(commits),
        "fence_samples": len(samples),
        "grants": dict(Counter(g["kind"] for g in grants)),
    }
    return Report(violations=violations, stats=stats)


def _grant_line(fmt: _Fmt, g: dict) -> str:
    return (f"{g['kind']} token={g['token']} by {g.get('writer')} via {g.get('replica')} "
            f"sent={fmt.t(g['t_send'])} answered={fmt.t(g['t_recv'])}")


def _check_grants(grants: list, samples: list, commits: list, by_id: dict, fmt: _Fmt,
                  continuity: "_Continuity") -> list:
    """`grant-repeated` and `grant-order` (see the module doc)."""
    violations = []
    leases = sorted((g for g in grants if g["kind"] == "lease"), key=lambda g: g["t_send"])
    same: dict = defaultdict(list)
    for g in leases:
        same[(g["resource"], g["token"])].append(g)
    for (res, token), gs in sorted(same.items()):
        # Two grants of one token, unless a loss between them excuses it (module doc).
        repeated = [(a, b) for i, a in enumerate(gs) for b in gs[i + 1:]
                    if continuity.binds(_granted(a, fmt), b["replica"], b["t_recv"], grant=True)]
        if repeated:
            shown = {id(g): g for pair in repeated for g in pair}.values()
            violations.append(Violation(
                "grant-repeated", res, f"token {token} was granted {len(gs)} times",
                [_grant_line(fmt, g) for g in shown],
                window=(gs[0]["t_send"], max(g["t_recv"] for g in gs))))

    # Per resource, every token known at a time.
    known: dict = defaultdict(list)
    for g in grants:
        known[g["resource"]].append(_read(g, g["token"], continuity, fmt, _grant_line(fmt, g))
                                    if g["kind"] == "read" else _granted(g, fmt))
    for s in samples:
        if s.get("token") is not None:
            known[s["resource"]].append(_read(s, s["token"], continuity, fmt))
    for op in commits:
        if op.token is not None:
            known[op.resource].append(_committed(op, by_id, fmt))
    for items in known.values():
        items.sort(key=lambda k: k.t)
    for g in leases:
        top = _top(known.get(g["resource"], []), g["t_send"], g["replica"], g["t_recv"], continuity,
                   grant=True)
        if top is not None and top.token >= g["token"]:
            violations.append(Violation(
                "grant-order", g["resource"],
                f"lease granted token {g['token']}, not above token {top.token} known "
                f"{g['t_send'] - top.t:.3f}s before the grant was asked for",
                [top.line, _grant_line(fmt, g)], window=(top.t, g["t_recv"])))
    return violations


@dataclass
class _Known:
    """A token known at or below a resource's fence from time `t` on (see `_Continuity.binds`)."""

    t: float  # when it was known: a grant or read answered, a commit answered by moto
    token: int
    replica: str | None  # the replica that granted, admitted or read it
    since: float  # it came from the store at an instant no earlier than this
    since_own: float  # the same, for its own replica's process (a read: when it was sent)
    read: bool  # a fence read (the store's fence, or its replica's mark if higher)
    line: str


def _granted(g: dict, fmt: _Fmt) -> _Known:
    """A lease grant or registration answered: the store held its token from `t_send` on."""
    return _Known(g["t_recv"], g["token"], g.get("replica"), g["t_send"], g["t_send"], False,
                  _grant_line(fmt, g))


def _committed(op: _Op, by_id: dict, fmt: _Fmt) -> _Known:
    """A commit: its token was admitted (the store raised to it) after its writer sent it."""
    w = by_id.get(op.event.get("chaos_id"))
    since = w["t_start"] if w and w.get("t_start") is not None else op.event["t_arrival"]
    return _Known(op.event["t_done"], op.token, w.get("replica") if w else None, since, since, False,
                  fmt.event(op.event, op.token))


def _read(s: dict, value: int, continuity: "_Continuity", fmt: _Fmt, line: str | None = None) -> _Known:
    """A fence read: its replica's mark came from the store during that replica's process."""
    if line is None:
        line = (f"fence read {s['token']} via {s.get('replica')} "
                f"sent={fmt.t(s['t_send'])} answered={fmt.t(s['t_recv'])}")
    return _Known(s["t_recv"], value, s.get("replica"), continuity.started(s.get("replica"), s["t_send"]),
                  s["t_send"], True, line)


def _top(known: list, before: float, replica, answered: float, continuity: "_Continuity",
         grant: bool) -> "_Known | None":
    """The highest token known before `before` that binds a read (or a grant) through `replica`
    answered at `answered`; None if none does."""
    best = None
    for k in known:
        if k.t < before and (best is None or k.token > best.token) \
                and continuity.binds(k, replica, answered, grant):
            best = k
    return best


class _Continuity:
    """When the store may have lost its state (`losses`), and when each replica restarted
    (`restarts`): what a known token still binds (the module doc)."""

    def __init__(self, losses: list, restarts: list):
        self.losses = [(float(a), float(b)) for a, b in losses]
        self.restarts: dict = defaultdict(list)
        for r in restarts:
            self.restarts[r["replica"]].append((float(r["t_from"]), float(r["t_to"])))

    def lost(self, since: float, until: float) -> bool:
        """Whether the store may have lost its state after `since` and before `until`."""
        return any(b > since and a < until for a, b in self.losses)

    def same_process(self, replica, since: float, until: float) -> bool:
        """Whether `replica` certainly ran as one process from `since` to `until`."""
        return replica is not None and not any(
            b > since and a < until for a, b in self.restarts.get(replica, []))

    def started(self, replica, at: float) -> float:
        """A time no later than the start of the process of `replica` that answered at `at`."""
        return max((a for a, b in self.restarts.get(replica, []) if b <= at), default=float("-inf"))

    def binds(self, k: _Known, replica, answered: float, grant: bool) -> bool:
        """Whether `k` binds a fence read (or, `grant`, a lease grant) through `replica`
        answered at `answered`: it is at or below what that read may return (below the grant)."""
        if not self.lost(k.since, answered):
            return True  # the store still holds it (a read: its mark's sources too)
        if replica != k.replica or not self.same_process(replica, k.since_own, answered):
            return False
        if k.read:  # its own later reads and grants, if the store lost nothing since the read
            return not self.lost(k.since_own, answered)
        return grant  # in the replica's mark: every grant it makes is above it


def _handovers(commits: list) -> int:
    last: dict = {}
    changes = 0
    for op in commits:
        if op.token is None:
            continue
        if op.resource in last and last[op.resource] != op.token:
            changes += 1
        last[op.resource] = op.token
    return changes


def render(report: Report, title: str, faults: dict | None = None, limit: int = 12) -> str:
    """The human-readable summary the test prints."""
    s = report.stats
    lines = [f"== chaos run: {title}"]
    lines.append(f"   writes attempted {s['writes']}: answered 2xx {s['answered'].get('2xx', 0)}, "
                 f"409 {s['answered'].get('409', 0)}, other {s['answered'].get('other', 0)} "
                 f"{s['other_answers']}")
    lines.append(f"   ops {s['ops']}, client modes {s['modes']}")
    lines.append(f"   upstream: {s['upstream_writes']} write requests {s['upstream_outcomes']}, "
                 f"{s['commits']} key commits on {s['resources']} resources with {s['handovers']} token "
                 f"handovers, {s['held']} held, "
                 f"{s['forwarded_after_fencegate_hung_up']} forwarded after fencegate hung up; "
                 f"{s['fence_samples']} fence reads")
    lines.append(f"   slowest commit {s['max_commit_latency']:.2f}s after its body arrived, "
                 f"{s['late_commits']} beyond the upstream's commit bound")
    if s.get("grants"):
        lines.append(f"   tokens given or read by the writers (grant order checked) {s['grants']}")
    if faults is not None:
        lines.append(f"   faults injected {dict(faults)}")
    lines.append(f"   violations {len(report.violations)} {dict(report.by_kind())}")
    for v in report.violations[:limit]:
        lines.append("   " + v.render())
    if len(report.violations) > limit:
        lines.append(f"   ... and {len(report.violations) - limit} more")
    return "\n".join(lines)
