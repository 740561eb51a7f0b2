"""Forward-pass metrics: the version-1 msgpack-map wire format, decoding, Welford stats."""

from __future__ import annotations

import logging
import statistics

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dynamo.common.forward_pass_metrics import (
    FPM_VERSION,
    ForwardPassMetrics,
    QueuedRequestMetrics,
    ScheduledRequestMetrics,
    UnsupportedFpmVersionError,
    WelfordAccumulator,
    decode,
    encode,
)

pytestmark = pytest.mark.unit


def sample_metrics(counter_id: int = 7) -> ForwardPassMetrics:
    return ForwardPassMetrics(
        worker_id="1a2b",
        dp_rank=1,
        counter_id=counter_id,
        wall_time=0.0125,
        scheduled_requests=ScheduledRequestMetrics(
            num_prefill_requests=2,
            sum_prefill_tokens=900,
            var_prefill_length=12.5,
            sum_prefill_kv_tokens=128,
            num_decode_requests=30,
            sum_decode_kv_tokens=40_000,
            var_decode_kv_tokens=3.25,
        ),
        queued_requests=QueuedRequestMetrics(num_prefill_requests=4, sum_prefill_tokens=2000),
    )


def test_defaults_are_an_all_zero_version_1_message() -> None:
    idle = ForwardPassMetrics()
    assert FPM_VERSION == 1
    assert idle.version == 1
    assert (idle.worker_id, idle.dp_rank, idle.counter_id, idle.wall_time) == ("", 0, 0, 0.0)
    assert idle.scheduled_requests == ScheduledRequestMetrics()
    assert idle.queued_requests == QueuedRequestMetrics()


def test_wire_format_is_a_msgpack_map_keyed_by_field_name_in_declaration_order() -> None:
    raw = msgspec.msgpack.decode(encode(sample_metrics()))
    assert list(raw) == [
        "version",
        "worker_id",
        "dp_rank",
        "counter_id",
        "wall_time",
        "scheduled_requests",
        "queued_requests",
    ]
    assert list(raw["scheduled_requests"]) == [
        "num_prefill_requests",
        "sum_prefill_tokens",
        "var_prefill_length",
        "sum_prefill_kv_tokens",
        "num_decode_requests",
        "sum_decode_kv_tokens",
        "var_decode_kv_tokens",
    ]
    # Defaults are written too: a reader never has to know them.
    assert raw["queued_requests"] == {
        "num_prefill_requests": 4,
        "sum_prefill_tokens": 2000,
        "var_prefill_length": 0.0,
        "num_decode_requests": 0,
        "sum_decode_kv_tokens": 0,
        "var_decode_kv_tokens": 0.0,
    }
    # First byte of a msgpack fixmap with 7 entries.
    assert encode(sample_metrics())[0] == 0x87


def test_round_trip() -> None:
    metrics = sample_metrics()
    assert decode(encode(metrics)) == metrics


def test_decode_accepts_a_map_written_by_another_producer() -> None:
    # A producer in another language writes plain maps; unknown extra keys are ignored.
    payload = msgspec.msgpack.encode(
        {"version": 1, "worker_id": "w", "counter_id": 3, "future_field": [1, 2]}
    )
    decoded = decode(payload)
    assert decoded == ForwardPassMetrics(worker_id="w", counter_id=3)


@pytest.mark.parametrize(
    "payload",
    [b"", b"\xc1", b"not msgpack at all", msgspec.msgpack.encode([1, 2, 3])],
)
def test_decode_returns_none_on_garbage(payload: bytes, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert decode(payload) is None
    assert "Failed to decode ForwardPassMetrics" in caplog.text


def test_decode_returns_none_on_wrong_field_types() -> None:
    assert decode(msgspec.msgpack.encode({"version": 1, "dp_rank": "zero"})) is None


@pytest.mark.parametrize("version", [0, 2, 99])
def test_decode_returns_none_on_unknown_version(
    version: int, caplog: pytest.LogCaptureFixture
) -> None:
    payload = encode(ForwardPassMetrics(version=version, counter_id=1))
    with caplog.at_level(logging.WARNING):
        assert decode(payload) is None
    assert "unsupported version" in caplog.text


def test_structs_are_frozen() -> None:
    with pytest.raises(AttributeError):
        sample_metrics().counter_id = 1  # type: ignore[misc]


def test_unsupported_version_error_is_an_exception() -> None:
    assert issubclass(UnsupportedFpmVersionError, Exception)


def test_welford_empty() -> None:
    acc = WelfordAccumulator()
    assert (acc.n, acc.s, acc.variance()) == (0, 0, 0.0)


@given(st.lists(st.integers(min_value=0, max_value=10**9), min_size=1, max_size=200))
def test_welford_matches_population_variance(values: list[int]) -> None:
    acc = WelfordAccumulator()
    for value in values:
        acc.add(value)
    assert acc.n == len(values)
    assert acc.s == sum(values)
    assert acc.variance() == pytest.approx(statistics.pvariance(values), rel=1e-9, abs=1e-6)


def test_welford_is_stable_with_large_offsets() -> None:
    # Sum-of-squares would lose these small differences entirely at 1e12.
    values = [10**12 + delta for delta in (1, 2, 3, 4)]
    acc = WelfordAccumulator()
    for value in values:
        acc.add(value)
    assert acc.variance() == pytest.approx(1.25)
