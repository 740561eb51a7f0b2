"""A real S3-compatible server for tests: moto's server on loopback, on a free port.

`s3_server` (session-scoped, exported through tests/conftest.py) starts one server for the
whole run and yields an `S3Server`; `S3Server.env` holds the variables a client needs
(test credentials, `AWS_ENDPOINT_URL`, region). Tests apply them with `S3Server.apply_env`
(through pytest's `monkeypatch`) and create uniquely named buckets with `S3Server.new_bucket`,
so tests sharing the server never see each other's objects. `s3_server_at` describes any
S3 server the same way (`support.s3_sigv4` runs one that checks signatures, as moto does not).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from moto.server import ThreadedMotoServer

REGION = "us-east-1"


@dataclass(frozen=True)
class S3Server:
    """Where the loopback S3 server listens and how to reach it."""

    endpoint_url: str
    env: dict[str, str] = field(default_factory=dict)
    # The server's own access log (S3 server-access-log lines), where it keeps one.
    access_log: Path | None = None

    def client(self) -> Any:
        """A boto3 S3 client bound to this server."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=REGION,
            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
        )

    def new_bucket(self, prefix: str = "test") -> str:
        """Create a bucket with a unique name and return the name."""
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def put_files(self, bucket: str, prefix: str, files: dict[str, bytes]) -> None:
        """Put each of `files` (name: content) at `prefix/<name>` in `bucket`."""
        s3 = self.client()
        for name, content in files.items():
            s3.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=content)

    def upload_dir(self, bucket: str, prefix: str, root: Path) -> None:
        """Put every file below `root` at `prefix/<its path below root>` in `bucket`."""
        s3 = self.client()
        for file in sorted(root.rglob("*")):
            if file.is_file():
                key = f"{prefix}/{file.relative_to(root).as_posix()}"
                s3.put_object(Bucket=bucket, Key=key, Body=file.read_bytes())

    def apply_env(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Point default-configured S3 clients (boto3, s3fs) at this server for one test.

        Also drops s3fs's cached filesystem instances, which would otherwise keep whatever
        endpoint and credentials they were first built with.
        """
        for name, value in self.env.items():
            monkeypatch.setenv(name, value)
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
            monkeypatch.delenv(name, raising=False)
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()


def start_s3_server(host: str = "127.0.0.1") -> tuple[ThreadedMotoServer, S3Server]:
    """Start moto's server on `host` (loopback by default) with an OS-chosen port."""
    server = ThreadedMotoServer(ip_address=host, port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, s3_server_at(f"http://{host}:{port}", key="testing", secret="testing")


def s3_server_at(endpoint: str, *, key: str, secret: str) -> S3Server:
    """An `S3Server` for the server at `endpoint` that takes these credentials."""
    env = {
        "AWS_ACCESS_KEY_ID": key,
        "AWS_SECRET_ACCESS_KEY": secret,
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_REGION": REGION,
    }
    return S3Server(endpoint_url=endpoint, env=env)


# The test bed's host address: process-node pods reach it, and nothing outside the machine can.
TESTBED_HOST = "198.18.0.1"


@pytest.fixture(scope="session")
def testbed_s3_server() -> Iterator[S3Server]:
    """One moto S3 server on the test bed's host address, reachable from process-node pods
    (and from this machine); needs the test bed's network to be up."""
    server, info = start_s3_server(TESTBED_HOST)
    try:
        yield info
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One moto S3 server on loopback for the whole test session."""
    server, info = start_s3_server()
    try:
        yield info
    finally:
        server.stop()
