"""Native-offloading capacity metadata: accepted values and every refused edge case."""

from __future__ import annotations

import math
from typing import Any

import pytest

from dynamo.common.native_offloading import (
    NATIVE_OFFLOADING_CAPACITY_RUNTIME_KEY,
    get_native_offloading_capacity_tokens,
    native_offloading_capacity,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1, {"total_tokens": 1}),
        (4096, {"total_tokens": 4096}),
        (4096.9, {"total_tokens": 4096}),
        (True, None),
        (False, None),
        (0, None),
        (-5, None),
        (0.0, None),
        (0.5, None),  # positive, but truncates to zero tokens
        (math.nan, None),
        (math.inf, None),
        (-math.inf, None),
        ("4096", None),
        (None, None),
        ([4096], None),
    ],
)
def test_capacity_builder(value: object, expected: dict[str, int] | None) -> None:
    assert native_offloading_capacity(value) == expected


def test_key_name() -> None:
    assert NATIVE_OFFLOADING_CAPACITY_RUNTIME_KEY == "native_offloading_capacity"


@pytest.mark.parametrize(
    ("runtime_data", "expected"),
    [
        ({"native_offloading_capacity": {"total_tokens": 1024}}, 1024),
        ({"native_offloading_capacity": {"total_tokens": 1024.0}}, 1024),
        ({"native_offloading_capacity": {"total_tokens": True}}, None),
        ({"native_offloading_capacity": {"total_tokens": math.nan}}, None),
        ({"native_offloading_capacity": {"total_tokens": 0}}, None),
        ({"native_offloading_capacity": {}}, None),
        ({"native_offloading_capacity": 1024}, None),
        ({}, None),
        (None, None),
        ([("native_offloading_capacity", {"total_tokens": 1})], None),
    ],
)
def test_capacity_reader(runtime_data: Any, expected: int | None) -> None:
    assert get_native_offloading_capacity_tokens(runtime_data) == expected


def test_round_trip_through_runtime_data() -> None:
    runtime_data = {NATIVE_OFFLOADING_CAPACITY_RUNTIME_KEY: native_offloading_capacity(70_000)}
    assert get_native_offloading_capacity_tokens(runtime_data) == 70_000
