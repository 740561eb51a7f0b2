"""`VideoLoader` on clips encoded here with PyAV, served by a loopback aiohttp server."""

from __future__ import annotations

import base64
import io
from collections.abc import AsyncIterator
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest

from dynamo.common.http import HttpStatusError, UrlValidationError, UrlValidationPolicy
from dynamo.common.multimodal import VideoLoader
from dynamo.common.multimodal.video_loader import sample_frame_indices
from support.loopback_http import LoopbackHttpServer, loopback_policy, media_app, serve

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("closed_default_http_client")]

FRAME_COUNT = 10
FPS = 10


def frame_pixels(index: int, size: int = 32) -> np.ndarray:
    """A frame whose colour identifies its index, plus a gradient so it is not flat."""
    frame = np.zeros((size, size, 3), dtype=np.uint8)
    frame[..., 0] = 20 * index
    frame[..., 1] = 255 - 20 * index
    frame[..., 2] = np.arange(size, dtype=np.uint8)[None, :] * 4
    return frame


FRAMES = [frame_pixels(i) for i in range(FRAME_COUNT)]


def encode_video(codec: str, container_format: str, pix_fmt: str, **options: str) -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=container_format) as container:
        stream = container.add_stream(codec, rate=FPS, options=options)
        assert isinstance(stream, av.VideoStream)
        stream.width, stream.height, stream.pix_fmt = 32, 32, pix_fmt
        stream.time_base = Fraction(1, FPS)
        for index, pixels in enumerate(FRAMES):
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            frame.pts = index
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return buffer.getvalue()


def audio_only() -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="wav") as container:
        stream = container.add_stream("pcm_s16le", rate=8000, layout="mono")
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16")
        frame.sample_rate = 8000
        for packet in stream.encode(frame):
            container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return buffer.getvalue()


FILES = {
    # FFV1 in RGB is lossless, so decoded frames must equal the originals bit for bit.
    "lossless.mkv": encode_video("ffv1", "matroska", "bgr0"),
    "h264.mp4": encode_video("libx264", "mp4", "yuv420p", crf="18"),
    "sound.wav": audio_only(),
    "noise.bin": bytes(range(256)) * 16,
}


@pytest.fixture(scope="module")
async def media_server() -> AsyncIterator[LoopbackHttpServer]:
    async with serve(media_app(FILES), "127.0.0.1") as server:
        yield server


@pytest.fixture
def server(media_server: LoopbackHttpServer) -> LoopbackHttpServer:
    media_server.requests.clear()
    return media_server


def loader(num_frames: int = 32) -> VideoLoader:
    return VideoLoader(num_frames=num_frames, url_policy=loopback_policy())


@pytest.mark.parametrize(
    ("total", "wanted", "expected"),
    [
        (10, 4, [0, 3, 6, 9]),
        (10, 10, list(range(10))),
        (10, 32, list(range(10))),
        (10, 0, list(range(10))),
        (10, -1, list(range(10))),
        (100, 3, [0, 49, 99]),
        (0, 4, []),
    ],
)
def test_uniform_sampling(total: int, wanted: int, expected: list[int]) -> None:
    assert sample_frame_indices(total, wanted) == expected


async def test_lossless_clip_sampled_frames_are_exact(server: LoopbackHttpServer) -> None:
    frames, metadata = await loader(num_frames=4).load_video(server.url("media/lossless.mkv"))
    assert frames.shape == (4, 32, 32, 3)
    assert frames.dtype == np.uint8
    assert frames.flags["C_CONTIGUOUS"]
    assert metadata["frames_indices"] == [0, 3, 6, 9]
    for decoded, index in zip(frames, metadata["frames_indices"], strict=True):
        np.testing.assert_array_equal(decoded, FRAMES[index])
    assert metadata["total_num_frames"] == FRAME_COUNT
    assert metadata["fps"] == pytest.approx(FPS)
    assert metadata["duration"] == pytest.approx(FRAME_COUNT / FPS)
    assert metadata["video_backend"] == "pyav"
    assert metadata["do_sample_frames"] is False


