"""The operator console (`GET /` of the admin listener) in a real browser: Debian's headless
chromium driven by selenium. It asks for the admin token once and keeps it only in an HttpOnly,
SameSite=Strict cookie; it shows the store's health, the fences (prefix search, pages), the live
leases counting down, the in-flight writes and the live decisions with the refusals first; and a
hostile resource name or holder shows as text, never as markup."""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
from pathlib import Path

import pytest
from botocore.exceptions import ClientError

from fencegate_testlib import (
    ACCESS_KEY,
    REPO_ROOT,
    code_of,
    quote_resource,
    signed_raw_request,
    status_of,
)

try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:  # reported by the `browser` fixture: a failure under CI, a skip elsewhere
    webdriver = None

CHROMIUM = Path("/usr/bin/chromium")  # Debian's `chromium`
CHROMEDRIVER = Path("/usr/bin/chromedriver")  # Debian's `chromium-driver`, same version
WAIT_S = 15.0  # the page polls every 2 s; a decision reaches it at once
ADMIN_TOKEN = "console-admin-token-0123"
SCREENSHOT = REPO_ROOT / "target" / "test-artifacts" / "console.png"
README_SCREENSHOT = REPO_ROOT / "docs" / "console.png"
HOSTILE_RESOURCE = 'x<img src=x onerror="window.pwned=1">'
HOSTILE_HOLDER = "<script>window.pwned=2</script><b>holder</b>"


# --------------------------------------------------------------------------------------------
# the browser and the page
# --------------------------------------------------------------------------------------------


@pytest.fixture
def browser(tmp_path):
    """A headless chromium of the test's own (fresh profile, so no cookie carries over). Missing
    chromium, chromedriver or selenium fails the test under CI and skips it elsewhere."""
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if webdriver is None:
        missing.append("selenium (tests/python/requirements.txt)")
    if missing:
        message = f"the console test needs {', '.join(missing)}: scripts/test installs them"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900",
                "--no-first-run", "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--disable-extensions", f"--user-data-dir={tmp_path / 'chromium'}"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # An explicit chromedriver: selenium-manager, which would try to download one, never runs.
    service = Service(executable_path=str(CHROMEDRIVER), log_output=str(tmp_path / "chromedriver.log"))
    driver = webdriver.Chrome(service=service, options=options)
    try:
        yield driver
        # An exception the page threw, or anything a Content-Security-Policy blocked, fails the
        # test even when what it checked looked right.
        thrown = [e["message"] for e in driver.get_log("browser") if e.get("source") in ("javascript", "security")]
        assert not thrown, f"the console threw or was blocked: {thrown}"
    finally:
        driver.quit()


# Each table row as {column: text}: one script call reads the whole table, so the page's
# re-rendering every 2 s cannot leave the test holding a stale element. A cell's column is the
# last word of its class (`name resource` -> `resource`).
ROWS_JS = """
return [...document.querySelectorAll('#' + arguments[0] + ' tbody tr')].map((tr) => Object.assign(
  {_class: tr.className},
  Object.fromEntries([...tr.cells].map((td) => [td.className.split(' ').pop(), td.textContent]))));
"""


