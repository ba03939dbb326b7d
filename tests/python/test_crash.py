"""Proves G1/G2 across crashes: a fence advanced before `kill -9` still rejects older tokens after restart."""

from __future__ import annotations

from pathlib import Path

import pytest
from botocore.exceptions import ClientError

from fencegate_testlib import code_of, head_status, header_of, read_object, status_of


def assert_stale(exc_info, current: int):
    exc = exc_info.value
    assert status_of(exc) == 409, exc.response
    assert code_of(exc) == "FencingTokenStale", exc.response
    assert header_of(exc, "Fencing-Token-Current") == str(current), exc.response


def test_advance_by_write_survives_kill9(fg):
    bucket = "crash"
    fg.client().create_bucket(Bucket=bucket)
    fg.client(token=12).put_object(Bucket=bucket, Key="k", Body=b"written with 12")

    fg.restart(kill=True)

    with pytest.raises(ClientError) as exc_info:
        fg.client(token=11).put_object(Bucket=bucket, Key="k", Body=b"stale 11")
    assert_stale(exc_info, 12)
    assert read_object(fg.client(), bucket, "k") == b"written with 12"
    assert fg.get_fence(f"{bucket}/k").json() == {"resource": f"{bucket}/k", "token": 12}
    # The holder of 12 carries on.
    fg.client(token=12).put_object(Bucket=bucket, Key="k", Body=b"12 again")


def test_advance_by_admin_survives_kill9(fg):
    bucket = "crash2"
    fg.client().create_bucket(Bucket=bucket)
    r = fg.put_fence(f"{bucket}/k", 20)
    assert r.status_code == 200, r.text
    r = fg.put_fence("job:crash", 7)
    assert r.status_code == 200, r.text

    fg.restart(kill=True)

    assert fg.get_fence(f"{bucket}/k").json()["token"] == 20
    assert fg.get_fence("job:crash").json()["token"] == 7
    with pytest.raises(ClientError) as exc_info:
        fg.client(token=19).put_object(Bucket=bucket, Key="k", Body=b"stale 19")
    assert_stale(exc_info, 20)
    assert head_status(fg.client(), bucket, "k") == 404
    with pytest.raises(ClientError) as exc_info:
        fg.client(token=6, resource="job:crash").put_object(Bucket=bucket, Key="j", Body=b"6")
    assert_stale(exc_info, 7)


def test_many_advances_then_kill9_twice(fg):
    """Every acknowledged advance is durable, not only the last one before the crash."""
    bucket = "crash3"
    fg.client().create_bucket(Bucket=bucket)
    for i in range(10):
        fg.client(token=100 + i).put_object(Bucket=bucket, Key=f"k{i}", Body=b"x")
    fg.restart(kill=True)
    fg.restart(kill=True)
    for i in range(10):
        assert fg.get_fence(f"{bucket}/k{i}").json()["token"] == 100 + i
        with pytest.raises(ClientError) as exc_info:
            fg.client(token=99 + i).put_object(Bucket=bucket, Key=f"k{i}", Body=b"old")
        assert_stale(exc_info, 100 + i)


def test_graceful_restart_keeps_fences(fg):
    bucket = "crash4"
    fg.client().create_bucket(Bucket=bucket)
    fg.client(token=12).put_object(Bucket=bucket, Key="k", Body=b"12")
    fg.restart(kill=False)
    with pytest.raises(ClientError) as exc_info:
        fg.client(token=11).put_object(Bucket=bucket, Key="k", Body=b"11")
    assert_stale(exc_info, 12)


