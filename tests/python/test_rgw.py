"""fencegate in front of a real Ceph RGW 16 (the `ceph_rgw` fixture, tests/python/ceph_rgw.py).

RGW 16 is an upstream the other tests only imitate: it compares a PutObject's `If-Match` with
the bare (unquoted) ETag, honours `If-None-Match: *`, and ignores `If-Match` / `If-None-Match`
on CopyObject destinations, DeleteObject and CompleteMultipartUpload (and
`x-amz-copy-source-if-match`). fencegate's start-up probe finds all of that; these tests prove
that the fenced writes then behave as documented against it, on the embedded store and on the
Redis store (several replicas' configuration: copies become a read and a conditional PUT).

Every test opens with what it proves, uses a bucket of its own, and reads the outcome from RGW
directly (`ceph_rgw.client()`), not through fencegate. Sections:
  1-7  the fenced operations, both stores (`gate`);
  G4   objects changed at RGW behind fencegate's back: the object's stamp refuses an older
       token (PutObject, and the operations whose preconditions RGW ignores), and a write whose
       precondition RGW refused is read again and retried;
  8    the start-up probe and `fencegate probe` against RGW;
  9    rclone, s3cmd and the aws CLI under `fencegate-lease run` (`tools_gate`), with the helpers
       of test_lease_tools.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from botocore.exceptions import ClientError

from fencegate_testlib import MiB, base_config, metric, metric_samples, unique
from test_classic import assert_stale
from test_lease_tools import (
    TOOL_TIMEOUT_S,
    aws_cli,
    explain,
    fence_of,
    granted_token,
    lease_cmd,
    tool_env,
    upstream_bytes,
    upstream_head,
    upstream_keys,
)
from test_probe import probe

STORES = ["embedded", "redis"]
PROBE_LINE = ("upstream enforces preconditions on PutObject; ignores them on: CopyObject, "
              "CompleteMultipartUpload, DeleteObject (If-Match sent with the bare ETag, the form this upstream compares)")
PART = 5 * MiB  # RGW's smallest part but the last (rgw_multipart_min_part_size)
TOOLS_RESOURCE = "job:tools"


# --------------------------------------------------------------------------------------------
# fixtures and helpers
# --------------------------------------------------------------------------------------------


def start_gate(request, fencegate, ceph_rgw, store: str, prefix_resource: tuple | None = None):
    """fencegate on `store` in front of RGW, with a fresh bucket made at RGW (`fg.bucket`, also
    the probe's); `prefix_resource` = (prefix, resource) binds a prefix of it to a resource.
    `fg.rgw` (and `fg.moto`, the name test_lease_tools.py's helpers read) is a client of RGW
    itself."""
    bucket = ceph_rgw.make_bucket(unique("rgw"))
    config = {}
    if store == "redis":
        redis = request.getfixturevalue("redis_server")
        config["store"] = {"kind": "redis", "url": redis.url, "path": None}
    if prefix_resource:
        prefix, resource = prefix_resource
        config["fencing"] = {"rules": [{"bucket": bucket, "prefix": prefix, "resource": resource}]}
    fg = fencegate(upstream=dict(ceph_rgw.upstream_config(), probe_bucket=bucket), config=config)
    fg.bucket = bucket
    fg.rgw = fg.moto = ceph_rgw.client()
    fg.store = store
    return fg


@pytest.fixture(params=STORES)
def gate(request, fencegate, ceph_rgw):
    """fencegate in front of RGW on the embedded store, then on the Redis store; every object is
    its own resource."""
    return start_gate(request, fencegate, ceph_rgw, request.param)


@pytest.fixture
def tools_gate(request, fencegate, ceph_rgw):
    """fencegate (embedded store) in front of RGW whose bucket's `data/` prefix is resource
    `job:tools`: the lease the tools run under."""
    return start_gate(request, fencegate, ceph_rgw, "embedded", prefix_resource=("data/", TOOLS_RESOURCE))


def at_rgw(gate, key: str) -> tuple:
    """(bytes, user metadata) of `key` read from RGW directly."""
    got = gate.rgw.get_object(Bucket=gate.bucket, Key=key)
    return got["Body"].read(), got["Metadata"]


def rgw_status(gate, key: str) -> int:
    try:
        return gate.rgw.head_object(Bucket=gate.bucket, Key=key)["ResponseMetadata"]["HTTPStatusCode"]
    except ClientError as exc:
        return exc.response["ResponseMetadata"]["HTTPStatusCode"]


def rgw_uploads(gate) -> list:
    return gate.rgw.list_multipart_uploads(Bucket=gate.bucket).get("Uploads", [])


def status(resp: dict) -> int:
    return resp["ResponseMetadata"]["HTTPStatusCode"]


def conflicts(gate) -> dict:
    """`fencegate_precondition_conflicts_total` by result: the upstream's refusals of fencegate's
    own preconditions, and what fencegate made of each."""
    samples = metric_samples(gate)
    return {r: metric(samples, "fencegate_precondition_conflicts_total", result=r) for r in ("retried", "stale")}


def multipart(client, bucket: str, key: str, parts: list) -> tuple:
    """Create, upload `parts`, complete; (upload id, the completion's answer)."""
    upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    done = [{"PartNumber": n, "ETag": client.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=n,
                                                          Body=body)["ETag"]}
            for n, body in enumerate(parts, start=1)]
    return upload, client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload,
                                                    MultipartUpload={"Parts": done})


# --------------------------------------------------------------------------------------------
# 1-3: PutObject
# --------------------------------------------------------------------------------------------


def test_classic_scenario(gate):
    """Worker B (token 12) overwrites worker A's object (token 11); A, woken late, gets 409
    FencingTokenStale with Fencing-Token-Current: 12, and RGW keeps B's bytes stamped 12."""
    key = "report.csv"
    a, b = gate.client(token=11), gate.client(token=12)
    a.put_object(Bucket=gate.bucket, Key=key, Body=b"A's first write")
    assert at_rgw(gate, key) == (b"A's first write", {"fencing-token": "11"})
    b.put_object(Bucket=gate.bucket, Key=key, Body=b"B's data")
    with pytest.raises(ClientError) as refused:
        a.put_object(Bucket=gate.bucket, Key=key, Body=b"A woke up late")
    assert_stale(refused, 12)
    assert at_rgw(gate, key) == (b"B's data", {"fencing-token": "12"})


def test_overwrites_by_the_same_token_a_newer_token_and_with_metadata(gate):
    """Overwrites of an existing key at RGW (each sent with the bare ETag RGW compares) are 200:
    by the token that wrote it, by a newer token, and with user metadata and a content type;
    after each RGW holds the newest bytes stamped with the writer's token, and fencegate's ETag
    is RGW's."""
    key = "ledger/2026.csv"
    writes = [
        (5, b"first", {}),
        (5, b"second, same token", {}),
        (6, b"third, newer token", {}),
        (6, b"fourth, with metadata", {"owner": "worker-b", "batch": "42"}),
        (7, b"fifth, newer token with metadata", {"owner": "worker-c"}),
    ]
    for token, body, metadata in writes:
        resp = gate.client(token=token).put_object(Bucket=gate.bucket, Key=key, Body=body, Metadata=metadata,
                                                   ContentType="text/csv")
        assert status(resp) == 200, resp
        assert at_rgw(gate, key) == (body, {**metadata, "fencing-token": str(token)}), (token, body)
        head = gate.rgw.head_object(Bucket=gate.bucket, Key=key)
        assert (resp["ETag"], head["ContentType"]) == (head["ETag"], "text/csv")


def test_a_stale_overwrite_is_refused_and_rgw_keeps_the_newer_bytes(gate):
    """After token 7 overwrote a key, token 6 is refused 409 (as a `Fencing-Token` header and as
    `x-amz-meta-fencing-token` metadata, with and without a body already at RGW); RGW's object
    is unchanged, byte for byte and ETag for ETag."""
    key = "state.json"
    gate.client(token=6).put_object(Bucket=gate.bucket, Key=key, Body=b'{"by": 6}')
    gate.client(token=7).put_object(Bucket=gate.bucket, Key=key, Body=b'{"by": 7}')
    before = gate.rgw.head_object(Bucket=gate.bucket, Key=key)["ETag"]
    with pytest.raises(ClientError) as refused:
        gate.client(token=6).put_object(Bucket=gate.bucket, Key=key, Body=b'{"by": 6, "late": true}')
    assert_stale(refused, 7)
    with pytest.raises(ClientError) as refused:
        gate.client().put_object(Bucket=gate.bucket, Key=key, Body=b"stale metadata token",
                                 Metadata={"fencing-token": "6"})
    assert_stale(refused, 7)
    assert at_rgw(gate, key) == (b'{"by": 7}', {"fencing-token": "7"})
    assert gate.rgw.head_object(Bucket=gate.bucket, Key=key)["ETag"] == before


# --------------------------------------------------------------------------------------------
# 4: CopyObject (RGW ignores preconditions on copy destinations: the gate orders them; on a
#    shared store fencegate copies by a read and a conditional PUT)
# --------------------------------------------------------------------------------------------


def test_copy_onto_an_existing_key_is_fenced(gate):
    """CopyObject onto an existing key with a newer token replaces it at RGW with the source's
    bytes, content type and metadata, stamped with the copier's token; a copy with the older
    token is then refused 409 and RGW keeps the newer copy."""
    src, dst = "src.txt", "dst.txt"
    gate.client(token=5).put_object(Bucket=gate.bucket, Key=src, Body=b"source bytes", ContentType="text/plain",
                                    Metadata={"owner": "a"})
    gate.client(token=5).put_object(Bucket=gate.bucket, Key=dst, Body=b"old destination")
    source = {"Bucket": gate.bucket, "Key": src}

    resp = gate.client(token=6).copy_object(Bucket=gate.bucket, Key=dst, CopySource=source)
    assert status(resp) == 200 and resp["CopyObjectResult"]["ETag"], resp
    assert at_rgw(gate, dst) == (b"source bytes", {"owner": "a", "fencing-token": "6"})
    assert gate.rgw.head_object(Bucket=gate.bucket, Key=dst)["ContentType"] == "text/plain"

    with pytest.raises(ClientError) as refused:
        gate.client(token=5).copy_object(Bucket=gate.bucket, Key=dst, CopySource=source,
                                         MetadataDirective="REPLACE", Metadata={"owner": "stale"})
    assert_stale(refused, 6)
    assert at_rgw(gate, dst) == (b"source bytes", {"owner": "a", "fencing-token": "6"})


# --------------------------------------------------------------------------------------------
# 5: multipart uploads
# --------------------------------------------------------------------------------------------


def test_multipart_upload_overwrites_an_existing_key(gate):
    """A multipart upload (create, two parts, complete) with a newer token replaces an object
    an older token wrote: RGW holds the parts' bytes as one 2-part object stamped with the
    newer token."""
    key = "big.bin"
    gate.client(token=5).put_object(Bucket=gate.bucket, Key=key, Body=b"small, by 5")
    parts = [os.urandom(PART), os.urandom(1234)]
    _, done = multipart(gate.client(token=6), gate.bucket, key, parts)
    assert status(done) == 200, done
    assert at_rgw(gate, key) == (b"".join(parts), {"fencing-token": "6"})
    # RGW 16's own CompleteMultipartUploadResult has an empty <ETag>: read the object's.
    etag = gate.rgw.head_object(Bucket=gate.bucket, Key=key)["ETag"]
    assert etag.strip('"').endswith("-2"), etag


def test_a_multipart_object_is_overwritten_by_put_and_by_multipart(gate):
    """A multipart object's ETag (`<md5>-2`) is a precondition RGW compares too: PutObject with
    the same token, then another multipart upload with a newer token, each replace it at RGW."""
    key = "again.bin"
    first = [os.urandom(PART), b"tail one"]
    multipart(gate.client(token=5), gate.bucket, key, first)
    resp = gate.client(token=5).put_object(Bucket=gate.bucket, Key=key, Body=b"put over a multipart object")
    assert status(resp) == 200, resp
    assert at_rgw(gate, key) == (b"put over a multipart object", {"fencing-token": "5"})
    multipart(gate.client(token=6), gate.bucket, key, first)
    third = [os.urandom(PART), b"tail three"]
    _, done = multipart(gate.client(token=6), gate.bucket, key, third)
    assert status(done) == 200, done
    assert at_rgw(gate, key) == (b"".join(third), {"fencing-token": "6"})


# --------------------------------------------------------------------------------------------
# 6: DeleteObject and DeleteObjects (RGW ignores If-Match on deletes: the gate orders them)
# --------------------------------------------------------------------------------------------


def test_delete_object_stale_refused_current_removes(gate):
    """On an existing key: a DeleteObject with an older token is refused 409 and the object
    stays at RGW; one with the current token removes it from RGW (204)."""
    key = "to-delete"
    gate.client(token=11).put_object(Bucket=gate.bucket, Key=key, Body=b"by 11")
    gate.client(token=12).put_object(Bucket=gate.bucket, Key=key, Body=b"by 12")
    with pytest.raises(ClientError) as refused:
        gate.client(token=11).delete_object(Bucket=gate.bucket, Key=key)
    assert_stale(refused, 12)
    assert at_rgw(gate, key) == (b"by 12", {"fencing-token": "12"})
    resp = gate.client(token=12).delete_object(Bucket=gate.bucket, Key=key)
    assert status(resp) == 204, resp
    assert rgw_status(gate, key) == 404


def test_delete_objects_answers_per_key(gate):
    """DeleteObjects with token 11 over keys fenced at 12 (stale), written by 11 (current), by 5
    (older: 11 advances their fences) and absent: the stale key comes back as a per-key
    FencingTokenStale error and stays at RGW, every other key is deleted from RGW."""
    writes = {"fenced": 12, "current": 11, "older": 5}
    for key, token in writes.items():
        gate.client(token=token).put_object(Bucket=gate.bucket, Key=key, Body=f"by {token}".encode())
    resp = gate.client(token=11).delete_objects(
        Bucket=gate.bucket, Delete={"Objects": [{"Key": k} for k in ("fenced", "current", "older", "absent")]})
    assert status(resp) == 200, resp
    errors = {e["Key"]: e["Code"] for e in resp.get("Errors", [])}
    deleted = {d["Key"] for d in resp.get("Deleted", [])}
    assert (errors, deleted) == ({"fenced": "FencingTokenStale"}, {"current", "older", "absent"}), resp
    assert at_rgw(gate, "fenced") == (b"by 12", {"fencing-token": "12"})
    for key in ("current", "older", "absent"):
        assert rgw_status(gate, key) == 404, key
    assert [o["Key"] for o in gate.rgw.list_objects_v2(Bucket=gate.bucket).get("Contents", [])] == ["fenced"]


# --------------------------------------------------------------------------------------------
# 7: a superseded upload (RGW ignores preconditions on completions: the gate refuses it)
# --------------------------------------------------------------------------------------------


def test_the_completion_of_a_superseded_upload_is_refused(gate):
    """An upload started and filled under token 5 cannot complete after token 6 wrote the key:
    409 FencingTokenStale, and RGW keeps token 6's bytes."""
    key = "superseded.bin"
    old = gate.client(token=5)
    upload = old.create_multipart_upload(Bucket=gate.bucket, Key=key)["UploadId"]
    part = old.upload_part(Bucket=gate.bucket, Key=key, UploadId=upload, PartNumber=1, Body=os.urandom(PART))
    gate.client(token=6).put_object(Bucket=gate.bucket, Key=key, Body=b"token 6's bytes")
    with pytest.raises(ClientError) as refused:
        old.complete_multipart_upload(Bucket=gate.bucket, Key=key, UploadId=upload,
                                      MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]})
    assert_stale(refused, 6)
    assert at_rgw(gate, key) == (b"token 6's bytes", {"fencing-token": "6"})
    assert [u["UploadId"] for u in rgw_uploads(gate)] == [upload]


