"""The operator's view on the admin listener (docs/operations.md, "The console"), on the embedded and the Redis
store: who may read and who may raise (the console's cookie reads only, and only JSON opens a
session), the fences in pages, the live leases without their ids, the writes in flight with a
newer token waiting behind them, and the live feed of decisions (`/v1/events`), which names the
stale writer and ends at shutdown."""

from __future__ import annotations

import json
import threading
import time

import pytest
import requests
from botocore.exceptions import ClientError

from fencegate_testlib import ACCESS_KEY, code_of, quote_resource, signed_raw_request, status_of, wait_until
from holding_upstream import HELD_PREFIX, HELD_RESOURCE

ADMIN_TOKEN = "operator-view-token-0123"
WAIT_S = 15.0


def redis_store(redis_server) -> dict:
    return {"store": {"kind": "redis", "url": redis_server.url, "path": None}}


@pytest.fixture(params=["embedded", "redis"])
def any_store(request, fencegate):
    """A fencegate with an admin token and a bucket `feed`, on each store."""
    config = {"server": {"admin_token": ADMIN_TOKEN}}
    if request.param == "redis":
        config.update(redis_store(request.getfixturevalue("redis_server")))
        config["upstream"] = {"probe_bucket": "feed"}
    return fencegate(config=config, local_buckets=("feed",))


