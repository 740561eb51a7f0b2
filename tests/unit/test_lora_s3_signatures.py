"""`s3://` adapters against an S3 server that checks signatures (versitygw on loopback): a
wrong secret key is refused as `auth`, and the key shows up in no answer and no log record."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from pathlib import Path

import botocore.exceptions
import pytest

from dynamo.common.lora import LoRAManager, s3_source
from support.lora_adapters import adapter_files, lora_env, write_tree
from support.s3 import S3Server
from support.s3_sigv4 import sigv4_s3_server

pytestmark = pytest.mark.unit
__all__ = ["lora_env"]


@pytest.fixture
def sigv4(tmp_path: Path) -> Iterator[S3Server]:
    with sigv4_s3_server(tmp_path / "versitygw") as server:
        yield server


def test_the_server_checks_signatures(sigv4: S3Server) -> None:
    bucket = sigv4.new_bucket()
    right = sigv4.client()
    right.put_object(Bucket=bucket, Key="a/b.json", Body=b"{}")
    assert [o["Key"] for o in right.list_objects_v2(Bucket=bucket)["Contents"]] == ["a/b.json"]

    import boto3

    wrong = boto3.client(
        "s3",
        endpoint_url=sigv4.endpoint_url,
        region_name=sigv4.env["AWS_REGION"],
        aws_access_key_id=sigv4.env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key="not-the-secret",
    )
    with pytest.raises(botocore.exceptions.ClientError) as refused:
        wrong.list_objects_v2(Bucket=bucket)
    assert refused.value.response["Error"]["Code"] == "SignatureDoesNotMatch"


async def test_a_wrong_secret_is_refused_and_never_shown(
    sigv4: S3Server,
    lora_env: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    bucket = sigv4.new_bucket()
    sigv4.upload_dir(bucket, "adapters/mine", write_tree(tmp_path / "mine", adapter_files()))
    uri = f"s3://{bucket}/adapters/mine"
    sigv4.apply_env(monkeypatch)
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    monkeypatch.setattr(s3_source, "RETRY_DELAYS", (0.01, 0.01))
    canary = f"canary-{uuid.uuid4().hex}"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", canary)
    manager = LoRAManager()

    with caplog.at_level(logging.DEBUG):
        failed = await manager.download_lora(uri)
    assert (failed["status"], failed["reason"]) == ("error", "auth"), failed
    assert "AWS_SECRET_ACCESS_KEY" in failed["message"], "the message names what to check"
    assert canary not in repr(failed)
    assert caplog.records, "the S3 client logged at DEBUG"
    assert canary not in caplog.text
    assert not manager.is_cached(uri)

    # With the right key the same manager downloads it: the failure was not remembered.
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", sigv4.env["AWS_SECRET_ACCESS_KEY"])
    loaded = await manager.download_lora(uri)
    assert loaded["status"] == "success", loaded
