"""`ImageLoader` on images generated here, served by a real aiohttp server on loopback."""

from __future__ import annotations

import asyncio
import base64
import io
import re
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web
from PIL import Image

from dynamo.common.http import (
    HttpStatusError,
    UrlValidationError,
    UrlValidationPolicy,
)
from dynamo.common.multimodal import ImageLoader
from support.loopback_http import LoopbackHttpServer, loopback_policy, media_app, serve

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("closed_default_http_client")]


def gradient(width: int = 40, height: int = 24) -> np.ndarray:
    y, x = np.mgrid[0:height, 0:width]
    return np.stack(
        [x * 255 // (width - 1), y * 255 // (height - 1), (x + y) * 255 // (width + height - 2)],
        axis=-1,
    ).astype(np.uint8)


PIXELS = gradient()


def encode(fmt: str, array: np.ndarray = PIXELS, mode: str = "RGB", **options: object) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).convert(mode).save(buffer, format=fmt, **options)
    return buffer.getvalue()


RGBA = np.dstack([PIXELS, np.full(PIXELS.shape[:2], 128, dtype=np.uint8)])

FILES = {
    "a.png": encode("PNG"),
    "A.png": encode("PNG", PIXELS[::-1]),  # a different image under a case-variant name
    "b.webp": encode("WEBP", lossless=True),
    "c.jpg": encode("JPEG", quality=95, subsampling=0),
    "rgba.png": encode("PNG", RGBA, mode="RGBA"),
    "anim.gif": encode("GIF"),
    "bitmap.bmp": encode("BMP"),
    "page.html": b"<html><body>not an image</body></html>",
    "truncated.png": encode("PNG")[: len(encode("PNG")) // 2],
    "empty.png": b"",
}


@pytest.fixture(scope="module")
async def media_server() -> AsyncIterator[LoopbackHttpServer]:
    release = asyncio.Event()
    app = media_app(FILES)

    async def slow(request: web.Request) -> web.Response:
        await release.wait()
        return web.Response(body=FILES["a.png"])

    app.router.add_get("/slow.png", slow)
    async with serve(app, "127.0.0.1") as server:
        yield server
        release.set()


@pytest.fixture(scope="module")
async def internal_server() -> AsyncIterator[LoopbackHttpServer]:
    async with serve(media_app(FILES), "127.0.0.2") as server:
        yield server


@pytest.fixture
def server(media_server: LoopbackHttpServer) -> LoopbackHttpServer:
    media_server.requests.clear()
    return media_server


def loader(**kwargs: object) -> ImageLoader:
    return ImageLoader(url_policy=loopback_policy(), **kwargs)  # type: ignore[arg-type]


def pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image)


@pytest.mark.parametrize("name", ["a.png", "b.webp"])
async def test_lossless_images_decode_pixel_exact(server: LoopbackHttpServer, name: str) -> None:
    image = await loader().load_image(server.url(f"media/{name}"))
    assert image.mode == "RGB"
    assert image.size == (40, 24)
    np.testing.assert_array_equal(pixels(image), PIXELS)


async def test_jpeg_decodes_within_tolerance(server: LoopbackHttpServer) -> None:
    image = await loader().load_image(server.url("media/c.jpg"))
    diff = np.abs(pixels(image).astype(int) - PIXELS.astype(int))
    assert image.mode == "RGB"
    assert diff.mean() < 3.0


async def test_alpha_is_dropped_to_rgb(server: LoopbackHttpServer) -> None:
    image = await loader().load_image(server.url("media/rgba.png"))
    assert image.mode == "RGB"
    np.testing.assert_array_equal(pixels(image), RGBA[..., :3])


@pytest.mark.parametrize("name", ["anim.gif", "bitmap.bmp", "page.html"])
async def test_unsupported_formats_are_415(server: LoopbackHttpServer, name: str) -> None:
    url = server.url(f"media/{name}")
    with pytest.raises(HttpStatusError) as caught:
        await loader().load_image(url)
    assert caught.value.status == 415
    assert caught.value.message == "Unsupported Media Type"
    assert caught.value.url == url


