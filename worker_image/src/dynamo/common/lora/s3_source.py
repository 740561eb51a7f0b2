"""`s3://bucket/prefix` adapters: every object under the prefix, fetched with s3fs.

`download_s3` returns its plan (each object's key, size and ETag) so that a caller can verify
what arrived; the model cache (`dynamo.runtime.model_cache`) does, the LoRA downloader checks
adapters its own way.

Configuration comes from the environment only (as upstream): `AWS_ACCESS_KEY_ID` and
`AWS_SECRET_ACCESS_KEY` (required), `AWS_SESSION_TOKEN`, `AWS_REGION` (default `us-east-1`),
`AWS_ENDPOINT` (a custom endpoint, path-style addressing; the SDK names `AWS_ENDPOINT_URL_S3`
and `AWS_ENDPOINT_URL` are accepted too), `AWS_ALLOW_HTTP` (required for an `http://`
endpoint) and `LORA_DOWNLOAD_TIMEOUT_SECS`.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Final, TypeVar

from dynamo.common.lora._env import download_timeout, env_truthy
from dynamo.common.lora.adapter import check_file_count, safe_relative_path
from dynamo.common.lora.endpoint_guard import check_s3_endpoint
from dynamo.common.lora.errors import (
    REASON_AUTH,
    REASON_BAD_URI,
    REASON_FAILED,
    REASON_NOT_FOUND,
    REASON_TIMEOUT,
    REASON_UNSAFE,
    LoRADownloadError,
    cache_full_error,
    is_disk_full,
)

logger = logging.getLogger(__name__)

SCHEME_PREFIX: Final = "s3://"
#: The waits between the 3 attempts of each request (upstream: 1 s, then 2 s).
RETRY_DELAYS: tuple[float, ...] = (1.0, 2.0)
#: Objects fetched at once; s3fs also splits objects above 50 MiB into parallel ranges.
CONCURRENT_OBJECTS: Final = 8

_AUTH_CODES: Final = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "AllAccessDisabled",
        # What versitygw (an S3-compatible server) answers for an access key it does not know.
        "XAdminUserNotFound",
    }
)
_NOT_FOUND_CODES: Final = frozenset({"NoSuchBucket", "NoSuchKey", "404"})

T = TypeVar("T")


@dataclass(frozen=True)
class S3Location:
    """A parsed `s3://bucket/prefix` URI; `prefix` has no leading or trailing `/`."""

    bucket: str
    prefix: str


@dataclass(frozen=True)
class S3Object:
    """One object to fetch: its `bucket/key`, its path below the destination, and what the
    listing said of it (`etag` without quotes, empty when the server gave none)."""

    remote: str
    relative: PurePosixPath
    size: int
    etag: str


@dataclass(frozen=True)
class S3Settings:
    """S3 client settings read from the environment."""

    key: str
    secret: str
    token: str | None
    region: str
    endpoint: str | None
    timeout: float


def parse_s3_uri(uri: str, what: str = "LoRA URI") -> S3Location:
    """Split `s3://bucket/prefix`, refusing credentials, queries, and empty or `..` prefixes.

    `what` names the URI in the messages (a model source is not a LoRA URI)."""
    rest = uri[len(SCHEME_PREFIX) :]
    bucket, _, prefix = rest.partition("/")
    if "@" in bucket:
        raise LoRADownloadError(
            f"{what} {_redact(uri)} embeds credentials; remove them and set "
            "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in the environment instead",
            REASON_BAD_URI,
        )
    if not bucket:
        raise LoRADownloadError(
            f"{what} {uri!r} names no bucket; use s3://<bucket>/<prefix>", REASON_BAD_URI
        )
    if "?" in rest or "#" in rest:
        raise LoRADownloadError(
            f"{what} {uri!r} has a query or fragment; use s3://<bucket>/<prefix>", REASON_BAD_URI
        )
    prefix = prefix.strip("/")
    if not prefix:
        raise LoRADownloadError(
            f"{what} {uri!r} has an empty prefix, which would download the whole bucket; "
            "point it at the directory that holds the files: s3://<bucket>/<prefix>",
            REASON_BAD_URI,
        )
    if any(part in ("", ".", "..") for part in prefix.split("/")) or "\\" in prefix:
        raise LoRADownloadError(
            f"{what} {uri!r} has an empty, '.' or '..' path component or a backslash",
            REASON_BAD_URI,
        )
    return S3Location(bucket, prefix)


def _redact(uri: str) -> str:
    scheme, _, rest = uri.partition("://")
    bucket, _, path = rest.partition("/")
    return f"{scheme}://***@{bucket.rpartition('@')[2]}/{path}"


def s3_settings() -> S3Settings:
    """Read the S3 settings, explaining what to set when something is missing."""
    key = os.environ.get("AWS_ACCESS_KEY_ID", "")
    secret = os.environ.get("AWS_SECRET_ACCESS_KEY", "")
    if not key or not secret:
        raise LoRADownloadError(
            "S3 credentials are not configured: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
            REASON_AUTH,
        )
    endpoint = (
        os.environ.get("AWS_ENDPOINT")
        or os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
        or None
    )
    if endpoint and endpoint.startswith("http://") and not env_truthy("AWS_ALLOW_HTTP"):
        raise LoRADownloadError(
            f"S3 endpoint {endpoint} is plain http; set AWS_ALLOW_HTTP=true to allow it",
            REASON_BAD_URI,
        )
    return S3Settings(
        key=key,
        secret=secret,
        token=os.environ.get("AWS_SESSION_TOKEN") or None,
        region=os.environ.get("AWS_REGION") or "us-east-1",
        endpoint=endpoint,
        timeout=download_timeout(),
    )


def _filesystem(settings: S3Settings) -> Any:
    from s3fs import S3FileSystem

    config: dict[str, Any] = {
        "connect_timeout": settings.timeout,
        "read_timeout": settings.timeout,
        # Retries are ours (see RETRY_DELAYS); botocore's own would multiply them.
        "retries": {"max_attempts": 1, "mode": "standard"},
    }
    if settings.endpoint:
        config["s3"] = {"addressing_style": "path"}
    fs = S3FileSystem(
        asynchronous=True,
        skip_instance_cache=True,
        use_listings_cache=False,
        key=settings.key,
        secret=settings.secret,
        token=settings.token,
        endpoint_url=settings.endpoint,
        client_kwargs={"region_name": settings.region},
        config_kwargs=config,
    )
    fs.retries = 1  # s3fs retries each call 5 times by default; ours are the only ones
    return fs


async def download_s3(
    uri: str,
    dest: Path,
    *,
    what: str = "LoRA URI",
    on_plan: Callable[[Sequence[S3Object]], None] | None = None,
) -> list[S3Object]:
    """Write every object under the URI's prefix into the empty directory `dest`; the plan.

    Object keys are checked before anything is written: a key whose remainder after the
    prefix is absolute, has `..`/`.`/empty components, or collides with a bookkeeping name
    is refused, as is a listing longer than `max_adapter_files()` or one that holds both a
    file and a directory of the same name. `on_plan` sees the checked plan before the first
    object is fetched (a caller reporting progress learns the total there).
    """
    location = parse_s3_uri(uri, what)
    settings = s3_settings()
    if settings.endpoint:
        await check_s3_endpoint(settings.endpoint)
    fs = _filesystem(settings)
    try:
        client = await fs.set_session()
    except Exception as exc:
        raise classify_s3_error(exc, uri, settings) from exc
    try:
        plan = await _plan(fs, uri, location, settings)
        if on_plan is not None:
            on_plan(plan)
        limiter = asyncio.Semaphore(CONCURRENT_OBJECTS)

        async def fetch(remote: str, relative: PurePosixPath) -> None:
            local = dest.joinpath(*relative.parts)
            local.parent.mkdir(parents=True, exist_ok=True)
            async with limiter:
                await with_retries(
                    lambda: fs._get_file(remote, str(local)),
                    what=f"s3://{remote}",
                    delays=RETRY_DELAYS,
                )

        try:
            async with asyncio.TaskGroup() as group:
                for item in plan:
                    group.create_task(fetch(item.remote, item.relative))
        except ExceptionGroup as failures:
            # The first failure explains the download; the others were cancelled with it.
            first: BaseException = failures.exceptions[0]
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            if isinstance(first, LoRADownloadError):
                raise first from None
            raise classify_s3_error(first, uri, settings) from first
    finally:
        await client.close()
    return plan


async def _plan(fs: Any, uri: str, location: S3Location, settings: S3Settings) -> list[S3Object]:
    root = f"{location.bucket}/{location.prefix}"
    try:
        listing: dict[str, dict[str, Any]] = await with_retries(
            lambda: fs._find(root, detail=True), what=uri, delays=RETRY_DELAYS
        )
    except Exception as exc:
        raise classify_s3_error(exc, uri, settings) from exc
    plan: list[S3Object] = []
    for name, info in sorted(listing.items()):
        if info.get("type") == "directory" or (name.endswith("/") and not info.get("size")):
            continue  # "folder" placeholder objects that S3 consoles create
        if not name.startswith(root + "/"):
            # The prefix itself is an object (s3://b/x/adapter_config.json): its remainder
            # is empty, which upstream skips.
            continue
        relative = safe_relative_path(name[len(root) + 1 :], uri)
        etag = str(info.get("ETag") or "").strip('"')
        plan.append(S3Object(name, relative, int(info.get("size") or 0), etag))
        check_file_count(len(plan), uri)
    if not plan:
        raise LoRADownloadError(
            f"no objects found under {uri} (bucket {location.bucket!r}, prefix "
            f"{location.prefix + '/'!r}); check the URI",
            REASON_NOT_FOUND,
        )
    files = {item.relative for item in plan}
    for relative in files:
        for parent in relative.parents:
            if parent in files:
                raise LoRADownloadError(
                    f"refusing {uri}: {parent} is both an object and a directory prefix",
                    REASON_UNSAFE,
                )
    return plan


async def with_retries(op: Callable[[], Awaitable[T]], *, what: str, delays: Sequence[float]) -> T:
    """Run `op` up to `len(delays) + 1` times, sleeping `delays[i]` after failure `i`.

    Not-found, permission and credential errors fail at once: asking again cannot help.
    """
    attempt = 0
    while True:
        try:
            return await op()
        except Exception as exc:
            if attempt >= len(delays) or not _transient(exc):
                raise
            logger.warning(
                "fetching %s failed (attempt %d of %d): %s; retrying in %.1f s",
                what,
                attempt + 1,
                len(delays) + 1,
                exc,
                delays[attempt],
            )
            await asyncio.sleep(delays[attempt])
            attempt += 1


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, FileNotFoundError | PermissionError | LoRADownloadError):
        return False
    if is_disk_full(exc):
        return False  # a full cache stays full
    code = _error_code(exc)
    return not (code in _AUTH_CODES or code in _NOT_FOUND_CODES)


def _error_code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    cause = exc.__cause__ or exc.__context__
    return _error_code(cause) if cause is not None and cause is not exc else ""


def classify_s3_error(exc: BaseException, uri: str, settings: S3Settings) -> LoRADownloadError:
    """Turn an s3fs/botocore error into a `LoRADownloadError` with a reason and a hint."""
    from botocore.exceptions import (
        ConnectTimeoutError,
        EndpointConnectionError,
        NoCredentialsError,
        ReadTimeoutError,
    )

    where = settings.endpoint or "AWS S3"
    code = _error_code(exc)
    if isinstance(exc, LoRADownloadError):
        return exc
    if (
        isinstance(exc, NoCredentialsError)
        or code in _AUTH_CODES
        or isinstance(exc, PermissionError)
    ):
        return LoRADownloadError(
            f"access to {uri} was refused ({exc}); check AWS_ACCESS_KEY_ID, "
            "AWS_SECRET_ACCESS_KEY and the bucket policy",
            REASON_AUTH,
        )
    if isinstance(exc, FileNotFoundError) or code in _NOT_FOUND_CODES:
        return LoRADownloadError(f"{uri} not found on {where}: {exc}", REASON_NOT_FOUND)
    if isinstance(exc, ConnectTimeoutError | ReadTimeoutError | TimeoutError):
        return LoRADownloadError(
            f"timed out fetching {uri} from {where} after {settings.timeout:g} s; "
            "raise LORA_DOWNLOAD_TIMEOUT_SECS or check the network",
            REASON_TIMEOUT,
        )
    if isinstance(exc, EndpointConnectionError):
        return LoRADownloadError(
            f"cannot reach the S3 endpoint {where} for {uri}: {exc}; check AWS_ENDPOINT",
            REASON_FAILED,
        )
    if is_disk_full(exc):
        return cache_full_error(exc, uri)
    return LoRADownloadError(f"fetching {uri} from {where} failed: {exc}", REASON_FAILED)