def test_the_creator_aborts_its_superseded_upload(gate):
    """The token-5 creator of a superseded upload may still abort it (its parts go from RGW),
    while token 6's object stays."""
    key = "abandoned.bin"
    old = gate.client(token=5)
    upload = old.create_multipart_upload(Bucket=gate.bucket, Key=key)["UploadId"]
    old.upload_part(Bucket=gate.bucket, Key=key, UploadId=upload, PartNumber=1, Body=b"part of 5")
    gate.client(token=6).put_object(Bucket=gate.bucket, Key=key, Body=b"token 6's bytes")
    resp = old.abort_multipart_upload(Bucket=gate.bucket, Key=key, UploadId=upload)
    assert status(resp) == 204, resp
    assert rgw_uploads(gate) == []
    assert at_rgw(gate, key) == (b"token 6's bytes", {"fencing-token": "6"})


# --------------------------------------------------------------------------------------------
# G4 against RGW: objects changed at RGW behind fencegate's back (the store-side check, and
#    the retry with a fresh precondition after RGW refused one)
# --------------------------------------------------------------------------------------------


def test_an_object_stamped_newer_at_rgw_refuses_an_older_token(gate):
    """G4 against RGW: an object rewritten at RGW behind fencegate's back, stamped 9, refuses a
    token-8 write that the fence (7) alone would admit: RGW answers fencegate's `If-Match` with
    412, fencegate re-reads the object, finds the newer stamp and answers 409; RGW's object
    stays."""
    key = "behind-its-back"
    gate.client(token=7).put_object(Bucket=gate.bucket, Key=key, Body=b"by 7 through fencegate")
    gate.rgw.put_object(Bucket=gate.bucket, Key=key, Body=b"by 9, straight at RGW", Metadata={"fencing-token": "9"})
    before = conflicts(gate)
    with pytest.raises(ClientError) as refused:
        gate.client(token=8).put_object(Bucket=gate.bucket, Key=key, Body=b"by 8, too late")
    assert_stale(refused, 9)
    assert at_rgw(gate, key) == (b"by 9, straight at RGW", {"fencing-token": "9"})
    after = conflicts(gate)
    assert after["stale"] - before["stale"] == 1, (before, after)


