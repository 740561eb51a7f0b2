"""Config dump: canonical JSON, encoders, env capture with redaction, host probes, CLI flag."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import logging
import os
import stat
import sys
from pathlib import Path
from typing import Any

import pydantic
import pytest

import dynamo.common
from dynamo.common.config_dump import (
    add_config_dump_args,
    dump_config,
    get_config_dump,
    get_environment_vars,
    get_gpu_info,
    get_runtime_info,
    get_system_info,
    register_encoder,
)

pytestmark = pytest.mark.unit


class Color(enum.Enum):
    RED = "red"


@dataclasses.dataclass
class Inner:
    path: Path
    tags: set[str]


class Settings(pydantic.BaseModel):
    name: str
    limit: int


class Opaque:
    __slots__ = ()

    def __str__(self) -> str:
        return "opaque!"


class Plain:
    def __init__(self) -> None:
        self.value = 3


class Custom:
    def __init__(self, secret: str) -> None:
        self.secret = secret


@register_encoder(Custom)
def _encode_custom(obj: Custom) -> dict[str, Any]:
    return {"custom": len(obj.secret)}


def test_canonical_json_with_all_encoder_fallbacks() -> None:
    config = {
        "inner": Inner(path=Path("/models/x"), tags={"b", "a"}),
        "settings": Settings(name="n", limit=2),
        "namespace": argparse.Namespace(port=8000),
        "color": Color.RED,
        "opaque": Opaque(),
        "plain": Plain(),
        "custom": Custom("hunter2"),
        "mixed": {1, "a"},
    }
    text = get_config_dump(config, extra_info={"launch": "test"})
    # Compact separators and sorted keys: canonical output.
    assert ": " not in text.split('"config":', 1)[1][:20]
    dump = json.loads(text)
    assert list(dump) == sorted(dump)
    assert dump["config"] == {
        "color": "Color.RED",
        "custom": {"custom": 7},
        "inner": {"path": "/models/x", "tags": ["a", "b"]},
        "mixed": ["a", 1],  # unorderable: sorted by repr
        "namespace": {"port": 8000},
        "opaque": "opaque!",
        "plain": {"value": 3},
        "settings": {"limit": 2, "name": "n"},
    }
    assert dump["launch"] == "test"
    assert dump["dynamo_version"] == dynamo.common.__version__
    assert dump["installed_packages"]["msgspec"]
    for key in ("system_info", "environment", "runtime_info", "gpu_info"):
        assert key in dump
    # Frameworks are recorded only when installed; none of them is here.
    assert not {"vllm_version", "sglang_version", "trtllm_version"} & set(dump)


def test_dump_is_deterministic() -> None:
    assert get_config_dump({"b": 1, "a": [1, 2]}) == get_config_dump({"a": [1, 2], "b": 1})


def test_unencodable_config_gives_error_document() -> None:
    dump = json.loads(get_config_dump({"value": float("nan")}))
    assert set(dump) == {"error", "system_info"}
    assert dump["error"].startswith("Failed to collect config dump: ")


def test_non_ascii_is_kept() -> None:
    assert "modèle" in get_config_dump({"name": "modèle"})


def test_environment_capture_and_redaction(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_NAMESPACE", "prod")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("NIXL_AUTH_KEY", "k")
    monkeypatch.setenv("ENABLE_PERFECT_ROUTER", "1")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws")
    monkeypatch.setenv("UNRELATED", "x")
    captured = get_environment_vars()
    assert captured["DYN_NAMESPACE"] == "prod"
    assert captured["NCCL_DEBUG"] == "INFO"
    assert captured["HF_TOKEN"] == "<REDACTED>"
    assert captured["NIXL_AUTH_KEY"] == "<REDACTED>"
    assert captured["ENABLE_PERFECT_ROUTER"] == "1"
    assert "AWS_SECRET_ACCESS_KEY" not in captured
    assert "UNRELATED" not in captured
    assert get_environment_vars(include_sensitive=True)["HF_TOKEN"] == "hf_secret"


def test_environment_custom_prefixes_and_additional_vars(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_APP_PORT", "1")
    monkeypatch.setenv("MY_APP_PASSWORD", "p")
    monkeypatch.setenv("DYN_NAMESPACE", "prod")
    monkeypatch.setenv("HOME_DIR_X", "/h")
    captured = get_environment_vars(prefixes=["MY_APP_"], additional_vars={"HOME_DIR_X"})
    assert captured == {"MY_APP_PORT": "1", "MY_APP_PASSWORD": "<REDACTED>", "HOME_DIR_X": "/h"}


def test_environment_in_dump_is_redacted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_API_KEY", "sk-live")
    dump = json.loads(get_config_dump({}))
    assert dump["environment"]["DYN_API_KEY"] == "<REDACTED>"
    assert "sk-live" not in json.dumps(dump)


def test_system_and_runtime_info() -> None:
    system = get_system_info()
    assert set(system) == {
        "platform",
        "architecture",
        "processor",
        "hostname",
        "os_name",
        "os_release",
        "os_version",
    }
    assert system["os_name"] == "Linux"
    runtime = get_runtime_info()
    assert runtime["executable"] == sys.executable
    assert runtime["python_version_info"]["major"] == sys.version_info.major
    assert runtime["argv"] == sys.argv


def _fake_nvidia_smi(directory: Path, script: str) -> None:
    """Install an `nvidia-smi` stand-in: this machine has no GPU driver to run the real one."""
    path = directory / "nvidia-smi"
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_gpu_info_without_nvidia_smi(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert get_gpu_info() is None


NVIDIA_SMI_XML = """<?xml version="1.0" ?>
<nvidia_smi_log>
  <driver_version>550.54.15</driver_version>
  <attached_gpus>2</attached_gpus>
  <gpu id="00000000:01:00.0">
    <product_name>NVIDIA H100 80GB HBM3</product_name>
    <board_part_number>692-2G520-0200-000</board_part_number>
    <gpu_part_number>2330-885-A1</gpu_part_number>
    <fb_memory_usage><total>81559 MiB</total><used>0 MiB</used></fb_memory_usage>
  </gpu>
  <gpu id="00000000:02:00.0">
    <product_name>NVIDIA H100 80GB HBM3</product_name>
    <fb_memory_usage><total>81559 MiB</total></fb_memory_usage>
  </gpu>