class Console:
    """The console page in `driver`, served at `url` (the admin listener's base URL)."""

    def __init__(self, driver, url: str):
        self.driver = driver
        self.url = url

    def open(self):
        self.driver.get(self.url + "/")
        return self

    def until(self, what: str, pred, timeout: float = WAIT_S):
        return WebDriverWait(self.driver, timeout, poll_frequency=0.1).until(lambda _d: pred(), message=what)

    def js(self, script: str, *args):
        return self.driver.execute_script(script, *args)

    def shown(self, element_id: str) -> bool:
        return self.driver.find_element(By.ID, element_id).is_displayed()

    def text(self, element_id: str) -> str:
        return self.js("return document.getElementById(arguments[0])?.textContent", element_id)

    def rows(self, table_id: str) -> list:
        return self.js(ROWS_JS, table_id)

    def resources(self, table_id: str) -> list:
        return [r["resource"] for r in self.rows(table_id)]

    def wait_row(self, table_id: str, **cells) -> dict:
        """The first row of `table_id` whose cells have these texts, once there is one."""

        def found():
            return next((r for r in self.rows(table_id) if all(r.get(k) == v for k, v in cells.items())), None)

        return self.until(f"a row {cells} in #{table_id} (has {self.rows(table_id)})", found)

    def sign_in(self, token: str):
        self.until("the sign-in form", lambda: self.shown("login-form"))
        field = self.driver.find_element(By.ID, "login-token")
        field.clear()
        field.send_keys(token)
        self.driver.find_element(By.CSS_SELECTOR, "#login-form button[type=submit]").click()

    def wait_healthy(self):
        self.until("the store shown healthy",
                   lambda: self.js("return document.getElementById('store-health')?.dataset.state") == "ok")
        assert self.text("store-health") == "healthy"

    def wait_feed_open(self):
        """The decision stream is connected: decisions from now on reach the page."""
        self.until("the decision feed open",
                   lambda: self.js("return document.getElementById('feed-state')?.dataset.state") == "open")

    def background(self, table_id: str) -> tuple:
        rgb = self.js("return getComputedStyle(document.querySelector('#' + arguments[0] + ' tbody td'))"
                      ".backgroundColor", table_id)
        return tuple(int(x) for x in re.findall(r"\d+", rgb)[:3])


def refused(call) -> ClientError:
    with pytest.raises(ClientError) as exc_info:
        call()
    return exc_info.value


def grant(fg, name: str, holder: str, ttl_ms: int) -> dict:
    body = json.dumps({"holder": holder, "ttl_ms": ttl_ms}).encode()
    r = signed_raw_request(fg, "POST", "/_fencegate/v1/leases/" + quote_resource(name),
                           {"Content-Type": "application/json"}, body)
    assert r.status == 201, (r.status, r.body)
    return json.loads(r.body)


def seconds_left(text: str) -> float:
    m = re.fullmatch(r"(\d+\.\d) s", text)
    assert m, f"not a countdown under a minute: {text!r}"
    return float(m.group(1))


# --------------------------------------------------------------------------------------------
# the tests
# --------------------------------------------------------------------------------------------


def test_sign_in_then_fences_and_decisions_refusals_first(fencegate, browser):
    """With `server.admin_token` the page asks for it, keeps it only in an HttpOnly, SameSite=Strict
    cookie, then shows the store healthy, the fence a write raised, and the stale write's refusal
    (token, fence, code, who) above the accepted write, in red and green."""
    fg = fencegate(config={"server": {"admin_token": ADMIN_TOKEN}})
    bucket, key = "console", "report.csv"
    resource = f"{bucket}/{key}"
    fg.client().create_bucket(Bucket=bucket)

    page = Console(browser, fg.admin_url).open()
    page.until("the sign-in form", lambda: page.shown("login-form"))
    assert not page.shown("console"), "no data is shown before the token"
    page.sign_in("not-the-admin-token-at-all")
    page.until("the refusal of a wrong token", lambda: page.text("login-error") == "That token was refused.")
    assert browser.get_cookies() == []
    page.sign_in(ADMIN_TOKEN)
    page.wait_healthy()
    assert not page.shown("login-form")
    page.wait_feed_open()

    fg.client(token=5).put_object(Bucket=bucket, Key=key, Body=b"token five")
    error = refused(lambda: fg.client(token=3).put_object(Bucket=bucket, Key=key, Body=b"token three"))
    assert (status_of(error), code_of(error)) == (409, "FencingTokenStale")

    page.wait_row("fences", resource=resource, token="5")
    row = page.wait_row("events-refused", resource=resource, token="3")
    assert (row["fence"], row["code"], row["operation"], row["who"], row["_class"]) == (
        "5", "FencingTokenStale", "PutObject", ACCESS_KEY, "refused"), row
    row = page.wait_row("events-accepted", resource=resource, token="5")
    assert (row["code"], row["_class"]) == ("accepted", "accepted"), row
    assert page.resources("events-refused") == [resource], "an accepted write is not listed as refused"

    # Refusals first, and told apart by colour: refused reddish, accepted greenish.
    above = page.js("const y = (id) => document.getElementById(id).getBoundingClientRect().top;"
                    "return y('events-refused') < y('events-accepted');")
    assert above, "the refusals are listed above the accepted decisions"
    r, g, _ = page.background("events-refused")
    assert r > g, f"refused rows are reddish: {(r, g)}"
    r, g, _ = page.background("events-accepted")
    assert g > r, f"accepted rows are greenish: {(r, g)}"

    # The token lives only in the cookie, out of the page's reach.
    cookies = {c["name"]: c for c in browser.get_cookies()}
    assert set(cookies) == {"fencegate_admin"}, cookies
    assert (cookies["fencegate_admin"]["httpOnly"], cookies["fencegate_admin"]["sameSite"]) == (True, "Strict")
    assert page.js("return document.cookie") == ""
    kept = page.js("return JSON.stringify([localStorage, sessionStorage]) + "
                   "document.getElementById('login-token').value")
    assert ADMIN_TOKEN not in kept, kept

    # A lease and a held name or two, so the screenshot shows every part of the page.
    grant(fg, "job:nightly-report", "worker-a", 60_000)
    page.wait_row("leases", resource="job:nightly-report", holder="worker-a")
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(SCREENSHOT)), SCREENSHOT
    if os.environ.get("FENCEGATE_UPDATE_SCREENSHOT") == "1":
        shutil.copyfile(SCREENSHOT, README_SCREENSHOT)


