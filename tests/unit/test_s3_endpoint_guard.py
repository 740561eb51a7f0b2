"""The worker's run-time check of the S3 endpoint (lora.endpoint_guard): a metadata address
is refused whether written as a literal or reached through a name.

Names are resolved by a table here (a stub resolver: tests cannot control DNS); literals and
the download path's hook are real.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pytest

from dynamo.common.lora import LoRAManager
from dynamo.common.lora.endpoint_guard import check_s3_endpoint
from dynamo.common.lora.errors import REASON_UNSAFE, LoRADownloadError
from support.lora_adapters import lora_env

pytestmark = pytest.mark.unit
__all__ = ["lora_env"]

DNS = {
    "minio.storage": ["10.1.2.3"],
    "rebound.example": ["198.18.0.9", "169.254.169.254"],
    "aws6.example": ["fd00:ec2::254"],
}


async def resolve(host: str) -> Iterable[str]:
    if host not in DNS:
        raise OSError(f"no such host {host}")
    return DNS[host]


@pytest.mark.parametrize(
    "endpoint",
    [
        "http://169.254.169.254",
        "http://169.254.169.254.",
        "http://2852039166:80",
        "http://0xa9fea9fe",
        "http://[::ffff:169.254.169.254]",
        "http://[fe80::1%25eth0]",
        "http://[fd00:ec2::254]",
        "http://100.100.100.200",
        "http://metadata.google.internal.",
        "http://rebound.example:9000",
        "https://aws6.example",
    ],
)
async def test_metadata_endpoints_are_refused(endpoint: str) -> None:
    with pytest.raises(LoRADownloadError, match="link-local or cloud metadata") as refused:
        await check_s3_endpoint(endpoint, resolve)
    assert refused.value.reason == REASON_UNSAFE


@pytest.mark.parametrize(
    "endpoint",
    ["http://127.0.0.1:9000", "http://minio.storage:9000", "https://10.0.0.1", "http://nx.invalid"],
)
async def test_private_and_loopback_endpoints_pass(endpoint: str) -> None:
    await check_s3_endpoint(endpoint, resolve)


async def test_a_download_with_a_metadata_endpoint_fails_before_any_request(
    lora_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://169.254.169.254")
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    result = await LoRAManager().download_lora("s3://bucket/adapter")
    assert result["status"] == "error"
    assert result["reason"] == REASON_UNSAFE
    assert "refusing S3 endpoint http://169.254.169.254" in result["message"]
    assert "secret" not in result["message"]
