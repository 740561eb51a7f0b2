"""The DynamoWorker and LoRAAdapter models accept good manifests, fill in the defaults the CRD
declares, and refuse bad ones with the same messages the API server gives."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import ValidationError

from dynamo_operator.api import (
    AdapterState,
    Condition,
    DynamoWorker,
    DynamoWorkerStatus,
    LoRAAdapter,
    LoRAAdapterStatus,
)
from dynamo_operator.api.dynamoworker import PublishedTokenBudget, WorkerPodStatus
from dynamo_operator.api.resource import Resource
from support.api_cases import INVALID, VALID, Invalid, dynamo_worker, lora_adapter

pytestmark = pytest.mark.unit

KINDS: dict[str, type[Resource]] = {"DynamoWorker": DynamoWorker, "LoRAAdapter": LoRAAdapter}


def parse(manifest: dict[str, Any]) -> Resource:
    return KINDS[manifest["kind"]].model_validate(manifest)


def error_location(error: Any) -> str:
    """A pydantic error location written the way the API server writes field paths."""
    path = ""
    for part in error["loc"]:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    return path


@pytest.mark.parametrize(("case_id", "manifest"), VALID, ids=[c for c, _ in VALID])
def test_valid_manifests_parse_and_round_trip(case_id: str, manifest: dict[str, Any]) -> None:
    parsed = parse(manifest)
    # Dumping and parsing again gives the same object: nothing is lost or renamed.
    assert parse(parsed.to_dict()) == parsed


@pytest.mark.parametrize("case", INVALID, ids=[c.id for c in INVALID])
def test_invalid_manifests_are_refused_naming_the_field(case: Invalid) -> None:
    with pytest.raises(ValidationError) as refused:
        parse(case.manifest)
    errors = refused.value.errors()
    locations = [error_location(e) for e in errors]
    if case.message is None:
        # A schema bound: reported on the field itself.
        assert case.field in locations, locations
        return
    # A CEL rule: reported on the object holding it, with the message naming the field.
    assert any(
        case.message in str(e["msg"]) and case.field.startswith(error_location(e)) for e in errors
    ), errors


def test_dynamo_worker_defaults_match_the_documented_ones() -> None:
    dw = DynamoWorker.model_validate(dynamo_worker())
    spec = dw.spec
    assert spec.replicas == 1
    assert spec.resources.gpus_per_pod == 1
    assert spec.resources.shared_memory_size == "8Gi"
    assert (spec.drain.grace_period_seconds, spec.drain.drain_timeout_seconds) == (5, 30)
    assert spec.metrics.pod_monitor == "Auto"
    assert (spec.data_parallel.size, spec.data_parallel.start_rank) == (1, 0)
    assert spec.lora.enabled is False
    assert spec.lora.effective_max_loras is None
    assert spec.token_budget is None
    assert spec.model_taints == []
    assert spec.model.served_name == "Qwen/Qwen3-0.6B"
    assert dw.status is None


def test_lora_max_loras_defaults_to_four_when_enabled() -> None:
    dw = DynamoWorker.model_validate(dynamo_worker(spec={"lora": {"enabled": True}}))
    assert dw.spec.lora.effective_max_loras == 4
    dw = DynamoWorker.model_validate(
        dynamo_worker(spec={"lora": {"enabled": True, "maxLoras": 16}})
    )
    assert dw.spec.lora.effective_max_loras == 16


def test_camel_case_on_the_wire_snake_case_in_python() -> None:
    dw = DynamoWorker.model_validate(
        dynamo_worker(
            spec={
                "model": {"servedModelName": "qwen3"},
                "engine": {"class": "pkg.mod:Engine", "extraArgs": ["--a"]},
                "dataParallel": {"size": 1, "startRank": 3},
            }
        )
    )
    assert dw.spec.model.served_name == "qwen3"
    assert dw.spec.engine.engine_class == "pkg.mod:Engine"
    assert dw.spec.data_parallel.ranks == [3]
    wire = dw.to_dict()["spec"]
    assert wire["model"]["servedModelName"] == "qwen3"
    assert wire["engine"] == {"class": "pkg.mod:Engine", "extraArgs": ["--a"]}
    assert wire["dataParallel"] == {"size": 1, "startRank": 3}
    assert "served_model_name" not in str(wire)


def test_quantities_accept_numbers_and_suffixed_strings() -> None:
    dw = DynamoWorker.model_validate(
        dynamo_worker(
            spec={"resources": {"cpu": 4, "memory": "1.5Gi", "sharedMemorySize": "512Mi"}}
        )
    )
    assert (dw.spec.resources.cpu, dw.spec.resources.memory) == (4, "1.5Gi")
    for bad in (-1, "1.5 Gi", "Gi", "-2"):
        with pytest.raises(ValidationError, match="quantity"):
            DynamoWorker.model_validate(dynamo_worker(spec={"resources": {"cpu": bad}}))


@pytest.mark.parametrize(
    "uri",
    [
        "s3://bucket/prefix/v1",
        "s3://bucket",
        "hf://org/repo",
        "hf://org/repo@main",
        "hf://org/repo@refs/pr/7",
        "hf://gpt2@0123456789abcdef0123456789abcdef01234567",
        "file:///adapters/sql",
    ],
)
def test_adapter_uris_the_worker_downloads_are_accepted(uri: str) -> None:
    lora = LoRAAdapter.model_validate(lora_adapter(spec={"source": {"uri": uri}}))
    assert lora.spec.source.uri == uri


@pytest.mark.parametrize(
    "uri",
    [
        "s3://key:secret@bucket/prefix",
        "s3://key@bucket/prefix",
        "hf://user:token@org/repo",
        "file://user:pw@/etc",
    ],
)
def test_credentials_inside_a_uri_are_refused(uri: str) -> None:
    with pytest.raises(ValidationError, match="must not contain credentials"):
        LoRAAdapter.model_validate(lora_adapter(spec={"source": {"uri": uri}}))


def test_duplicate_env_names_and_taints_are_refused() -> None:
    with pytest.raises(ValidationError, match="duplicate"):
        DynamoWorker.model_validate(dynamo_worker(spec={"modelTaints": ["a=b", "a=b"]}))
    env = [{"name": "X", "value": "1"}, {"name": "X", "value": "2"}]
    with pytest.raises(ValidationError, match="duplicate"):
        DynamoWorker.model_validate(dynamo_worker(spec={"pod": {"env": env}}))


def test_adapter_name_defaults_to_the_object_name() -> None:
    lora = LoRAAdapter.model_validate(lora_adapter("sql-v1"))
    assert lora.adapter_name == "sql-v1"
    named = LoRAAdapter.model_validate(lora_adapter("sql-v1", {"adapterName": "org/sql:v1"}))
    assert named.adapter_name == "org/sql:v1"
    assert lora.spec.placement.policy == "AllReplicas"
    assert lora.spec.placement.strategy == "FewestAdaptersFirst"
    assert lora.spec.required_for_readiness is False


def test_status_round_trips_with_rfc3339_times() -> None:
    when = datetime(2025, 3, 1, 12, 30, 5, 123456, tzinfo=UTC)
    ready = Condition(type="Ready", status="True", reason="AllPodsReady", last_transition_time=when)
    status = DynamoWorkerStatus(
        observed_generation=2,
        replicas=2,
        ready_replicas=2,
        selector="dynamo.dev/worker=llm",
        conditions=[ready],
        pods=[
            WorkerPodStatus(
                name="llm-0", ready=True, token_budget=PublishedTokenBudget(combined_limit=4096)
            )
        ],
    )
    wire = status.to_dict()
    assert wire["conditions"][0]["lastTransitionTime"] == "2025-03-01T12:30:05Z"
    assert wire["pods"][0]["tokenBudget"] == {
        "combinedLimit": 4096,
        "rejectPromptOverflow": False,
        "rejectTotalOverflow": False,
    }
    assert DynamoWorkerStatus.model_validate(wire).conditions[
        0
    ].last_transition_time == when.replace(microsecond=0)


def test_condition_reasons_must_be_camel_case() -> None:
    now = datetime.now(UTC)
    with pytest.raises(ValidationError, match="reason"):
        Condition(type="Ready", status="True", reason="all pods ready", last_transition_time=now)
    with pytest.raises(ValidationError):
        Condition(type="Ready", status="Yes", reason="Fine", last_transition_time=now)


def test_lora_status_per_pod_states() -> None:
    status = LoRAAdapterStatus.model_validate(
        {
            "pods": [
                {"pod": "llm-0", "state": "Loaded", "loraId": 17, "attempts": 1},
                {
                    "pod": "llm-1",
                    "state": "Failed",
                    "reason": "CapacityExceeded",
                    "message": "full",
                },
            ],
            "loadedReplicas": 1,
            "targetReplicas": 2,
            "loaded": "1/2",
            "futureField": "ignored: an older operator reads a newer status",
        }
    )
    assert [p.state for p in status.pods] == [AdapterState.LOADED, AdapterState.FAILED]
    assert status.to_dict()["pods"][1]["state"] == "Failed"
    with pytest.raises(ValidationError):
        LoRAAdapterStatus.model_validate({"pods": [{"pod": "p", "state": "Downloading"}]})
    with pytest.raises(ValidationError):
        LoRAAdapterStatus.model_validate({"loaded": "one of two"})


def test_objects_read_from_the_api_server_keep_metadata() -> None:
    manifest = dynamo_worker()
    manifest["metadata"].update(
        {
            "namespace": "ns",
            "uid": "u-1",
            "generation": 3,
            "resourceVersion": "42",
            "managedFields": [{"manager": "kubectl"}],
            "finalizers": ["dynamo.dev/finalizer"],
        }
    )
    dw = DynamoWorker.model_validate(manifest)
    assert (dw.metadata.namespace, dw.metadata.generation, dw.metadata.finalizers) == (
        "ns",
        3,
        ["dynamo.dev/finalizer"],
    )
