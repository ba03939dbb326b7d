"""`fencegate reconcile` (docs/operations.md, "Reconciling") against a running fencegate, on moto
and on the local upstream, on the embedded and the Redis store: a bucket written only through
fencegate is clean (exit 0); an upload of a superseded token, an object written around
fencegate under a fenced prefix, and an object stamped above a fence the store lost are found
(exit 1), shown as a table or as JSON lines, with progress on stderr; `--apply=stale_upload`
aborts the upload and `--apply=raise_fence` raises the lost fence to the stamp (each only when
named), after which the same scan finds only what it cannot repair (the object written around
fencegate)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time

import pytest
import requests

from fencegate_testlib import RedisServer, bin_path, free_port, quote_resource, signed_raw_request, unique
from holding_upstream import HELD_PREFIX, HELD_RESOURCE

RESOURCE = "job:reports"
ADMIN_TOKEN = "reconcile-admin-token-0123"


def start(fencegate, moto_server, upstream_kind: str, extra: dict | None = None):
    bucket = unique("recon")
    config = {
        "server": {"admin_token": ADMIN_TOKEN},
        "fencing": {"rules": [{"bucket": bucket, "prefix": "reports/", "resource": RESOURCE}]},
    }
    config.update(extra or {})
    if upstream_kind == "moto":
        moto_server.client().create_bucket(Bucket=bucket)
        upstream = dict(moto_server.upstream_config(), probe_bucket=bucket)
        fg = fencegate(upstream=upstream, config=config)
    else:
        if "store" in config:
            config["upstream"] = {"probe_bucket": bucket}
        fg = fencegate(config=config, local_buckets=(bucket,))
    fg.bucket = bucket
    return fg


def reconcile(fg, *args: str) -> subprocess.CompletedProcess:
    """`fencegate reconcile` on the instance's config file; its admin listener took a free port,
    which an override names, as for any command run beside a fencegate."""
    env = dict(os.environ, FENCEGATE_SERVER__ADMIN_LISTEN="%s:%d" % fg.admin_addr)
    return subprocess.run([str(bin_path()), "reconcile", "--config", str(fg.config_path), "--bucket", fg.bucket,
                           *args], capture_output=True, text=True, timeout=120, env=env)


def findings(run: subprocess.CompletedProcess) -> list:
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.strip()]
    assert lines and lines[-1]["event"] == "done", run.stdout + run.stderr
    return [line for line in lines if line["event"] == "finding"]


def fence(fg, resource: str) -> int | None:
    r = fg.admin("GET", "/v1/fences/" + quote_resource(resource), token=ADMIN_TOKEN)
    return r.json()["token"] if r.status_code == 200 else None


@pytest.mark.parametrize("upstream_kind", ["local", "moto"])
def test_a_bucket_written_through_fencegate_is_clean(fencegate, moto_server, upstream_kind):
    fg = start(fencegate, moto_server, upstream_kind)
    for token, key in [(3, "reports/a.csv"), (4, "reports/b.csv"), (9, "loose/c.txt")]:
        fg.client(token=token).put_object(Bucket=fg.bucket, Key=key, Body=b"x")
    run = reconcile(fg)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 found in 0 gateway records, 0 uploads and 3 objects" in run.stdout
    assert "scanned" in run.stderr, "progress goes to stderr"
    assert findings(reconcile(fg, "--json")) == []


@pytest.mark.parametrize("upstream_kind,store", [("local", "embedded"), ("moto", "embedded"), ("local", "redis")])
def test_a_stale_upload_is_found_and_aborted_with_apply(fencegate, moto_server, upstream_kind, store, request):
    extra = None
    if store == "redis":
        extra = {"store": {"kind": "redis", "url": request.getfixturevalue("redis_server").url, "path": None}}
    fg = start(fencegate, moto_server, upstream_kind, extra)
    s3 = fg.client(token=5)
    upload = s3.create_multipart_upload(Bucket=fg.bucket, Key="reports/big.bin")["UploadId"]
    s3.upload_part(Bucket=fg.bucket, Key="reports/big.bin", UploadId=upload, PartNumber=1, Body=b"p" * 1024)
    live = fg.client(token=5).create_multipart_upload(Bucket=fg.bucket, Key="other/live.bin")["UploadId"]
    assert fg.put_fence(RESOURCE, 6, token=ADMIN_TOKEN).status_code == 200

    run = reconcile(fg)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "stale_upload" in run.stdout and "reports/big.bin" in run.stdout
    assert upload in run.stdout and " created 20" in run.stdout, "the table shows the upload id and its time"
    found = findings(reconcile(fg, "--json"))
    assert [(f["kind"], f["upload_id"], f["token"], f["fence"], f["action"]) for f in found] == \
        [("stale_upload", upload, 5, 6, "none")]
    assert abs(found[0]["created_at_ms"] / 1000 - time.time()) < 600, found[0]

    # Only the kinds named are fixed.
    other = findings(reconcile(fg, "--json", "--apply=raise_fence"))
    assert [(f["kind"], f["action"]) for f in other] == [("stale_upload", "none")]
    applied = findings(reconcile(fg, "--json", "--apply=stale_upload"))
    assert [(f["kind"], f["action"]) for f in applied] == [("stale_upload", "aborted")]
    listed = fg.client().list_multipart_uploads(Bucket=fg.bucket).get("Uploads", [])
    assert {u["UploadId"] for u in listed} == {live}, "only the live upload is left"
    assert reconcile(fg).returncode == 0

    # An upload of its resource's current token open longer than asked is a finding of its
    # own, never aborted, whatever --apply names.
    aged = reconcile(fg, "--json", "--old-upload-after-ms", "0", "--apply=stale_upload")
    assert aged.returncode == 1, aged.stdout + aged.stderr
    assert [(f["kind"], f["upload_id"], f["key"], f["token"]) for f in findings(aged)] == \
        [("old_upload", live, "other/live.bin", 5)]
    listed = fg.client().list_multipart_uploads(Bucket=fg.bucket).get("Uploads", [])
    assert {u["UploadId"] for u in listed} == {live}, "the current token's upload is left alone"


@pytest.mark.parametrize("store", ["embedded", "redis"])
def test_objects_around_fencegate_and_lost_advances_on_moto(fencegate, moto_server, store, request):
    extra = None
    if store == "redis":
        extra = {"store": {"kind": "redis", "url": request.getfixturevalue("redis_server").url, "path": None}}
    fg = start(fencegate, moto_server, "moto", extra)
    fg.client(token=7).put_object(Bucket=fg.bucket, Key="reports/ok.csv", Body=b"x")
    fg.client(token=7).put_object(Bucket=fg.bucket, Key="loose/ok.txt", Body=b"x")
    moto = moto_server.client()
    # Written straight to the upstream: no stamp, under the rule's prefix.
    moto.put_object(Bucket=fg.bucket, Key="reports/around.csv", Body=b"around")
    # Outside every rule: its stamp may be another resource's, which the object does not record
    # (as loose/ok.txt's, written through fencegate): not judged, counted as unattributed.
    moto.put_object(Bucket=fg.bucket, Key="loose/unknown.txt", Body=b"?", Metadata={"fencing-token": "4"})
    # Stamped 12 straight at the upstream: as if the store lost the advance to 12.
    moto.put_object(Bucket=fg.bucket, Key="reports/lost.csv", Body=b"12", Metadata={"fencing-token": "12"})

    run = reconcile(fg, "--json")
    assert run.returncode == 1, run.stdout + run.stderr
    found = {(f["kind"], f["key"]): f for f in findings(run)}
    assert set(found) == {("unstamped", "reports/around.csv"), ("stamp_above_fence", "reports/lost.csv")}
    assert found[("unstamped", "reports/around.csv")]["modified"].startswith("20"), "the object's time, as listed"
    lost = found[("stamp_above_fence", "reports/lost.csv")]
    assert (lost["resource"], lost["stamp"], lost["fence"], lost["action"]) == (RESOURCE, 12, 7, "none")
    done = json.loads(run.stdout.splitlines()[-1])
    assert (done["objects"], done["findings"], done["unattributed"]) == (5, 2, 2)

    uploads_only = findings(reconcile(fg, "--json", "--apply=stale_upload"))
    assert {(f["kind"], f["action"]) for f in uploads_only if f["kind"] == "stamp_above_fence"} == \
        {("stamp_above_fence", "none")}
    assert fence(fg, RESOURCE) == 7, "raising a fence to a stamp is never implied"
    run = reconcile(fg, "--json", "--apply=raise_fence")
    assert "not authenticated" in run.stderr, run.stderr
    applied = findings(run)
    assert {(f["kind"], f["action"]) for f in applied if f["kind"] == "stamp_above_fence"} == \
        {("stamp_above_fence", "raised")}
    assert fence(fg, RESOURCE) == 12, "the lost fence is raised to the stamp"
    again = findings(reconcile(fg, "--json"))
    assert [(f["kind"], f["key"]) for f in again] == [("unstamped", "reports/around.csv")]
    # Only a prefix: the rest of the bucket is not read.
    assert findings(reconcile(fg, "--json", "--prefix", "loose/")) == []


def test_a_fence_the_store_lost_is_raised_back_on_the_embedded_store(fencegate, moto_server, tmp_path):
    """The embedded store restored from a copy taken before an advance, and taken as it is by
    the operator (its witness refuses it otherwise: test_crash.py): the object's stamp is above
    the fence; `--apply` raises it back once the start's hold has passed, and stale writes are
    refused again."""
    import time

    fg = start(fencegate, moto_server, "local")
    fg.config["fencing"]["inflight_deadline_ms"] = 2000
    fg.client(token=3).put_object(Bucket=fg.bucket, Key="reports/r.csv", Body=b"3")
    fg.stop()
    backup = tmp_path / "fences-backup"
    shutil.copytree(fg.workdir / "fences", backup)
    fg.start()
    fg.client(token=8).put_object(Bucket=fg.bucket, Key="reports/r.csv", Body=b"8")
    fg.stop()
    shutil.rmtree(fg.workdir / "fences")
    shutil.copytree(backup, fg.workdir / "fences")
    fg.accept_restored_store()
    fg.start()
    assert fence(fg, RESOURCE) == 3, "the restored store lost the advance to 8"
    time.sleep(2.2)  # the hold of an accepted copy, as after a crash

    found = findings(reconcile(fg, "--json", "--apply=raise_fence"))
    assert [(f["kind"], f["stamp"], f["fence"], f["action"]) for f in found] == [("stamp_above_fence", 8, 3, "raised")]
    assert fence(fg, RESOURCE) == 8
    with pytest.raises(Exception):
        fg.client(token=5).put_object(Bucket=fg.bucket, Key="reports/r.csv", Body=b"stale")


def test_apply_names_the_kinds_it_fixes(fencegate, moto_server):
    """A bare `--apply` (which used to abort uploads and raise fences to stamps, which nothing
    authenticates, at once) and an unknown kind are refused, naming the kinds; so is
    `"apply": true` on the admin API. Nothing is scanned or changed."""
    fg = start(fencegate, moto_server, "local")
    for arg in ("--apply", "--apply=everything", "--apply=stale_upload,nope"):
        run = reconcile(fg, "--json", arg)
        assert run.returncode == 2, (arg, run.stdout, run.stderr)
        assert "stale_upload" in run.stderr and "raise_fence" in run.stderr, run.stderr
        assert run.stdout == "", run.stdout
    r = fg.admin("POST", "/v1/reconcile", token=ADMIN_TOKEN, json={"bucket": fg.bucket, "apply": True})
    assert r.status_code == 400 and "raise_fence" in r.json()["detail"], r.text
    r = fg.admin("POST", "/v1/reconcile", token=ADMIN_TOKEN, json={"bucket": fg.bucket, "apply": False})
    assert r.status_code == 200, r.text


def test_reconcile_needs_the_admin_token_and_a_running_fencegate(fencegate, moto_server):
    fg = start(fencegate, moto_server, "local")
    r = fg.admin("POST", "/v1/reconcile", json={"bucket": fg.bucket})
    assert r.status_code == 401
    r = fg.admin("POST", "/v1/reconcile", token=ADMIN_TOKEN, json={"bucket": fg.bucket, "color": "red"})
    assert r.status_code == 400
    fg.stop()
    run = reconcile(fg)
    assert run.returncode == 2 and "is it running?" in run.stderr


def test_a_stamp_reconcile_cannot_attribute_or_that_would_lock_is_never_raised(fencegate, moto_server):
    """A stamp is not authenticated: whoever writes the upstream directly can forge one. A
    stamp on a key no rule binds may be another resource's (`Fencing-Resource`): never judged,
    even when the key's own name has a fence. A forged 2^64-1 under a rule is reported and
    never raised: it would lock the resource for good."""
    fg = start(fencegate, moto_server, "moto")
    fg.client(token=5).put_object(Bucket=fg.bucket, Key="loose/shared.bin", Body=b"5")
    fg.client(token=1000000, resource="tenant:z").put_object(Bucket=fg.bucket, Key="loose/shared.bin", Body=b"z")
    fg.client(token=7).put_object(Bucket=fg.bucket, Key="reports/ok.csv", Body=b"7")
    moto_server.client().put_object(Bucket=fg.bucket, Key="reports/forged.csv", Body=b"!",
                                    Metadata={"fencing-token": str(2 ** 64 - 1)})
    run = reconcile(fg, "--json", "--apply=raise_fence")
    found = findings(run)
    assert [(f["kind"], f["key"], f["action"]) for f in found] == [
        ("stamp_above_fence", "reports/forged.csv", {"failed": "not raised: 2^64-1 would lock the resource for good"})]
    assert json.loads(run.stdout.splitlines()[-1])["unattributed"] == 1
    assert fence(fg, f"{fg.bucket}/loose/shared.bin") == 5 and fence(fg, RESOURCE) == 7


def test_an_upload_taken_over_while_the_scan_ran_is_not_aborted(held_s3):
    """Token 6 takes over token 5's upload while reconcile --apply checks it at the upstream:
    the record is read again before the abort, and token 6 completes its upload."""
    env = held_s3(config={"server": {"admin_token": ADMIN_TOKEN}})
    fg, key = env.fg, HELD_PREFIX + "big.bin"
    a = fg.client(token=5)
    upload = a.create_multipart_upload(Bucket=env.bucket, Key=key)["UploadId"]
    p1 = a.upload_part(Bucket=env.bucket, Key=key, UploadId=upload, PartNumber=1, Body=b"a" * (5 << 20))
    assert fg.put_fence(HELD_RESOURCE, 6, token=ADMIN_TOKEN).status_code == 200
    hold = env.up.hold_next("GET", key, query="max-parts=1")  # reconcile asks whether it exists
    out = {}

    def scan():
        r = requests.post(fg.admin_url + "/v1/reconcile", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                          json={"bucket": env.bucket, "apply": ["stale_upload"]}, timeout=120)
        out["lines"] = [json.loads(line) for line in r.text.splitlines() if line.strip()]

    t = threading.Thread(target=scan)
    t.start()
    assert hold.wait_arrived(30), "reconcile never asked the upstream about the upload"
    b = fg.client(token=6)
    p2 = b.upload_part(Bucket=env.bucket, Key=key, UploadId=upload, PartNumber=2, Body=b"b" * 1024)
    hold.release()
    t.join(60)
    assert [line["event"] for line in out["lines"]][-1] == "done"
    assert not [line for line in out["lines"] if line["event"] == "finding"], out["lines"]
    b.complete_multipart_upload(Bucket=env.bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": [
        {"PartNumber": 1, "ETag": p1["ETag"]}, {"PartNumber": 2, "ETag": p2["ETag"]}]})


def test_reconcile_refuses_what_is_no_bucket_and_pages_of_other_sites(fencegate, moto_server):
    fg = start(fencegate, moto_server, "local")
    bearer = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    for bucket in ("", "/", "a/b", "a b", "a\nb"):
        r = requests.post(fg.admin_url + "/v1/reconcile", headers=bearer, json={"bucket": bucket}, timeout=10)
        assert r.status_code == 400, bucket
    # A page of another site may post without asking first ("simple" request): refused.
    for cross in ({"Origin": "http://evil.example"}, {"Sec-Fetch-Site": "cross-site"}, {"Origin": "null"}):
        r = requests.post(fg.admin_url + "/v1/reconcile",
                          data=json.dumps({"bucket": fg.bucket, "apply": ["stale_upload"]}),
                          headers={**bearer, "Content-Type": "text/plain", **cross}, timeout=10)
        assert r.status_code == 403 and r.json()["title"] == "CrossSiteRequest", cross
    own = {"Origin": fg.admin_url, "Sec-Fetch-Site": "same-origin"}
    assert fg.put_fence("job:own-page", 3, token=ADMIN_TOKEN).status_code == 200
    r = requests.put(fg.admin_url + "/v1/fences/" + quote_resource("job:own-page"), json={"token": 4},
                     headers={**bearer, **own}, timeout=10)
    assert r.status_code == 200, "the listener's own page may change what its token allows"


def test_the_stamp_cannot_be_named_in_the_query(fencegate, moto_server):
    """An upstream that takes metadata from the query (moto does) would store a writer's own
    stamp over fencegate's: `?x-amz-meta-fencing-token=` on a write is refused unless it is the
    token presented (as a presigned URL carries it), nothing sent."""
    fg = start(fencegate, moto_server, "moto")
    fg.client(token=5).put_object(Bucket=fg.bucket, Key="reports/x.csv", Body=b"5")
    for name in ("x-amz-meta-fencing-token", "X-Amz-Meta-Fencing-Token"):
        r = signed_raw_request(fg, "PUT", f"/{fg.bucket}/reports/x.csv?{name}={2 ** 64 - 1}",
                               {"Fencing-Token": "5"}, b"mine")
        assert (r.status, r.code()) == (400, "InvalidFencingToken"), (name, r.body)
    head = moto_server.client().head_object(Bucket=fg.bucket, Key="reports/x.csv")
    assert head["Metadata"]["fencing-token"] == "5"
    r = signed_raw_request(fg, "PUT", f"/{fg.bucket}/reports/x.csv?x-amz-meta-fencing-token=5", {"Fencing-Token": "5"},
                           b"five again")
    assert r.status == 200, r.body


# ---------------------------------------------------------------------------------------------
# The API gateway's requests whose outcome is unknown.


def gateway_route(api, **route) -> dict:
    r = {"prefix": "/pay/", "upstream": api.url + "/v1/payments/", "resource": "payment:{1}",
         "mode": "idempotency-key", "advance": "write", "request_timeout_ms": 1000}
    r.update(route)
    return r


def reconcile_records(fg, *args: str) -> subprocess.CompletedProcess:
    """`fencegate reconcile` without a bucket: the gateway's records only."""
    env = dict(os.environ, FENCEGATE_SERVER__ADMIN_LISTEN="%s:%d" % fg.admin_addr)
    return subprocess.run([str(bin_path()), "reconcile", "--config", str(fg.config_path), *args],
                          capture_output=True, text=True, timeout=120, env=env)