def test_a_hostile_resource_name_and_holder_show_as_text(fencegate, browser):
    """Resource names and lease holders are the caller's: markup in them shows as literal text in
    every table and runs nothing. Without an admin token the page needs no sign-in."""
    fg = fencegate()
    bucket = "hostile"
    fg.client().create_bucket(Bucket=bucket)

    page = Console(browser, fg.admin_url).open()
    page.wait_healthy()
    assert not page.shown("login-form")
    page.wait_feed_open()

    fg.client(token=2, resource=HOSTILE_RESOURCE).put_object(Bucket=bucket, Key="k", Body=b"two")
    error = refused(lambda: fg.client(token=1, resource=HOSTILE_RESOURCE).put_object(Bucket=bucket, Key="k",
                                                                                     Body=b"one"))
    assert code_of(error) == "FencingTokenStale"
    lease = grant(fg, HOSTILE_RESOURCE, HOSTILE_HOLDER, 60_000)

    page.wait_row("fences", resource=HOSTILE_RESOURCE, token=str(lease["token"]))
    page.wait_row("events-refused", resource=HOSTILE_RESOURCE, token="1", fence="2")
    page.wait_row("events-accepted", resource=HOSTILE_RESOURCE, token="2")
    page.wait_row("leases", resource=HOSTILE_RESOURCE, holder=HOSTILE_HOLDER)
    # Rendered as text: what a reader sees is the markup itself.
    assert HOSTILE_RESOURCE in browser.find_element(By.ID, "fences").text
    assert page.js("return window.pwned") is None
    assert page.js("return document.querySelectorAll('img, b, main script').length") == 0


@pytest.fixture(params=["embedded", "redis"])
def any_store(request, fencegate):
    """A fencegate on each store (a shared store wants a bucket to probe at start-up)."""
    if request.param == "embedded":
        return fencegate()
    redis = request.getfixturevalue("redis_server")
    config = {"store": {"kind": "redis", "url": redis.url, "path": None}, "upstream": {"probe_bucket": "probe"}}
    return fencegate(config=config, local_buckets=("probe",))