async def test_short_clips_return_every_frame(server: LoopbackHttpServer) -> None:
    frames, metadata = await loader(num_frames=32).load_video(server.url("media/lossless.mkv"))
    assert len(frames) == FRAME_COUNT
    np.testing.assert_array_equal(frames, np.stack(FRAMES))
    assert metadata["frames_indices"] == list(range(FRAME_COUNT))


async def test_h264_mp4_decodes_within_tolerance(server: LoopbackHttpServer) -> None:
    frames, metadata = await loader(num_frames=5).load_video(server.url("media/h264.mp4"))
    assert frames.shape == (5, 32, 32, 3)
    assert metadata["total_num_frames"] == FRAME_COUNT
    assert metadata["fps"] == pytest.approx(FPS)
    for decoded, index in zip(frames, metadata["frames_indices"], strict=True):
        error = np.abs(decoded.astype(int) - FRAMES[index].astype(int)).mean()
        assert error < 6.0, f"frame {index}: mean abs error {error:.2f}"


async def test_data_urls_and_local_files(tmp_path: Path) -> None:
    url = "data:video/x-matroska;base64," + base64.b64encode(FILES["lossless.mkv"]).decode()
    frames, _ = await loader(num_frames=2).load_video(url)
    np.testing.assert_array_equal(frames, np.stack([FRAMES[0], FRAMES[9]]))

    clip = tmp_path / "clip.mkv"
    clip.write_bytes(FILES["lossless.mkv"])
    local = VideoLoader(
        num_frames=3, url_policy=UrlValidationPolicy(allowed_local_path=str(tmp_path))
    )
    frames, metadata = await local.load_video(clip.as_uri())
    assert metadata["frames_indices"] == [0, 4, 9]
    np.testing.assert_array_equal(frames[1], FRAMES[4])
    with pytest.raises(UrlValidationError, match="set DYN_MM_LOCAL_PATH to enable"):
        await VideoLoader(url_policy=UrlValidationPolicy()).load_video(str(clip))


@pytest.mark.parametrize(
    ("name", "message"), [("sound.wav", "no video stream"), ("noise.bin", "Failed to load video")]
)
async def test_undecodable_inputs_are_value_errors(
    server: LoopbackHttpServer, name: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        await loader().load_video(server.url(f"media/{name}"))


async def test_http_errors_and_policy(server: LoopbackHttpServer) -> None:
    with pytest.raises(HttpStatusError) as caught:
        await loader().load_video(server.url("media/missing.mp4"))
    assert caught.value.status == 404
    with pytest.raises(UrlValidationError, match="is blocked"):
        await loader().load_video(server.url("redirect") + "?to=http://metadata.google.internal/")
    with pytest.raises(UrlValidationError, match="scheme 'gopher' not allowed"):
        await loader().load_video("gopher://example.com/v.mp4")


async def test_batch(server: LoopbackHttpServer) -> None:
    items = [{"Url": server.url("media/lossless.mkv")}, {"Url": server.url("media/h264.mp4")}]
    results = await loader(num_frames=2).load_video_batch(items)
    assert [frames.shape[0] for frames, _ in results] == [2, 2]
    with pytest.raises(HttpStatusError):
        await loader().load_video_batch([*items, {"Url": server.url("media/gone.mp4")}])
    with pytest.raises(ValueError, match="Received decoded video data"):
        await loader().load_video_batch([{"Decoded": {}}])


def test_constructor_validation() -> None:
    with pytest.raises(RuntimeError, match="enable_frontend_decoding=True is not supported"):
        VideoLoader(enable_frontend_decoding=True)
    with pytest.raises(ValueError, match="http_timeout must be positive"):
        VideoLoader(http_timeout=0)
    assert VideoLoader.NUM_FRAMES_DEFAULT > 0
