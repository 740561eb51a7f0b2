"""`EngineHealthMonitorConfig.from_env`: explicit values, env vars, defaults, bad input."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from dynamo.common.engine_monitor import EngineHealthMonitorConfig

pytestmark = pytest.mark.unit

ENV_VARS = (
    "DYN_ENGINE_HEALTH_CHECK_INTERVAL",
    "DYN_ENGINE_HEALTH_CHECK_TIMEOUT",
    "DYN_ENGINE_HEALTH_SHUTDOWN_TIMEOUT",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)


def test_defaults() -> None:
    assert EngineHealthMonitorConfig.from_env() == EngineHealthMonitorConfig(2.0, 30.0, 60.0)


def test_env_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_ENGINE_HEALTH_CHECK_INTERVAL", "0.5")
    monkeypatch.setenv("DYN_ENGINE_HEALTH_CHECK_TIMEOUT", "10")
    monkeypatch.setenv("DYN_ENGINE_HEALTH_SHUTDOWN_TIMEOUT", " 0 ")
    assert EngineHealthMonitorConfig.from_env() == EngineHealthMonitorConfig(0.5, 10.0, 0.0)


def test_explicit_arguments_win_over_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_ENGINE_HEALTH_CHECK_INTERVAL", "9")
    config = EngineHealthMonitorConfig.from_env(interval=1.0, shutdown_timeout=5)
    assert config == EngineHealthMonitorConfig(1.0, 30.0, 5.0)


@pytest.mark.parametrize("raw", ["abc", "nan", "inf", "-inf", "1s"])
def test_invalid_or_non_finite_env_uses_default_with_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, raw: str
) -> None:
    monkeypatch.setenv("DYN_ENGINE_HEALTH_CHECK_TIMEOUT", raw)
    with caplog.at_level(logging.WARNING):
        assert EngineHealthMonitorConfig.from_env().check_timeout == 30.0
    assert "DYN_ENGINE_HEALTH_CHECK_TIMEOUT" in caplog.text


def test_empty_env_uses_default_silently(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("DYN_ENGINE_HEALTH_CHECK_INTERVAL", "")
    with caplog.at_level(logging.WARNING):
        assert EngineHealthMonitorConfig.from_env().interval == 2.0
    assert caplog.text == ""


def test_negative_values_become_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_ENGINE_HEALTH_SHUTDOWN_TIMEOUT", "-3")
    config = EngineHealthMonitorConfig.from_env(check_timeout=-1.0)
    assert (config.check_timeout, config.shutdown_timeout) == (0.0, 0.0)


def test_config_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        EngineHealthMonitorConfig.from_env().interval = 1.0  # type: ignore[misc]
