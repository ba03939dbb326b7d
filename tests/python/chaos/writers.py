"""Writers that hand leases over constantly and write with whatever token they hold.

Each writer repeatedly takes a token for a random resource (a short lease from fencegate's lease
API, or now and then a registration of fence + 1 on the admin API), then does a few writes with
it through a random replica: PUTs of small random bodies, DELETEs and DeleteObjects. Some
writes stream their body slowly, some hang up mid-body ("cut"), some give up waiting for the
answer after sending the whole body ("timeout", shorter than the upstream wrapper's hold). Now
and then a writer stalls past its lease's TTL and carries on with its old token: the stale
writer fencegate must refuse.

Every request is a raw SigV4-signed HTTP/1.1 request on a fresh connection, carrying a unique
chaos id (`x-chaos-id`, and `x-amz-meta-chaos-id` on PUTs): fencegate forwards both, so the
checker can find each write in the upstream's commit log. Every write is recorded (see
checker.py for the fields), and so is every token a writer was given or read (`grants`: lease
grants answered 201, registrations answered 200, the fence reads before registrations), for the
checker's grant-order rule.
"""

from __future__ import annotations

import base64
import hashlib
import json
import random
import socket
import struct
import threading
import time
import urllib.parse
import xml.etree.ElementTree as ET

import requests

from fencegate_testlib import build_head, quote_resource, read_response, s3_error_code, sign_headers

LEASE_PATH = "/_fencegate/v1/leases/"
CONNECT_TIMEOUT_S = 3.0
ANSWER_TIMEOUT_S = 10.0  # a patient client; longer than any hold or stop the nemesis makes
RECORDS_MAX = 5000  # per writer: a bound on memory whatever the duration


