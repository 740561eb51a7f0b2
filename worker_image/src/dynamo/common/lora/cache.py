"""Where downloaded adapters live: the cache root and the URI-to-directory-name rule."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

from dynamo.common.lora.errors import REASON_BAD_URI, LoRADownloadError

CACHE_PATH_ENV: Final = "DYN_LORA_PATH"
#: One directory-name component; longer names fail on common file systems.
_MAX_KEY_BYTES: Final = 255


def default_cache_root() -> Path:
    """`DYN_LORA_PATH`, else `<home>/.cache/dynamo_loras` where home is `HOME`, else
    `USERPROFILE`, else `/tmp`. Nothing is created here."""
    configured = os.environ.get(CACHE_PATH_ENV)
    if configured:
        return Path(configured)
    home = os.environ.get("HOME") or os.environ.get("USERPROFILE") or "/tmp"
    return Path(home) / ".cache" / "dynamo_loras"


def uri_to_cache_key(uri: str) -> str:
    """The cache directory name for `uri`, as upstream computes it.

    `://` becomes `__`, then every `/`, `\\` and `.` becomes `_`:
    `s3://bucket/path/to/lora` -> `s3__bucket_path_to_lora`. The result has no separators and
    no dots, so it always names a single entry directly under the cache root.
    """
    key = uri.replace("://", "__")
    for char in ("/", "\\", "."):
        key = key.replace(char, "_")
    return key


def checked_cache_key(uri: str) -> str:
    """`uri_to_cache_key`, refusing keys that cannot be a directory name (empty, NUL, too long)."""
    key = uri_to_cache_key(uri)
    if not key or "\x00" in key or len(key.encode("utf-8")) > _MAX_KEY_BYTES:
        raise LoRADownloadError(
            f"LoRA URI {uri!r} cannot name a cache directory (empty, NUL byte, or longer than "
            f"{_MAX_KEY_BYTES} bytes once encoded); use a shorter URI",
            REASON_BAD_URI,
        )
    return key
