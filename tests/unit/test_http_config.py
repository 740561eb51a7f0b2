"""`DYN_HTTP_*` settings: defaults, parsing, validation, legacy aliases and CLI flags."""

from __future__ import annotations

import argparse
import logging

import pytest

from dynamo.common.http import AiohttpClient, HttpConfigBase, HttpxClient, add_http_args, from_env
from dynamo.common.http import config as http_config

pytestmark = pytest.mark.unit

ALL_VARS = [
    *http_config.LEGACY_ENV_ALIASES,
    *sorted(set(http_config.LEGACY_ENV_ALIASES.values())),
]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # setenv first so monkeypatch records every name and removes, after the test, the
    # canonical names that the legacy aliases copy into the environment.
    for name in ALL_VARS:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setattr(http_config, "_warned_legacy", set())


def test_defaults() -> None:
    config = from_env()
    assert config == HttpConfigBase(
        max_connections=100,
        per_call_timeout_override=None,
        connect_timeout=5.0,
        max_keepalive=100,  # 0 means "as many as max_connections"
        pool_timeout=60.0,
        concurrency=50,
        keepalive_timeout=15.0,
    )


def test_env_values(monkeypatch: pytest.MonkeyPatch) -> None:
    values = {
        "DYN_HTTP_MAX_CONNECTIONS": "7",
        "DYN_HTTP_TIMEOUT": "2.5",
        "DYN_HTTP_CONNECT_TIMEOUT": "1.5",
        "DYN_HTTP_MAX_KEEPALIVE": "3",
        "DYN_HTTP_POOL_TIMEOUT": "9",
        "DYN_HTTP_CONCURRENCY": "4",
        "DYN_HTTP_KEEPALIVE_TIMEOUT": "30",
    }
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    assert from_env() == HttpConfigBase(7, 2.5, 1.5, 3, 9.0, 4, 30.0)
    # The client reads the environment when it is built.
    assert AiohttpClient().config.max_connections == 7
    assert HttpxClient().config.concurrency == 4


def test_empty_values_mean_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_HTTP_MAX_CONNECTIONS", "")
    monkeypatch.setenv("DYN_HTTP_TIMEOUT", "None")
    config = from_env()
    assert config.max_connections == 100
    assert config.per_call_timeout_override is None


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        (
            "DYN_HTTP_MAX_CONNECTIONS",
            "many",
            "DYN_HTTP_MAX_CONNECTIONS must be an integer, got 'many'",
        ),
        ("DYN_HTTP_TIMEOUT", "soon", "DYN_HTTP_TIMEOUT must be a number, got 'soon'"),
        ("DYN_HTTP_MAX_CONNECTIONS", "0", "max_connections must be greater than 0, got 0"),
        ("DYN_HTTP_CONNECT_TIMEOUT", "-1", "connect_timeout must be greater than 0, got -1.0"),
        ("DYN_HTTP_MAX_KEEPALIVE", "-2", "max_keepalive must be 0 or more, got -2"),
    ],
)
def test_invalid_values_name_the_setting(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, message: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        from_env()


def test_legacy_aliases_are_copied_once_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=http_config.__name__)
    monkeypatch.setenv("DYN_MM_HTTP_MAX_CONNECTIONS", "11")
    monkeypatch.setenv("DYN_MM_HTTP_READ_TIMEOUT", "4")
    monkeypatch.setenv("DYN_MM_HTTP_KEEPALIVE_TIMEOUT", "8")
    config = from_env()
    assert config.max_connections == 11
    assert config.per_call_timeout_override == 4.0
    assert config.keepalive_timeout == 8.0
    from_env()
    warnings = [r.getMessage() for r in caplog.records]
    assert sorted(warnings) == [
        "DYN_MM_HTTP_KEEPALIVE_TIMEOUT is deprecated; use DYN_HTTP_KEEPALIVE_TIMEOUT instead",
        "DYN_MM_HTTP_MAX_CONNECTIONS is deprecated; use DYN_HTTP_MAX_CONNECTIONS instead",
        "DYN_MM_HTTP_READ_TIMEOUT is deprecated; use DYN_HTTP_TIMEOUT instead",
    ]


def test_canonical_names_win_over_legacy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_HTTP_MAX_CONNECTIONS", "20")
    monkeypatch.setenv("DYN_MM_HTTP_MAX_CONNECTIONS", "11")
    monkeypatch.setenv("DYN_MM_HTTP_TIMEOUT", "3")
    monkeypatch.setenv("DYN_MM_HTTP_READ_TIMEOUT", "4")  # older alias loses to DYN_MM_HTTP_TIMEOUT
    config = from_env()
    assert config.max_connections == 20
    assert config.per_call_timeout_override == 3.0


def test_cli_flags_default_to_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_HTTP_CONCURRENCY", "5")
    parser = argparse.ArgumentParser()
    add_http_args(parser)
    args = parser.parse_args(["--http-max-connections", "12", "--http-timeout", "1.5"])
    config = HttpConfigBase.from_cli_args(args)
    assert config.max_connections == 12
    assert config.per_call_timeout_override == 1.5
    assert config.concurrency == 5
    assert config.max_keepalive == 12
