"""The health state machine behind /health and /live."""

from __future__ import annotations

import pytest

from dynamo.runtime.health import HealthState

pytestmark = pytest.mark.unit


def test_system_status_decides_by_default() -> None:
    health = HealthState()
    assert not health.is_healthy()
    health.set_endpoint_ready("generate", True)
    assert not health.is_healthy()  # no endpoint list: the system status decides
    health.set_system_ready(True)
    assert health.is_healthy()
    assert HealthState(starting_ready=True).is_healthy()


def test_endpoint_list_decides_when_set() -> None:
    health = HealthState(use_endpoint_health_status=("generate",))
    health.set_system_ready(True)
    assert not health.is_healthy()
    health.set_endpoint_ready("other", True)
    assert not health.is_healthy()
    health.set_endpoint_ready("generate", True)
    assert health.is_healthy()
    health.set_endpoint_ready("generate", False)
    assert not health.is_healthy()


def test_canary_targets_decide_without_a_list() -> None:
    health = HealthState(starting_ready=True)
    health.register_target("generate")
    assert health.is_targeted("generate")
    assert not health.is_healthy()
    health.set_endpoint_ready("generate", True)
    assert health.is_healthy()


def test_body_shape() -> None:
    health = HealthState()
    health.set_endpoint_ready("generate", True)
    health.set_endpoint_ready("clear_kv", False)
    body = health.body()
    assert body["status"] == "notready"
    assert body["endpoints"] == {"clear_kv": "notready", "generate": "ready"}
    assert set(body["uptime"]) == {"secs", "nanos"}
    assert 0 <= body["uptime"]["nanos"] < 1_000_000_000
    health.set_system_ready(True)
    assert health.body()["status"] == "ready"