@pytest.mark.parametrize("op", ["copy", "delete", "delete_objects"])
def test_an_object_stamped_newer_at_rgw_refuses_an_older_copy_or_delete(gate, op):
    """G4 on the operations whose preconditions RGW ignores: an object stamped 9 at RGW that
    the fence store never saw (lost state, another path; README G4 and the failover table of
    docs/operations.md) refuses a token-8 CopyObject onto it, DeleteObject of it and
    DeleteObjects naming it, though fencegate last saw the object as token 7's: 409 (a per-key
    FencingTokenStale error for DeleteObjects), and RGW keeps 9's object."""
    key = "stamped-newer"
    gate.client(token=7).put_object(Bucket=gate.bucket, Key="src", Body=b"source by 7")
    gate.client(token=7).put_object(Bucket=gate.bucket, Key=key, Body=b"by 7 through fencegate")
    gate.rgw.put_object(Bucket=gate.bucket, Key=key, Body=b"by 9, straight at RGW", Metadata={"fencing-token": "9"})
    stale = gate.client(token=8)
    if op == "delete_objects":
        resp = stale.delete_objects(Bucket=gate.bucket, Delete={"Objects": [{"Key": key}]})
        errors = {e["Key"]: e["Code"] for e in resp.get("Errors", [])}
        assert (errors, resp.get("Deleted", [])) == ({key: "FencingTokenStale"}, []), resp
    else:
        with pytest.raises(ClientError) as refused:
            if op == "copy":
                stale.copy_object(Bucket=gate.bucket, Key=key, CopySource={"Bucket": gate.bucket, "Key": "src"})
            else:
                stale.delete_object(Bucket=gate.bucket, Key=key)
        assert_stale(refused, 9)
    assert at_rgw(gate, key) == (b"by 9, straight at RGW", {"fencing-token": "9"})


