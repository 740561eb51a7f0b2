"""What a LoRA adapter directory is: validation, the content digest, and safe file names.

Validation follows upstream (`validate_path`): the directory holds `adapter_config.json` and
one weights file (`adapter_model.safetensors`, `adapter_model.bin` or the TensorRT-LLM
`model.lora_weights.npy`). Names from a remote listing are checked with `safe_relative_path`
before anything is written, so a listing cannot place a file outside its destination.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Final

from dynamo.common.lora.errors import REASON_UNSAFE, LoRADownloadError

ADAPTER_CONFIG: Final = "adapter_config.json"
WEIGHT_FILES: Final = ("adapter_model.safetensors", "adapter_model.bin", "model.lora_weights.npy")

#: Written last into a finished download; a directory without it is an unfinished download.
#: Upstream writes it (content `b"1\n"`) into Hugging Face snapshots; we write it into every
#: download we make.
COMPLETE_MARKER: Final = ".dynamo_lora_complete"
COMPLETE_MARKER_BYTES: Final = b"1\n"
#: Holds the `adapter_digest` of a finished download once it has been computed.
DIGEST_RECORD: Final = ".dynamo_lora_sha256"
#: Bookkeeping files (and their temp files) start with this; a source may not provide such a
#: name (compared case-insensitively) and the digest leaves top-level ones out.
RESERVED_PREFIX: Final = ".dynamo_lora_"

#: Default bound on the number of files in one adapter. Real adapters hold a handful of
#: files; a listing with thousands is a wrong prefix (a whole bucket) or an attack.
DEFAULT_MAX_ADAPTER_FILES: Final = 1000
MAX_FILES_ENV: Final = "DYN_LORA_MAX_FILES"

_CHUNK: Final = 1 << 20


def max_adapter_files() -> int:
    """The file-count bound: `DYN_LORA_MAX_FILES` when set to a positive integer, else 1000."""
    raw = os.environ.get(MAX_FILES_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_ADAPTER_FILES
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(
            f"{MAX_FILES_ENV}={raw!r} is not an integer; set a positive integer"
        ) from None
    if value <= 0:
        raise ValueError(f"{MAX_FILES_ENV}={raw!r} must be a positive integer")
    return value


def check_file_count(count: int, where: str) -> None:
    """Refuse an adapter with more files than `max_adapter_files()`."""
    limit = max_adapter_files()
    if count > limit:
        raise LoRADownloadError(
            f"{where} holds {count} files, more than the limit of {limit} for one LoRA adapter; "
            f"point the URI at the adapter's own directory or raise {MAX_FILES_ENV}",
            REASON_UNSAFE,
        )


def validate_path(path: str | os.PathLike[str]) -> bool:
    """True when `path` is a directory with an adapter config and a weights file."""
    root = Path(path)
    if not root.is_dir() or not (root / ADAPTER_CONFIG).is_file():
        return False
    return any((root / name).is_file() for name in WEIGHT_FILES)


def is_complete(path: str | os.PathLike[str]) -> bool:
    """True when `path` validates and carries the completion marker written after download."""
    marker = Path(path) / COMPLETE_MARKER
    try:
        if marker.read_bytes() != COMPLETE_MARKER_BYTES:
            return False
    except OSError:
        return False
    return validate_path(path)


def describe_invalid(path: str | os.PathLike[str]) -> str:
    """Say which adapter file is missing from `path` (for error messages)."""
    root = Path(path)
    if not root.is_dir():
        return f"{root} is not a directory"
    if not (root / ADAPTER_CONFIG).is_file():
        return f"{root} has no {ADAPTER_CONFIG}"
    return f"{root} has none of the weight files {', '.join(WEIGHT_FILES)}"


def safe_relative_path(name: str, where: str) -> PurePosixPath:
    """Check a file name taken from a remote listing and return it as a relative path.

    Refused: empty names, absolute names (`/x`, `C:x`, `\\x`), backslashes, NUL bytes, empty,
    `.` or `..` components, and bookkeeping names (starting with `RESERVED_PREFIX`).
    """
    problem = ""
    parts = name.split("/")
    if not name:
        problem = "is empty"
    elif "\x00" in name:
        problem = "contains a NUL byte"
    elif "\\" in name:
        problem = "contains a backslash"
    elif name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        problem = "is absolute"
    elif any(part in ("", ".", "..") for part in parts):
        problem = "has an empty, '.' or '..' component"
    elif parts[-1].lower().startswith(RESERVED_PREFIX):
        problem = "is reserved for the download's bookkeeping"
    if problem:
        raise LoRADownloadError(
            f"refusing file name {name!r} from {where}: it {problem}, so it could be written "
            "outside the destination directory",
            REASON_UNSAFE,
        )
    return PurePosixPath(name)


def check_no_escaping_symlinks(root: Path, where: str) -> int:
    """Refuse a directory holding a symlink that resolves outside it; return its file count.

    Stops as soon as the file count passes `max_adapter_files()`.
    """
    resolved_root = root.resolve()
    count = 0
    for entry in _walk(root):
        if entry.is_symlink():
            target = entry.resolve()
            if not target.is_relative_to(resolved_root):
                raise LoRADownloadError(
                    f"refusing {where}: {entry} is a symlink to {target}, outside the adapter "
                    "directory; copy the file into the directory instead",
                    REASON_UNSAFE,
                )
        if entry.is_file():
            count += 1
            check_file_count(count, where)
    return count


def _walk(root: Path) -> Iterator[Path]:
    # os.walk does not descend into symlinked directories, so a link to "/" is reported once
    # (and refused) rather than walked.
    for dirpath, dirnames, filenames in os.walk(root):
        base = Path(dirpath)
        for name in dirnames + filenames:
            yield base / name


def atomic_write(path: Path, data: bytes) -> None:
    """Replace `path` with `data` so readers see the old or the new content, never a part;
    the data is fsynced before the rename. The temp file is named `<name>.<random>.tmp`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temp = tempfile.mkstemp(dir=path.parent, prefix=f"{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def adapter_digest(path: str | os.PathLike[str]) -> str:
    """The sha256 that identifies an adapter's content, as 64 lower-case hex digits.

    Definition (so other tools can compute it): take every regular file under `path`
    (symlinks followed), except top-level bookkeeping files (names starting with
    `.dynamo_lora_`, such as `.dynamo_lora_complete`); sort them by their relative path in
    POSIX form (`/` separators), compared as UTF-8 bytes; then feed sha256, for each file in
    turn, with
    `len(relpath_utf8)` as 8 big-endian bytes, `relpath_utf8`, the file size as 8 big-endian
    bytes, and the file's bytes. From a shell: `python -m
    dynamo.common.lora.adapter <dir>`.
    """
    root = Path(path)
    files: list[tuple[bytes, Path]] = []
    for entry in _walk(root):
        if not entry.is_file():
            continue
        rel = entry.relative_to(root).as_posix()
        if "/" not in rel and rel.startswith(RESERVED_PREFIX):
            continue
        files.append((rel.encode("utf-8"), entry))
    files.sort(key=lambda item: item[0])
    digest = hashlib.sha256()
    for rel_bytes, entry in files:
        with entry.open("rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            digest.update(len(rel_bytes).to_bytes(8, "big"))
            digest.update(rel_bytes)
            digest.update(size.to_bytes(8, "big"))
            while chunk := handle.read(_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m dynamo.common.lora.adapter ADAPTER_DIR")
    print(adapter_digest(sys.argv[1]))