def pay(fg, path: str, key: str, token: int = 5) -> requests.Response:
    return requests.post(fg.s3_url + path, data=b'{"amount": 1}', timeout=30,
                         headers={"Fencing-Token": str(token), "Idempotency-Key": key, "Authorization": "Bearer alice"})


@pytest.mark.parametrize("store", ["embedded", "redis"])
def test_gateway_requests_of_unknown_outcome_are_found(fencegate, api, store, request):
    """A route's API that does not answer within `request_timeout_ms`: the request may or may not
    have executed, and only the API can tell. `fencegate reconcile` (with or without a bucket)
    lists it with the `Idempotency-Key` the API was sent, its resource, token, route and cause,
    and exits 1; a request the API answered is not listed. `--apply` leaves it: the retry still
    gets "outcome unknown", never a second call."""
    config = {"server": {"admin_token": ADMIN_TOKEN}, "routes": [gateway_route(api)]}
    if store == "redis":
        config["store"] = {"kind": "redis", "url": request.getfixturevalue("redis_server").url, "path": None}
        config["upstream"] = {"probe_bucket": "probe"}
    fg = fencegate(config=config, local_buckets=("probe",))
    assert pay(fg, "/pay/1/charges", "answered").status_code == 201
    hold = api.hold("/v1/payments/2/charges")
    try:
        timed_out = pay(fg, "/pay/2/charges", "held")
        assert timed_out.status_code == 504, timed_out.text
        sent_key = timed_out.json()["upstream_idempotency_key"]
    finally:
        hold.released.set()
    assert [r["headers"]["idempotency-key"] for r in api.requests("/v1/payments/2/charges")] == [sent_key]

    run = reconcile_records(fg)
    assert run.returncode == 1, run.stdout + run.stderr
    assert sent_key in run.stdout and "ask the API (timeout)" in run.stdout, run.stdout
    assert "1 found in 2 gateway records" in run.stdout, run.stdout
    assert "gateway records" in run.stderr, "progress goes to stderr"
    found = findings(reconcile_records(fg, "--json", "--apply=stale_upload,raise_fence"))
    assert [(f["kind"], f["resource"], f["upstream_key"], f["token"], f["route"], f["cause"]) for f in found] == \
        [("unknown_outcome", "payment:2", sent_key, 5, "/pay/", "timeout")]
    assert found[0]["fence"] == 5 and 0 < found[0]["expires_in_ms"] <= 24 * 3600 * 1000, found
    assert found[0]["claimed_at_ms"] > 0

    # A bucket's scan reports them too (the command's one report).
    bucket = subprocess.run([str(bin_path()), "reconcile", "--config", str(fg.config_path), "--bucket", "probe",
                             "--json"], capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, FENCEGATE_SERVER__ADMIN_LISTEN="%s:%d" % fg.admin_addr))
    assert bucket.returncode == 1 and [f["upstream_key"] for f in findings(bucket)] == [sent_key], bucket.stdout
    retry = pay(fg, "/pay/2/charges", "held")
    assert retry.status_code == 504 and retry.json()["upstream_idempotency_key"] == sent_key, retry.text
    assert len(api.requests("/v1/payments/2/charges")) == 1, "--apply or the retry sent it again"


