"""`file://` adapters: used in place, never copied."""

from __future__ import annotations

from pathlib import Path
from typing import Final

from dynamo.common.lora.adapter import check_no_escaping_symlinks, describe_invalid, validate_path
from dynamo.common.lora.errors import (
    REASON_BAD_URI,
    REASON_INVALID_ADAPTER,
    REASON_NOT_FOUND,
    LoRADownloadError,
)

SCHEME_PREFIX: Final = "file://"


def local_path(uri: str) -> Path:
    """The directory a `file://` URI names: the URI minus `file://` (`file:///abs` -> `/abs`)."""
    return Path(uri[len(SCHEME_PREFIX) :])


def resolve_local(uri: str) -> Path:
    """Check a `file://` adapter and return its directory (the original path, not a copy).

    Upstream returns any existing directory. Here the directory must also hold a valid
    adapter, stay within the file-count bound, and contain no symlink that points outside
    it: the path is handed to an engine that would otherwise read whatever the link targets.
    """
    if uri == SCHEME_PREFIX:
        raise LoRADownloadError(
            f"LoRA URI {uri!r} names no directory; use file:///absolute/path", REASON_BAD_URI
        )
    path = local_path(uri)
    if not path.exists():
        raise LoRADownloadError(f"Local LoRA not found: {uri}", REASON_NOT_FOUND)
    if not path.is_dir():
        raise LoRADownloadError(f"LoRA path is not a directory: {path}", REASON_INVALID_ADAPTER)
    check_no_escaping_symlinks(path, uri)
    if not validate_path(path):
        raise LoRADownloadError(
            f"{uri} is not a valid LoRA adapter: {describe_invalid(path)}", REASON_INVALID_ADAPTER
        )
    return path
