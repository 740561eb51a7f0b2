"""Environment parsing (`dynamo.runtime.env`) and `RuntimeSettings.from_env`."""

from __future__ import annotations

import logging

import pytest

from dynamo.common.token_budget import TokenBudget
from dynamo.common.utils.env import env_bool as python_env_bool
from dynamo.runtime.env import env_flag, env_int, env_seconds, env_text, is_truthy
from dynamo.runtime.settings import RuntimeSettings, parse_endpoint_list, token_budget_from_env

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("1", True),
        ("true", True),
        (" TRUE ", True),
        ("on", True),
        ("Yes", True),
        ("0", False),
        ("false", False),
        ("off", False),
        ("", False),
        ("enabled", False),
    ],
)
def test_rust_truthiness(value: str, expected: bool) -> None:
    assert is_truthy(value) is expected


def test_rust_and_python_parsers_differ_on_on(monkeypatch: pytest.MonkeyPatch) -> None:
    # Upstream quirk kept on purpose: `on` mounts /v1/loras (Rust) but the Python
    # LoRA manager stays off.
    monkeypatch.setenv("DYN_LORA_ENABLED", "on")
    assert env_flag({"DYN_LORA_ENABLED": "on"}, "DYN_LORA_ENABLED") is True
    assert python_env_bool("DYN_LORA_ENABLED") is False
    assert RuntimeSettings.from_env({"DYN_LORA_ENABLED": "on"}).lora_enabled is True


def test_empty_values_count_as_unset() -> None:
    env = {"A": "", "B": "x"}
    assert env_text(env, "A") is None
    assert env_text(env, "B") == "x"
    assert env_flag(env, "A", default=True) is True
    assert env_int(env, "A", 7) == 7


@pytest.mark.parametrize(
    ("value", "expected"),
    [("2.5", 2.5), ("-3", 0.0), ("nan", 5.0), ("inf", 5.0), ("soon", 5.0), ("", 5.0)],
)
def test_env_seconds(value: str, expected: float, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert env_seconds({"S": value}, "S", 5.0) == expected
    if value in ("nan", "inf", "soon"):
        assert "S=" in caplog.text


def test_env_int_names_the_variable() -> None:
    with pytest.raises(ValueError, match="DYN_SYSTEM_PORT='x' is not an integer"):
        RuntimeSettings.from_env({"DYN_SYSTEM_PORT": "x"})


def test_defaults() -> None:
    settings = RuntimeSettings.from_env({})
    assert settings.system_port == -1
    assert settings.system_host == "0.0.0.0"
    assert (settings.health_path, settings.live_path) == ("/health", "/live")
    assert settings.starting_ready is False
    assert settings.http_port == 8000
    assert settings.grace_period_secs == 5.0
    assert settings.drain_timeout_secs == 30.0
    assert settings.graceful_shutdown_timeout_secs == 30.0
    # Drain budget keeps 5 s of the hard deadline for cleanup.
    assert settings.drain_budget_secs == 25.0
    assert settings.hard_deadline_secs == 35.0
    assert settings.fpm_port is None
    assert settings.token_budget is None
    assert settings.lora_enabled is False


def test_everything_from_env() -> None:
    settings = RuntimeSettings.from_env(
        {
            "DYN_SYSTEM_HOST": "127.0.0.1",
            "DYN_SYSTEM_PORT": "0",
            "DYN_SYSTEM_HEALTH_PATH": "/h",
            "DYN_SYSTEM_LIVE_PATH": "/l",
            "DYN_SYSTEM_STARTING_HEALTH_STATUS": "ready",
            "DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS": '["generate"]',
            "DYN_HEALTH_CHECK_ENABLED": "yes",
            "DYN_CANARY_WAIT_TIME": "2",
            "DYN_HEALTH_CHECK_REQUEST_TIMEOUT": "1",
            "DYN_HTTP_HOST": "::1",
            "DYN_HTTP_PORT": "0",
            "DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS": "0.5",
            "DYN_PREFILL_DRAIN_TIMEOUT_S": "100",
            "DYN_WORKER_GRACEFUL_SHUTDOWN_TIMEOUT": "12",
            "DYN_FORWARDPASS_METRIC_PORT": "20380",
            "DYN_TOKEN_BUDGET_COMBINED_LIMIT": "64",
            "DYN_TOKEN_BUDGET_REJECT_TOTAL_OVERFLOW": "on",
        }
    )
    assert settings.system_host == "127.0.0.1"
    assert settings.system_port == 0
    assert (settings.health_path, settings.live_path) == ("/h", "/l")
    assert settings.starting_ready is True
    assert settings.use_endpoint_health_status == ("generate",)
    assert settings.health_check_enabled is True
    assert (settings.canary_wait_secs, settings.health_check_timeout_secs) == (2.0, 1.0)
    assert (settings.http_host, settings.http_port) == ("::1", 0)
    assert settings.grace_period_secs == 0.5
    # min(drain timeout, hard deadline - 5)
    assert settings.drain_budget_secs == 7.0
    assert settings.hard_deadline_secs == 12.5
    assert settings.fpm_port == 20380
    assert settings.token_budget == TokenBudget(64, False, True)


def test_bad_starting_status_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        settings = RuntimeSettings.from_env({"DYN_SYSTEM_STARTING_HEALTH_STATUS": "green"})
    assert settings.starting_ready is False
    assert "DYN_SYSTEM_STARTING_HEALTH_STATUS" in caplog.text


def test_deprecated_system_enabled_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        RuntimeSettings.from_env({"DYN_SYSTEM_ENABLED": "true"})
    assert "DYN_SYSTEM_ENABLED is deprecated" in caplog.text


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ('["generate"]', ("generate",)),
        ('["a", "b"]', ("a", "b")),
        ("a, b,", ("a", "b")),
        (None, ()),
    ],
)
def test_endpoint_list(value: str | None, expected: tuple[str, ...]) -> None:
    assert parse_endpoint_list(value) == expected


def test_endpoint_list_bad_json() -> None:
    with pytest.raises(ValueError, match="not a JSON array of strings"):
        parse_endpoint_list("[1, 2]")


def test_token_budget_env_errors() -> None:
    assert token_budget_from_env({}) is None
    with pytest.raises(ValueError, match="must be >= 0"):
        token_budget_from_env({"DYN_TOKEN_BUDGET_COMBINED_LIMIT": "-1"})
    with pytest.raises(ValueError, match="DYN_TOKEN_BUDGET_COMBINED_LIMIT='many'"):
        token_budget_from_env({"DYN_TOKEN_BUDGET_COMBINED_LIMIT": "many"})
