"""An S3-compatible server for tests: moto's server mode on a free loopback port, reached by
the real s3fs and boto3 clients through the environment variables botocore reads.

`s3_server()` starts one for a test session; `S3Server.bucket()` creates a fresh bucket and
returns its `s3://` URL and the environment a process needs to use it (endpoint, region,
credentials), for this process (`apply`) or for child processes (`env`).
"""

from __future__ import annotations

import logging
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import boto3
from moto.server import ThreadedMotoServer

REGION = "us-east-1"


@dataclass(frozen=True)
class S3Server:
    endpoint: str

    @property
    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_ACCESS_KEY_ID": "treadle-test",
            "AWS_SECRET_ACCESS_KEY": "treadle-test-secret",
        }

    def client(self):  # type: ignore[no-untyped-def]
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
        )

    def bucket(self, prefix: str = "artifacts") -> str:
        """A new, empty bucket; returns the artifact URL `s3://<bucket>/<prefix>`."""
        name = f"treadle-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return f"s3://{name}/{prefix}"

    def keys(self, url: str) -> list[str]:
        """Every object key under the artifact URL `url`, sorted."""
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        pages = (
            self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        )
        return sorted(item["Key"] for page in pages for item in page.get("Contents", []))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def s3_server() -> Iterator[S3Server]:
    # moto's server logs every request; the tests' output keeps to failures.
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield S3Server(f"http://127.0.0.1:{port}")
    finally:
        server.stop()
