"""`hf://org/repo[@revision]` adapters, fetched with `huggingface_hub` into the HF hub cache.

The adapter lives in the hub cache (`models--org--repo/snapshots/<sha>`), not under
`DYN_LORA_PATH`. A snapshot counts as cached only once `.dynamo_lora_complete` (content
`b"1\\n"`) has been written into it, which happens after every listed file is present and the
directory validates; `refs/<revision>` is written after the marker.

Environment, read at call time: `HF_ENDPOINT`, `HF_HUB_OFFLINE`, `HF_TOKEN` >
`HUGGING_FACE_HUB_TOKEN` > the file `HF_TOKEN_PATH` or `<HF_HOME>/token`, `HF_HUB_CACHE` >
`HF_HOME/hub` > `XDG_CACHE_HOME/huggingface/hub` > `~/.cache/huggingface/hub`, and
`LORA_DOWNLOAD_TIMEOUT_SECS` (metadata requests; body reads follow `HF_HUB_DOWNLOAD_TIMEOUT`).
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from dynamo.common.lora import hub_redirects
from dynamo.common.lora._env import download_timeout, env_truthy
from dynamo.common.lora.adapter import (
    COMPLETE_MARKER,
    COMPLETE_MARKER_BYTES,
    atomic_write,
    check_file_count,
    describe_invalid,
    is_complete,
    safe_relative_path,
    validate_path,
)
from dynamo.common.lora.errors import (
    REASON_AUTH,
    REASON_BAD_URI,
    REASON_FAILED,
    REASON_INVALID_ADAPTER,
    REASON_NOT_FOUND,
    REASON_OFFLINE,
    REASON_TIMEOUT,
    REASON_UNSAFE,
    LoRADownloadError,
)

SCHEME_PREFIX: Final = "hf://"
DEFAULT_REVISION: Final = "main"
DEFAULT_ENDPOINT: Final = "https://huggingface.co"
_COMMIT = re.compile(r"[0-9a-f]{40}")
# Hub repo names: letters, digits, `-`, `_`, `.`; no `--` or `..`; at most 96 characters.
_REPO_PART = re.compile(r"[A-Za-z0-9_](?:[\w.-]{0,94}[A-Za-z0-9_])?")


class DownloadCancelled(Exception):
    """The caller went away; the worker thread stops between files."""


@dataclass(frozen=True)
class HfLocation:
    """A parsed `hf://` URI."""

    repo_id: str
    revision: str


def parse_hf_uri(uri: str) -> HfLocation:
    """Split `hf://org/repo@revision` (revision default `main`, may contain `/`)."""
    rest = uri[len(SCHEME_PREFIX) :]
    if "?" in rest or "#" in rest:
        raise LoRADownloadError(
            f"LoRA URI {uri!r} has a query or fragment; use hf://<org>/<repo>[@<revision>]",
            REASON_BAD_URI,
        )
    repo_id, has_revision, revision = rest.partition("@")
    if ":" in repo_id:
        raise LoRADownloadError(
            f"LoRA URI {uri.split('@')[-1]!r} (after '@') looks like it embeds credentials; "
            "remove them and set HF_TOKEN in the environment instead",
            REASON_BAD_URI,
        )
    parts = repo_id.split("/")
    if (
        not 1 <= len(parts) <= 2
        or not all(_REPO_PART.fullmatch(part) for part in parts)
        or "--" in repo_id
        or ".." in repo_id
    ):
        raise LoRADownloadError(
            f"LoRA URI {uri!r} does not name a Hub repository; use hf://<org>/<repo>[@<revision>]",
            REASON_BAD_URI,
        )
    if has_revision and not revision:
        raise LoRADownloadError(f"LoRA URI {uri!r} has an empty revision after '@'", REASON_BAD_URI)
    revision = revision or DEFAULT_REVISION
    if "\\" in revision or any(part in ("", ".", "..") for part in revision.split("/")):
        raise LoRADownloadError(
            f"LoRA URI {uri!r} has a revision with an empty, '.' or '..' component or a backslash",
            REASON_BAD_URI,
        )
    return HfLocation(repo_id, revision)


def hf_home() -> Path:
    """`HF_HOME`, else `XDG_CACHE_HOME/huggingface`, else `~/.cache/huggingface`."""
    if home := os.environ.get("HF_HOME"):
        return Path(home)
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg) / "huggingface"
    return Path.home() / ".cache" / "huggingface"


def hub_cache_dir() -> Path:
    """`HF_HUB_CACHE`, else `<hf_home()>/hub`."""
    if cache := os.environ.get("HF_HUB_CACHE"):
        return Path(cache)
    return hf_home() / "hub"


def hf_token() -> str | None:
    """`HF_TOKEN`, else `HUGGING_FACE_HUB_TOKEN`, else the token file, else None."""
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        if token := os.environ.get(name, "").strip():
            return token
    path = Path(os.environ.get("HF_TOKEN_PATH") or hf_home() / "token")
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def hf_endpoint() -> str:
    """`HF_ENDPOINT` without a trailing slash, else the public Hub."""
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def offline() -> bool:
    """True when `HF_HUB_OFFLINE` is set to a truthy value."""
    return env_truthy("HF_HUB_OFFLINE")


def storage_folder(location: HfLocation) -> Path:
    """The hub-cache folder of the repository."""
    return hub_cache_dir() / ("models--" + location.repo_id.replace("/", "--"))


def cached_snapshot(location: HfLocation) -> Path | None:
    """The finished snapshot for the URI's revision, or None when there is none."""
    storage = storage_folder(location)
    if _COMMIT.fullmatch(location.revision):
        commit = location.revision
    else:
        try:
            commit = (storage / "refs" / location.revision).read_text().strip()
        except OSError:
            return None
        if not _COMMIT.fullmatch(commit):
            return None
    snapshot = storage / "snapshots" / commit
    return snapshot if is_complete(snapshot) else None


