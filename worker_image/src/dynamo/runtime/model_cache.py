"""The model cache: one directory per model source, filled once, trusted only when complete.

The operator and the worker agree on this layout (issue 29), so it is kept in one place:

- a source's directory is `<cache>/<key>`, `key = cache_key(source)` (16 hex digits of the
  sha256 of the source URI; the operator computes the same key);
- it is complete iff it holds `MARKER`, a JSON record of what the fill verified:
  `{"source": ..., "bytes": total, "files": {"rel/path": {"size": n, "etag": "..."}}}`;
- a fill writes into `<cache>/.<key>.partial-<pid>`, verifies every file against the source's
  listing, writes the marker there, and only then renames the directory into place, so no
  reader ever sees a half-written directory that looks complete.

Sources: `s3://bucket/prefix` (every object under the prefix, with the LoRA downloader's S3
code, so the same `AWS_*` settings; sizes checked, and MD5s where the ETag is one) and
`hf://org/repo[@revision]` (every file of the revision, with the same `HF_*` settings as the
LoRA downloader; sizes checked, and the sha256 of files the Hub stores in LFS).

`fill` is what the operator's download Job runs (through `dynamo-model-cache fill`) and what a
worker without a cache Job runs for itself; `lookup` is what a worker that must not download
(`DYN_MODEL_CACHE_REQUIRED`) runs instead; `prune` removes the directories of sources no
DynamoWorker uses any more.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Final, TypedDict

from dynamo.common.lora import hf_source, hub_redirects, s3_source
from dynamo.common.lora._env import download_timeout
from dynamo.common.lora.adapter import safe_relative_path
from dynamo.common.lora.errors import (
    REASON_BAD_URI,
    REASON_FAILED,
    REASON_NOT_FOUND,
    REASON_UNSAFE,
    LoRADownloadError,
    is_disk_full,
)

#: Where the cache lives (the operator points it at the pod's cache volume).
MODEL_CACHE_ENV: Final = "DYN_MODEL_CACHE"
#: `true`/`1`: the worker loads only from a complete cache directory and never downloads.
REQUIRED_ENV: Final = "DYN_MODEL_CACHE_REQUIRED"
#: Written last into a verified directory; its presence is what "complete" means.
MARKER: Final = ".dynamo-model-cache.json"
#: Seconds between two progress reports of a fill.
PROGRESS_INTERVAL_S: Final = 1.0

_KEY: Final = re.compile(r"[0-9a-f]{16}")
_PARTIAL: Final = re.compile(r"\.([0-9a-f]{16})\.partial-.+")
_PLAIN_MD5: Final = re.compile(r"[0-9a-f]{32}")
_CHUNK: Final = 1 << 20
_WHAT: Final = "model source"
#: Where `huggingface_hub` keeps its bookkeeping inside a download directory (removed before
#: the directory is published; a repository may not hold files there).
_HUB_BOOKKEEPING: Final = ".cache"

log = logging.getLogger(__name__)

#: `(bytesDone, bytesTotal)` while a fill runs.
ProgressCallback = Callable[[int, int], None]


class ModelCacheMissingError(RuntimeError):
    """A worker that must load from the cache found its source's directory incomplete."""


class VerifiedFile(TypedDict):
    """A file's entry in the marker."""

    size: int
    etag: str


@dataclass(frozen=True)
class ExpectedFile:
    """One file a fill must deliver: its place in the directory, its size (None where the
    source did not say), the source's tag for it (the S3 ETag; the Hub's LFS sha256 or git
    blob id), and the digest to check (`(hashlib name, hex digest)`), where the tag is one."""

    relative: PurePosixPath
    size: int | None
    etag: str
    digest: tuple[str, str] | None = None

    @classmethod
    def from_s3(cls, item: s3_source.S3Object) -> ExpectedFile:
        """A plain MD5 ETag (32 hex digits) is a single-part upload's MD5; a multipart one
        (`<hex>-<parts>`) is a digest of the parts' digests, not of the file."""
        etag = item.etag.lower()
        digest = ("md5", etag) if _PLAIN_MD5.fullmatch(etag) else None
        return cls(item.relative, item.size, item.etag, digest)


@dataclass(frozen=True)
class FillResult:
    """A complete directory and what it holds; `fetched` is False when it was already there."""

    directory: Path
    bytes_total: int
    fetched: bool


def cache_key(source: str) -> str:
    """The name of `source`'s directory in the cache (the operator computes the same)."""
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def default_cache() -> Path:
    """`DYN_MODEL_CACHE`, else `~/.cache/dynamo/models`."""
    configured = os.environ.get(MODEL_CACHE_ENV, "").strip()
    return Path(configured) if configured else Path.home() / ".cache" / "dynamo" / "models"


