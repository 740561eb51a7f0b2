"""Media output storage on fsspec (`file://`, `s3://`, `memory://`, any fsspec protocol).

Local filesystem: the URL's path is the root; directories are created on write.
S3: the URL names the bucket (and optionally a prefix). Credentials come from the usual
places: `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` / `AWS_SESSION_TOKEN`, `AWS_ENDPOINT_URL`,
config files, or fsspec's `FSSPEC_S3_ENDPOINT_URL` / `FSSPEC_S3_KEY` / `FSSPEC_S3_SECRET`
for S3-compatible stores.

Runtime settings that feed this module: `DYN_MEDIA_OUTPUT_FS_URL` (default
`file:///tmp/dynamo_media`) and `DYN_MEDIA_OUTPUT_HTTP_URL` (optional public base URL).
"""

from __future__ import annotations

import asyncio
import os
from typing import Final

import fsspec
from fsspec.implementations.dirfs import DirFileSystem

DEFAULT_MEDIA_OUTPUT_FS_URL: Final = "file:///tmp/dynamo_media"

_LOCAL_PROTOCOLS: Final = ("file", "local")


def get_fs(fs_url: str) -> DirFileSystem:
    """Initialize fsspec filesystem for the given URL.

    `fs_url` is a filesystem URL (`s3://bucket`, `gs://bucket`, `file:///local/path`,
    `memory://name`) or a local path without a protocol. The result is a `DirFileSystem`
    rooted there: `fs.fs.protocol` is the protocol, `fs.path` the bucket or root path, and
    an object `path` lives at `f"{protocol}://{fs.path}/{path}"`.

    Two deliberate differences from upstream, which did not do what its docstring says:
    a bare path (`/srv/media`) is rooted at that path, not at `/`; and only a real local
    protocol (`file`/`local`) turns on directory creation, where upstream's substring test
    (`protocol in "file"`) also matched fragments such as `"fi"`.
    """
    if not fs_url or not fs_url.strip():
        raise ValueError(
            "fs_url must not be empty; give a filesystem URL such as "
            "'file:///tmp/dynamo_media' or 's3://bucket/prefix'"
        )
    protocol, sep, rest = fs_url.partition("://")
    if not sep:
        protocol, root = "file", os.path.abspath(fs_url)
    else:
        root = rest
        if not protocol:
            raise ValueError(f"fs_url {fs_url!r} has no protocol before '://'")
    options = {"auto_mkdir": True} if protocol in _LOCAL_PROTOCOLS else {}
    return DirFileSystem(fs=fsspec.filesystem(protocol, **options), path=root)


def get_media_url(fs: DirFileSystem, storage_path: str, base_url: str | None = None) -> str:
    """Build a public URL for a file stored in the media filesystem.

    With `base_url` (a CDN or proxy), the URL is `{base_url}/{storage_path}`; otherwise it
    is built from the filesystem's protocol and root, e.g. `file:///root/x`, `s3://bucket/x`,
    `memory:///media/x`.
    """
    if base_url:
        return f"{base_url.rstrip('/')}/{storage_path}"
    protocol = fs.fs.protocol
    if isinstance(protocol, list | tuple):
        protocol = protocol[0]
    return f"{protocol}://{fs.path}/{storage_path}"


async def upload_to_fs(
    fs: DirFileSystem, storage_path: str, data: bytes, base_url: str | None = None
) -> str:
    """Upload bytes to the media filesystem and return the public URL.

    The canonical helper for backends storing generated images/videos. The write runs in a
    worker thread so a slow store does not block the event loop.
    """
    await asyncio.to_thread(fs.pipe, storage_path, data)
    return get_media_url(fs, storage_path, base_url)