def _close_hard(sock: socket.socket):
    """Close with a reset: the server sees the client gone at once (and no TIME_WAIT piles up)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


def send(addr: tuple, method: str, path: str, headers: dict, body: bytes, mode: str,
         rng: random.Random) -> dict:
    """Sends one signed request the way `mode` says; returns status, error, body_complete and the
    answer's body. `mode`: normal | slow | timeout | cut (see the module doc)."""
    host, port = addr
    h = dict(headers)
    if method in ("PUT", "POST"):
        h["Content-Length"] = str(len(body))
    payload = body if path.startswith(LEASE_PATH) else None  # fencegate's own endpoints: signed body
    head = build_head(method, path, sign_headers(method, host, port, path, h, payload=payload))
    out = {"status": None, "error": None, "body_complete": False, "answer": b""}
    try:
        sock = socket.create_connection(addr, timeout=CONNECT_TIMEOUT_S)
    except OSError as exc:
        out["error"] = f"connect: {type(exc).__name__}"
        return out
    try:
        sock.settimeout(ANSWER_TIMEOUT_S)
        try:
            if mode == "cut":
                sock.sendall(head + body[: max(1, len(body) // 2)])
                time.sleep(rng.uniform(0.0, 0.3))
                out["error"] = "client-cut"
                return out
            if mode == "slow":
                sock.sendall(head)
                cuts = sorted(rng.sample(range(1, len(body)), k=min(3, len(body) - 1))) if len(body) > 1 else []
                start = 0
                for end in cuts + [len(body)]:
                    time.sleep(rng.uniform(0.05, 0.25))
                    sock.sendall(body[start:end])
                    start = end
            else:
                sock.sendall(head + body)
            out["body_complete"] = True
        except OSError as exc:  # fencegate answered early (a refusal) and closed, or died
            out["error"] = f"send: {type(exc).__name__}"
        wait = rng.uniform(0.2, 1.5) if mode == "timeout" else ANSWER_TIMEOUT_S
        resp = read_response(sock, timeout=wait)
        out["status"], out["answer"] = resp.status, resp.body
        if resp.status is None:
            out["error"] = "client-timeout" if resp.error == "timeout" else f"no answer: {resp.error}"
        return out
    finally:
        _close_hard(sock)


def _deleted_and_errors(xml: bytes) -> tuple:
    """DeleteObjects' answer: (keys under <Deleted>, {key: code} under <Error>)."""
    try:
        root = ET.fromstring(xml)
    except ET.ParseError:
        return [], {}
    deleted, errors = [], {}
    for el in root:
        tag = el.tag.rsplit("}", 1)[-1]
        fields = {c.tag.rsplit("}", 1)[-1]: (c.text or "") for c in el}
        if tag == "Deleted" and "Key" in fields:
            deleted.append(fields["Key"])
        elif tag == "Error" and "Key" in fields:
            errors[fields["Key"]] = fields.get("Code", "")
    return deleted, errors


class Writer(threading.Thread):
    """One worker: lease, write, sometimes stall, repeat, until `deadline` (monotonic)."""

    def __init__(self, name: str, run: str, replicas: list, bucket: str, resources: dict,
                 deadline: float, seed: int, lease_ttl_ms: int = 800):
        super().__init__(name=name, daemon=True)
        self.writer = name
        self.run_tag = run
        self.replicas = replicas  # chaos Replica handles (harness.py); read at every request
        self.bucket = bucket
        self.resources = resources  # resource -> its keys
        self.deadline = deadline
        self.rng = random.Random(seed)
        self.ttl_ms = lease_ttl_ms
        self.records: list = []
        # {resource, kind: lease | registration | read, token, t_send, t_recv, writer, replica}
        self.grants: list = []
        self.counts = {"leases": 0, "registrations": 0, "lease_busy": 0, "stalls": 0}
        self.n = 0
        self.failure: BaseException | None = None

    # helpers ----------------------------------------------------------------------------
    def replica(self):
        live = [r for r in self.replicas if r.state != "down"]
        return self.rng.choice(live or self.replicas)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self):
        try:
            while self.left() > 0 and len(self.records) < RECORDS_MAX:
                self.round()
        except BaseException as exc:  # noqa: BLE001 - reported by the harness
            self.failure = exc

    # a round: take a token, write with it ------------------------------------------------
    def round(self):
        resource = self.rng.choice(sorted(self.resources))
        token, lease_id = self.take_token(resource)
        if token is None:
            time.sleep(self.rng.uniform(0.02, 0.2))
            return
        stalled = False
        for _ in range(self.rng.randint(2, 5)):
            if self.left() <= 0:
                break
            if self.rng.random() < 0.12:
                # A GC pause or VM suspend: the lease expires meanwhile; the token is kept.
                self.counts["stalls"] += 1
                stalled = True
                time.sleep(self.ttl_ms / 1000 + self.rng.uniform(0.1, 1.0))
            self.write(resource, token, stalled)
        if lease_id is not None and not stalled and self.rng.random() < 0.5:
            self.lease_call("DELETE", resource, "", {"lease_id": lease_id})

    def take_token(self, resource: str):
        """(token, lease id): a lease grant (the grant raises the fence), or one time in five a
        registration of the fence + 1 on the admin API. (None, None) if neither worked."""
        if self.rng.random() < 0.2:
            r = self.replica()
            try:
                t_get = time.monotonic()
                got = requests.get(f"{r.admin_url}/v1/fences/{quote_resource(resource)}", timeout=2)
                current = got.json()["token"] if got.status_code == 200 else 0 if got.status_code == 404 else None
                if current is None:
                    return None, None
                self._grant(resource, "read", current, t_get, r.name)
                t_put = time.monotonic()
                put = requests.put(f"{r.admin_url}/v1/fences/{quote_resource(resource)}",
                                   json={"token": current + 1}, timeout=5)
            except (requests.RequestException, ValueError, KeyError):
                return None, None
            if put.status_code == 200:
                self.counts["registrations"] += 1
                self._grant(resource, "registration", current + 1, t_put, r.name)
                return current + 1, None
            return None, None
        for _attempt in range(3):
            t_send = time.monotonic()
            status, doc, name = self.lease_call("POST", resource, "",
                                                {"holder": self.writer, "ttl_ms": self.ttl_ms})
            if status == 201:
                self.counts["leases"] += 1
                self._grant(resource, "lease", int(doc["token"]), t_send, name)
                return int(doc["token"]), doc["lease_id"]
            if status != 409 or self.left() <= 0:
                return None, None
            self.counts["lease_busy"] += 1
            time.sleep(min(int(doc.get("remaining_ms", 200)), 600) / 1000 + 0.01)
        return None, None

    def _grant(self, resource: str, kind: str, token: int, t_send: float, replica: str):
        if len(self.grants) < RECORDS_MAX:
            self.grants.append({"resource": resource, "kind": kind, "token": token,
                                "t_send": t_send, "t_recv": time.monotonic(),
                                "writer": self.writer, "replica": replica})

    def lease_call(self, method: str, name: str, suffix: str, payload: dict):
        """(status, answer document, the replica's name)."""
        r = self.replica()
        path = LEASE_PATH + urllib.parse.quote(name, safe="/-._~") + suffix
        body = json.dumps(payload).encode()
        res = send(r.s3_addr, method, path, {"Content-Type": "application/json"}, body, "normal",
                   self.rng)
        try:
            doc = json.loads(res["answer"] or b"{}")
        except ValueError:
            doc = {}
        return res["status"], doc if isinstance(doc, dict) else {}, r.name

    # one write ---------------------------------------------------------------------------
    def write(self, resource: str, token: int, stale: bool):
        keys = self.resources[resource]
        x = self.rng.random()
        op = "put" if x < 0.62 else "delete" if x < 0.84 else "delete_objects"
        if op == "delete_objects":
            chosen = sorted(self.rng.sample(keys, k=self.rng.randint(1, min(3, len(keys)))))
        else:
            chosen = [self.rng.choice(keys)]
        if op == "delete":
            mode = self.rng.choices(["normal", "timeout"], [0.7, 0.3])[0]
        else:
            mode = self.rng.choices(["normal", "slow", "timeout", "cut"], [0.5, 0.15, 0.22, 0.13])[0]
        self.n += 1
        chaos_id = f"{self.run_tag}-{self.writer}-{self.n}"
        headers = {"Fencing-Token": str(token), "x-chaos-id": chaos_id}
        body = b""
        if op == "put":
            method, path = "PUT", f"/{self.bucket}/{chosen[0]}"
            headers["x-amz-meta-chaos-id"] = chaos_id
            headers["Content-Type"] = "application/octet-stream"
            body = f"{chaos_id} token {token}\n".encode() + self.rng.randbytes(self.rng.randint(32, 4096))
        elif op == "delete":
            method, path = "DELETE", f"/{self.bucket}/{chosen[0]}"
        else:
            method, path = "POST", f"/{self.bucket}?delete"
            objects = "".join(f"<Object><Key>{k}</Key></Object>" for k in chosen)
            body = (f'<?xml version="1.0" encoding="UTF-8"?><Delete>{objects}'
                    "<Quiet>false</Quiet></Delete>").encode()
            headers["Content-MD5"] = base64.b64encode(hashlib.md5(body).digest()).decode()
            headers["Content-Type"] = "application/xml"
        r = self.replica()
        record = {
            "id": chaos_id, "writer": self.writer, "replica": r.name, "resource": resource,
            "op": op, "bucket": self.bucket, "keys": chosen, "token": token, "mode": mode,
            "stale_writer": stale, "t_start": time.monotonic(),
        }
        res = send(r.s3_addr, method, path, headers, body, mode, self.rng)
        record["t_end"] = time.monotonic()
        status = res["status"]
        record.update(status=status, error=res["error"], body_complete=res["body_complete"],
                      code=s3_error_code(res["answer"]) if status and status >= 300 else "",
                      acked_keys=[], refused_keys={})
        if status is not None and 200 <= status < 300:
            if op == "delete_objects":
                record["acked_keys"], record["refused_keys"] = _deleted_and_errors(res["answer"])
            else:
                record["acked_keys"] = chosen
        self.records.append(record)
