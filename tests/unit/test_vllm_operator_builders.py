"""The vLLM engine as the operator runs it: `spec.engine.name: vllm` (or its class) becomes
`dynamo-worker --engine vllm`, the spec's GPUs and token budget become vLLM's
--tensor-parallel-size and --max-model-len ahead of spec.engine.extraArgs, the pods get the
vLLM image, and the names the API takes are the worker's own."""

from __future__ import annotations

import copy
from typing import Any, get_args

import pytest

from dynamo.runtime import cli as worker_cli
from dynamo_operator.api import DynamoWorker
from dynamo_operator.api.dynamoworker import OWNED_FLAGS, VLLM_ENGINE_CLASS, EngineName
from dynamo_operator.reconcile.dynamoworker.builders import desired_deployment
from dynamo_operator.reconcile.dynamoworker.settings import ReconcileSettings
from dynamo_operator.reconcile.errors import SpecError
from support.api_cases import dynamo_worker

pytestmark = pytest.mark.unit

IMAGE = "registry.example.com/dynamo-worker:0.1"
VLLM_IMAGE = "registry.example.com/dynamo-worker-vllm:0.1"
SETTINGS = ReconcileSettings(worker_image=IMAGE, vllm_worker_image=VLLM_IMAGE)


def container(spec: dict[str, Any], settings: ReconcileSettings = SETTINGS) -> dict[str, Any]:
    manifest = copy.deepcopy(dynamo_worker(spec=spec))
    manifest["metadata"] |= {"namespace": "serving", "uid": "u-1", "generation": 1}
    deployment = desired_deployment(DynamoWorker.model_validate(manifest), settings)
    found: dict[str, Any] = deployment["spec"]["template"]["spec"]["containers"][0]
    return found


def engine_argv(spec: dict[str, Any]) -> tuple[str, list[str]]:
    """The engine the worker's CLI loads and what that engine's `from_args` receives."""
    main = container(spec)
    args, extras = worker_cli.build_parser().parse_known_args(main["args"])
    worker_cli.check_args(args)  # exits on anything the worker would refuse
    env = {e["name"]: e["value"] for e in main["env"] if "value" in e}
    if "DYN_MAX_LORAS" in env:  # the CLI reads it as --max-loras' default
        args.max_loras = int(env["DYN_MAX_LORAS"])
    return args.engine, worker_cli.engine_argv(args, args.model, extras)


def test_vllm_gets_tensor_parallelism_context_and_the_rest_of_the_spec() -> None:
    engine, argv = engine_argv(
        {
            "engine": {"name": "vllm", "extraArgs": ["--gpu-memory-utilization", "0.9"]},
            "resources": {"gpusPerPod": 8},
            "dataParallel": {"size": 2, "startRank": 4},
            "lora": {"enabled": True, "maxLoras": 6},
            "tokenBudget": {"combinedLimit": 4096},
        }
    )
    assert worker_cli.ENGINE_NAMES[engine] == VLLM_ENGINE_CLASS
    assert argv == [
        "--model", "hf://Qwen/Qwen3-0.6B@main",
        "--served-model-name", "Qwen/Qwen3-0.6B",
        "--max-loras", "6",
        "--data-parallel-size", "2",
        "--data-parallel-start-rank", "4",
        # 8 GPUs over 2 ranks: 4 per rank, as tensor parallelism.
        "--tensor-parallel-size", "4",
        "--max-model-len", "4096",
        "--gpu-memory-utilization", "0.9",
    ]  # fmt: skip


def test_vllm_named_by_class_is_the_same_engine() -> None:
    by_name = container({"engine": {"name": "vllm"}, "resources": {"gpusPerPod": 2}})
    by_class = container({"engine": {"class": VLLM_ENGINE_CLASS}, "resources": {"gpusPerPod": 2}})
    assert by_class["image"] == by_name["image"] == VLLM_IMAGE
    tail = ["--", "--tensor-parallel-size", "2"]
    assert by_name["args"][-3:] == by_class["args"][-3:] == tail


@pytest.mark.parametrize(
    ("spec", "absent"),
    [
        ({"resources": {"gpusPerPod": 0}}, "--tensor-parallel-size"),  # the CPU: vLLM's default
        ({"tokenBudget": {"combinedLimit": 0}}, "--max-model-len"),  # no budget to size to
    ],
)
def test_vllm_flags_only_where_the_spec_sets_them(spec: dict[str, Any], absent: str) -> None:
    _, argv = engine_argv({"engine": {"name": "vllm"}, **spec})
    assert absent not in argv


@pytest.mark.parametrize("engine", [{}, {"name": "transformers"}, {"class": "my.engines:Fast"}])
def test_other_engines_get_no_vllm_flags_and_the_worker_image(engine: dict[str, Any]) -> None:
    spec = {"engine": engine, "resources": {"gpusPerPod": 4}, "tokenBudget": {"combinedLimit": 64}}
    main = container(spec)
    assert main["image"] == IMAGE
    assert "--" not in main["args"]
    name, _ = engine_argv(spec)
    assert name == engine.get("name", engine.get("class", worker_cli.DEFAULT_ENGINE))


def test_missing_vllm_image_names_the_fix() -> None:
    with pytest.raises(SpecError, match=r"no default vLLM worker image.*--vllm-worker-image"):
        container({"engine": {"name": "vllm"}}, ReconcileSettings(worker_image=IMAGE))
    explicit = container({"engine": {"name": "vllm"}, "image": "mine:1"}, ReconcileSettings())
    assert explicit["image"] == "mine:1"


def test_engine_names_are_the_workers() -> None:
    assert set(get_args(EngineName)) == set(worker_cli.ENGINE_NAMES)
    assert worker_cli.ENGINE_NAMES["vllm"] == VLLM_ENGINE_CLASS


def test_owned_flags_are_the_ones_the_operator_passes() -> None:
    """Every flag the worker's argv carries for the engine is one extraArgs may not repeat."""
    _, argv = engine_argv(
        {
            "engine": {"name": "vllm"},
            "resources": {"gpusPerPod": 2},
            "dataParallel": {"size": 2, "startRank": 2},
            "lora": {"enabled": True},
            "tokenBudget": {"combinedLimit": 128},
        }
    )
    passed = {a for a in argv if a.startswith("-")}
    # An aggregated worker's role is the default; a disaggregated one's is passed
    # (test_disaggregation_builders).
    assert passed == {flag.spellings[0] for flag in OWNED_FLAGS} - {"--disaggregation-mode"}


@pytest.mark.parametrize(
    "extra", [["--max-loras=2"], ["--max_loras", "2"], ["--data-parallel-size", "1"], ["-dpr=0"]]
)
def test_every_spelling_of_an_owned_flag_is_refused(extra: list[str]) -> None:
    manifest = dynamo_worker(spec={"engine": {"extraArgs": extra}, "lora": {"enabled": True}})
    with pytest.raises(ValueError, match=r"spec\.engine\.extraArgs must not set"):
        DynamoWorker.model_validate(manifest)


def test_a_flag_merely_starting_like_an_owned_one_passes() -> None:
    extra = ["--max-loras-per-batch", "2", "--model-impl", "vllm", "-dpb", "mp"]
    manifest = dynamo_worker(
        spec={"engine": {"name": "vllm", "extraArgs": extra}, "lora": {"enabled": True}}
    )
    assert DynamoWorker.model_validate(manifest).spec.engine.extra_args == extra