@pytest.mark.parametrize(
    ("name", "message"),
    [("truncated.png", "Failed to load image"), ("empty.png", "Empty response content")],
)
async def test_broken_images_are_value_errors(
    server: LoopbackHttpServer, name: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        await loader().load_image(server.url(f"media/{name}"))


async def test_http_status_is_preserved(server: LoopbackHttpServer) -> None:
    with pytest.raises(HttpStatusError) as caught:
        await loader().load_image(server.url("media/missing.png"))
    assert caught.value.status == 404


async def test_timeouts_are_value_errors(server: LoopbackHttpServer) -> None:
    with pytest.raises(ValueError, match="Timeout loading image"):
        await loader(http_timeout=0.3).load_image(server.url("slow.png"))


async def test_default_policy_refuses_loopback(
    server: LoopbackHttpServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DYN_MM_ALLOW_INTERNAL", raising=False)
    default = ImageLoader()
    with pytest.raises(UrlValidationError, match="http:// URLs are not allowed"):
        await default.load_image(server.url("media/a.png"))
    with pytest.raises(UrlValidationError, match="blocked range"):
        await ImageLoader(url_policy=UrlValidationPolicy(allow_http=True)).load_image(
            server.url("media/a.png")
        )
    assert server.requests == []


async def test_redirect_to_an_internal_address_is_refused(
    server: LoopbackHttpServer, internal_server: LoopbackHttpServer
) -> None:
    internal_server.requests.clear()
    target = internal_server.url("media/a.png")
    with pytest.raises(UrlValidationError, match=r"127\.0\.0\.2"):
        await loader().load_image(server.url("redirect") + f"?to={target}")
    assert internal_server.requests == []
    with pytest.raises(UrlValidationError, match=r"169\.254\.169\.254"):
        await loader().load_image(server.url("redirect") + "?to=http://169.254.169.254/x.png")


async def test_redirect_within_policy_is_followed(server: LoopbackHttpServer) -> None:
    target = server.url("media/a.png")
    image = await loader().load_image(server.url("redirect") + f"?to={target}")
    np.testing.assert_array_equal(pixels(image), PIXELS)


def data_url(media_type: str, payload: bytes) -> str:
    return f"data:{media_type};base64,{base64.b64encode(payload).decode()}"


async def test_data_urls() -> None:
    image = await loader().load_image(data_url("image/png", FILES["a.png"]))
    np.testing.assert_array_equal(pixels(image), PIXELS)
    with pytest.raises(HttpStatusError) as caught:
        await loader().load_image(data_url("image/gif", FILES["anim.gif"]))
    assert caught.value.status == 415
    bad = [
        (data_url("text/plain", FILES["a.png"]), "Data URL must be an image type"),
        ("data:image/png," + "x" * 10, "Data URL must be base64 encoded"),
        ("data:image/png;base64,@@@@", "Invalid base64 encoding"),
        ("data:image/png;base64", "no ','"),
    ]
    for url, message in bad:
        with pytest.raises(ValueError, match=message):
            await loader().load_image(url)


async def test_local_files_are_refused_even_when_the_policy_allows_them(tmp_path: Path) -> None:
    path = tmp_path / "a.png"
    path.write_bytes(FILES["a.png"])
    permissive = ImageLoader(url_policy=UrlValidationPolicy(allowed_local_path=str(tmp_path)))
    for url in (str(path), path.as_uri()):
        with pytest.raises(ValueError, match="local file access is not allowed"):
            await permissive.load_image(url)
    with pytest.raises(ValueError, match="Invalid image source scheme: ftp"):
        await permissive.load_image("ftp://example.com/a.png")


async def test_cache_and_coalescing(server: LoopbackHttpServer) -> None:
    images = loader(cache_size=2)
    url = server.url("media/a.png")
    first = await asyncio.gather(*(images.load_image(url) for _ in range(5)))
    assert server.requests == ["/media/a.png"]  # five callers, one download
    assert all(image is first[0] for image in first)
    # Scheme and host are case-insensitive; the cached image is reused.
    upper = url.replace("http://", "HTTP://")
    assert await images.load_image(upper) is first[0]
    assert server.requests == ["/media/a.png"]
    # Paths are case-sensitive: /media/A.png is another image, not a cache hit.
    other = await images.load_image(server.url("media/A.png"))
    np.testing.assert_array_equal(pixels(other), PIXELS[::-1])
    assert server.requests == ["/media/a.png", "/media/A.png"]


async def test_cache_evicts_least_recently_used(server: LoopbackHttpServer) -> None:
    images = loader(cache_size=1)
    await images.load_image(server.url("media/a.png"))
    await images.load_image(server.url("media/b.webp"))
    await images.load_image(server.url("media/a.png"))
    assert server.requests == ["/media/a.png", "/media/b.webp", "/media/a.png"]
    uncached = loader(cache_size=0)
    await uncached.load_image(server.url("media/a.png"))
    await uncached.load_image(server.url("media/a.png"))
    assert server.requests[-2:] == ["/media/a.png", "/media/a.png"]


async def test_failed_downloads_are_not_cached(server: LoopbackHttpServer) -> None:
    images = loader()
    for _ in range(2):
        with pytest.raises(HttpStatusError):
            await images.load_image(server.url("media/missing.png"))
    assert server.requests == ["/media/missing.png", "/media/missing.png"]


async def test_batch_loads_in_order_with_uuid_slots(server: LoopbackHttpServer) -> None:
    items = [
        {"Url": server.url("media/a.png")},
        {"UuidOnly": "sha256:abc"},
        {"Url": server.url("media/A.png")},
    ]
    result = await loader().load_image_batch(items, preserve_uuid_slots=True)
    assert result[1] is None
    np.testing.assert_array_equal(pixels(result[0]), PIXELS)
    np.testing.assert_array_equal(pixels(result[2]), PIXELS[::-1])
    with pytest.raises(ValueError, match="UUID-only"):
        await loader().load_image_batch(items)


async def test_batch_error_precedence(server: LoopbackHttpServer) -> None:
    unsupported = {"Url": server.url("media/anim.gif")}
    refused = {"Url": "https://169.254.169.254/latest/meta-data/"}
    broken = {"Url": server.url("media/truncated.png")}
    good = {"Url": server.url("media/a.png")}
    with pytest.raises(HttpStatusError) as caught:
        await loader().load_image_batch([good, refused, unsupported, broken])
    assert caught.value.status == 415
    with pytest.raises(UrlValidationError):
        await loader().load_image_batch([broken, refused, good])
    with pytest.raises(Exception, match="Failed to load image") as combined:
        await loader().load_image_batch([broken, good, broken])
    assert type(combined.value) is Exception
    assert str(combined.value).count("Failed to load image from") == 2


async def test_batch_refuses_bad_items_before_loading(server: LoopbackHttpServer) -> None:
    good = {"Url": server.url("media/a.png")}
    with pytest.raises(ValueError, match="Could not load decoded media from frontend"):
        await loader().load_image_batch([good, {"Decoded": {"shape": [1]}}])
    with pytest.raises(ValueError, match=re.escape("expected one of 'Url'")):
        await loader().load_image_batch([good, {"Other": 1}])
    assert server.requests == []


def test_constructor_validation() -> None:
    with pytest.raises(RuntimeError, match="enable_frontend_decoding=True is not supported"):
        ImageLoader(enable_frontend_decoding=True)
    with pytest.raises(ValueError, match="http_timeout must be positive"):
        ImageLoader(http_timeout=0)
    with pytest.raises(ValueError, match="cache_size must be 0 or more"):
        ImageLoader(cache_size=-1)
    assert ImageLoader.CACHE_SIZE_MAXIMUM >= 0