def test_the_prefix_search_narrows_the_fences_and_pages_turn(any_store, browser):
    """Typing a prefix shows only the fences under it; more than a page (50) turns with next and
    previous, on the embedded store and on Redis (whose pages are walks of its keys)."""
    fg = any_store
    names = ["alpha/1", "alpha/2", "beta/1"] + [f"page/{i:03}" for i in range(55)]
    for i, name in enumerate(names):
        assert fg.put_fence(name, 10 + i).status_code == 200

    page = Console(browser, fg.admin_url).open()
    page.until("all first-page fences", lambda: len(page.rows("fences")) == 50)
    search = browser.find_element(By.ID, "fence-prefix")

    search.send_keys("alpha/")
    page.until("only alpha/", lambda: page.resources("fences") == ["alpha/1", "alpha/2"])
    assert page.rows("fences")[1]["token"] == "11"
    assert browser.find_element(By.ID, "fences-next").get_property("disabled")

    search.clear()
    search.send_keys("page/")
    first = [f"page/{i:03}" for i in range(50)]
    page.until("page/ page 1", lambda: page.resources("fences") == first)
    browser.find_element(By.ID, "fences-next").click()
    page.until("page/ page 2", lambda: page.resources("fences") == [f"page/{i:03}" for i in range(50, 55)])
    assert page.text("fences-page") == "page 2"
    assert browser.find_element(By.ID, "fences-next").get_property("disabled")
    browser.find_element(By.ID, "fences-prev").click()
    page.until("page/ page 1 again", lambda: page.resources("fences") == first)

    search.clear()
    search.send_keys("nothing-here/")
    page.until("no fence", lambda: page.rows("fences") == [] and page.shown("fences-empty"))


def test_a_granted_lease_shows_its_holder_and_counts_down(any_store, browser):
    """A lease granted through fencegate shows with its holder and token, and its time left
    counts down on the page."""
    fg = any_store
    page = Console(browser, fg.admin_url).open()
    page.wait_healthy()
    lease = grant(fg, "job:console-lease", "worker-a", 30_000)

    row = page.wait_row("leases", resource="job:console-lease", holder="worker-a", token=str(lease["token"]))
    first = seconds_left(row["left"])
    assert 0 < first <= 30.0, row
    assert row["ttl"] == "30.0 s", row
    page.until("the countdown to go down",
               lambda: seconds_left(page.wait_row("leases", resource="job:console-lease")["left"]) <= first - 1.0)


def test_a_held_write_shows_in_flight(held_s3, browser):
    """A write the upstream holds shows in flight with its token until the upstream answers."""
    env = held_s3(bucket_prefix="console")
    page = Console(browser, env.fg.admin_url).open()
    page.wait_healthy()
    hold = env.up.hold_next("PUT", env.path("jobs/a"))
    result: dict = {}

    def put():
        try:
            env.fg.client(token=5).put_object(Bucket=env.bucket, Key="jobs/a", Body=b"token five")
            result["ok"] = True
        except Exception as exc:  # noqa: BLE001 - reported in the assertion
            result["error"] = repr(exc)

    writer = threading.Thread(target=put, daemon=True)
    writer.start()
    try:
        assert hold.wait_arrived(WAIT_S), "the token-5 PUT never reached the upstream"
        row = page.wait_row("inflight", resource="job")
        assert row["writes"] == "1" and row["tokens"] == "5", row
    finally:
        hold.release()
        writer.join(timeout=30)
    assert result.get("ok"), result
    page.until("no write in flight", lambda: page.rows("inflight") == [] and page.shown("inflight-empty"))


def test_the_hold_after_a_crash_and_the_upstream_show_in_the_header(fencegate, browser):
    """After a kill -9, the next start holds advances for the in-flight deadline: the header says
    so with the seconds left (and /v1/status carries it), beside the upstream's readiness; once
    the hold has passed it is gone. Before: neither the hold nor the upstream showed anywhere."""
    fg = fencegate(config={"fencing": {"inflight_deadline_ms": 4000}})
    fg.restart(kill=True)
    status = fg.admin("GET", "/v1/status").json()
    assert status["hold"] and 0 < status["hold"]["remaining_ms"] <= 4000, status
    page = Console(browser, fg.admin_url).open()
    page.wait_healthy()
    page.until("the hold shown", lambda: page.shown("hold"))
    assert 1 <= int(page.text("hold-left")) <= 4, page.text("hold-left")
    assert page.js("return document.getElementById('upstream-health').dataset.state") == "ok"
    assert page.text("upstream-health") == "answers"
    page.until("the hold gone once passed", lambda: not page.shown("hold"), timeout=10)
    assert fg.admin("GET", "/v1/status").json()["hold"] is None