def offline_error(uri: str) -> LoRADownloadError:
    """The error for an uncached adapter while `HF_HUB_OFFLINE` is set."""
    return LoRADownloadError(
        f"HF_HUB_OFFLINE is enabled and {uri} is not fully cached", REASON_OFFLINE
    )


def fetch_snapshot(uri: str, location: HfLocation, cancel: threading.Event) -> tuple[Path, str]:
    """Download every file of the revision into the hub cache; return (snapshot dir, commit).

    Blocking; runs in a worker thread. Every listed file name is checked before the first
    download, and every downloaded path must stay inside the repository's cache folder.
    The completion marker is not written here (see `mark_complete`).
    """
    from huggingface_hub import HfApi, hf_hub_download

    hub_redirects.install(hf_endpoint)
    endpoint = hf_endpoint()
    token: str | bool = hf_token() or False  # False: never fall back to a stored login
    timeout = download_timeout()
    try:
        info = HfApi(endpoint=endpoint, token=token).model_info(
            location.repo_id, revision=location.revision, timeout=timeout
        )
    except Exception as exc:
        raise classify_hf_error(exc, uri, endpoint, timeout) from exc
    commit = info.sha or ""
    if not _COMMIT.fullmatch(commit):
        raise LoRADownloadError(
            f"the Hub at {endpoint} returned no commit for {uri} (got {commit!r})", REASON_FAILED
        )
    names = [sibling.rfilename for sibling in info.siblings or []]
    if not names:
        raise LoRADownloadError(f"{uri} lists no files at commit {commit}", REASON_NOT_FOUND)
    check_file_count(len(names), uri)
    relatives = [safe_relative_path(name, uri) for name in names]
    storage = storage_folder(location).resolve()
    cache_dir = hub_cache_dir()
    for relative in relatives:
        if cancel.is_set():
            raise DownloadCancelled(uri)
        try:
            path = hf_hub_download(
                location.repo_id,
                relative.as_posix(),
                revision=commit,
                cache_dir=cache_dir,
                endpoint=endpoint,
                token=token,
                etag_timeout=timeout,
            )
        except Exception as exc:
            raise classify_hf_error(exc, uri, endpoint, timeout) from exc
        if not Path(path).resolve().is_relative_to(storage):
            raise LoRADownloadError(
                f"refusing {uri}: {relative} was stored at {path}, outside {storage}",
                REASON_UNSAFE,
            )
    snapshot = storage_folder(location) / "snapshots" / commit
    if not validate_path(snapshot):
        raise LoRADownloadError(
            f"{uri} is not a valid LoRA adapter: {describe_invalid(snapshot)}",
            REASON_INVALID_ADAPTER,
        )
    return snapshot, commit


def mark_complete(location: HfLocation, snapshot: Path, commit: str) -> None:
    """Write the completion marker (atomically, durably), then `refs/<revision>`."""
    atomic_write(snapshot / COMPLETE_MARKER, COMPLETE_MARKER_BYTES)
    if location.revision != commit:
        atomic_write(storage_folder(location) / "refs" / location.revision, commit.encode())


def classify_hf_error(
    exc: BaseException, uri: str, endpoint: str, timeout: float
) -> LoRADownloadError:
    """Turn a `huggingface_hub` error into a `LoRADownloadError` with a reason and a hint."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(exc, LoRADownloadError):
        return exc
    if isinstance(exc, OfflineModeIsEnabled):
        return offline_error(uri)
    if isinstance(exc, GatedRepoError):
        return LoRADownloadError(
            f"{uri} is gated and the token has no access; accept the terms on the Hub and set "
            "HF_TOKEN",
            REASON_AUTH,
        )
    status = exc.response.status_code if isinstance(exc, HfHubHTTPError) else None
    if status == 401 and not isinstance(exc, RepositoryNotFoundError | RevisionNotFoundError):
        return LoRADownloadError(
            f"the Hub at {endpoint} refused the credentials for {uri}; check HF_TOKEN",
            REASON_AUTH,
        )
    if status == 403:
        return LoRADownloadError(
            f"the token has no access to {uri} on {endpoint}; check HF_TOKEN", REASON_AUTH
        )
    if isinstance(exc, RepositoryNotFoundError):
        return LoRADownloadError(
            f"repository for {uri} not found on {endpoint} (a private repository also needs "
            "HF_TOKEN)",
            REASON_NOT_FOUND,
        )
    if isinstance(exc, RevisionNotFoundError):
        return LoRADownloadError(f"revision of {uri} not found on {endpoint}", REASON_NOT_FOUND)
    if isinstance(exc, EntryNotFoundError):
        return LoRADownloadError(f"a listed file of {uri} is missing: {exc}", REASON_NOT_FOUND)
    # httpx and httpx2 (used by huggingface_hub) name their timeout base "TimeoutException".
    if isinstance(exc, TimeoutError) or any(
        cls.__name__ == "TimeoutException" for cls in type(exc).__mro__
    ):
        return LoRADownloadError(
            f"timed out fetching {uri} from {endpoint} (limit {timeout:g} s); raise "
            "LORA_DOWNLOAD_TIMEOUT_SECS or check the network",
            REASON_TIMEOUT,
        )
    return LoRADownloadError(
        f"fetching {uri} from {endpoint} failed: {type(exc).__name__}: {exc}; check HF_ENDPOINT",
        REASON_FAILED,
    )
