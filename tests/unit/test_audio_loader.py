"""`AudioLoader` on audio generated here (soundfile and PyAV encoders), served on loopback."""

from __future__ import annotations

import base64
import io
from collections.abc import AsyncIterator
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
import soundfile

from dynamo.common.http import HttpStatusError, UrlValidationError, UrlValidationPolicy
from dynamo.common.multimodal import AudioLoader
from support.loopback_http import LoopbackHttpServer, loopback_policy, media_app, serve

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("closed_default_http_client")]

RATE = 16_000


def tone(frequency: float, seconds: float = 0.5, rate: int = RATE) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.5 * np.sin(2 * np.pi * frequency * t)).astype(np.float32)


MONO = tone(440.0)
STEREO = np.stack([tone(440.0, rate=44_100), tone(660.0, rate=44_100)], axis=1)


def encode_soundfile(samples: np.ndarray, rate: int, fmt: str, subtype: str) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format=fmt, subtype=subtype)
    return buffer.getvalue()


def encode_aac(samples: np.ndarray, rate: int) -> bytes:
    """AAC in an MP4 container, which libsndfile cannot read (exercises the PyAV path)."""
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("aac", rate=rate, layout="mono")
        block = 1024
        for start in range(0, len(samples), block):
            chunk = samples[start : start + block]
            frame = av.AudioFrame.from_ndarray(chunk[np.newaxis, :], format="flt", layout="mono")
            frame.sample_rate = rate
            frame.pts = start
            frame.time_base = Fraction(1, rate)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return buffer.getvalue()


FILES = {
    "mono16.wav": encode_soundfile(MONO, RATE, "WAV", "PCM_16"),
    "float.wav": encode_soundfile(MONO, RATE, "WAV", "FLOAT"),
    "stereo.flac": encode_soundfile(STEREO, 44_100, "FLAC", "PCM_16"),
    "tone.m4a": encode_aac(MONO, RATE),
    "noise.bin": bytes(range(256)) * 8,
}


@pytest.fixture(scope="module")
async def media_server() -> AsyncIterator[LoopbackHttpServer]:
    async with serve(media_app(FILES), "127.0.0.1") as server:
        yield server


@pytest.fixture
def server(media_server: LoopbackHttpServer) -> LoopbackHttpServer:
    media_server.requests.clear()
    return media_server


def loader(**kwargs: object) -> AudioLoader:
    return AudioLoader(url_policy=loopback_policy(), **kwargs)  # type: ignore[arg-type]


def dominant_frequency(samples: np.ndarray, rate: float) -> float:
    spectrum = np.abs(np.fft.rfft(samples))
    return float(np.fft.rfftfreq(len(samples), 1 / rate)[int(np.argmax(spectrum))])


async def test_pcm16_wav_matches_within_quantisation(server: LoopbackHttpServer) -> None:
    waveform, rate = await loader().load_audio(server.url("media/mono16.wav"))
    assert rate == 16_000.0
    assert waveform.dtype == np.float32
    assert waveform.shape == MONO.shape
    np.testing.assert_allclose(waveform, MONO, atol=1 / 32_768)


async def test_float_wav_is_sample_exact(server: LoopbackHttpServer) -> None:
    waveform, _ = await loader().load_audio(server.url("media/float.wav"))
    np.testing.assert_array_equal(waveform, MONO)


async def test_stereo_is_averaged_to_mono_at_the_native_rate(server: LoopbackHttpServer) -> None:
    waveform, rate = await loader().load_audio(server.url("media/stereo.flac"))
    assert rate == 44_100.0
    assert waveform.ndim == 1
    np.testing.assert_allclose(waveform, STEREO.mean(axis=1), atol=2 / 32_768)