def test_a_grant_after_an_unclean_stop_is_refused_at_once_with_retry_after(fencegate):
    """After an unclean stop no fence advances for `fencing.inflight_deadline_ms` (D): a write
    admitted before the crash may still commit. Before: a grant then hung for D (30 s by
    default) while `fencegate-lease` gave up after 5 s. Now it is answered at once, 503
    `FenceStoreUnavailable` with `Retry-After` (the rest of D, rounded up), and granted once that
    time has passed."""
    import json
    import time

    from fencegate_testlib import quote_resource, signed_raw_request

    d_ms = 3000
    fg = fencegate(config={"fencing": {"inflight_deadline_ms": d_ms}})
    fg.restart(kill=True)
    path = "/_fencegate/v1/leases/" + quote_resource("job:after-crash")
    body = json.dumps({"holder": "worker", "ttl_ms": 10000}).encode()
    started = time.monotonic()
    r = signed_raw_request(fg, "POST", path, {"Content-Type": "application/json"}, body)
    took = time.monotonic() - started
    assert r.status == 503 and json.loads(r.body)["title"] == "FenceStoreUnavailable", (r.status, r.body)
    retry_after = int(r.headers["retry-after"])
    assert 1 <= retry_after <= d_ms // 1000, r.headers
    assert took < d_ms / 1000 / 2, f"the refusal took {took:.2f}s: it waited"
    time.sleep(retry_after)
    r = signed_raw_request(fg, "POST", path, {"Content-Type": "application/json"}, body)
    assert r.status == 201, (r.status, r.body)


def test_a_clean_stop_inside_the_hold_does_not_end_it(fencegate):
    """Crash, start (the hold of D begins), a clean stop 0.5 s later, start: the hold goes on to
    D after the first start (a grant is refused with the rest of it in `Retry-After`), however
    many starts and stops come between. Before: the clean stop erased it, and the third process
    granted at once while the crashed one's writes could still commit."""
    import json
    import time

    from fencegate_testlib import quote_resource, signed_raw_request

    d_ms = 6000
    fg = fencegate(config={"fencing": {"inflight_deadline_ms": d_ms}})
    before_hold = time.monotonic()
    fg.restart(kill=True)  # the hold starts at this start, after `before_hold`
    time.sleep(0.5)
    fg.restart()  # a clean stop inside the hold
    path = "/_fencegate/v1/leases/" + quote_resource("job:crash-loop")
    body = json.dumps({"holder": "worker", "ttl_ms": 10000}).encode()
    r = signed_raw_request(fg, "POST", path, {"Content-Type": "application/json"}, body)
    left_s = before_hold + d_ms / 1000 - time.monotonic()
    assert left_s > 1, f"the test was too slow to show the hold ({left_s:.2f}s left)"
    assert r.status == 503 and json.loads(r.body)["title"] == "FenceStoreUnavailable", (r.status, r.body)
    assert 1 <= int(r.headers["retry-after"]) <= d_ms // 1000, r.headers
    time.sleep(int(r.headers["retry-after"]))
    r = signed_raw_request(fg, "POST", path, {"Content-Type": "application/json"}, body)
    assert r.status == 201, (r.status, r.body)
    # Once passed, the hold is not served again by a later clean start.
    fg.restart()
    r = signed_raw_request(fg, "POST", "/_fencegate/v1/leases/" + quote_resource("job:after-hold"),
                           {"Content-Type": "application/json"}, body)
    assert r.status == 201, (r.status, r.body)


def test_a_sigterm_right_after_ready_is_a_clean_stop(fencegate):
    """Two restarts in a row (SIGTERM as soon as "fencegate ready" is printed): each stop is
    clean, so nothing is held after them. Before: the handler was installed after the ready line,
    a SIGTERM in between killed the process, and the next start held every advance for D."""
    import json

    from fencegate_testlib import quote_resource, signed_raw_request

    fg = fencegate(config={"fencing": {"inflight_deadline_ms": 30000}})
    for _ in range(3):
        fg.restart()
    r = signed_raw_request(fg, "POST", "/_fencegate/v1/leases/" + quote_resource("job:restarted"),
                           {"Content-Type": "application/json"},
                           json.dumps({"holder": "worker", "ttl_ms": 10000}).encode())
    assert r.status == 201, (r.status, r.headers, r.body)


