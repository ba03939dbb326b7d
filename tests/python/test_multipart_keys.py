"""A multipart upload's id works only under the key it was started on (S3 answers 404
`NoSuchUpload` otherwise), on every upstream fencegate fronts.

Before: the local upstream (s3s-fs) and moto keep parts by the upload id alone. A writer allowed
on resource `job:reports` sent a part and the completion of another resource's upload under its
own key (`reports/x?uploadId=<the other's>`): fencegate fenced the request on `job:reports`, and
the bytes landed in `other/victim`, under the victim's stamp, past the victim's fence.
"""

from __future__ import annotations

import pytest
from botocore.exceptions import ClientError

from fencegate_testlib import unique

RULES = [{"prefix": "reports/", "resource": "job:reports"}, {"prefix": "other/", "resource": "job:other"}]


def refused(call) -> tuple:
    with pytest.raises(ClientError) as info:
        call()
    e = info.value.response
    return e["ResponseMetadata"]["HTTPStatusCode"], e["Error"]["Code"]


@pytest.mark.parametrize("upstream_kind", ["local", "moto"])
def test_an_upload_id_under_another_key_is_no_such_upload(fencegate, moto_server, upstream_kind):
    bucket = unique("mpk")
    rules = [dict(r, bucket=bucket) for r in RULES]
    if upstream_kind == "moto":
        # The probe finds moto keeping parts by the id alone: fencegate checks the pair itself.
        moto_server.client().create_bucket(Bucket=bucket)
        fg = fencegate(upstream=dict(moto_server.upstream_config(), probe_bucket=bucket),
                       config={"fencing": {"rules": rules}})
        assert "checks each multipart step's key" in fg.log_tail(200)
    else:
        # The local upstream refuses the pair on its own (the probe finds it tied).
        fg = fencegate(config={"fencing": {"rules": rules}, "upstream": {"probe_bucket": bucket}},
                       local_buckets=(bucket,))
        assert "checks each multipart step's key" not in fg.log_tail(200)
    victim = fg.client(token=100)
    victim.put_object(Bucket=bucket, Key="other/victim", Body=b"ORIGINAL")
    upload = victim.create_multipart_upload(Bucket=bucket, Key="other/victim")["UploadId"]
    good = victim.upload_part(Bucket=bucket, Key="other/victim", UploadId=upload, PartNumber=1, Body=b"GOOD-PART")

    attacker = fg.client(token=1)  # may write job:reports, not job:other
    status, code = refused(lambda: attacker.upload_part(
        Bucket=bucket, Key="reports/x", UploadId=upload, PartNumber=1, Body=b"EVIL-PART"))
    assert (status, code) == (404, "NoSuchUpload")
    status, code = refused(lambda: attacker.complete_multipart_upload(
        Bucket=bucket, Key="reports/x", UploadId=upload,
        MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": good["ETag"]}]}))
    assert (status, code) == (404, "NoSuchUpload")
    status, code = refused(lambda: attacker.abort_multipart_upload(Bucket=bucket, Key="reports/x", UploadId=upload))
    assert (status, code) == (404, "NoSuchUpload")

    # The victim's own upload is untouched and completes as it should.
    victim.complete_multipart_upload(Bucket=bucket, Key="other/victim", UploadId=upload,
                                     MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": good["ETag"]}]})
    if upstream_kind == "moto":
        body = moto_server.client().get_object(Bucket=bucket, Key="other/victim")["Body"].read()
    else:
        body = fg.client().get_object(Bucket=bucket, Key="other/victim")["Body"].read()
    assert body == b"GOOD-PART"
    assert fg.client().head_object(Bucket=bucket, Key="other/victim")["Metadata"]["fencing-token"] == "100"
    assert fg.client().list_objects_v2(Bucket=bucket, Prefix="reports/").get("KeyCount") == 0
