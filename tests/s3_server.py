"""A real S3-compatible server for the tests: moto in server mode (HTTP on 127.0.0.1), not a client mock."""

from __future__ import annotations

import contextlib
import os
import socket
import uuid

S3_ENV = {"AWS_ACCESS_KEY_ID": "indknn-test", "AWS_SECRET_ACCESS_KEY": "indknn-test",
          "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def moto_server():
    """Start moto's S3 server in a thread; yields its endpoint URL with the AWS_* variables set."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in [*S3_ENV, "AWS_ENDPOINT_URL"]}
    os.environ.update(S3_ENV, AWS_ENDPOINT_URL=endpoint)
    try:
        yield endpoint
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


def new_bucket(endpoint: str, *, versioned: bool = False) -> str:
    import boto3

    name = "b-" + uuid.uuid4().hex[:12]
    s3 = boto3.client("s3", endpoint_url=endpoint, **_creds())
    s3.create_bucket(Bucket=name)
    if versioned:
        s3.put_bucket_versioning(Bucket=name, VersioningConfiguration={"Status": "Enabled"})
    return name


def raw_objects(endpoint: str, bucket: str) -> dict[str, bytes]:
    """Every object of the bucket (every version, were there any) as raw bytes, read with boto3."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, **_creds())
    out = {}
    for page in s3.get_paginator("list_object_versions").paginate(Bucket=bucket):
        for v in page.get("Versions", []):
            key = f"{v['Key']}@{v.get('VersionId')}"
            out[key] = s3.get_object(Bucket=bucket, Key=v["Key"], VersionId=v["VersionId"])["Body"].read() \
                if v.get("VersionId") not in (None, "null") else \
                s3.get_object(Bucket=bucket, Key=v["Key"])["Body"].read()
    return out


def _creds() -> dict:
    return {"aws_access_key_id": S3_ENV["AWS_ACCESS_KEY_ID"], "aws_secret_access_key": S3_ENV["AWS_SECRET_ACCESS_KEY"],
            "region_name": S3_ENV["AWS_DEFAULT_REGION"]}
