"""The `dynamo-worker` command line, in-process (process-level checks are in tests/e2e)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dynamo.engines.sample import SampleEngine
from dynamo.runtime import cli
from support.s3 import S3Server

pytestmark = pytest.mark.unit

ENV_NAMES = (
    "DYN_WORKER_ENGINE", "DYN_MODEL", "DYN_SERVED_MODEL_NAME", "DYN_DATA_PARALLEL_SIZE",
    "DYN_DATA_PARALLEL_START_RANK", "DYN_MAX_LORAS", "DYN_LORA_ENABLED", "DYN_LORA_PATH",
    "DYN_SYSTEM_PORT", "DYN_HTTP_PORT", "DYN_PREFILL_DRAIN_TIMEOUT_S", "DYN_NAMESPACE",
    "DYN_TOKEN_BUDGET_COMBINED_LIMIT", "DYN_TOKEN_BUDGET_REJECT_TOTAL_OVERFLOW",
    "DYN_DISCOVERY_BACKEND", "DYN_LOG", "DYN_REQUEST_PLANE", "DYN_EVENT_PLANE",
)  # fmt: skip


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)


def test_defaults_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    args, extras = cli.build_parser().parse_known_args([])
    assert args.engine == cli.DEFAULT_ENGINE
    assert args.model is None
    assert extras == []
    monkeypatch.setenv("DYN_WORKER_ENGINE", "pkg.mod:Engine")
    monkeypatch.setenv("DYN_MODEL", "/models/x")
    monkeypatch.setenv("DYN_DATA_PARALLEL_SIZE", "4")
    monkeypatch.setenv("DYN_MAX_LORAS", "2")
    args, _ = cli.build_parser().parse_known_args(["--model", "/models/y"])
    assert (args.engine, args.model) == ("pkg.mod:Engine", "/models/y")
    assert (args.data_parallel_size, args.max_loras) == (4, 2)


def test_engine_argv_forwards_common_flags_and_extras() -> None:
    argv = [
        "--served-model-name", "tiny", "--max-loras", "3", "--data-parallel-size", "2",
        "--token-delay", "0.1", "--", "--max-tokens", "5",
    ]  # fmt: skip
    args, extras = cli.build_parser().parse_known_args(argv)
    assert cli.engine_argv(args, "/m", extras) == [
        "--model", "/m", "--served-model-name", "tiny", "--max-loras", "3",
        "--data-parallel-size", "2", "--token-delay", "0.1", "--max-tokens", "5",
    ]  # fmt: skip
    args, extras = cli.build_parser().parse_known_args([])
    assert cli.engine_argv(args, None, extras) == []


def test_flags_become_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    argv = [
        "--enable-lora", "--lora-cache-path", "/tmp/loras", "--system-port", "0",
        "--drain-timeout", "7.5", "--namespace", "team", "--token-budget-combined-limit", "64",
        "--no-token-budget-reject-total-overflow", "--discovery-backend", "file",
        "--request-plane", "tcp", "--event-plane", "zmq",
    ]  # fmt: skip
    for name in ENV_NAMES:
        monkeypatch.setenv(name, "")  # registered with monkeypatch so they are restored
    args, _ = cli.build_parser().parse_known_args(argv)
    cli.apply_environment(args)
    assert os.environ["DYN_LORA_ENABLED"] == "true"
    assert os.environ["DYN_LORA_PATH"] == "/tmp/loras"
    assert os.environ["DYN_SYSTEM_PORT"] == "0"
    assert os.environ["DYN_PREFILL_DRAIN_TIMEOUT_S"] == "7.5"
    assert os.environ["DYN_NAMESPACE"] == "team"
    assert os.environ["DYN_TOKEN_BUDGET_COMBINED_LIMIT"] == "64"
    assert os.environ["DYN_TOKEN_BUDGET_REJECT_TOTAL_OVERFLOW"] == "false"
    assert os.environ["DYN_DISCOVERY_BACKEND"] == "file"
    # Upstream's worker flags, with upstream's variables.
    assert (os.environ["DYN_REQUEST_PLANE"], os.environ["DYN_EVENT_PLANE"]) == ("tcp", "zmq")
    # Nothing of them is left for the engine, whose parser would refuse them.
    args, extras = cli.build_parser().parse_known_args(["--request-plane", "http"])
    assert (args.request_plane, extras) == ("http", [])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--data-parallel-size", "0"], "--data-parallel-size must be >= 1"),
        (["--max-loras", "-1"], "--max-loras must be >= 0"),
        (["--system-port", "-2"], "--system-port must be -1-65535"),
        (["--drain-timeout", "-1"], "--drain-timeout must be >= 0"),
        (["--engine", "nocolon"], "must be MODULE:CLASS"),
        (["--request-plane", "nats"], "--request-plane nats needs NATS"),
    ],
)
def test_bad_values_are_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args, _ = cli.build_parser().parse_known_args(argv)
    with pytest.raises(SystemExit) as info:
        cli.check_args(args)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert message in err


def test_env_integer_errors_are_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DYN_MAX_LORAS", "lots")
    with pytest.raises(SystemExit):
        cli.build_parser()
    assert "DYN_MAX_LORAS='lots' is not an integer" in capsys.readouterr().err


def test_load_engine_class() -> None:
    assert cli.load_engine_class("dynamo.engines.sample:SampleEngine") is SampleEngine
    with pytest.raises(ValueError, match="cannot import"):
        cli.load_engine_class("no.such.module:X")
    with pytest.raises(ValueError, match=r"not a dynamo\.common\.backend\.BaseEngine subclass"):
        cli.load_engine_class("dynamo.engines.sample:build_arg_parser")


async def test_resolve_model() -> None:
    assert await cli.resolve_model(None) is None
    assert await cli.resolve_model("/models/x") == "/models/x"
    assert await cli.resolve_model("file:///models/x") == "/models/x"
    with pytest.raises(ValueError, match="unsupported scheme 'ftp'"):
        await cli.resolve_model("ftp://host/model")


async def test_an_s3_model_is_fetched_once_into_the_model_cache(
    s3_server: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    s3_server.apply_env(monkeypatch)
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")  # what the operator sets for an http endpoint
    monkeypatch.setenv("DYN_MODEL_CACHE", str(tmp_path / "models"))
    bucket = s3_server.new_bucket("model")
    s3 = s3_server.client()
    s3.put_object(Bucket=bucket, Key="tiny/config.json", Body=b"{}")
    s3.put_object(Bucket=bucket, Key="tiny/weights/part-0.bin", Body=b"0123")
    local = Path(str(await cli.resolve_model(f"s3://{bucket}/tiny")))
    assert local.parent == tmp_path / "models"
    assert (local / "config.json").read_bytes() == b"{}"
    assert (local / "weights" / "part-0.bin").read_bytes() == b"0123"
    assert [p.name for p in (tmp_path / "models").iterdir()] == [local.name]  # nothing partial
    # A second start reads the cache: the objects are not fetched again.
    s3.delete_object(Bucket=bucket, Key="tiny/config.json")
    assert await cli.resolve_model(f"s3://{bucket}/tiny") == str(local)


async def test_create_engine_reports_engine_errors_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    engine, config = await cli.create_engine(SampleEngine, ["--token-delay", "0.5"])
    assert isinstance(engine, SampleEngine)
    assert engine.args.token_delay == 0.5
    assert config.request_plane == "tcp"
    with pytest.raises(SystemExit) as info:
        await cli.create_engine(SampleEngine, ["--no-such-flag"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0
    assert "engine arguments:" in err
    assert "unrecognized arguments: --no-such-flag" in err