def test_a_write_whose_precondition_rgw_refused_is_read_again_and_retried(gate):
    """G4's retry against RGW: the object rewritten at RGW behind fencegate's back (unstamped),
    then deleted there. Each time RGW refuses the precondition fencegate sent from what it last
    saw, fencegate re-reads the object, finds no newer stamp and retries once with the fresh
    precondition (the bare ETag, then `If-None-Match: *`): the current token's write lands."""
    key = "changed-behind"
    writer = gate.client(token=7)
    writer.put_object(Bucket=gate.bucket, Key=key, Body=b"by 7")
    before = conflicts(gate)
    gate.rgw.put_object(Bucket=gate.bucket, Key=key, Body=b"by someone else, unstamped")
    assert status(writer.put_object(Bucket=gate.bucket, Key=key, Body=b"by 7 again")) == 200
    assert at_rgw(gate, key) == (b"by 7 again", {"fencing-token": "7"})
    gate.rgw.delete_object(Bucket=gate.bucket, Key=key)
    assert status(writer.put_object(Bucket=gate.bucket, Key=key, Body=b"by 7 after a delete")) == 200
    assert at_rgw(gate, key) == (b"by 7 after a delete", {"fencing-token": "7"})
    after = conflicts(gate)
    assert after["retried"] - before["retried"] == 2, (before, after)