</nvidia_smi_log>
"""


def test_gpu_info_parses_nvidia_smi_xml(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "out.xml").write_text(NVIDIA_SMI_XML)
    _fake_nvidia_smi(tmp_path, f'[ "$*" = "-q -x" ] && exec cat "{tmp_path}/out.xml"\nexit 9\n')
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}/usr/bin:/bin")
    info = get_gpu_info()
    assert info is not None
    assert info["count"] == 2
    assert info["gpus"][0] == {
        "name": "NVIDIA H100 80GB HBM3",
        "driver_version": "550.54.15",
        "memory_total": "81559 MiB",
        "board_part_number": "692-2G520-0200-000",
        "gpu_part_number": "2330-885-A1",
    }
    assert info["gpus"][1]["board_part_number"] is None


@pytest.mark.parametrize("script", ["exit 3\n", "echo '<not-closed'\n"])
def test_gpu_info_on_failure_or_bad_output(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, script: str
) -> None:
    _fake_nvidia_smi(tmp_path, script)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}/usr/bin:/bin")
    assert get_gpu_info() is None


def test_dump_config_writes_file_creating_parents(tmp_path: Path) -> None:
    target = tmp_path / "nested" / "dir" / "config.json"
    dump_config(str(target), {"model": "m"})
    assert json.loads(target.read_text())["config"] == {"model": "m"}


def test_dump_config_logs_when_the_file_cannot_be_written(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with caplog.at_level(logging.INFO, logger="dynamo.common.config_dump.config_dumper"):
        dump_config(str(blocker / "config.json"), {"model": "m"})
    assert "Could not write config dump" in caplog.text
    assert 'CONFIG_DUMP: {"config":{"model":"m"}' in caplog.text


def test_dump_config_without_path_logs_only_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    logger_name = "dynamo.common.config_dump.config_dumper"
    with caplog.at_level(logging.INFO, logger=logger_name):
        dump_config(None, {"model": "quiet"})
    assert "CONFIG_DUMP" not in caplog.text
    with caplog.at_level(logging.DEBUG, logger=logger_name):
        dump_config(None, {"model": "loud"})
    assert '"model":"loud"' in caplog.text


def test_cli_flag_defaults_to_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DYN_DUMP_CONFIG_TO", raising=False)
    parser = argparse.ArgumentParser()
    add_config_dump_args(parser)
    assert parser.parse_args([]).dump_config_to is None
    assert parser.parse_args(["--dump-config-to", "/tmp/c.json"]).dump_config_to == "/tmp/c.json"
    monkeypatch.setenv("DYN_DUMP_CONFIG_TO", "/var/dump.json")
    parser = argparse.ArgumentParser()
    add_config_dump_args(parser)
    assert parser.parse_args([]).dump_config_to == "/var/dump.json"
