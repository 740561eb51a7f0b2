"""Why a LoRA download failed, as a machine-readable reason plus a message for people.

`LoRAManager.download_lora` turns a `LoRADownloadError` into
`{"status": "error", "message": <message>, "reason": <reason>}`; the `reason` values below are
stable so a caller (an engine handler, the operator) can tell the failures apart.
"""

from __future__ import annotations

import errno
from typing import Final

#: The URI cannot be parsed, uses an unknown scheme, names an empty S3 prefix, or carries
#: credentials (credentials come from the environment only).
REASON_BAD_URI: Final = "bad uri"
#: Nothing exists at the URI (no local directory, no S3 objects, no Hub repo or revision).
REASON_NOT_FOUND: Final = "not found"
#: The storage refused the credentials (missing, wrong, or without access).
REASON_AUTH: Final = "auth"
#: A request or the wait for another process's download of the same URI took too long.
REASON_TIMEOUT: Final = "timeout"
#: The files arrived but do not form a LoRA adapter (see `adapter.validate_path`).
REASON_INVALID_ADAPTER: Final = "invalid adapter"
#: The source would write outside the destination (`..`, absolute names, escaping symlinks)
#: or lists more files than `max_adapter_files()` allows.
REASON_UNSAFE: Final = "unsafe source"
#: The adapter's `adapter_digest` differs from the sha256 the caller expected.
REASON_DIGEST_MISMATCH: Final = "digest mismatch"
#: The expected sha256 passed by the caller is not 64 hexadecimal digits.
REASON_BAD_DIGEST: Final = "bad digest"
#: HF_HUB_OFFLINE is set and the adapter is not fully cached.
REASON_OFFLINE: Final = "offline"
#: Any other failure (connection refused, server error, disk full, ...).
REASON_FAILED: Final = "download failed"


class LoRADownloadError(RuntimeError):
    """A LoRA download or cache lookup failed; `reason` is one of the `REASON_*` values."""

    def __init__(self, message: str, reason: str = REASON_FAILED) -> None:
        super().__init__(message)
        self.reason = reason


def is_disk_full(exc: BaseException) -> bool:
    """True for the error of a write to a full file system (ENOSPC, or EDQUOT past a quota)."""
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def cache_full_error(exc: BaseException, uri: str) -> LoRADownloadError:
    """The error of a download that filled the LoRA cache volume."""
    return LoRADownloadError(
        f"the LoRA cache volume is full ({exc}) while fetching {uri}; the partial download was "
        "removed: free space on it or make it larger (DYN_LORA_PATH; for a DynamoWorker, "
        "spec.lora.cache.emptyDir.sizeLimit or its PersistentVolumeClaim)",
        REASON_FAILED,
    )