# --------------------------------------------------------------------------------------------
# 8: the probe
# --------------------------------------------------------------------------------------------


def probe_config(tmp_path: Path, ceph_rgw, **upstream) -> dict:
    """A config whose upstream is RGW (with `upstream` keys replaced), probing a fresh bucket."""
    bucket = ceph_rgw.make_bucket(unique("probe"))
    return dict(base_config(tmp_path), upstream=dict(ceph_rgw.upstream_config(), probe_bucket=bucket, **upstream))


def assert_probe_bucket_empty(ceph_rgw, bucket: str):
    """Nothing of the probe's (objects, uploads) is left in `bucket` at RGW."""
    rgw = ceph_rgw.client()
    assert rgw.list_objects_v2(Bucket=bucket).get("KeyCount") == 0
    assert not rgw.list_multipart_uploads(Bucket=bucket).get("Uploads")


def test_probe_names_what_rgw_ignores_and_the_bare_etag(tmp_path, ceph_rgw):
    """`fencegate probe` against RGW exits 0 with one line: PutObject enforced; CopyObject,
    CompleteMultipartUpload and DeleteObject ignored; If-Match sent bare. It leaves nothing in
    the probe bucket."""
    config = probe_config(tmp_path, ceph_rgw)
    out = probe(tmp_path, config)
    assert (out.returncode, out.stdout.strip()) == (0, PROBE_LINE), out.stderr
    assert_probe_bucket_empty(ceph_rgw, config["upstream"]["probe_bucket"])


