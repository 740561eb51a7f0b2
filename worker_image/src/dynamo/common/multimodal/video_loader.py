"""Video loading for multimodal requests, decoded in software with PyAV (FFmpeg).

`load_video` returns `(frames, metadata)`: `frames` is a uint8 array `(N, H, W, 3)` in RGB
holding `num_frames` frames sampled uniformly over the clip (all frames when the clip is
shorter, or when `num_frames <= 0`), the same sampling vLLM applies; `metadata` describes
the source (`total_num_frames`, `fps`, `duration`, `frames_indices`, `video_backend`,
`do_sample_frames`).

Upstream decodes H.264/H.265 on NVDEC when a GPU is present and falls back to software;
this runtime always uses the software decoder.
"""

from __future__ import annotations

import asyncio
import io
import logging
from typing import Any, ClassVar

import av
import numpy as np

from dynamo.common.http import HttpStatusError
from dynamo.common.http.url_validator import (
    UrlValidationError,
    UrlValidationPolicy,
    describe_media_source,
)

from .media_source import (
    env_int,
    gather_batch_results,
    load_media_bytes,
    refuse_frontend_decoding,
    require_positive_timeout,
    require_url_item,
)

logger = logging.getLogger(__name__)


def sample_frame_indices(total_frames: int, num_frames: int) -> list[int]:
    """Uniformly spaced frame indices, first and last included (all when fewer than asked)."""
    if num_frames <= 0 or total_frames <= num_frames:
        return list(range(total_frames))
    return [int(i) for i in np.linspace(0, total_frames - 1, num_frames, dtype=int)]


def _count_video_packets(data: bytes) -> int:
    # Demuxing without decoding is cheap and exact where container headers (stream.frames)
    # are often missing or approximate.
    with av.open(io.BytesIO(data), mode="r") as container:
        stream = container.streams.video[0]
        return sum(1 for packet in container.demux(stream) if packet.size > 0)


def decode_video(data: bytes, num_frames: int) -> tuple[np.ndarray, dict[str, Any]]:
    """Decode encoded video bytes into sampled RGB frames plus source metadata."""
    with av.open(io.BytesIO(data), mode="r") as probe:
        if not probe.streams.video:
            raise ValueError("no video stream found")
        stream = probe.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate
        fps = float(rate) if rate else 0.0
    total = _count_video_packets(data)
    wanted = sample_frame_indices(total, num_frames)
    wanted_set = set(wanted)
    frames: list[np.ndarray] = []
    decoded = 0
    with av.open(io.BytesIO(data), mode="r") as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        for index, frame in enumerate(container.decode(stream)):
            decoded = index + 1
            if index in wanted_set:
                frames.append(frame.to_ndarray(format="rgb24"))
            if len(frames) == len(wanted):
                break
    if len(frames) < len(wanted):
        # The decoder produced fewer frames than the demuxer counted packets (e.g. a
        # corrupt tail): keep what decoded and report the indices that were really read.
        wanted = wanted[: len(frames)]
        total = max(decoded, len(frames))
    if not frames:
        return np.zeros((0, 0, 0, 3), dtype=np.uint8), {}
    metadata: dict[str, Any] = {
        "total_num_frames": total,
        "fps": fps,
        "duration": total / fps if fps > 0 else 0.0,
        "frames_indices": wanted,
        "video_backend": "pyav",
        # Frames are already sampled here; the processor must not sample again.
        "do_sample_frames": False,
    }
    return np.stack(frames), metadata


class VideoLoader:
    """Async video loader for multimodal pipelines (see the module docstring)."""

    NUM_FRAMES_DEFAULT: ClassVar[int] = env_int("DYN_MM_VIDEO_NUM_FRAMES", 32)

    def __init__(
        self,
        http_timeout: float = 60.0,
        num_frames: int = NUM_FRAMES_DEFAULT,
        enable_frontend_decoding: bool = False,
        url_policy: UrlValidationPolicy | None = None,
    ) -> None:
        """`http_timeout`: seconds per fetch. `num_frames`: frames sampled per clip
        (default `DYN_MM_VIDEO_NUM_FRAMES`, else 32; <= 0 keeps every frame).
        `enable_frontend_decoding`: NIXL-transferred decoded video, unavailable here (True
        raises). `url_policy`: defaults to `UrlValidationPolicy.from_env()`."""
        if enable_frontend_decoding:
            refuse_frontend_decoding("video")
        self._http_timeout = require_positive_timeout(http_timeout)
        self._num_frames = num_frames
        self._enable_frontend_decoding = enable_frontend_decoding
        self._url_policy = url_policy if url_policy is not None else UrlValidationPolicy.from_env()

    async def load_video(self, video_url: str) -> tuple[np.ndarray, dict[str, Any]]:
        """Load a video from http(s), `data:`, `file:` or a bare path; return frames + metadata.

        Policy refusals (`UrlValidationError`) and HTTP status errors keep their type;
        anything else becomes a `ValueError` naming the source.
        """
        label = describe_media_source(video_url)
        try:
            data = await load_media_bytes(video_url, self._url_policy, self._http_timeout)
            frames, metadata = await asyncio.to_thread(decode_video, data, self._num_frames)
            if frames.size == 0:
                raise ValueError(
                    f"Failed to extract video frames from {label}. Decoded clip is empty."
                )
            return np.ascontiguousarray(frames), metadata
        except (UrlValidationError, HttpStatusError):
            logger.error("URL rejected loading video: '%s'", label)
            raise
        except Exception as exc:
            logger.error("Error loading video from %s: %s", label, exc)
            raise ValueError(f"Failed to load video from {label}: {exc}") from exc

    async def load_video_batch(
        self, video_mm_items: list[dict[str, Any]]
    ) -> list[tuple[np.ndarray, dict[str, Any]]]:
        """Load a batch of `{"Url": ...}` video items concurrently.

        Raises the first `HttpStatusError`, else the first `UrlValidationError`, else one
        `Exception` naming every item that failed.
        """
        urls = [require_url_item("video", i, item) for i, item in enumerate(video_mm_items)]
        results = await asyncio.gather(
            *(self.load_video(url) for url in urls), return_exceptions=True
        )
        return gather_batch_results("video", video_mm_items, results)
