"""Fault injection on the test bed: each scenario under each fault, then the invariants.

Every operator talks to the API server through its own counting proxy (`support.api_proxy`),
so writes are counted where the server sees them, kopf's own patches (its finalizer, and
its progress annotations on a deletion) and Events included, and each is attributed to its
sender.

Faults:
- `kill-after-each-write`: each operator run is SIGKILLed right after its first write
  reaches the server (the proxy kills it when its second write arrives, and drops that one);
  a fresh run takes over, until one converges without being killed. Over the runs every write
  of the scenario's sequence is followed by a kill, so this is "killed after the k-th write,
  for every k" with the state each earlier kill left.
- `leader-killed`: two operators with leader election; the leader is SIGKILLed right after the
  scenario's change, while it reconciles it, and a fresh standby replaces it.
- `api-errors`: the API server (the proxy) answers bursts of 503 and of 429 with Retry-After to
  every request but watches, right after each change.
- `apiserver-restart`: right after each change the test bed's real kube-apiserver is stopped,
  left stopped for `OUTAGE_SECONDS` and started again (`hack/cluster restart-apiserver`; etcd
  and the other components keep running and reconnect).
- `watch-expired`: right before each change every connection is cut and the next watches
  get 410 Gone (an ERROR event with an Expired Status, what the API server sends once a
  resourceVersion is compacted away; injected by the proxy: the shared test bed's etcd is not
  compacted), so the operator must list again.
- `silent-watch`: right before each change, every watch stream open goes silent with its TCP
  connection alive (the proxy stops forwarding it); the operator notices through kopf's
  inactivity timeout (`WATCH_INACTIVITY_SECONDS`) and watches again.

Scenarios, on a DynamoWorker on the fake GPU nodes: create it; edit its spec (rolls the
pods); scale 2 -> 4 -> 1; delete it. On one with LoRA enabled and a frontend, its workers
(SampleEngine) on the process node, adapters from the moto S3 server on the test bed's host:
create it; apply a LoRAAdapter; roll the adapter's source; delete the adapter; delete the
DynamoWorker while the adapter targets it; set and unset `requiredForReadiness` (each rolls
the pods once, through the readiness gate). The frontend's pods land on the fake nodes (they
run nothing; the scenario is about the operator's children, not the frontend's routing).

Invariants after each run, against a run of the same scenario without the fault:
- exactly one child of each kind, owned by the DynamoWorker (none once it is deleted);
- the same status: conditions (status and reason), replica counts, observedGeneration;
- the finalizer once, or the object gone (no finalizer stuck), LoRAAdapters included;
- every targeted ready pod serves every adapter, and no other pod does (each ready worker
  pod's `GET /v1/loras` lists exactly the adapters the step left), and each adapter's status
  (conditions, per-pod states and sources) is the same as without the fault;
- no more ReplicaSets than without the fault (no pod replaced that the scenario did not
  require);
- no write by a non-leader (leader election: a standby writes nothing before it leads).

The machinery (operators behind proxies, the faults, convergence, outcomes) is in
`support.fault_matrix`. CI runs the subset in `CI_SUBSET` (about 6 minutes);
DYNAMO_FAULT_MATRIX=full runs every scenario under every fault, and
DYNAMO_FAULT_MATRIX=create,scale (scenario names) those scenarios under every fault, so the
full matrix can run in parts. Each cell prints its verdict as it ends
(`support.fault_report`).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client

from support.api_cases import dynamo_worker, lora_adapter
from support.cluster import Cluster, create_test_namespace
from support.dynamo_workers import GROUP, PLURAL, VERSION, create_worker
from support.fault_matrix import (
    ADAPTERS,
    GONE,
    MERGE_PATCH,
    NAME,
    WORKER_NOT_FOUND,
    LoraBed,
    Outcome,
    Scenario,
    Space,
    Target,
    check_invariants,
    run_scenario,
)
from support.operator_namespace import serving_worker_spec
from support.s3 import S3Server, testbed_s3_server
from support.tiny_model import TinyModel
from support.worker_admin import chart_worker_admin

pytestmark = pytest.mark.cluster
__all__ = ["testbed_s3_server"]

ADAPTER = "sql"
CREDENTIALS = "s3-creds"


# One bucket per session (each session starts its own S3 server), so the URIs are constants.
BUCKET = "fault-matrix"
V1, V2 = f"s3://{BUCKET}/adapters/sql-lora", f"s3://{BUCKET}/adapters/poet-lora"


@dataclass(frozen=True)
class AdapterStore:
    """The LoRA scenarios' shared inputs: the base model in a folder process-node pods read,
    and the tiny model's adapters in `BUCKET` on the S3 server on the test bed's host."""

    model: Path
    s3: S3Server


@pytest.fixture(scope="session")
def adapter_store(
    testbed: Cluster, tiny_model: TinyModel, testbed_s3_server: S3Server
) -> Iterator[AdapterStore]:
    shared = Path(testbed.kubeconfig).parent / "e2e" / f"faults-{uuid.uuid4().hex[:8]}"
    shutil.copytree(tiny_model.base, shared / "base")
    testbed_s3_server.client().create_bucket(Bucket=BUCKET)
    for name, path in tiny_model.adapters.items():
        testbed_s3_server.upload_dir(BUCKET, f"adapters/{name}", path)
    try:
        yield AdapterStore(shared / "base", testbed_s3_server)
    finally:
        shutil.rmtree(shared, ignore_errors=True)


# -- the steps ---------------------------------------------------------------------------


async def _patch(space: Space, plural: str, name: str, spec: dict[str, Any]) -> None:
    await space.custom.patch_namespaced_custom_object(
        GROUP, VERSION, space.namespace, plural, name, {"spec": spec}, **MERGE_PATCH
    )


async def _create(space: Space) -> None:
    await create_worker(space.api, space.namespace, NAME)


async def _edit(space: Space) -> None:
    await _patch(space, PLURAL, NAME, {"engine": {"extraArgs": ["--dtype", "bfloat16"]}})


async def _scale_to_4(space: Space) -> None:
    await _patch(space, PLURAL, NAME, {"replicas": 4})


async def _scale_to_1(space: Space) -> None:
    await _patch(space, PLURAL, NAME, {"replicas": 1})


async def _delete(space: Space) -> None:
    await space.custom.delete_namespaced_custom_object(
        GROUP, VERSION, space.namespace, PLURAL, NAME
    )


async def _create_lora_worker(space: Space) -> None:
    assert space.lora is not None
    s3 = space.lora.s3
    secret: Any = {
        "metadata": {"name": CREDENTIALS},
        "stringData": {
            "AWS_ACCESS_KEY_ID": s3.env["AWS_ACCESS_KEY_ID"],
            "AWS_SECRET_ACCESS_KEY": s3.env["AWS_SECRET_ACCESS_KEY"],
        },
    }
    await client.CoreV1Api(space.api).create_namespaced_secret(space.namespace, secret)
    spec = {
        **serving_worker_spec(
            space.lora.model,
            s3={"secretName": CREDENTIALS, "endpoint": s3.endpoint_url, "region": "us-east-1"},
        ),
        "frontend": {"image": "registry.invalid/dynamo-frontend:test"},
    }
    await space.custom.create_namespaced_custom_object(
        GROUP, VERSION, space.namespace, PLURAL, dynamo_worker(NAME, spec)
    )


async def _apply_adapter(space: Space) -> None:
    body = lora_adapter(ADAPTER, {"workerRef": {"name": NAME}, "source": {"uri": V1}})
    await space.custom.create_namespaced_custom_object(
        GROUP, VERSION, space.namespace, ADAPTERS, body
    )


async def _roll_adapter(space: Space) -> None:
    await _patch(space, ADAPTERS, ADAPTER, {"source": {"uri": V2}})


async def _delete_adapter(space: Space) -> None:
    await space.custom.delete_namespaced_custom_object(
        GROUP, VERSION, space.namespace, ADAPTERS, ADAPTER
    )


async def _require_adapter(space: Space) -> None:
    await _patch(space, ADAPTERS, ADAPTER, {"requiredForReadiness": True})


async def _unrequire_adapter(space: Space) -> None:
    await _patch(space, ADAPTERS, ADAPTER, {"requiredForReadiness": False})


WITH_V1 = Target(2, {ADAPTER: V1})
SCENARIOS = {
    "create": Scenario((), Target(2), ((_create, Target(2)),)),
    "edit": Scenario((_create,), Target(2), ((_edit, Target(2)),)),
    "scale": Scenario((_create,), Target(2), ((_scale_to_4, Target(4)), (_scale_to_1, Target(1)))),
    "delete": Scenario((_create,), Target(2), ((_delete, Target(None)),)),
    "lora-create": Scenario((), Target(2), ((_create_lora_worker, Target(2)),), lora=True),
    "adapter-apply": Scenario(
        (_create_lora_worker,), Target(2), ((_apply_adapter, WITH_V1),), lora=True
    ),
    "adapter-roll": Scenario(
        (_create_lora_worker, _apply_adapter),
        WITH_V1,
        ((_roll_adapter, Target(2, {ADAPTER: V2})),),
        lora=True,
    ),
    "adapter-delete": Scenario(
        (_create_lora_worker, _apply_adapter),
        WITH_V1,
        ((_delete_adapter, Target(2, {ADAPTER: GONE})),),
        lora=True,
    ),
    "delete-targeted": Scenario(
        (_create_lora_worker, _apply_adapter),
        WITH_V1,
        ((_delete, Target(None, {ADAPTER: WORKER_NOT_FOUND})),),
        lora=True,
    ),
    "required": Scenario(
        (_create_lora_worker, _apply_adapter),
        WITH_V1,
        (
            (_require_adapter, Target(2, {ADAPTER: V1}, gated=True)),
            (_unrequire_adapter, Target(2, {ADAPTER: V1})),
        ),
        lora=True,
    ),
}
FAULTS = (
    "kill-after-each-write",
    "leader-killed",
    "api-errors",
    "apiserver-restart",
    "watch-expired",
    "silent-watch",
)
CI_SUBSET = {
    ("create", "kill-after-each-write"),
    ("create", "api-errors"),
    ("scale", "leader-killed"),
    ("edit", "api-errors"),
    ("adapter-roll", "leader-killed"),
    ("adapter-apply", "apiserver-restart"),
}
# Violations the matrix found, each fixed in the product (none is marked expected to fail: a new one
# fails its cell until it is fixed): a 16-request 5xx/429 burst exhausted kopf's 9 tries of its
# finalizer PATCH (create, delete): kopf now retries for minutes
# (`handlers.lifecycle.api_error_backoffs`); a DynamoWorker became Ready while that PATCH was still
# being retried (create x api-errors): no daemon reconciles before kopf's finalizer is on its object
# (`handlers.resync`); a LoRAAdapter was loaded (and Ready) before kopf's finalizer was on it when
# the API failed (adapter-apply x api-errors, and x the proxy's outage that apiserver-restart
# replaced): its daemon now waits for the finalizer; an operator killed at every second write
# hot-swapped adapters its predecessor had loaded and never converged (adapter-apply, adapter-roll x
# kill-after-each-write): workers now list each adapter's source, and a pod serving the current one
# is adopted.


@asynccontextmanager
async def space_for(
    api: client.ApiClient, namespace: str, store: AdapterStore | None, logs: Path
) -> AsyncIterator[Space]:
    """The run's space; a LoRA scenario's (`store` given) with a worker-admin token."""
    if store is None:
        yield Space(api, namespace)
        return
    async with chart_worker_admin(api, namespace, logs) as token:
        yield Space(api, namespace, LoraBed(token, store.model, store.s3))


_BASELINES: dict[str, Outcome] = {}


async def baseline(
    name: str, cluster: Cluster, api: client.ApiClient, store: AdapterStore | None, logs: Path
) -> Outcome:
    """The scenario without a fault (once per session), in a namespace of its own."""
    if name not in _BASELINES:
        namespace = await create_test_namespace(api, "baseline")
        try:
            async with space_for(api, namespace, store, logs) as space:
                _BASELINES[name] = await run_scenario("none", SCENARIOS[name], cluster, space, logs)
        finally:
            await client.CoreV1Api(api).delete_namespace(namespace)
    return _BASELINES[name]


def chosen_scenarios(setting: str) -> frozenset[str]:
    """The scenarios DYNAMO_FAULT_MATRIX runs under every fault: `full` (all), or names,
    comma-separated; none when unset (CI's subset only)."""
    if setting.strip() == "full":
        return frozenset(SCENARIOS)
    names = frozenset(n.strip() for n in setting.split(",") if n.strip())
    unknown = sorted(names - SCENARIOS.keys())
    if unknown:
        raise pytest.UsageError(
            f"DYNAMO_FAULT_MATRIX: no scenario {', '.join(unknown)}; set `full` or some of"
            f" {', '.join(SCENARIOS)}, comma-separated"
        )
    return names


CHOSEN = chosen_scenarios(os.environ.get("DYNAMO_FAULT_MATRIX", ""))


def _marks(scenario: str, fault: str) -> tuple[pytest.MarkDecorator, ...]:
    if scenario not in CHOSEN and (scenario, fault) not in CI_SUBSET:
        reason = "the full fault matrix: set DYNAMO_FAULT_MATRIX=full (or scenario names)"
        return (pytest.mark.skip(reason=reason),)
    return ()


MATRIX = [
    pytest.param(scenario, fault, marks=_marks(scenario, fault), id=f"{scenario}-{fault}")
    for scenario in SCENARIOS
    for fault in FAULTS
]


@pytest.mark.parametrize(("scenario", "fault"), MATRIX)
async def test_scenario_under_fault_keeps_the_invariants(
    api: client.ApiClient,
    cluster: Cluster,
    namespace: str,
    crds: None,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    scenario: str,
    fault: str,
) -> None:
    chosen = SCENARIOS[scenario]
    store = request.getfixturevalue("adapter_store") if chosen.lora else None
    expected = await baseline(scenario, cluster, api, store, tmp_path)
    async with space_for(api, namespace, store, tmp_path) as space:
        got = await run_scenario(fault, chosen, cluster, space, tmp_path, expected)
    check_invariants(got, expected)
