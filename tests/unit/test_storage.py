"""`dynamo.common.storage` on real fsspec filesystems: local, memory, and S3 (moto server)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from fsspec.implementations.dirfs import DirFileSystem

from dynamo.common.storage import get_fs, get_media_url, upload_to_fs
from support.s3 import S3Server

pytestmark = pytest.mark.unit


async def test_file_url_roots_at_its_path_and_creates_directories(tmp_path: Path) -> None:
    root = tmp_path / "media"
    fs = get_fs(root.as_uri())
    assert isinstance(fs, DirFileSystem)
    url = await upload_to_fs(fs, "videos/req-1/out.mp4", b"\x00mp4")
    assert (root / "videos" / "req-1" / "out.mp4").read_bytes() == b"\x00mp4"
    assert url == f"file://{root}/videos/req-1/out.mp4"


async def test_bare_path_roots_at_that_path_not_at_slash(tmp_path: Path) -> None:
    # Upstream rooted a protocol-less path at "/"; the docstring promises the path itself.
    root = tmp_path / "bare"
    fs = get_fs(str(root))
    assert fs.path == str(root)
    url = await upload_to_fs(fs, "a/b.png", b"png")
    assert (root / "a" / "b.png").read_bytes() == b"png"
    assert url == f"file://{root}/a/b.png"


async def test_relative_bare_path_is_made_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    fs = get_fs("out/media")
    await upload_to_fs(fs, "x.bin", b"1")
    assert (tmp_path / "out" / "media" / "x.bin").read_bytes() == b"1"


async def test_local_protocol_alias_also_creates_directories(tmp_path: Path) -> None:
    fs = get_fs(f"local://{tmp_path}/l")
    await upload_to_fs(fs, "deep/er/x.bin", b"2")
    assert (tmp_path / "l" / "deep" / "er" / "x.bin").read_bytes() == b"2"


async def test_memory_filesystem_round_trip() -> None:
    name = f"media-{uuid.uuid4().hex[:8]}"
    fs = get_fs(f"memory://{name}")
    url = await upload_to_fs(fs, "videos/request.mp4", b"video")
    assert url == f"memory:///{name}/videos/request.mp4"
    assert fs.cat("videos/request.mp4") == b"video"
    assert get_fs(f"memory://{name}").cat("videos/request.mp4") == b"video"


def test_get_media_url_with_base_url() -> None:
    fs = get_fs("memory://media")
    expected = "https://cdn.example.com/media/videos/request.mp4"
    assert get_media_url(fs, "videos/request.mp4", "https://cdn.example.com/media") == expected
    assert get_media_url(fs, "videos/request.mp4", "https://cdn.example.com/media/") == expected
    assert get_media_url(fs, "videos/request.mp4") == "memory:///media/videos/request.mp4"


async def test_upload_with_base_url_rewrites_the_url(tmp_path: Path) -> None:
    fs = get_fs(tmp_path.as_uri())
    url = await upload_to_fs(fs, "i.png", b"i", base_url="https://cdn.example.com/")
    assert url == "https://cdn.example.com/i.png"
    assert (tmp_path / "i.png").read_bytes() == b"i"


@pytest.mark.parametrize("bad", ["", "   ", "://bucket"])
def test_invalid_urls_are_clear_errors(bad: str) -> None:
    with pytest.raises(ValueError, match="fs_url"):
        get_fs(bad)


def test_unknown_protocols_are_refused() -> None:
    # Upstream's `protocol in "file"` substring test treated "fi" as local.
    with pytest.raises(ValueError, match="fi"):
        get_fs("fi://somewhere")


async def test_s3_round_trip(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    s3_server.apply_env(monkeypatch)
    bucket = s3_server.new_bucket("media")
    fs = get_fs(f"s3://{bucket}/outputs")
    url = await upload_to_fs(fs, "videos/req-9.mp4", b"s3-bytes")
    assert url == f"s3://{bucket}/outputs/videos/req-9.mp4"
    body = s3_server.client().get_object(Bucket=bucket, Key="outputs/videos/req-9.mp4")["Body"]
    assert body.read() == b"s3-bytes"
    assert get_media_url(fs, "videos/req-9.mp4", "https://cdn.example.com") == (
        "https://cdn.example.com/videos/req-9.mp4"
    )


async def test_s3_missing_bucket_fails_loudly(
    s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    s3_server.apply_env(monkeypatch)
    fs = get_fs(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}")
    with pytest.raises((FileNotFoundError, OSError)):
        await upload_to_fs(fs, "x.bin", b"x")