def test_a_claim_its_fencegate_never_finished_is_found_once_its_window_closed(fencegate, api):
    """fencegate killed (-9) while a call waits at the API: its record stays in flight. Restarted
    on the same store, a scan within the claim's window finds nothing (a live fencegate could
    still be working on it); once the window closed (the gate's deadline, twice the route's
    timeout and the store's, and a second), the record is listed as `abandoned`."""
    config = {"server": {"admin_token": ADMIN_TOKEN}, "routes": [gateway_route(api)],
              "fencing": {"inflight_deadline_ms": 1000}, "store": {"timeout_ms": 500}}
    fg = fencegate(config=config)
    hold = api.hold("/v1/payments/7/charges")
    claimed = time.monotonic()
    def call():
        try:
            pay(fg, "/pay/7/charges", "died")
        except requests.ConnectionError:
            pass  # its fencegate was killed: the answer is lost

    t = threading.Thread(target=call, daemon=True)
    t.start()
    try:
        assert hold.arrived.wait(15), "the call never reached the API"
        fg.kill9()
    finally:
        hold.released.set()
    t.join(30)
    sent_key = api.requests("/v1/payments/7/charges")[0]["headers"]["idempotency-key"]
    fg.start()
    window_s = 1 + 2 * 1 + 2 * 0.5 + 1
    early = reconcile_records(fg)
    if time.monotonic() - claimed < window_s - 1:
        assert early.returncode == 0 and "0 found" in early.stdout, early.stdout
        assert "1 gateway requests still within their claim's window" in early.stdout, early.stdout
    deadline = time.monotonic() + window_s + 15
    while True:
        found = findings(reconcile_records(fg, "--json"))
        if found or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert [(f["kind"], f["upstream_key"], f["cause"]) for f in found] == [("unknown_outcome", sent_key, "abandoned")]