def test_probe_with_a_wrong_secret_key_could_not_run(tmp_path, ceph_rgw):
    """A wrong secret key: `fencegate probe` exits 1 saying RGW refused fencegate's credentials,
    prints nothing on stdout, and wrote nothing."""
    config = probe_config(tmp_path, ceph_rgw, secret_access_key="not-the-secret")
    out = probe(tmp_path, config)
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert "upstream probe could not run: the upstream refused fencegate's credentials" in out.stderr, out.stderr
    assert out.stdout == ""
    assert_probe_bucket_empty(ceph_rgw, config["upstream"]["probe_bucket"])


def test_serve_with_wrong_credentials_says_the_probe_could_not_run(tmp_path, fencegate, ceph_rgw):
    """`fencegate serve` (one process) with a wrong secret key starts, logs, loudly, that the
    probe could not run (not that it failed), and is not ready: /readyz names the credentials."""
    upstream = probe_config(tmp_path, ceph_rgw, secret_access_key="not-the-secret")["upstream"]
    fg = fencegate(upstream=upstream)
    log = fg.log_tail(200)
    assert "UPSTREAM PROBE COULD NOT RUN" in log, log
    assert "PRECONDITION PROBE FAILED" not in log, log
    ready = fg.admin("GET", "/readyz")
    assert ready.status_code == 503, ready.text
    assert "the upstream refuses fencegate access to the bucket" in ready.json()["detail"], ready.text
    assert_probe_bucket_empty(ceph_rgw, upstream["probe_bucket"])


