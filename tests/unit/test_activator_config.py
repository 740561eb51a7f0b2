"""The activator's configuration: defaults, and every bad value named with exit status 2."""

from __future__ import annotations

import pytest

from dynamo.activator import cli
from dynamo.activator.config import ActivatorConfig, ConfigError

pytestmark = pytest.mark.unit

BASE = {
    "DYN_ACTIVATOR_WORKER": "llama",
    "POD_NAME": "llama-activator-abc",
    "POD_NAMESPACE": "team-a",
    "POD_UID": "uid-1",
    "POD_IP": "10.1.2.3",
}


def test_defaults_from_the_required_variables() -> None:
    config = ActivatorConfig.from_env(BASE)
    assert (config.max_held, config.hold_timeout_s) == (256, 300.0)
    assert (config.http_port, config.system_port, config.tcp_port) == (8000, 9090, 0)
    assert config.activator_slice == "llama-activator"
    assert config.bind_host == "0.0.0.0"


def test_values_are_read() -> None:
    config = ActivatorConfig.from_env(
        {
            **BASE,
            "DYN_ACTIVATOR_MAX_HELD": "3",
            "DYN_ACTIVATOR_HOLD_TIMEOUT_SECONDS": "2.5",
            "DYN_HTTP_PORT": "8001",
            "DYN_TCP_RPC_PORT": "9345",
        }
    )
    assert (config.max_held, config.hold_timeout_s, config.http_port, config.tcp_port) == (
        3,
        2.5,
        8001,
        9345,
    )


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("DYN_ACTIVATOR_WORKER", ""),
        ("POD_NAME", ""),
        ("POD_UID", ""),
        ("POD_IP", "not-an-ip"),
        ("DYN_ACTIVATOR_MAX_HELD", "many"),
        ("DYN_ACTIVATOR_MAX_HELD", "0"),
        ("DYN_ACTIVATOR_HOLD_TIMEOUT_SECONDS", "-1"),
        ("DYN_ACTIVATOR_HOLD_TIMEOUT_SECONDS", "nan"),
        ("DYN_HTTP_PORT", "70000"),
        ("DYN_SYSTEM_PORT", "http"),
    ],
)
def test_a_bad_value_names_its_variable_and_exits_2(
    variable: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    environ = {**BASE, variable: value}
    with pytest.raises(ConfigError, match=variable):
        ActivatorConfig.from_env(environ)
    assert cli.main([], environ) == 2
    assert variable in capsys.readouterr().err


def test_help_documents_every_variable(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["--help"], BASE)
    assert exited.value.code == 0
    text = capsys.readouterr().out
    for variable in (
        *BASE,
        "DYN_ACTIVATOR_MAX_HELD",
        "DYN_ACTIVATOR_HOLD_TIMEOUT_SECONDS",
        "DYN_HTTP_PORT",
        "DYN_SYSTEM_PORT",
        "DYN_TCP_RPC_PORT",
    ):
        assert variable in text