def cache_required() -> bool:
    """Whether `DYN_MODEL_CACHE_REQUIRED` is on; a value that is not a clear yes or no is
    refused rather than guessed, since guessing "no" would download where the operator said
    never to."""
    raw = os.environ.get(REQUIRED_ENV, "").strip().lower()
    if raw in ("true", "1"):
        return True
    if raw in ("", "false", "0"):
        return False
    raise ValueError(f"{REQUIRED_ENV}={raw!r} is not true, 1, false or 0")


def is_complete(directory: Path) -> bool:
    """Whether `directory` is a complete cache directory (it holds the marker)."""
    return (directory / MARKER).is_file()


def lookup(source: str, cache: Path) -> Path:
    """`source`'s complete directory, for a worker that must not download it."""
    directory = cache / cache_key(source)
    if is_complete(directory):
        return directory
    state = "is incomplete" if directory.exists() else "does not exist"
    raise ModelCacheMissingError(
        f"--model {source}: the model cache directory {directory} {state} (no {MARKER}): the "
        "operator's model cache fill Job has not completed it, and with "
        f"{REQUIRED_ENV} set no download is attempted; check the fill Job of this "
        "DynamoWorker (kubectl get jobs) and its status, or unset "
        f"{REQUIRED_ENV} to let the worker download the model itself"
    )


def read_marker(directory: Path) -> dict[str, object]:
    """The marker of a complete directory (what its fill verified)."""
    record = json.loads((directory / MARKER).read_text())
    if not isinstance(record, dict):
        raise ValueError(f"{directory / MARKER} does not hold a JSON object")
    return record


def verify(directory: Path, expected: Sequence[ExpectedFile]) -> dict[str, VerifiedFile]:
    """Check every expected file in `directory`; the marker's `files`.

    Sizes must match, and digests where there are some. Each file is fsynced on the way, so
    the marker is never more durable than the data. A mismatch is a transient failure: the
    next attempt downloads again.
    """
    files: dict[str, VerifiedFile] = {}
    for item in expected:
        path = directory.joinpath(*item.relative.parts)
        name = item.relative.as_posix()
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise _mismatch(name, "is missing") from None
        if item.size is not None and size != item.size:
            raise _mismatch(name, f"has {size} bytes, the listing says {item.size}")
        if item.digest is not None:
            algorithm, want = item.digest
            got = _digest_and_sync(path, algorithm)
            if got != want:
                raise _mismatch(name, f"has {algorithm} {got}, the listing says {want}")
        else:
            _sync(path)
        files[name] = {"size": size, "etag": item.etag}
    return files


def _mismatch(name: str, problem: str) -> LoRADownloadError:
    return LoRADownloadError(
        f"downloaded file {name} {problem}: the object changed during the download or arrived "
        "damaged; the download is retried",
        REASON_FAILED,
    )


def _digest_and_sync(path: Path, algorithm: str) -> str:
    digest = hashlib.new(algorithm, usedforsecurity=False)
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
        os.fsync(handle.fileno())
    return digest.hexdigest()


def _sync(path: Path) -> None:
    with path.open("rb") as handle:
        os.fsync(handle.fileno())


def _sync_directory(directory: Path) -> None:
    handle = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def partial_directories(cache: Path, key: str) -> list[Path]:
    """The partial directories of `key` under `cache` (left by fills that did not finish)."""
    if not cache.is_dir():
        return []
    return sorted(
        entry
        for entry in cache.iterdir()
        if (match := _PARTIAL.fullmatch(entry.name)) and match.group(1) == key
    )


def bytes_written(directory: Path) -> int:
    """Bytes of file data under `directory`, counted by allocated blocks where that is less
    than the size: s3fs sizes a large file in full before its ranges arrive, so the size alone
    would report a file as done as soon as it starts."""
    total = 0
    for root, _, names in os.walk(directory):
        for name in names:
            if name == MARKER:
                continue
            try:
                info = os.stat(os.path.join(root, name))
            except FileNotFoundError:
                continue  # renamed or removed while we counted
            total += min(info.st_size, info.st_blocks * 512)
    return total