def test_a_stop_with_an_upload_in_flight_fits_its_timeout_and_the_next_start_holds(fencegate):
    """Before: a graceful stop with an upload in flight waited 10 s for open requests and then
    up to `fencing.inflight_deadline_ms` for writes in flight (17.7 s seen), past the 10 s
    `docker stop` gives before SIGKILL. Now the whole stop fits in
    `server.shutdown_timeout_ms` (here 2 s); the write left in flight makes the next start hold
    advances (a grant: 503 with Retry-After), as after a crash, so nothing older can commit
    after a newer token."""
    import json
    import signal
    import socket
    import time

    from fencegate_testlib import build_head, quote_resource, sign_headers, signed_raw_request

    fg = fencegate(config={"server": {"shutdown_timeout_ms": 2000}, "fencing": {"inflight_deadline_ms": 20000}},
                   local_buckets=("stopbkt",))
    host, port = fg.s3_addr
    path = "/stopbkt/held"
    headers = sign_headers("PUT", host, port, path, {"Fencing-Token": "3", "Content-Length": "100000"})
    sock = socket.create_connection(fg.s3_addr, timeout=10)
    try:
        sock.sendall(build_head("PUT", path, headers) + b"x" * 1000)  # admitted; the body never ends
        time.sleep(0.5)
        started = time.monotonic()
        fg.proc.send_signal(signal.SIGTERM)
        fg.proc.wait(timeout=30)
        took = time.monotonic() - started
    finally:
        sock.close()
    assert took < 2.0 + 2.5, f"the stop took {took:.1f}s with server.shutdown_timeout_ms = 2000"
    fg.start()
    r = signed_raw_request(fg, "POST", "/_fencegate/v1/leases/" + quote_resource("stopbkt/held"),
                           {"Content-Type": "application/json"}, json.dumps({"holder": "h", "ttl_ms": 1000}).encode())
    assert r.status == 503 and "retry-after" in r.headers, (r.status, r.headers, r.body)


