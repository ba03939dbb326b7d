"""pytest plugin: every botocore client that ceph/s3-tests creates sends `Fencing-Token`.

Loaded by scripts/s3-tests-differential with `-p s3tests_token_plugin` (this directory on
PYTHONPATH) in its "fencegate-token" mode. It wraps `botocore.session.Session.create_client`,
through which every `boto3.client`, `boto3.resource` and `botocore.session` client passes, and
registers on each new S3 client the same `before-sign.s3.*` handler as the README's boto3
example: the header is set on every request except presigned ones (a header added while
presigning would be signed into the URL). Requests s3-tests makes with `requests` (POST
policies, raw HTTP, presigned URLs) carry no token.

Environment: FENCING_TOKEN (default 1), FENCING_TOKEN_HEADER (default Fencing-Token).
"""

from __future__ import annotations

import os

import botocore.session

TOKEN = os.environ.get("FENCING_TOKEN", "1")
HEADER = os.environ.get("FENCING_TOKEN_HEADER", "Fencing-Token")


def add_fencing_token(request, signature_version="", **_):
    del request.headers[HEADER]  # no-op when absent; a retry signs again
    if not str(signature_version).endswith(("-query", "-presign-post")):
        request.headers[HEADER] = TOKEN


_original_create_client = botocore.session.Session.create_client


def _create_client(self, service_name, *args, **kwargs):
    client = _original_create_client(self, service_name, *args, **kwargs)
    if service_name == "s3":
        client.meta.events.register("before-sign.s3.*", add_fencing_token,
                                    unique_id="fencegate-s3tests-token")
    return client


botocore.session.Session.create_client = _create_client


def pytest_report_header(config):
    return f"s3tests_token_plugin: {HEADER}: {TOKEN} on every botocore S3 request"