async def fill(
    source: str,
    cache: Path,
    *,
    progress: ProgressCallback | None = None,
    clear_stale: bool = True,
) -> FillResult:
    """Make `source`'s directory under `cache` complete, downloading only when it is not.

    `clear_stale` removes the partial directories other fills of this key left behind; the
    operator's Job sets it (it runs one fill per key at a time), a worker filling its own
    cache does not (another worker process may be filling the same key right now).
    Failures are `LoRADownloadError`s whose `reason` says whether a retry can help.
    """
    key = cache_key(source)
    final = cache / key
    if is_complete(final):
        return FillResult(final, _marker_bytes(final), fetched=False)
    _check_source(source)  # a bad URI fails before the cache is touched
    partial = _new_partial(source, cache, clear_stale)
    try:
        plan = await _download(source, partial, progress)
        files = await asyncio.to_thread(verify, partial, plan)
        total = sum(file["size"] for file in files.values())
        _write_marker(partial, {"source": source, "bytes": total, "files": files})
        return _publish(partial, final, FillResult(final, total, fetched=True))
    except BaseException as exc:
        _remove(partial)
        if any(e is not None and is_disk_full(e) for e in (exc, exc.__cause__)):
            raise LoRADownloadError(
                f"the model cache volume {cache} is full while fetching {source}; the partial "
                "download was removed: make the volume (spec.model.cache's "
                "PersistentVolumeClaim) larger or free space on it",
                REASON_FAILED,
            ) from exc
        raise


def _new_partial(source: str, cache: Path, clear_stale: bool) -> Path:
    """An empty partial directory for this process's fill of `source`."""
    key = cache_key(source)
    cache.mkdir(parents=True, exist_ok=True)
    if clear_stale:
        for stale in partial_directories(cache, key):
            log.info("model %s: removing %s, left by a fill that did not finish", source, stale)
            _remove(stale)
    partial = cache / f".{key}.partial-{os.getpid()}"
    _remove(partial)  # this process's own, from a pid reused by an earlier pod
    partial.mkdir()
    return partial


def _check_source(source: str) -> None:
    if source.startswith(s3_source.SCHEME_PREFIX):
        s3_source.parse_s3_uri(source, _WHAT)
    elif source.startswith(hf_source.SCHEME_PREFIX):
        _parse_hf(source)
    else:
        scheme = f"{source.partition('://')[0]}://" if "://" in source else "a local path"
        raise LoRADownloadError(
            f"model source {source}: the model cache is filled from s3:// and hf:// sources "
            f"only, not {scheme}; a local source needs no cache: drop spec.model.cache",
            REASON_BAD_URI,
        )


def _parse_hf(source: str) -> hf_source.HfLocation:
    try:
        return hf_source.parse_hf_uri(source)
    except LoRADownloadError as exc:
        # The parser is the LoRA downloader's; its messages call the URI a LoRA URI.
        raise LoRADownloadError(str(exc).replace("LoRA URI", _WHAT), exc.reason) from None


async def _download(
    source: str, partial: Path, progress: ProgressCallback | None
) -> list[ExpectedFile]:
    """Fetch `source` into `partial`, reporting `progress` every `PROGRESS_INTERVAL_S` once
    the total is known from the listing; what the files must be."""
    loop = asyncio.get_running_loop()
    planned = asyncio.Event()
    total = 0

    def on_plan(plan: Sequence[ExpectedFile]) -> None:
        """Called once the listing is checked, maybe from the Hub's download thread."""
        nonlocal total
        if any(item.relative.as_posix() == MARKER for item in plan):
            raise LoRADownloadError(
                f"model source {source} holds a file named {MARKER}, the name the cache "
                "uses to mark a complete directory; remove it from the source",
                REASON_UNSAFE,
            )
        total = sum(item.size or 0 for item in plan)
        loop.call_soon_threadsafe(planned.set)

    async def report(callback: ProgressCallback) -> None:
        await planned.wait()
        while True:
            callback(min(bytes_written(partial), total), total)
            await asyncio.sleep(PROGRESS_INTERVAL_S)

    reporter = asyncio.create_task(report(progress)) if progress is not None else None
    try:
        if source.startswith(hf_source.SCHEME_PREFIX):
            return await _download_hf(source, partial, on_plan)
        plan = await s3_source.download_s3(
            source,
            partial,
            what=_WHAT,
            on_plan=lambda objects: on_plan([ExpectedFile.from_s3(o) for o in objects]),
        )
        return [ExpectedFile.from_s3(item) for item in plan]
    finally:
        if reporter is not None:
            reporter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reporter


async def _download_hf(
    source: str, partial: Path, on_plan: Callable[[Sequence[ExpectedFile]], None]
) -> list[ExpectedFile]:
    """`_fetch_hf` in a thread; a cancelled fill stops it between files and waits for it, so
    that nothing writes into the partial directory once the caller removes it."""
    cancel = threading.Event()
    work = asyncio.ensure_future(asyncio.to_thread(_fetch_hf, source, partial, on_plan, cancel))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        cancel.set()
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await work
        raise