def test_records_outlive_their_claim_window_whatever_the_retention(fencegate, api):
    """Before: a route whose `idempotency_retention_ms` was shorter than its claim's window let
    a record of a call still waiting at the API expire: the retry sent it a second time, and
    a claim abandoned by a crash was never found. Now a record is kept two windows at least."""
    config = {"server": {"admin_token": ADMIN_TOKEN},
              "routes": [gateway_route(api, idempotency_retention_ms=1000, request_timeout_ms=500)]}
    fg = fencegate(config=config)
    hold = api.hold("/v1/payments/3/charges")
    try:
        assert pay(fg, "/pay/3/charges", "short").status_code == 504
    finally:
        hold.released.set()
    time.sleep(1.5)
    retry = pay(fg, "/pay/3/charges", "short")
    assert retry.status_code == 504, retry.text
    assert len(api.requests("/v1/payments/3/charges")) == 1, "the retry reached the API again"
    found = findings(reconcile_records(fg, "--json"))
    assert [(f["kind"], f["cause"]) for f in found] == [("unknown_outcome", "timeout")]


def test_unreadable_records_are_findings_and_hide_no_other(fencegate, api, redis_server):
    """Before: one record the store could not read (JSON of another version, a key written by
    hand, of another type) failed the whole scan with "fence store backend failed". Now each
    is a finding of its own, named and explained, and the others are still found."""
    config = {"server": {"admin_token": ADMIN_TOKEN}, "routes": [gateway_route(api, request_timeout_ms=500)],
              "store": {"kind": "redis", "url": redis_server.url, "path": None},
              "upstream": {"probe_bucket": "probe"}}
    fg = fencegate(config=config, local_buckets=("probe",))
    hold = api.hold("/v1/payments/2/charges")
    try:
        sent_key = pay(fg, "/pay/2/charges", "held").json()["upstream_idempotency_key"]
    finally:
        hold.released.set()
    for command in (["HSET", "fg:{payment:9}:idem:" + "a" * 64, "record", "{not json"],
                    ["SET", "fg:{payment:8}:idem:" + "b" * 64, "a string, not a hash"]):
        subprocess.run(["redis-cli", "-p", str(redis_server.port), *command], check=True, capture_output=True,
                       timeout=20)
    run = reconcile_records(fg, "--json")
    assert run.returncode == 1, run.stdout + run.stderr
    found = findings(run)
    unknown = [f["upstream_key"] for f in found if f["kind"] == "unknown_outcome"]
    unreadable = {f["name"]: f["error"] for f in found if f["kind"] == "unreadable_record"}
    assert unknown == [sent_key], found
    assert set(unreadable) == {"fg:{payment:9}:idem:" + "a" * 64, "fg:{payment:8}:idem:" + "b" * 64}, found
    assert "not an idempotency record" in unreadable["fg:{payment:9}:idem:" + "a" * 64]
    assert "WRONGTYPE" in unreadable["fg:{payment:8}:idem:" + "b" * 64]