def test_characters_that_do_not_print_show_escaped(fencegate, browser):
    """Look-alike names: a soft hyphen, a variation selector, a Hangul filler, a combining
    grapheme joiner and a no-break space are legal in a resource name, and each shows escaped,
    so two names that look alike do not read alike. Before: the five showed raw."""
    fg = fencegate()
    names = {"in\u00advoice": "in\\u{ad}voice", "job\ufe0f": "job\\u{fe0f}", "a\u3164b": "a\\u{3164}b",
             "c\u034fd": "c\\u{34f}d", "e\u00a0f": "e\\u{a0}f"}
    for name in names:
        assert fg.put_fence(name, 1).status_code == 200, name
    page = Console(browser, fg.admin_url).open()
    page.wait_healthy()
    for escaped in names.values():
        page.wait_row("fences", resource=escaped, token="1")


def test_refusals_made_before_the_page_opened_are_shown_with_what_they_named(fencegate, browser):
    """The console remembers: refusals made before the page was opened (or before a reload) are
    shown from the replica's history, a refusal made before any resource was named shows the
    bucket and key it wrote, each code links to its row in the list of errors, each fence says
    when and by whom this replica raised it, and at 400 px the page does not scroll
    sideways."""
    fg = fencegate(config={"fencing": {"require_token": True}})
    bucket, key = "memory", "ledger.csv"
    resource = f"{bucket}/{key}"
    fg.client().create_bucket(Bucket=bucket)
    fg.client(token=7).put_object(Bucket=bucket, Key=key, Body=b"token seven")
    stale = refused(lambda: fg.client(token=2).put_object(Bucket=bucket, Key=key, Body=b"token two"))
    assert code_of(stale) == "FencingTokenStale"
    tokenless = refused(lambda: fg.client().put_object(Bucket=bucket, Key="no-token.bin", Body=b"x"))
    assert code_of(tokenless) == "FencingTokenRequired"

    page = Console(browser, fg.admin_url).open()
    page.wait_healthy()
    row = page.wait_row("events-refused", resource=resource, token="2")
    assert (row["fence"], row["code"], row["who"]) == ("7", "FencingTokenStale", ACCESS_KEY), row
    row = page.wait_row("events-refused", code="FencingTokenRequired")
    assert row["resource"] == f"object {bucket}/no-token.bin", row
    page.wait_row("events-accepted", resource=resource, token="7")
    links = page.js("return [...document.querySelectorAll('#events-refused td.code a')].map((a) => a.href)")
    assert fg.admin_url + "/errors#FencingTokenStale" in links, links
    fence = page.wait_row("fences", resource=resource, token="7")
    assert fence["advanced"].endswith(f" by {ACCESS_KEY}"), fence

    # The link leads somewhere: the code's row in the list of every refusal.
    page.driver.get(fg.admin_url + "/errors#FencingTokenStale")
    assert page.js("return document.getElementById('FencingTokenStale')?.cells[2].textContent.includes('older than')")

    # Reloaded, the page shows the same refusals once each, and a refusal made while it was
    # closed too.
    refused(lambda: fg.client(token=3).put_object(Bucket=bucket, Key=key, Body=b"token three"))
    page.open()
    page.wait_row("events-refused", resource=resource, token="3")
    tokens = [r["token"] for r in page.rows("events-refused") if r["resource"] == resource]
    assert sorted(tokens) == ["2", "3"], tokens

    # A phone's width: the tables scroll inside their sections, the page never sideways.
    page.driver.set_window_size(400, 800)
    page.until("the page laid out at 400 px", lambda: page.js("return window.innerWidth") <= 400)
    wide = page.js("return document.documentElement.scrollWidth - window.innerWidth")
    assert wide <= 0, f"the page scrolls sideways by {wide} px at 400 px"