@pytest.mark.parametrize("store", STORES)
def test_serve_probes_rgw_and_names_the_ignored_operations(request, fencegate, ceph_rgw, store):
    """`fencegate serve` in front of RGW starts on either store (PutObject's preconditions are
    enforced, so a shared store is allowed); its log says it sends bare ETags and names the
    operations RGW ignores; the probe bucket is left empty."""
    fg = start_gate(request, fencegate, ceph_rgw, store)
    log = fg.log_tail(200)
    assert "upstream compares a write's If-Match with the bare ETag" in log, log
    assert 'ignored="CopyObject, CompleteMultipartUpload, DeleteObject"' in log, log
    assert "PROBE FAILED" not in log and "COULD NOT RUN" not in log, log
    assert_probe_bucket_empty(ceph_rgw, fg.bucket)


# --------------------------------------------------------------------------------------------
# 9: rclone, s3cmd and the aws CLI under `fencegate-lease run`
# --------------------------------------------------------------------------------------------


@dataclass
class Tool:
    """How one unmodified tool copies a file to a key and syncs a directory to a prefix, with the
    lease credentials `fencegate-lease run` puts in its environment."""

    name: str
    gate: object
    workdir: Path

    def env(self) -> dict:
        if self.name == "rclone":
            return {"RCLONE_CONFIG": os.devnull, "RCLONE_CONFIG_FG_TYPE": "s3", "RCLONE_CONFIG_FG_PROVIDER": "Ceph",
                    "RCLONE_CONFIG_FG_ENV_AUTH": "true", "RCLONE_CONFIG_FG_ENDPOINT": self.gate.s3_url,
                    "RCLONE_CONFIG_FG_REGION": "us-east-1"}
        if self.name == "aws":
            return {"AWS_MAX_ATTEMPTS": "1", "AWS_PAGER": ""}
        return {}

    def s3cfg(self) -> Path:
        host, port = self.gate.s3_addr
        cfg = self.workdir / "s3cfg"
        # No keys: s3cmd takes the lease credential from the environment.
        cfg.write_text(f"[default]\nhost_base = {host}:{port}\nhost_bucket = {host}:{port}\nuse_https = False\n"
                       "signature_v2 = False\nbucket_location = us-east-1\nmax_retries = 1\n")
        return cfg

    def copy(self, src: Path, key: str) -> list:
        dst = f"{self.gate.bucket}/{key}"
        if self.name == "aws":
            return [aws_cli(), "s3", "cp", "--only-show-errors", str(src), f"s3://{dst}"]
        if self.name == "rclone":
            return ["rclone", "copyto", "--s3-no-check-bucket", "--retries", "1", "--low-level-retries", "1",
                    "--s3-upload-cutoff", "5M", "--s3-chunk-size", "5M", str(src), f"fg:{dst}"]
        return ["s3cmd", "-c", str(self.s3cfg()), "--no-progress", "--multipart-chunk-size-mb=5",
                "put", str(src), f"s3://{dst}"]

    def sync(self, src: Path, prefix: str) -> list:
        dst = f"{self.gate.bucket}/{prefix}"
        if self.name == "aws":
            return [aws_cli(), "s3", "sync", "--delete", "--only-show-errors", str(src), f"s3://{dst}"]
        if self.name == "rclone":
            return ["rclone", "sync", "--s3-no-check-bucket", "--retries", "1", "--low-level-retries", "1",
                    str(src), f"fg:{dst}"]
        return ["s3cmd", "-c", str(self.s3cfg()), "--no-progress", "sync", "--delete-removed",
                f"{src}/", f"s3://{dst}"]

    def run(self, command: list) -> int:
        """Runs `command` under `fencegate-lease run job:tools`; the lease's token."""
        r = subprocess.run(lease_cmd(TOOLS_RESOURCE, command=command), env=tool_env(self.gate, **self.env()),
                           cwd=self.workdir, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           timeout=TOOL_TIMEOUT_S)
        assert r.returncode == 0, explain(self.gate, r.returncode, r.stdout, r.stderr)
        return granted_token(r.stderr, TOOLS_RESOURCE)


