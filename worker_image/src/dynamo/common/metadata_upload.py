"""Per-choice metadata upload: msgpack + zstd objects written through fsspec.

A request opts in with `nvext.metadata_upload = {"url": "<fs url>"}` (or the same under
`extra_args.nvext`). Each choice's metadata is written to `choice_<i>.msgpack.zst` under
that URL as `zstd(msgpack({"schema_version": 1, "metadata": ...}))`. Tensors and numpy
arrays become `{"type", "dtype", "shape", "data"}` maps with raw little-endian bytes.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass
from typing import Any, Final

SCHEMA_VERSION: Final = 1


def _backend_metadata_upload_settings(request: dict[str, Any]) -> dict[str, Any] | None:
    """The first non-null `metadata_upload` object in `nvext`, then `extra_args.nvext`."""
    extra_args = request.get("extra_args") or {}
    extra_nvext = extra_args.get("nvext") if isinstance(extra_args, dict) else None
    for source in (request.get("nvext"), extra_nvext):
        if not isinstance(source, dict):
            continue
        settings = source.get("metadata_upload")
        if settings is None:
            continue
        if not isinstance(settings, dict):
            raise ValueError("metadata_upload must be an object")
        return settings
    return None


def _tensor_to_payload(value: Any) -> dict[str, Any] | None:
    """A torch tensor as a payload map, or None when `value` is not one."""
    # A tensor can only exist once torch is imported, so never pay for importing it here.
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(value, torch.Tensor):
        return None
    tensor = value.detach().cpu().contiguous()
    try:
        data = tensor.numpy().tobytes()
    except TypeError:
        # dtypes numpy lacks (bfloat16, float8) are shipped as their raw bytes.
        data = tensor.view(torch.uint8).numpy().tobytes()
    return {
        "type": "tensor",
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "shape": list(tensor.shape),
        "data": data,
    }


def _ndarray_to_payload(value: Any) -> dict[str, Any] | None:
    np = sys.modules.get("numpy")
    if np is None or not isinstance(value, np.ndarray):
        return None
    array = np.ascontiguousarray(value)
    return {
        "type": "ndarray",
        "dtype": str(array.dtype),
        "shape": list(array.shape),
        "data": array.tobytes(),
    }


def _normalize_for_upload(value: Any) -> Any:
    if value is None or isinstance(value, str | int | float | bool | bytes):
        return value
    if isinstance(value, dict):
        return {key: _normalize_for_upload(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_normalize_for_upload(item) for item in value]
    for convert in (_tensor_to_payload, _ndarray_to_payload):
        payload = convert(value)
        if payload is not None:
            return payload
    return value


def _serialize_metadata(metadata: dict[str, Any]) -> bytes:
    try:
        import zstandard
    except ImportError as exc:
        raise RuntimeError(
            "Metadata upload requires zstandard; install it with `pip install zstandard`."
        ) from exc
    try:
        import msgspec
    except ImportError as exc:
        raise RuntimeError(
            "Metadata upload requires msgspec; install it with `pip install msgspec`."
        ) from exc
    payload = {"schema_version": SCHEMA_VERSION, "metadata": _normalize_for_upload(metadata)}
    return zstandard.ZstdCompressor().compress(msgspec.msgpack.encode(payload))


async def _upload_bytes(url: str, storage_path: str, data: bytes) -> str:
    try:
        from dynamo.common.storage import get_fs, upload_to_fs
    except ImportError as exc:
        raise RuntimeError(
            "Metadata upload requires fsspec; install fsspec and the backend extra, "
            "for example `fsspec[s3]` for S3."
        ) from exc
    return await upload_to_fs(get_fs(url), storage_path, data)


@dataclass(frozen=True)
class MetadataUploader:
    """Uploads each choice's metadata under `url` (any fsspec URL)."""

    url: str

    def __post_init__(self) -> None:
        if not isinstance(self.url, str):
            raise ValueError("metadata_upload.url must be a string")
        url = self.url.strip()
        if not url:
            raise ValueError("metadata_upload.url must not be empty")
        object.__setattr__(self, "url", url)

    @classmethod
    def from_settings(cls, settings: dict[str, Any] | None) -> MetadataUploader | None:
        """Build from a `metadata_upload` object; None when there is none.

        Only `url` is accepted; the alphabetically first unknown key is reported.
        """
        if settings is None:
            return None
        if not isinstance(settings, dict):
            raise ValueError("metadata_upload must be an object")
        unexpected = settings.keys() - {"url"}
        if unexpected:
            raise ValueError(f"metadata_upload.{min(unexpected)} is not supported")
        if "url" not in settings:
            raise ValueError("metadata_upload.url is required")
        return cls(url=settings["url"])

    @classmethod
    def from_backend_request(cls, request: dict[str, Any]) -> MetadataUploader | None:
        """Build from a backend request's `nvext` (or `extra_args.nvext`) settings."""
        return cls.from_settings(_backend_metadata_upload_settings(request))

    async def upload_choice(self, choice_index: int, metadata: dict[str, Any]) -> None:
        """Write `choice_<choice_index>.msgpack.zst`; empty metadata writes nothing."""
        if not metadata:
            return
        data = await asyncio.to_thread(_serialize_metadata, metadata)
        await _upload_bytes(self.url, f"choice_{choice_index}.msgpack.zst", data)