async def test_formats_libsndfile_cannot_read_fall_back_to_pyav(
    server: LoopbackHttpServer,
) -> None:
    with pytest.raises(soundfile.LibsndfileError):
        soundfile.read(io.BytesIO(FILES["tone.m4a"]))
    waveform, rate = await loader().load_audio(server.url("media/tone.m4a"))
    assert rate == 16_000.0
    assert waveform.dtype == np.float32
    # AAC is lossy and adds encoder delay: same tone, about the same length.
    assert abs(len(waveform) - len(MONO)) <= 2_048
    assert dominant_frequency(waveform, rate) == pytest.approx(440.0, abs=4.0)


async def test_undecodable_audio_is_a_value_error(server: LoopbackHttpServer) -> None:
    with pytest.raises(ValueError, match=r"Failed to load audio from .*noise\.bin"):
        await loader().load_audio(server.url("media/noise.bin"))


async def test_http_errors_and_policy(server: LoopbackHttpServer) -> None:
    with pytest.raises(HttpStatusError) as caught:
        await loader().load_audio(server.url("media/missing.wav"))
    assert caught.value.status == 404
    with pytest.raises(UrlValidationError, match="blocked range"):
        await loader().load_audio(server.url("redirect") + "?to=http://10.1.2.3/a.wav")
    with pytest.raises(UrlValidationError, match="http:// URLs are not allowed"):
        await AudioLoader(url_policy=UrlValidationPolicy()).load_audio(
            server.url("media/mono16.wav")
        )
    assert server.requests == ["/media/missing.wav", "/redirect?to=http://10.1.2.3/a.wav"]


async def test_data_urls() -> None:
    url = "data:audio/wav;base64," + base64.b64encode(FILES["mono16.wav"]).decode()
    waveform, rate = await loader().load_audio(url)
    assert rate == 16_000.0
    np.testing.assert_allclose(waveform, MONO, atol=1 / 32_768)
    with pytest.raises(ValueError, match="Data URL must be base64 encoded"):
        await loader().load_audio("data:audio/wav,abc")


async def test_local_files_only_inside_the_allowed_directory(tmp_path: Path) -> None:
    media = tmp_path / "media"
    media.mkdir()
    clip = media / "clip.wav"
    clip.write_bytes(FILES["mono16.wav"])
    outside = tmp_path / "outside.wav"
    outside.write_bytes(FILES["mono16.wav"])

    allowed = AudioLoader(url_policy=UrlValidationPolicy(allowed_local_path=str(media)))
    for reference in (str(clip), clip.as_uri()):
        waveform, rate = await allowed.load_audio(reference)
        assert rate == 16_000.0
        np.testing.assert_allclose(waveform, MONO, atol=1 / 32_768)
    with pytest.raises(UrlValidationError, match="outside the allowed directory"):
        await allowed.load_audio(str(outside))
    with pytest.raises(UrlValidationError, match="set DYN_MM_LOCAL_PATH to enable"):
        await AudioLoader(url_policy=UrlValidationPolicy()).load_audio(str(clip))


async def test_batch(server: LoopbackHttpServer) -> None:
    items = [{"Url": server.url("media/mono16.wav")}, {"Url": server.url("media/stereo.flac")}]
    results = await loader().load_audio_batch(items)
    assert [rate for _, rate in results] == [16_000.0, 44_100.0]
    with pytest.raises(UrlValidationError):
        await loader().load_audio_batch([*items, {"Url": "https://[::1]/a.wav"}])
    with pytest.raises(Exception, match="Failed to load audio from") as combined:
        await loader().load_audio_batch([*items, {"Url": server.url("media/noise.bin")}])
    assert type(combined.value) is Exception
    with pytest.raises(ValueError, match="Received decoded audio data"):
        await loader().load_audio_batch([{"Decoded": {}}])
    with pytest.raises(ValueError, match="Invalid audio multimodal item at index 1"):
        await loader().load_audio_batch([items[0], {"Nope": 1}])


def test_constructor_validation() -> None:
    with pytest.raises(RuntimeError, match="enable_frontend_decoding=True is not supported"):
        AudioLoader(enable_frontend_decoding=True)
    with pytest.raises(ValueError, match="http_timeout must be positive, got -1"):
        AudioLoader(http_timeout=-1)