def bearer() -> dict:
    return {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def session(fg) -> requests.Session:
    """A browser's session: the cookie `POST /v1/session` set, and nothing else."""
    s = requests.Session()
    r = s.post(fg.admin_url + "/v1/session", json={"token": ADMIN_TOKEN}, timeout=10)
    assert r.status_code == 204, r.text
    return s


def put(fg, bucket, key, token, resource=None):
    headers = {"Fencing-Token": str(token)}
    if resource:
        headers["Fencing-Resource"] = resource
    return signed_raw_request(fg, "PUT", f"/{bucket}/{key}", headers, b"x")


# --------------------------------------------------------------------------------------------
# who may do what
# --------------------------------------------------------------------------------------------


def test_the_cookie_reads_and_only_the_bearer_token_raises(fencegate):
    fg = fencegate(config={"server": {"admin_token": ADMIN_TOKEN}})
    url = fg.admin_url
    page = requests.get(url + "/", timeout=10)
    assert page.status_code == 200 and "<title>" in page.text
    policy = page.headers["Content-Security-Policy"]
    assert "default-src 'none'" in policy and "frame-ancestors 'none'" in policy and "script-src 'sha256-" in policy
    assert page.headers["X-Content-Type-Options"] == "nosniff"
    for path in ("/v1/status", "/v1/fences", "/v1/leases", "/v1/inflight", "/v1/events", "/metrics"):
        assert requests.get(url + path, timeout=10).status_code == 401, path

    wrong = requests.post(url + "/v1/session", json={"token": "not-the-token-at-all"}, timeout=10)
    assert wrong.status_code == 401 and "set-cookie" not in wrong.headers
    # A form another site could post without asking first is no way in.
    form = requests.post(url + "/v1/session", data=json.dumps({"token": ADMIN_TOKEN}),
                         headers={"Content-Type": "text/plain"}, timeout=10)
    assert form.status_code == 415 and "set-cookie" not in form.headers

    s = requests.Session()
    opened = s.post(url + "/v1/session", json={"token": ADMIN_TOKEN}, timeout=10)
    assert opened.status_code == 204
    cookie = opened.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/" in cookie
    assert ADMIN_TOKEN not in cookie, "the cookie holds a random session, never the token"
    assert s.get(url + "/v1/fences", timeout=10).status_code == 200
    assert fg.put_fence("job:locked", 5, token=ADMIN_TOKEN).status_code == 200

    raised = s.put(url + "/v1/fences/" + quote_resource("job:locked"), json={"token": 2 ** 64 - 1}, timeout=10)
    assert raised.status_code == 401, "the console's cookie must not raise a fence"
    assert fg.get_fence("job:locked", token=ADMIN_TOKEN).json()["token"] == 5

    closed = s.delete(url + "/v1/session", timeout=10)
    assert closed.status_code == 204 and "Max-Age=0" in closed.headers["Set-Cookie"]
    assert s.get(url + "/v1/fences", timeout=10).status_code == 401


def test_a_console_session_is_random_and_ends_at_sign_out(fencegate):
    """Before: the cookie was the token's unsalted SHA-256, the same for every session, and a
    copy of it still read after sign-out. Now each sign-in gets a random value the server keeps:
    two sign-ins differ, neither is derived from the token, and a copy of a signed-out cookie
    reads nothing."""
    import hashlib

    fg = fencegate(config={"server": {"admin_token": ADMIN_TOKEN}})
    url = fg.admin_url
    first, second = session(fg), session(fg)
    a, b = first.cookies["fencegate_admin"], second.cookies["fencegate_admin"]
    assert a != b and hashlib.sha256(ADMIN_TOKEN.encode()).hexdigest() not in (a, b)
    assert len(a) >= 32, a
    copy = {"Cookie": f"fencegate_admin={a}"}
    assert requests.get(url + "/v1/fences", headers=copy, timeout=10).status_code == 200
    assert first.delete(url + "/v1/session", timeout=10).status_code == 204
    assert requests.get(url + "/v1/fences", headers=copy, timeout=10).status_code == 401, "signed out"
    assert second.get(url + "/v1/fences", timeout=10).status_code == 200, "the other session goes on"
    forged = {"Cookie": "fencegate_admin=" + hashlib.sha256(ADMIN_TOKEN.encode()).hexdigest()}
    assert requests.get(url + "/v1/fences", headers=forged, timeout=10).status_code == 401


def test_an_origin_that_only_starts_like_the_listener_is_another_site(fencegate):
    """`Origin: http://127.0.0.1:PORT.evil.example` is a page of evil.example, not of this
    listener: a change from it is refused (403). Before: its text began with the listener's
    address and it passed. The origin is read by a URL parser."""
    fg = fencegate(config={"server": {"admin_token": ADMIN_TOKEN}})
    host, port = fg.admin_addr
    for origin in (f"http://{host}:{port}.evil.example", f"http://{host}:{port}@evil.example"):
        r = requests.put(fg.admin_url + "/v1/fences/job%3Aorigin", json={"token": 3},
                         headers={**bearer(), "Origin": origin}, timeout=10)
        assert r.status_code == 403 and r.json()["title"] == "CrossSiteRequest", (origin, r.status_code, r.text)
    own = requests.put(fg.admin_url + "/v1/fences/job%3Aorigin", json={"token": 3},
                       headers={**bearer(), "Origin": f"http://{host}:{port}"}, timeout=10)
    assert own.status_code == 200, own.text


def test_listing_queries_are_checked(fencegate):
    fg = fencegate()
    for query in ("limit=0", "limit=1001", "limit=ten", "prefix=a&prefix=b", "color=red"):
        r = fg.admin("GET", "/v1/fences?" + query)
        assert r.status_code == 400 and r.headers["Content-Type"] == "application/problem+json", query


# --------------------------------------------------------------------------------------------
# what it lists, on each store
# --------------------------------------------------------------------------------------------


def test_fences_are_listed_in_pages_by_prefix(any_store):
    fg = any_store
    names = [f"batch/{n:02}" for n in range(23)] + ["batchx", "other"]
    for n, name in enumerate(names):
        assert fg.put_fence(name, n + 1, token=ADMIN_TOKEN).status_code == 200
    walked, after, pages = [], None, 0
    while True:
        query = "prefix=batch%2F&limit=7" + (f"&after={requests.utils.quote(after, safe='')}" if after else "")
        page = requests.get(fg.admin_url + "/v1/fences?" + query, headers=bearer(), timeout=10).json()
        walked += [(f["resource"], f["token"]) for f in page["fences"]]
        pages += 1
        after = page["next"]
        if after is None:
            break
    assert walked == [(name, n + 1) for n, name in enumerate(names[:23])]
    assert pages == 4
    everything = requests.get(fg.admin_url + "/v1/fences", headers=bearer(), timeout=10).json()
    assert [f["resource"] for f in everything["fences"]] == sorted(names) and everything["next"] is None


def test_live_leases_are_listed_without_their_ids(any_store):
    fg = any_store
    body = json.dumps({"holder": "worker-7", "ttl_ms": 30000}).encode()
    r = signed_raw_request(fg, "POST", "/_fencegate/v1/leases/nightly", {"Content-Type": "application/json"}, body)
    assert r.status == 201, r.body
    granted = json.loads(r.body)
    s = session(fg)
    leases = s.get(fg.admin_url + "/v1/leases?prefix=night", timeout=10).json()["leases"]
    assert len(leases) == 1
    lease = leases[0]
    assert (lease["resource"], lease["holder"], lease["token"]) == ("nightly", "worker-7", granted["token"])
    assert 0 < lease["expires_in_ms"] <= 30000 and lease["ttl_ms"] == 30000
    assert "lease_id" not in lease and granted["lease_id"] not in json.dumps(leases)
    status = s.get(fg.admin_url + "/v1/status", timeout=10).json()
    assert status["store"]["ready"] is True and status["auth"] is True
    assert status["replica"] in status["replicas"]


def test_expired_leases_hide_no_live_one(any_store):
    """Before: `/v1/leases` read the first `limit` leases and dropped the expired ones, so three
    lapsed leases sorting first hid a live one from `limit=2`. Now pages are read until `limit`
    live ones are found, and `next` goes on from the last one shown."""
    fg = any_store

    def grant(resource: str, ttl_ms: int):
        body = json.dumps({"holder": "h-" + resource, "ttl_ms": ttl_ms}).encode()
        r = signed_raw_request(fg, "POST", "/_fencegate/v1/leases/" + resource, {"Content-Type": "application/json"},
                               body)
        assert r.status == 201, r.body

    for name in ("crew-a", "crew-b", "crew-c"):
        grant(name, 200)
    time.sleep(0.5)
    for name in ("crew-x", "crew-y"):
        grant(name, 30000)
    s = session(fg)
    first = s.get(fg.admin_url + "/v1/leases?prefix=crew-&limit=1", timeout=10).json()
    assert [lease["resource"] for lease in first["leases"]] == ["crew-x"] and first["next"] == "crew-x", first
    rest = s.get(fg.admin_url + "/v1/leases?prefix=crew-&limit=2&after=crew-x", timeout=10).json()
    assert [lease["resource"] for lease in rest["leases"]] == ["crew-y"] and rest["next"] is None, rest
    both = s.get(fg.admin_url + "/v1/leases?prefix=crew-&limit=2", timeout=10).json()
    assert [lease["resource"] for lease in both["leases"]] == ["crew-x", "crew-y"], both


# --------------------------------------------------------------------------------------------
# the feed of decisions
# --------------------------------------------------------------------------------------------


class Feed:
    """A reader of `/v1/events` on a thread of its own, collecting every event."""

    def __init__(self, fg, headers, query: str = ""):
        self.events: list = []
        self.ids: list = []  # the `id` of each event that had one, in order
        self.ended = threading.Event()
        self.resp = requests.get(fg.admin_url + "/v1/events" + query, headers=headers, stream=True, timeout=(5, 60))
        assert self.resp.status_code == 200 and self.resp.headers["Content-Type"] == "text/event-stream"
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        event = None
        try:
            for line in self.resp.iter_lines(decode_unicode=True):
                if line.startswith("event: "):
                    event = line[len("event: "):]
                elif line.startswith("id: "):
                    self.ids.append(line[len("id: "):])
                elif line.startswith("data: "):
                    self.events.append((event, json.loads(line[len("data: "):])))
        except (requests.RequestException, OSError, AttributeError, ValueError):
            pass  # the stream ended, or `close()` closed it under this thread's read
        finally:
            self.ended.set()

    def close(self):
        self.resp.close()
        self.ended.wait(WAIT_S)

    def of_kind(self, kind: str) -> list:
        return [e for k, e in list(self.events) if k == kind]

    def decisions(self, **match) -> list:
        return [e for kind, e in list(self.events) if kind == "decision"
                and all(e.get(k) == v for k, v in match.items())]


def test_the_feed_names_the_stale_writer(any_store):
    fg = any_store
    feed = Feed(fg, bearer())
    assert put(fg, "feed", "report.csv", 5).status == 200
    stale = put(fg, "feed", "report.csv", 3)
    assert stale.status == 409 and stale.code() == "FencingTokenStale"
    wait_until(lambda: feed.decisions(decision="refused"), WAIT_S, what="the refusal on the feed")
    accepted = feed.decisions(decision="accepted", resource="feed/report.csv")
    refused = feed.decisions(decision="refused")
    assert [(e["token"], e["operation"], e["who"]) for e in accepted] == [(5, "PutObject", ACCESS_KEY)]
    assert len(refused) == 1
    r = refused[0]
    assert (r["resource"], r["token"], r["fence"], r["code"], r["who"]) == \
        ("feed/report.csv", 3, 5, "FencingTokenStale", ACCESS_KEY)
    assert r["replica"] and r["time_ms"] > 0
    text = json.dumps(feed.events)
    assert "secret" not in text.lower() and ADMIN_TOKEN not in text

    # A missing token is a refusal too, with no token to name.
    missing = signed_raw_request(fg, "PUT", "/feed/other", {}, b"x")
    assert missing.status == 428
    wait_until(lambda: feed.decisions(code="FencingTokenRequired"), WAIT_S, what="the 428 on the feed")
    assert feed.decisions(code="FencingTokenRequired")[0]["token"] is None

    # An open feed does not hold a stop: fencegate ends it and stops well inside its budget.
    started = time.monotonic()
    fg.stop()
    assert time.monotonic() - started < 5.0
    assert feed.ended.wait(WAIT_S), "the feed did not end at shutdown"


def test_a_returning_reader_learns_how_many_refusals_it_missed(fencegate):
    """Before: a reader whose stream broke lost what was made meanwhile, and never knew. Now each
    refusal has an id; back with the last one read (`Last-Event-ID`, as `EventSource` sends it),
    a reader is first told how many refusals it missed; an id from before a restart, or none
    of this feed's, says the count is unknown."""
    fg = fencegate(config={"server": {"admin_token": ADMIN_TOKEN}}, local_buckets=("feed",))
    first = Feed(fg, bearer())
    assert put(fg, "feed", "k", 5).status == 200
    assert put(fg, "feed", "k", 3).status == 409
    wait_until(lambda: first.decisions(decision="refused"), WAIT_S, what="the refusal on the feed")
    assert len(first.ids) == 1, "a refusal has an id, an accepted write none"
    last = first.ids[-1]
    first.close()
    for token in (1, 2, 4):
        assert put(fg, "feed", "k", token).status == 409
    assert put(fg, "feed", "k", 6).status == 200
    back = Feed(fg, {**bearer(), "Last-Event-ID": last})
    wait_until(lambda: back.of_kind("missed"), WAIT_S, what="the count of what was missed")
    assert back.of_kind("missed") == [{"refusals": 3}]
    assert put(fg, "feed", "k", 2).status == 409
    wait_until(lambda: back.ids, WAIT_S, what="the next refusal")
    back.close()
    # A page that opens a new stream names it in the query (an `EventSource` cannot set headers).
    by_query = Feed(fg, bearer(), query="?last_event_id=" + requests.utils.quote(last, safe=""))
    wait_until(lambda: by_query.of_kind("missed"), WAIT_S, what="the count, asked in the query")
    assert by_query.of_kind("missed") == [{"refusals": 4}]
    by_query.close()
    caught_up = Feed(fg, {**bearer(), "Last-Event-ID": back.ids[-1]})
    wait_until(lambda: caught_up.of_kind("missed"), WAIT_S, what="nothing missed")
    assert caught_up.of_kind("missed") == [{"refusals": 0}]
    caught_up.close()
    bogus = Feed(fg, {**bearer(), "Last-Event-ID": "not-an-id"})
    wait_until(lambda: bogus.of_kind("missed"), WAIT_S, what="an unknown count")
    assert bogus.of_kind("missed") == [{"refusals": None}]
    bogus.close()
    fg.restart()
    restarted = Feed(fg, {**bearer(), "Last-Event-ID": back.ids[-1]})
    wait_until(lambda: restarted.of_kind("missed"), WAIT_S, what="an unknown count after a restart")
    assert restarted.of_kind("missed") == [{"refusals": None}]
    restarted.close()


def test_a_quiet_feed_outlives_a_short_idle_timeout(fencegate):
    """Before: a quiet feed said it was alive every 15 s, and a listener with a shorter
    `server.idle_timeout_ms` closed it. Now it speaks at least three times per idle timeout."""
    fg = fencegate(config={"server": {"admin_token": ADMIN_TOKEN, "idle_timeout_ms": 1500}}, local_buckets=("feed",))
    feed = Feed(fg, bearer())
    time.sleep(4.0)
    assert not feed.ended.is_set(), "the quiet feed was closed"
    assert put(fg, "feed", "k", 5).status == 200
    wait_until(lambda: feed.decisions(decision="accepted"), WAIT_S, what="a decision on the same stream")
    feed.close()


def test_a_write_in_flight_shows_with_the_newer_token_waiting_behind_it(held_s3):
    env = held_s3(config={"server": {"admin_token": ADMIN_TOKEN}})
    fg, key = env.fg, HELD_PREFIX + "a"
    hold = env.up.hold_next("PUT", env.path(key))
    results = {}

    def write(name, token, target):
        try:
            fg.client(token=token).put_object(Bucket=env.bucket, Key=target, Body=b"x")
            results[name] = 200
        except ClientError as e:
            results[name] = (status_of(e), code_of(e))

    five = threading.Thread(target=write, args=("five", 5, key))
    five.start()
    assert hold.wait_arrived(WAIT_S), "token 5's PUT never reached the upstream whole"

    def view():
        return requests.get(fg.admin_url + "/v1/inflight", headers=bearer(), timeout=10).json()["resources"]

    first = wait_until(lambda: [r for r in view() if r["resource"] == HELD_RESOURCE], WAIT_S, what="in flight")
    assert first[0]["tokens"] == [5] and first[0]["writes"] == 1 and first[0]["newer_waiting"] is False
    six = threading.Thread(target=write, args=("six", 6, HELD_PREFIX + "b"))
    six.start()
    waiting = wait_until(lambda: [r for r in view() if r["resource"] == HELD_RESOURCE and r["newer_waiting"]],
                         WAIT_S, what="token 6 waiting behind token 5")
    assert waiting[0]["tokens"] == [5] and waiting[0]["oldest_ms"] > 0
    hold.release()
    five.join(30)
    six.join(30)
    assert results == {"five": 200, "six": 200}
    wait_until(lambda: not view(), WAIT_S, what="nothing in flight")


def test_readers_that_never_read_cannot_keep_the_operator_off_the_feed(fencegate):
    """Before: 16 readers that never read held every `/v1/events` place, and the operator got
    503. Now one client (a peer address) holds 4 at most, and the operator with the admin token
    always gets a place, ending the oldest reader's stream that is not an operator's."""
    import socket

    read_token = "a-read-token-16-bytes"
    fg = fencegate(config={"server": {"admin_token": ADMIN_TOKEN, "admin_read_token": read_token}})
    host, port = fg.admin_addr
    opened = []

    def reader(source: str) -> int:
        sock = socket.create_connection((host, port), timeout=10, source_address=(source, 0))
        sock.sendall(f"GET /v1/events HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {read_token}\r\n"
                     "Accept: text/event-stream\r\n\r\n".encode())
        status = int(sock.recv(64).split()[1])
        opened.append(sock)  # and never read again
        return status

    try:
        assert [reader("127.0.0.2") for _ in range(4)] == [200] * 4
        assert reader("127.0.0.2") == 503, "a fifth from one client"
        for source in ("127.0.0.3", "127.0.0.4", "127.0.0.5"):
            assert [reader(source) for _ in range(4)] == [200] * 4
        assert reader("127.0.0.6") == 503, "every place taken"
        operator = requests.get(fg.admin_url + "/v1/events", headers=bearer(), stream=True, timeout=(5, 10))
        assert operator.status_code == 200, operator.text
        operator.close()
    finally:
        for sock in opened:
            sock.close()
