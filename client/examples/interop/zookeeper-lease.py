#!/usr/bin/env python3
# A worker under a ZooKeeper lock (its token the sequential node's number + 1), with kazoo and
# boto3: docs/leases.md, "Tokens issued elsewhere", exactly as the page has it
# (tests/python/test_lease_recipes.py checks that they agree, and runs it).
#
#   ZK_HOSTS=127.0.0.1:2181 RESOURCE=job:invoices python3 zookeeper-lease.py write:invoices.txt=invoices.txt

import hashlib, json, os, sys, threading, time, urllib.parse

import boto3, requests
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import LockTimeout

S3 = "http://127.0.0.1:9000"
RESOURCE = os.environ.get("RESOURCE", "job:invoices")
HOLDER = os.environ.get("HOLDER", f"worker-{os.getpid()}")
TTL = int(os.environ.get("TTL_MS", "10000")) / 1000
WAIT = int(os.environ.get("WAIT_MS", "0")) / 1000
BUCKET = os.environ.get("BUCKET", "reports")
KEY = os.environ.get("AWS_ACCESS_KEY_ID", "fencegate-dev")
SECRET = os.environ.get("AWS_SECRET_ACCESS_KEY", "fencegate-dev-secret")


def say(line):
    print(line, flush=True)


def register(token):
    """Registers the token on the S3 listener, signed with its body's hash by an issuer key
    (`role = "issuer"`): no admin listener, and it works with server.admin_token set."""
    body = json.dumps({"token": token}).encode()
    url = f"{S3}/_fencegate/v1/fences/{urllib.parse.quote(RESOURCE, safe='')}"
    request = AWSRequest("PUT", url, data=body, headers={"x-amz-content-sha256": hashlib.sha256(body).hexdigest()})
    S3SigV4Auth(Credentials(KEY, SECRET), "s3", "us-east-1").add_auth(request)
    return requests.put(url, data=body, headers=dict(request.headers), timeout=5)


class Lease:
    """Held until a heartbeat is refused, the session is lost, or TTL passes after the sending of
    the last heartbeat that succeeded (monotonic clock)."""
    deadline, lost = 0.0, None

    def held(self):
        if self.lost is None and time.monotonic() >= self.deadline:
            self.lost = "deadline"
        return self.lost is None


lease, done = Lease(), threading.Event()
zk = KazooClient(hosts=os.environ.get("ZK_HOSTS", "127.0.0.1:2181"), timeout=TTL)
zk.start(timeout=TTL)
zk.add_listener(lambda state: setattr(lease, "lost", lease.lost or "session") if state == KazooState.LOST else None)
# Never delete this node: its sequence counter is the token.
lock = zk.Lock("/fencing/" + urllib.parse.quote(RESOURCE, safe=""), identifier=HOLDER)


def beat():
    """One heartbeat: True if our node is still there (the lease is ours), False if it is gone."""
    sent = time.monotonic()
    if zk.exists_async(f"{lock.path}/{lock.node}").get(timeout=TTL / 3) is None:
        return False
    lease.deadline = sent + TTL
    say(f"heartbeat_latency ms={(time.monotonic() - sent) * 1000:.1f}")
    return True


def heartbeat():
    while not done.wait(TTL / 3) and lease.held():
        try:
            if not beat():
                lease.lost = "refused"
        except Exception:  # no answer: the deadline decides
            pass
        if not lease.held():
            say(f"lease_lost reason={lease.lost}")


def stop(code, line):
    say(line)
    done.set()
    zk.stop()
    sys.exit(code)


# 1. Take the lock (waiting up to WAIT) and register its token.
try:
    if not lock.acquire(blocking=WAIT > 0, timeout=WAIT or None):
        stop(3, f"lease_held resource={RESOURCE}")
except LockTimeout:
    stop(3, f"lease_held resource={RESOURCE}")
token = int(lock.node[-10:]) + 1  # "...__lock__0000000042" -> 43: never 0
if not beat():
    stop(5, "lease_lost reason=refused")
fence = register(token)
if fence.status_code != 200:
    lock.release()  # 409: the counter went back, and a ZooKeeper counter cannot be moved
    stop(6 if fence.status_code == 409 else 1, f"registration refused token={token} status={fence.status_code} {fence.text}")
say(f"lease_acquired token={token} holder={HOLDER}")
threading.Thread(target=heartbeat, daemon=True).start()

# 2. The work: the headers go in before-sign, so the signature covers them.
s3 = boto3.client("s3", endpoint_url=S3, region_name="us-east-1",
                  aws_access_key_id=KEY, aws_secret_access_key=SECRET)


def add_fencing_headers(request, **_):
    request.headers["Fencing-Token"] = str(token)
    request.headers["Fencing-Resource"] = RESOURCE


s3.meta.events.register("before-sign.s3.*", add_fencing_headers)
for step in sys.argv[1:]:
    kind, _, arg = step.partition(":")
    if kind == "write":
        key, _, path = arg.partition("=")
        if not lease.held():
            stop(5, f"lease_lost reason={lease.lost}")
        try:
            with open(path, "rb") as body:
                s3.put_object(Bucket=BUCKET, Key=key, Body=body)
        except s3.exceptions.ClientError as e:
            status, code = e.response["ResponseMetadata"]["HTTPStatusCode"], e.response["Error"]["Code"]
            if status != 409:
                stop(1, f"write failed key={key} status={status} code={code}")
            say(f"write refused key={key} status=409 code={code}")
            stop(4, "lease_lost reason=fenced")
        say(f"wrote key={key} token={token}")
    elif kind == "sleep":
        end = time.monotonic() + int(arg) / 1000
        while time.monotonic() < end:
            if not lease.held():
                stop(5, f"lease_lost reason={lease.lost}")
            time.sleep(TTL / 10)
    else:
        stop(2, f"unknown step: {step}")

# 3. Done: release (deletes our node), if it is still ours.
done.set()
if not lease.held():
    stop(5, f"lease_lost reason={lease.lost}")
lock.release()
stop(0, "released")