TOOLS = ["aws", "rclone", "s3cmd"]


@pytest.fixture(params=TOOLS)
def tool(request, tools_gate, tmp_path):
    """Each tool (the aws CLI, rclone, s3cmd) against `tools_gate`."""
    if request.param != "aws" and shutil.which(request.param) is None:
        pytest.fail(f"{request.param} is not installed (apt-get install {request.param})")
    return Tool(request.param, tools_gate, tmp_path)


def assert_at_rgw(gate, files: dict, token: int):
    """Each key of `files` holds its bytes at RGW, stamped `token`."""
    for key, body in files.items():
        assert upstream_bytes(gate, key) == body, key
        assert upstream_head(gate, key)["Metadata"].get("fencing-token") == str(token), key


def test_tool_copies_files_to_rgw(tool):
    """The tool copies a small file and a 12 MiB one (in parts) to RGW through fencegate under a
    lease: RGW has both byte for byte, stamped with the lease's token."""
    gate = tool.gate
    files = {"data/copy/small.txt": b"a small file\n", "data/copy/big.bin": os.urandom(12 * MiB)}
    tokens = []
    for key, body in files.items():
        src = tool.workdir / Path(key).name
        src.write_bytes(body)
        token = tool.run(tool.copy(src, key))
        assert_at_rgw(gate, {key: body}, token)
        tokens.append(token)
    assert upstream_keys(gate, "data/") == sorted(files)
    assert tokens[1] > tokens[0] and fence_of(gate, TOOLS_RESOURCE) == tokens[1]


def test_tool_syncs_with_deletes_to_rgw(tool):
    """A sync of a directory, then a sync after files were changed, added and removed (with the
    tool's delete option): RGW ends with exactly the directory's files and bytes; the changed and
    added ones are stamped with the second lease's token, the removed ones are gone."""
    gate = tool.gate
    src = tool.workdir / "tree"
    (src / "sub").mkdir(parents=True)
    first = {"keep.txt": b"kept\n", "change.txt": b"v1\n", "gone.txt": b"to be removed\n", "sub/gone.txt": b"too\n"}
    for name, body in first.items():
        (src / name).write_bytes(body)
    token1 = tool.run(tool.sync(src, "data/tree/"))
    assert_at_rgw(gate, {f"data/tree/{n}": b for n, b in first.items()}, token1)

    (src / "gone.txt").unlink()
    (src / "sub" / "gone.txt").unlink()
    (src / "change.txt").write_bytes(b"version two, longer\n")
    (src / "sub" / "new.txt").write_bytes(b"added\n")
    token2 = tool.run(tool.sync(src, "data/tree/"))
    assert token2 > token1
    expected = {"keep.txt": b"kept\n", "change.txt": b"version two, longer\n", "sub/new.txt": b"added\n"}
    assert upstream_keys(gate, "data/") == sorted(f"data/tree/{n}" for n in expected)
    assert_at_rgw(gate, {f"data/tree/{n}": expected[n] for n in ("change.txt", "sub/new.txt")}, token2)
    assert upstream_bytes(gate, "data/tree/keep.txt") == b"kept\n"
    assert fence_of(gate, TOOLS_RESOURCE) == token2


def test_tool_overwrites_a_key_at_rgw(tool):
    """The tool overwrites a key it wrote under an earlier lease (small, then in parts): each
    time RGW has the new bytes stamped with the new lease's token."""
    gate = tool.gate
    key = "data/overwrite.bin"
    src = tool.workdir / "overwrite.bin"
    last = 0
    for body in (b"first version\n", b"second version, a bit longer\n", os.urandom(11 * MiB)):
        src.write_bytes(body)
        token = tool.run(tool.copy(src, key))
        assert token > last
        assert_at_rgw(gate, {key: body}, token)
        last = token
    assert upstream_keys(gate, "data/") == [key]
