"""`MetadataUploader`: settings parsing, payload format, and round trips through fsspec."""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path
from typing import Any

import fsspec
import msgspec
import numpy as np
import pytest
import torch
import zstandard

from dynamo.common.metadata_upload import MetadataUploader
from support.s3 import S3Server

pytestmark = pytest.mark.unit


def decode_object(raw: bytes) -> Any:
    return msgspec.msgpack.decode(zstandard.ZstdDecompressor().decompress(raw))


def test_settings_from_nvext_then_extra_args() -> None:
    request: dict[str, Any] = {"nvext": {"metadata_upload": {"url": " s3://bucket/rollouts "}}}
    uploader = MetadataUploader.from_backend_request(request)
    assert uploader == MetadataUploader("s3://bucket/rollouts")  # stripped

    request = {"extra_args": {"nvext": {"metadata_upload": {"url": "file:///tmp/x"}}}}
    assert MetadataUploader.from_backend_request(request) == MetadataUploader("file:///tmp/x")

    # nvext wins; a null nvext value falls through to extra_args.
    both: dict[str, Any] = {
        "nvext": {"metadata_upload": {"url": "memory://a"}},
        "extra_args": {"nvext": {"metadata_upload": {"url": "memory://b"}}},
    }
    assert MetadataUploader.from_backend_request(both) == MetadataUploader("memory://a")
    both["nvext"] = {"metadata_upload": None}
    assert MetadataUploader.from_backend_request(both) == MetadataUploader("memory://b")


@pytest.mark.parametrize(
    "request_",
    [
        {},
        {"nvext": None},
        {"nvext": {}},
        {"nvext": {"metadata_upload": None}},
        {"extra_args": "not a dict"},
        {"extra_args": {"nvext": {"other": 1}}},
    ],
)
def test_no_settings_means_no_uploader(request_: dict[str, Any]) -> None:
    assert MetadataUploader.from_backend_request(request_) is None


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({}, "metadata_upload.url is required"),
        ({"url": ""}, "metadata_upload.url must not be empty"),
        ({"url": "   "}, "metadata_upload.url must not be empty"),
        ({"url": 1}, "metadata_upload.url must be a string"),
        ("invalid", "metadata_upload must be an object"),
        ({"url": "s3://b/r", "format": "json"}, "metadata_upload.format is not supported"),
        # The alphabetically first unexpected key is the one reported.
        ({"url": "s3://b/r", "zeta": 1, "alpha": 2}, "metadata_upload.alpha is not supported"),
    ],
)
def test_invalid_settings(settings: Any, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        MetadataUploader.from_backend_request({"nvext": {"metadata_upload": settings}})


def test_from_settings_none() -> None:
    assert MetadataUploader.from_settings(None) is None


async def test_round_trip_through_memory_filesystem() -> None:
    root = f"memory://meta-{uuid.uuid4().hex[:8]}/run"
    uploader = MetadataUploader(root)
    metadata = {
        "tokens": [1, 2, 3],
        "nested": {"ok": True, "score": 0.5, "none": None, "raw": b"\x00\x01"},
        "pair": (4, "five"),
    }
    await uploader.upload_choice(2, metadata)
    with fsspec.open(f"{root}/choice_2.msgpack.zst", "rb") as handle:
        payload = decode_object(handle.read())
    assert payload == {
        "schema_version": 1,
        "metadata": {
            "tokens": [1, 2, 3],
            "nested": {"ok": True, "score": 0.5, "none": None, "raw": b"\x00\x01"},
            "pair": [4, "five"],
        },
    }


async def test_round_trip_through_local_files_with_arrays_and_tensors(tmp_path: Path) -> None:
    uploader = MetadataUploader((tmp_path / "out").as_uri())
    array = np.arange(12, dtype=np.int16).reshape(3, 4)[:, ::2]  # non-contiguous view
    tensor = torch.arange(6, dtype=torch.float32).reshape(2, 3).t()  # non-contiguous
    bf16 = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)  # numpy has no bfloat16
    await uploader.upload_choice(0, {"array": array, "tensor": tensor, "bf16": bf16})

    payload = decode_object((tmp_path / "out" / "choice_0.msgpack.zst").read_bytes())
    meta = payload["metadata"]
    assert meta["array"]["type"] == "ndarray"
    assert meta["array"]["dtype"] == "int16"
    assert meta["array"]["shape"] == [3, 2]
    restored = np.frombuffer(meta["array"]["data"], dtype=np.int16).reshape(3, 2)
    np.testing.assert_array_equal(restored, array)

    assert meta["tensor"]["type"] == "tensor"
    assert meta["tensor"]["dtype"] == "float32"
    assert meta["tensor"]["shape"] == [3, 2]
    values = np.frombuffer(meta["tensor"]["data"], dtype=np.float32).reshape(3, 2)
    np.testing.assert_array_equal(values, tensor.numpy())

    assert meta["bf16"]["dtype"] == "bfloat16"
    raw = torch.frombuffer(bytearray(meta["bf16"]["data"]), dtype=torch.bfloat16)
    assert torch.equal(raw, bf16)


async def test_empty_metadata_writes_nothing(tmp_path: Path) -> None:
    await MetadataUploader(tmp_path.as_uri()).upload_choice(0, {})
    assert os.listdir(tmp_path) == []


async def test_round_trip_through_s3(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    s3_server.apply_env(monkeypatch)
    bucket = s3_server.new_bucket("meta")
    await MetadataUploader(f"s3://{bucket}/rollouts/r1").upload_choice(1, {"k": "v"})
    obj = s3_server.client().get_object(Bucket=bucket, Key="rollouts/r1/choice_1.msgpack.zst")
    assert decode_object(obj["Body"].read()) == {"schema_version": 1, "metadata": {"k": "v"}}