def test_the_store_directory_removed_under_a_running_fencegate(fencegate, tmp_path):
    """`data/fences` removed while serving: the running process makes no change any more (an
    advance would be fsynced into a file no later start reads), /readyz says why, and a second
    process on the same path refuses to start while the first runs. Before: the first went on
    "fsyncing" into a nameless file and the second started as a fresh store (two gates, two
    fences, an older token committed after a newer one)."""
    import shutil
    import subprocess

    from fencegate_testlib import bin_path, merge, to_toml

    fg = fencegate(local_buckets=("gone",))
    s3 = fg.client(token=5)
    s3.put_object(Bucket="gone", Key="k", Body=b"five")
    store_dir = Path(fg.config["store"]["path"])
    shutil.rmtree(store_dir)

    ready = fg.admin("GET", "/readyz")
    assert ready.status_code == 503 and "no longer the one this process opened" in ready.json()["detail"], ready.text
    with pytest.raises(ClientError) as refused:
        fg.client(token=6).put_object(Bucket="gone", Key="k", Body=b"six")
    assert (status_of(refused.value), code_of(refused.value)) == (503, "FenceStoreUnavailable")

    second = merge(fg.config, {"server": {"listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0"}})
    path = tmp_path / "second.toml"
    path.write_text(to_toml(second))
    out = subprocess.run([str(bin_path()), "serve", "--config", str(path)], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode != 0 and "fencegate ready" not in out.stdout, out.stdout
    assert "another fencegate process uses the fence store" in out.stderr, out.stderr



def _copy_store(store_dir: Path) -> dict:
    return {p.name: p.read_bytes() for p in store_dir.iterdir() if p.is_file()}


def _put_back(store_dir: Path, copy: dict):
    """Writes the copy's bytes over the files (in place: each file keeps its inode, as `cp` over
    an existing file does)."""
    for name, data in copy.items():
        (store_dir / name).write_bytes(data)


def _serve_once(fg):
    """`fencegate serve` on the instance's config, expected to refuse: (exit code, stdout,
    stderr); one that serves instead is stopped after 15 s and reported with exit code 0."""
    import subprocess

    from fencegate_testlib import bin_path
    try:
        out = subprocess.run([str(bin_path()), "serve", "--config", str(fg.config_path)], capture_output=True,
                             text=True, timeout=15, stdin=subprocess.DEVNULL, cwd=str(fg.workdir))
        return out.returncode, out.stdout, out.stderr
    except subprocess.TimeoutExpired as served:
        return 0, served.stdout or "", served.stderr or ""


def test_an_older_copy_of_the_store_put_back_is_refused_before_it_admits_anything(fencegate):
    """Registration 5, a clean stop, a copy of `data/fences`, a start, registration 7, a clean
    stop, the copy put back: the start refuses, naming the store that went back in time and the
    way out. Before: it started on the copy (fence 5) and took registration 6 after 7 had been
    given out, and a lease grant handed out 6 and 7 again. The operator who takes the copy on
    purpose (`init-store --accept-restored`) gets a start that holds writes as after a crash."""
    import json
    import subprocess

    from fencegate_testlib import bin_path, quote_resource, signed_raw_request

    fg = fencegate(config={"fencing": {"inflight_deadline_ms": 4000}})
    store_dir = Path(fg.config["store"]["path"])
    assert fg.put_fence("job:restored", 5).status_code == 200
    fg.stop()
    older = _copy_store(store_dir)
    fg.start()
    assert fg.put_fence("job:restored", 7).status_code == 200
    fg.stop()
    newest = _copy_store(store_dir)

    _put_back(store_dir, older)
    code, stdout, stderr = _serve_once(fg)
    assert code != 0 and "fencegate ready" not in str(stdout), stdout
    assert "went back in time" in stderr and "--accept-restored" in stderr, stderr
    # Put the newest copy back: it starts with every fence.
    _put_back(store_dir, newest)
    fg.start()
    assert fg.get_fence("job:restored").json()["token"] == 7
    assert fg.put_fence("job:restored", 6).status_code == 409
    fg.stop()

    # The operator takes the older copy on purpose: said, and held as after a crash.
    _put_back(store_dir, older)
    accepted = subprocess.run([str(bin_path()), "init-store", "--accept-restored", "--config", str(fg.config_path)],
                              capture_output=True, text=True, timeout=30)
    assert accepted.returncode == 0, accepted.stderr
    assert "accepted" in accepted.stdout and "reconcile" in accepted.stdout, accepted.stdout
    fg.start()
    assert fg.get_fence("job:restored").json()["token"] == 5
    r = signed_raw_request(fg, "POST", "/_fencegate/v1/leases/" + quote_resource("job:restored"),
                           {"Content-Type": "application/json"},
                           json.dumps({"holder": "worker", "ttl_ms": 10000}).encode())
    assert r.status == 503 and "retry-after" in r.headers, (r.status, r.headers, r.body)


def test_a_store_removed_while_stopped_does_not_start_empty(fencegate):
    """`data/fences` removed (or replaced by a fresh one) while fencegate is stopped: the witness
    beside it refuses an empty start, and the refused start leaves no file behind. Before: a
    fresh, empty store, every fence gone."""
    import shutil

    fg = fencegate()
    store_dir = Path(fg.config["store"]["path"])
    assert fg.put_fence("job:removed", 9).status_code == 200
    fg.stop()
    shutil.rmtree(store_dir)
    code, stdout, stderr = _serve_once(fg)
    assert code != 0 and "fencegate ready" not in str(stdout), stdout
    assert "is not the one its witness" in stderr, stderr
    assert not (store_dir / "fences.redb").exists()


def test_a_wall_clock_stepped_forward_does_not_shorten_the_hold(fencegate):
    """Crash, start (the hold of D begins), a clean stop, then a start whose wall clock is an hour
    ahead (an NTP step while fencegate was stopped; here libfaketime moves only the C library's
    wall clock): the hold goes on, read on CLOCK_BOOTTIME within the boot. Before: the recorded
    hold was a wall-clock end, already passed, and a grant was given at once while the crashed
    process's writes could still commit."""
    import os
    from pathlib import Path

    import requests

    libfaketime = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1")
    if not libfaketime.exists():
        message = f"{libfaketime} is missing (Debian's libfaketime; scripts/test installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    d_ms = 20000
    fg = fencegate(config={"fencing": {"inflight_deadline_ms": d_ms}})
    fg.restart(kill=True)  # the hold of D begins at this start
    fg.stop()  # a clean stop inside it
    fg.env.update({"LD_PRELOAD": str(libfaketime), "FAKETIME": "+1h", "FAKETIME_DONT_FAKE_MONOTONIC": "1"})
    fg.start()
    hold = fg.admin("GET", "/v1/status").json().get("hold")
    assert hold and d_ms / 2 < hold["remaining_ms"] <= d_ms, hold
    # A registration is an advance (on the admin listener: no signature, whose date would be an
    # hour off the faked clock): it waits for the hold, it is not admitted now.
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.put(fg.admin_url + "/v1/fences/job%3Astepped", json={"token": 1}, timeout=3)