def test_a_bucket_is_reconciled_on_a_redis_cluster_store(fencegate, tmp_path):
    """Before: every reconciliation read the gateway's records first, which a Redis Cluster
    cannot list, so `--bucket` failed there (exit 2) with no route keeping records. Now the
    records are read only where a route keeps them."""
    nodes, buses = [], []
    try:
        for i in range(2):
            d = tmp_path / f"node{i}"
            d.mkdir()
            # The bus port named: Redis's default (port + 10,000) fails for a port above 55,535.
            buses.append(free_port())
            nodes.append(RedisServer(d, name=f"node{i}").start(
                "--cluster-enabled", "yes", "--cluster-config-file", str(d / "nodes.conf"),
                "--cluster-port", str(buses[-1])))
        a, b = nodes

        def cli(node, *args):
            return subprocess.run(["redis-cli", "-p", str(node.port), *args], capture_output=True, text=True,
                                  timeout=20).stdout

        cli(a, "CLUSTER", "ADDSLOTSRANGE", "0", "8191")
        cli(b, "CLUSTER", "ADDSLOTSRANGE", "8192", "16383")
        cli(a, "CLUSTER", "MEET", "127.0.0.1", str(b.port), str(buses[1]))
        deadline = time.monotonic() + 20
        while not all("cluster_state:ok" in cli(n, "CLUSTER", "INFO") for n in nodes):
            assert time.monotonic() < deadline, "the cluster never formed"
            time.sleep(0.2)
        config = {"server": {"admin_token": ADMIN_TOKEN}, "upstream": {"probe_bucket": "probe"},
                  "store": {"kind": "redis", "cluster_urls": [a.url, b.url], "path": None}}
        fg = fencegate(config=config, local_buckets=("probe",))
        fg.client(token=4).put_object(Bucket="probe", Key="a.txt", Body=b"4")
        fg.bucket = "probe"
        run = reconcile(fg)
        assert run.returncode == 0, run.stdout + run.stderr
        assert "0 found in 0 gateway records, 0 uploads and 1 objects" in run.stdout, run.stdout
    finally:
        for node in nodes:
            node.kill9()
