"""Audio loading for multimodal requests, decoded with soundfile (libsndfile) or PyAV.

Returns `(waveform, sample_rate)` at the file's native sample rate, like vLLM's audio
loader (`librosa.load(..., sr=None)`): a 1-D float32 waveform in [-1, 1], channels averaged
to mono. WAV/FLAC/OGG/MP3 go through libsndfile; anything it cannot read (AAC, M4A, WebM,
...) through PyAV.
"""

from __future__ import annotations

import asyncio
import io
import logging
from typing import Any

import av
import numpy as np
import soundfile

from dynamo.common.http import HttpStatusError
from dynamo.common.http.url_validator import (
    UrlValidationError,
    UrlValidationPolicy,
    describe_media_source,
)

from .media_source import (
    gather_batch_results,
    load_media_bytes,
    refuse_frontend_decoding,
    require_positive_timeout,
    require_url_item,
)

logger = logging.getLogger(__name__)


def _decode_with_soundfile(data: bytes) -> tuple[np.ndarray, float]:
    samples, sample_rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    return samples.mean(axis=1, dtype=np.float32), float(sample_rate)


def _decode_with_pyav(data: bytes) -> tuple[np.ndarray, float]:
    with av.open(io.BytesIO(data), mode="r") as container:
        if not container.streams.audio:
            raise ValueError("no audio stream found")
        stream = container.streams.audio[0]
        # Planar float output keeps the native rate and channel count: (channels, samples).
        resampler = av.AudioResampler(format="fltp", layout=stream.layout, rate=stream.rate)
        chunks: list[np.ndarray] = []
        for frame in container.decode(stream):
            chunks.extend(out.to_ndarray() for out in resampler.resample(frame))
        chunks.extend(out.to_ndarray() for out in resampler.resample(None))
        sample_rate = float(stream.rate)
    if not chunks:
        return np.zeros(0, dtype=np.float32), sample_rate
    samples = np.concatenate(chunks, axis=1)
    return samples.mean(axis=0, dtype=np.float32), sample_rate


def decode_audio(data: bytes) -> tuple[np.ndarray, float]:
    """Decode encoded audio bytes to `(mono float32 waveform, sample_rate)`."""
    try:
        return _decode_with_soundfile(data)
    except soundfile.LibsndfileError as sndfile_error:
        try:
            return _decode_with_pyav(data)
        except (av.FFmpegError, ValueError) as av_error:
            raise ValueError(
                f"unsupported or corrupt audio (libsndfile: {sndfile_error}; FFmpeg: {av_error})"
            ) from av_error


class AudioLoader:
    """Async audio loader for multimodal pipelines.

    Loads http(s) URLs (through the SSRF-safe client), `data:` URLs, `file:` URLs and bare
    paths (only inside the policy's `allowed_local_path`) and returns `(waveform,
    sample_rate)` tuples at the native sample rate; resampling is left to the model's
    processor.
    """

    def __init__(
        self,
        http_timeout: float = 30.0,
        enable_frontend_decoding: bool = False,
        url_policy: UrlValidationPolicy | None = None,
    ) -> None:
        """`http_timeout`: seconds per fetch. `enable_frontend_decoding`: NIXL-transferred
        decoded audio, unavailable here (True raises). `url_policy`: defaults to
        `UrlValidationPolicy.from_env()`."""
        if enable_frontend_decoding:
            refuse_frontend_decoding("audio")
        self._http_timeout = require_positive_timeout(http_timeout)
        self._enable_frontend_decoding = enable_frontend_decoding
        self._url_policy = url_policy if url_policy is not None else UrlValidationPolicy.from_env()

    async def load_audio(self, audio_url: str) -> tuple[np.ndarray, float]:
        """Load audio from a URL and return a (waveform, sample_rate) tuple.

        Supports http(s), data: URIs, file:// paths, and bare filesystem paths.
        Audio is loaded at the native sample rate — no resampling is performed.
        Policy refusals (`UrlValidationError`) and HTTP status errors keep their type;
        anything else becomes a `ValueError` naming the source.
        """
        label = describe_media_source(audio_url)
        try:
            data = await load_media_bytes(audio_url, self._url_policy, self._http_timeout)
            waveform, sample_rate = await asyncio.to_thread(decode_audio, data)
            if waveform.size == 0:
                raise ValueError(f"Failed to decode audio from {label}. Decoded waveform is empty.")
            return waveform, sample_rate
        except (UrlValidationError, HttpStatusError):
            logger.error("URL rejected loading audio: '%s'", label)
            raise
        except Exception as exc:
            logger.error("Error loading audio from %s: %s", label, exc)
            raise ValueError(f"Failed to load audio from {label}: {exc}") from exc

    async def load_audio_batch(
        self, audio_mm_items: list[dict[str, Any]]
    ) -> list[tuple[np.ndarray, float]]:
        """Load a batch of `{"Url": ...}` audio items concurrently.

        Raises the first `HttpStatusError`, else the first `UrlValidationError`, else one
        `Exception` naming every item that failed.
        """
        urls = [require_url_item("audio", i, item) for i, item in enumerate(audio_mm_items)]
        results = await asyncio.gather(
            *(self.load_audio(url) for url in urls), return_exceptions=True
        )
        return gather_batch_results("audio", audio_mm_items, results)
