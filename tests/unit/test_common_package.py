"""Package root, constants and the small `utils` helpers of `dynamo.common`."""

from __future__ import annotations

import asyncio
import importlib
import importlib.metadata
import sys

import pytest

import dynamo.common
from dynamo.common.constants import (
    ROUTER_HINT_RUNTIME_CAPABILITY_KEY,
    ROUTER_HINT_SOURCE_CONTROL_ENDPOINTS_RUNTIME_KEY,
    ROUTER_HINT_WORKER_TYPE_RUNTIME_KEY,
    DisaggregationMode,
    EmbeddingTransferMode,
)
from dynamo.common.utils.env import env_bool
from dynamo.common.utils.namespace import get_worker_namespace
from dynamo.common.utils.runtime import parse_endpoint, run_async

pytestmark = pytest.mark.unit


def test_version_comes_from_installed_distribution() -> None:
    # No generated `_version` module and no `ai-dynamo` distribution: ours is used.
    assert dynamo.common.__version__ == importlib.metadata.version("dynamo-operator")


def test_version_falls_back_to_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert dynamo.common._resolve_version() == "0.0.0+unknown"


def test_lazy_submodules_import_on_access_and_are_cached() -> None:
    for name in ("config_dump", "constants", "utils"):
        module = getattr(dynamo.common, name)
        assert module is sys.modules[f"dynamo.common.{name}"]
        assert vars(dynamo.common)[name] is module
    assert set(dynamo.common.__all__) == {"__version__", "config_dump", "constants", "utils"}


def test_unknown_attribute_raises_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = dynamo.common.nope


def test_constants_match_upstream_values() -> None:
    assert {m.name: m.value for m in DisaggregationMode} == {
        "AGGREGATED": "agg",
        "PREFILL": "prefill",
        "DECODE": "decode",
        "ENCODE": "encode",
    }
    assert {m.name: m.value for m in EmbeddingTransferMode} == {
        "LOCAL": "local",
        "NIXL_WRITE": "nixl-write",
        "NIXL_READ": "nixl-read",
    }
    assert ROUTER_HINT_RUNTIME_CAPABILITY_KEY == "router_hint"
    assert ROUTER_HINT_WORKER_TYPE_RUNTIME_KEY == "router_hint_worker_type"
    assert (
        ROUTER_HINT_SOURCE_CONTROL_ENDPOINTS_RUNTIME_KEY == "router_hint_source_control_endpoints"
    )


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (None, False),
        ("", False),
        ("true", True),
        ("TRUE", True),
        ("1", True),
        ("Yes", True),
        ("on", False),  # unlike the RL parser, "on" is false here
        (" true", False),  # and nothing is stripped
        ("0", False),
    ],
)
def test_utils_env_bool(monkeypatch: pytest.MonkeyPatch, raw: str | None, expected: bool) -> None:
    if raw is None:
        monkeypatch.delenv("DYN_TEST_FLAG", raising=False)
    else:
        monkeypatch.setenv("DYN_TEST_FLAG", raw)
    assert env_bool("DYN_TEST_FLAG") is expected


def test_utils_env_bool_default_for_unset_and_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DYN_TEST_FLAG", raising=False)
    assert env_bool("DYN_TEST_FLAG", default=True) is True
    monkeypatch.setenv("DYN_TEST_FLAG", "")
    assert env_bool("DYN_TEST_FLAG", default=True) is True


def test_worker_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DYN_NAMESPACE", raising=False)
    monkeypatch.delenv("DYN_NAMESPACE_WORKER_SUFFIX", raising=False)
    assert get_worker_namespace() == "dynamo"
    monkeypatch.setenv("DYN_NAMESPACE", "prod")
    assert get_worker_namespace() == "prod"
    assert get_worker_namespace("explicit") == "explicit"
    monkeypatch.setenv("DYN_NAMESPACE_WORKER_SUFFIX", "abc123")
    assert get_worker_namespace() == "prod-abc123"


def test_parse_endpoint() -> None:
    assert parse_endpoint("dyn://ns.comp.ep") == ("ns", "comp", "ep")
    assert parse_endpoint("ns.comp.ep") == ("ns", "comp", "ep")
    for bad in ("ns.comp", "a.b.c.d", "dyn://ns..ep", ""):
        with pytest.raises(ValueError, match="exactly three"):
            parse_endpoint(bad)


async def _double(value: int) -> int:
    await asyncio.sleep(0)
    return value * 2


def test_run_async_without_a_running_loop() -> None:
    assert run_async(_double, 21) == 42


async def test_run_async_inside_a_running_loop() -> None:
    # A running loop cannot be re-entered; the helper must use another thread.
    assert run_async(_double, 5) == 10


def test_config_dump_is_reachable_lazily() -> None:
    module = importlib.import_module("dynamo.common")
    assert callable(module.config_dump.get_config_dump)