def _fetch_hf(
    source: str,
    partial: Path,
    on_plan: Callable[[Sequence[ExpectedFile]], None],
    cancel: threading.Event,
) -> list[ExpectedFile]:
    """Every file of the Hub revision into `partial` (blocking)."""
    from huggingface_hub import HfApi, hf_hub_download

    location = _parse_hf(source)
    hub_redirects.install(hf_source.hf_endpoint)
    endpoint = hf_source.hf_endpoint()
    token: str | bool = hf_source.hf_token() or False  # never a stored login's token
    timeout = download_timeout()

    def fail(exc: Exception) -> LoRADownloadError:
        return hf_source.classify_hf_error(exc, source, endpoint, timeout)

    def download(relative: PurePosixPath, *, dry_run: bool = False) -> Any:
        """One file of the commit into `partial` (with `dry_run`, only what it would be)."""
        try:
            return hf_hub_download(
                location.repo_id,
                relative.as_posix(),
                revision=commit,
                local_dir=partial,
                endpoint=endpoint,
                token=token,
                etag_timeout=timeout,
                dry_run=dry_run,
            )
        except Exception as exc:
            raise fail(exc) from exc

    try:
        info = HfApi(endpoint=endpoint, token=token).model_info(
            location.repo_id, revision=location.revision, files_metadata=True, timeout=timeout
        )
    except Exception as exc:
        raise fail(exc) from exc
    commit = info.sha or ""
    if not re.fullmatch(r"[0-9a-f]{40}", commit):
        raise LoRADownloadError(
            f"the Hub at {endpoint} returned no commit for {source} (got {commit!r})",
            REASON_FAILED,
        )
    siblings = info.siblings or []
    if not siblings:
        raise LoRADownloadError(f"{source} lists no files at commit {commit}", REASON_NOT_FOUND)
    plan: list[ExpectedFile] = []
    for sibling in siblings:
        relative = safe_relative_path(sibling.rfilename, source)
        if relative.parts[0] == _HUB_BOOKKEEPING:
            raise LoRADownloadError(
                f"refusing {source}: {relative} lies in {_HUB_BOOKKEEPING}/, where the download "
                "keeps its bookkeeping",
                REASON_UNSAFE,
            )
        lfs = sibling.lfs
        size = lfs.size if lfs is not None else sibling.size
        if size is None:  # a Hub that lists names only: ask for each file's size
            size = getattr(download(relative, dry_run=True), "file_size", None)
        if lfs is not None:
            plan.append(ExpectedFile(relative, size, lfs.sha256, ("sha256", lfs.sha256)))
        else:
            plan.append(ExpectedFile(relative, size, sibling.blob_id or ""))
    on_plan(plan)
    root = partial.resolve()
    for item in plan:
        if cancel.is_set():
            raise hf_source.DownloadCancelled(source)
        path = download(item.relative)
        if not Path(str(path)).resolve().is_relative_to(root):
            raise LoRADownloadError(
                f"refusing {source}: {item.relative} was stored at {path}, outside {root}",
                REASON_UNSAFE,
            )
    _remove(partial / _HUB_BOOKKEEPING)
    return plan


def _write_marker(directory: Path, record: Mapping[str, object]) -> None:
    with (directory / MARKER).open("w") as out:
        json.dump(record, out, sort_keys=True)
        out.flush()
        os.fsync(out.fileno())
    _sync_directory(directory)


def _publish(partial: Path, final: Path, result: FillResult) -> FillResult:
    """Rename the verified `partial` to `final`; a directory already at `final` is either
    complete (another fill won the race: keep it) or not (an older worker's copy without a
    marker, or a hand-made one: moved aside and removed, never trusted)."""
    if final.exists() and not is_complete(final):
        aside = final.with_name(f".{final.name}.partial-replaced-{os.getpid()}")
        final.rename(aside)
        _remove(aside)
    try:
        partial.rename(final)
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not is_complete(final):
            raise
        _remove(partial)
        return FillResult(final, _marker_bytes(final), fetched=False)
    _sync_directory(final.parent)
    return result


def _marker_bytes(directory: Path) -> int:
    try:
        value = read_marker(directory).get("bytes")
    except (OSError, ValueError):
        return 0
    return value if isinstance(value, int) else 0


def prune(cache: Path, keep: Iterable[str]) -> list[Path]:
    """Remove every key directory and partial directory under `cache` whose key is not in
    `keep`; what was removed. Names that do not look like keys are never touched."""
    kept = set(keep)
    for key in kept:
        if not _KEY.fullmatch(key):
            raise ValueError(f"--keep {key!r} is not a cache key (16 lowercase hex digits)")
    if not cache.is_dir():
        return []
    removed: list[Path] = []
    for entry in sorted(cache.iterdir()):
        partial = _PARTIAL.fullmatch(entry.name)
        key = partial.group(1) if partial else entry.name
        if not (partial or _KEY.fullmatch(entry.name)) or key in kept:
            continue
        if entry.is_dir() or entry.is_symlink():
            _remove(entry)
            removed.append(entry)
    return removed


def _remove(path: Path) -> None:
    """Remove a directory tree, or the link itself for a symlink (never what it points at)."""
    if path.is_symlink():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)
