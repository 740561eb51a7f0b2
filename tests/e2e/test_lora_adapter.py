"""LoRAAdapter end to end: the operator (a subprocess) loads adapters from S3 onto real worker
processes (the reference engine with the tiny Llama checkpoint) running as process-node pods.

One DynamoWorker serves all steps, in order: load onto both pods and serve a completion that
differs from the base model; reload after a worker process is killed; load onto a new pod
after a scale-out; roll a new version without ever leaving the name unserved; report bad
sources with reasons and backoff; report CapacityExceeded without disturbing other adapters;
unload on delete, also with one pod not answering (within the bound, with an Event); admit
changes only from callers allowed dynamoworkers/admin (401/403 otherwise, from a pod in
another namespace too); and
never leak a planted secret value into the operator's log, status or Events. Finally the
DynamoWorker is deleted before an adapter, which must not get stuck in Terminating.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import shutil
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest
import pytest_asyncio
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from dynamo.common.lora import adapter_digest
from dynamo_operator.pods.credentials import WORKER_ADMIN_AUDIENCE
from support.cluster import Cluster
from support.operator_namespace import (
    GROUP,
    MERGE,
    ON_PROCESS_NODE,
    TRANSFORMERS_ENGINE,
    VERSION,
    OperatorNamespace,
    operator_namespace,
    serving_worker_spec,
)
from support.s3 import S3Server, testbed_s3_server
from support.testbed_workers import signal_pod, wait_restarted
from support.tiny_model import TinyModel

pytestmark = pytest.mark.e2e
__all__ = ["testbed_s3_server"]

WORKER = "tiny"
MAX_LORAS = 2
UNLOAD_BOUND_SECONDS = 10.0
PROMPT = "the quick brown"
T = TypeVar("T")


@dataclass
class Bed(OperatorNamespace):
    """Everything the steps share: the namespace and operator, plus the adapters in S3."""

    bucket: str = ""
    canary: str = ""
    metrics_namespace: str = ""
    adapters: dict[str, Path] = field(default_factory=dict)
    statuses: list[str] = field(default_factory=list)
    texts: dict[str, str] = field(default_factory=dict)

    def uri(self, adapter: str) -> str:
        return f"s3://{self.bucket}/adapters/{adapter}"

    # --- objects ---------------------------------------------------------------------

    async def create_adapter(self, name: str, source: dict[str, Any], **spec: Any) -> None:
        body: Any = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "LoRAAdapter",
            "metadata": {"name": name},
            "spec": {"workerRef": {"name": WORKER}, "source": source, **spec},
        }
        await self.custom.create_namespaced_custom_object(
            GROUP, VERSION, self.namespace, "loraadapters", body
        )

    async def adapter(self, name: str) -> dict[str, Any]:
        found: dict[str, Any] = await self.custom.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, "loraadapters", name
        )
        self.statuses.append(json.dumps(found.get("status") or {}))
        return found

    async def wait_adapter(
        self, name: str, until: Callable[[dict[str, Any]], bool], within: float = 60
    ) -> dict[str, Any]:
        return await self.eventually(
            f"LoRAAdapter {name}", lambda: self.adapter(name), within, until
        )

    async def delete_adapter(self, name: str) -> None:
        await self.custom.delete_namespaced_custom_object(
            GROUP, VERSION, self.namespace, "loraadapters", name
        )

    async def gone(self, name: str) -> bool:
        try:
            await self.adapter(name)
        except ApiException as err:
            return err.status == 404
        return False

    async def worker(self) -> dict[str, Any]:
        found: dict[str, Any] = await self.custom.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, "dynamoworkers", WORKER
        )
        return found

    async def pods(self) -> list[Any]:
        listing = await self.core.list_namespaced_pod(
            self.namespace, label_selector=f"dynamo.dev/worker={WORKER}"
        )
        return sorted(
            (p for p in listing.items if p.metadata.deletion_timestamp is None),
            key=lambda p: p.metadata.name,
        )

    async def ready_pods(self, count: int, within: float = 120) -> list[Any]:
        def ready(pods: list[Any]) -> bool:
            return len(pods) == count and all(_ready(p) for p in pods)

        return await self.eventually(f"{count} ready pods", self.pods, within, ready)

    async def events(self) -> list[dict[str, Any]]:
        # Raw JSON: kopf's core/v1 Events have no eventTime, which the model refuses.
        response: Any = await client.EventsV1Api(self.api).list_namespaced_event(
            self.namespace, _preload_content=False
        )
        return list(json.loads(await response.read())["items"])


def _ready(pod: Any) -> bool:
    conditions = pod.status.conditions or []
    return bool(pod.status.pod_ip) and any(
        c.type == "Ready" and c.status == "True" for c in conditions
    )


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return dict(c)
    return {}


def pod_states(obj: dict[str, Any]) -> dict[str, tuple[str, str | None, str | None]]:
    return {
        p["pod"]: (p["state"], p.get("reason"), p.get("uri"))
        for p in (obj.get("status") or {}).get("pods") or []
    }


def all_loaded(count: int, uri: str) -> Callable[[dict[str, Any]], bool]:
    def check(obj: dict[str, Any]) -> bool:
        states = pod_states(obj)
        return (
            condition(obj, "Ready").get("status") == "True"
            and (obj.get("status") or {}).get("loaded") == f"{count}/{count}"
            and len(states) == count
            and all(s == ("Loaded", None, uri) for s in states.values())
        )

    return check


async def http_json(
    method: str,
    url: str,
    body: Any = None,
    limit_seconds: float = 30,
    headers: dict[str, str] | None = None,
) -> Any:
    async with (
        aiohttp.ClientSession() as session,
        session.request(
            method,
            url,
            json=body,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=limit_seconds),
        ) as response,
    ):
        return response.status, await response.json(content_type=None)


async def loras(ip: str) -> dict[str, int]:
    status, body = await http_json("GET", f"http://{ip}:9090/v1/loras", limit_seconds=5)
    assert status == 200, body
    return dict(body["loras"])


async def completion(ip: str, model: str) -> str:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    status, answer = await http_json("POST", f"http://{ip}:8000/v1/completions", body)
    assert status == 200, answer
    return str(answer["choices"][0]["text"])


@pytest_asyncio.fixture(scope="module")
async def bed(
    api: client.ApiClient,
    testbed: Cluster,
    tiny_model: TinyModel,
    testbed_s3_server: S3Server,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[Bed]:
    log_dir = tmp_path_factory.mktemp("lora-operator")
    async with operator_namespace(api, testbed, "t-lora", log_dir) as space:
        namespace = space.namespace
        shutil.copytree(tiny_model.base, space.shared / "base")
        s3 = testbed_s3_server
        bucket = s3.new_bucket("lora")
        for name, path in tiny_model.adapters.items():
            s3.upload_dir(bucket, f"adapters/{name}", path)
        canary = f"canary-{uuid.uuid4().hex}"
        secret: Any = {
            "metadata": {"name": "s3-creds"},
            "data": {
                "AWS_ACCESS_KEY_ID": base64.b64encode(b"testing").decode(),
                "AWS_SECRET_ACCESS_KEY": base64.b64encode(canary.encode()).decode(),
            },
        }
        await client.CoreV1Api(api).create_namespaced_secret(namespace, secret)
        bed = Bed(
            **vars(space),
            bucket=bucket,
            canary=canary,
            adapters=dict(tiny_model.adapters),
            metrics_namespace=f"{namespace}-metrics",
        )
        worker: Any = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "DynamoWorker",
            "metadata": {"name": WORKER},
            "spec": {
                **serving_worker_spec(
                    space.shared / "base",
                    2,
                    engine=TRANSFORMERS_ENGINE,
                    max_loras=MAX_LORAS,
                    s3={
                        "secretName": "s3-creds",
                        "endpoint": s3.endpoint_url,
                        "region": "us-east-1",
                    },
                ),
                "networkPolicy": {"systemPortNamespaces": [bed.metrics_namespace]},
            },
        }
        await space.create("dynamoworkers", worker)
        await bed.ready_pods(2, within=180)
        yield bed


# --- the steps, in order ----------------------------------------------------------------------


async def test_load_onto_every_pod_and_serve(bed: Bed) -> None:
    sql = bed.adapters["sql-lora"]
    await bed.create_adapter("sql", {"uri": bed.uri("sql-lora"), "sha256": adapter_digest(sql)})
    found = await bed.wait_adapter("sql", all_loaded(2, bed.uri("sql-lora")), within=90)
    assert found["status"]["adapterName"] == "sql"
    assert condition(found, "Degraded")["reason"] == "AsExpected"
    pods = await bed.pods()
    for pod in pods:
        assert "sql" in await loras(pod.status.pod_ip)
    ip = pods[0].status.pod_ip
    base, adapted = await completion(ip, "tiny-llama"), await completion(ip, "sql")
    assert adapted != base, "the adapter changes the output"
    assert await completion(pods[1].status.pod_ip, "sql") == adapted
    bed.texts["sql-v1"] = adapted

    # The worker's per-pod summary (from its DynamoWorkerMetadata) lists the adapter.
    def lists_it(worker: dict[str, Any]) -> bool:
        entries = worker.get("status", {}).get("pods", [])
        return len(entries) == 2 and all("sql" in e.get("loadedAdapters", []) for e in entries)

    await bed.eventually("DynamoWorker pods list sql", bed.worker, 30, lists_it)
    samples = bed.operator.metrics()
    count = samples.get(("dynamo_operator_lora_load_duration_seconds_count", ()), 0)
    assert count >= 2
    per_pod = {
        dict(labels)["pod"]: value
        for (name, labels), value in samples.items()
        if name == "dynamo_operator_lora_adapters"
    }
    assert per_pod == {p.metadata.name: 1 for p in pods}


# A pod elsewhere in the cluster tries to change a worker: no token, its ordinary token (the
# API server's audience), and its own token for the workers' audience (a projected volume).
CALLER_SCRIPT = """
import json, sys, urllib.request
url, body = sys.argv[1], json.dumps({"lora_name": "x", "source": {"uri": sys.argv[2]}}).encode()
tokens = {
    "none": None,
    "ordinary": "/var/run/secrets/kubernetes.io/serviceaccount/token",
    "audience": "/var/run/secrets/dynamo.dev/worker-admin/token",
}
for name, path in tokens.items():
    headers = {"Content-Type": "application/json"}
    if path:
        headers["Authorization"] = "Bearer " + open(path).read().strip()
    request = urllib.request.Request(url, body, headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            answer = {"status": response.status, "body": json.loads(response.read())}
    except urllib.error.HTTPError as err:
        answer = {"status": err.code, "body": json.loads(err.read())}
    except OSError as err:  # refused by the NetworkPolicy
        answer = {"status": 0, "error": str(err)}
    print(json.dumps({"token": name, **answer}), flush=True)
"""


async def _service_account_token(bed: Bed, namespace: str, account: str) -> str:
    request: Any = {"spec": {"audiences": [WORKER_ADMIN_AUDIENCE], "expirationSeconds": 600}}
    answer = await bed.core.create_namespaced_service_account_token(account, namespace, request)
    return str(answer.status.token)


def _caller_pod(url: str, uri: str) -> Any:
    token = {"audience": WORKER_ADMIN_AUDIENCE, "expirationSeconds": 600, "path": "token"}
    return {
        "metadata": {"name": "caller"},
        "spec": {
            **ON_PROCESS_NODE,
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "main",
                    "image": "registry.invalid/python:3",
                    "command": ["python", "-c", CALLER_SCRIPT, url, uri],
                    "volumeMounts": [
                        {
                            "name": "worker-admin",
                            "mountPath": "/var/run/secrets/dynamo.dev/worker-admin",
                        }
                    ],
                }
            ],
            "volumes": [
                {"name": "worker-admin", "projected": {"sources": [{"serviceAccountToken": token}]}}
            ],
        },
    }


async def _answers_from(bed: Bed, namespace: str, url: str) -> dict[str, dict[str, Any]]:
    """Run the caller pod in a new `namespace`; its answer per token."""
    body: Any = {"metadata": {"name": namespace, "labels": {"dynamo.dev/test": "true"}}}
    await bed.core.create_namespace(body)
    await bed.eventually(
        f"the default ServiceAccount of {namespace}",
        lambda: bed.core.read_namespaced_service_account("default", namespace),
        30,
        lambda _: True,
    )
    await bed.core.create_namespaced_pod(namespace, _caller_pod(url, bed.uri("poet-lora")))
    await bed.eventually(
        f"the caller pod in {namespace} finishes",
        lambda: bed.core.read_namespaced_pod("caller", namespace),
        60,
        lambda pod: pod.status.phase in ("Succeeded", "Failed"),
    )
    log = await bed.core.read_namespaced_pod_log("caller", namespace)
    return {a["token"]: a for a in map(json.loads, log.splitlines())}


async def test_only_authorized_callers_may_change_a_worker(bed: Bed) -> None:
    """Changes need a worker-audience token of someone allowed dynamoworkers/admin; the
    operator's own loads (the test above) carry such a token, from the chart's Role. The
    NetworkPolicy admits the system port from the namespace spec.networkPolicy names (the
    test bed's policy agent enforces it), not from any other."""
    ip = (await bed.pods())[0].status.pod_ip
    url = f"http://{ip}:9090/v1/loras"
    admitted, outsider = bed.metrics_namespace, f"{bed.namespace}-outsider"
    try:
        answers, shut_out = await asyncio.gather(
            _answers_from(bed, admitted, url), _answers_from(bed, outsider, url)
        )
    finally:
        for namespace in (admitted, outsider):
            await bed.core.delete_namespace(namespace)
    assert answers["none"]["status"] == 401, answers
    assert "missing bearer token" in answers["none"]["body"]["message"]
    assert answers["ordinary"]["status"] == 401, answers
    assert "invalid bearer token" in answers["ordinary"]["body"]["message"]
    assert answers["audience"]["status"] == 403, answers
    assert (
        f"system:serviceaccount:{admitted}:default may not change this worker"
        in (answers["audience"]["body"]["message"])
    )
    assert {a["status"] for a in shut_out.values()} == {0}, shut_out

    # In the worker's namespace: granted dynamoworkers/admin may, granted nothing may not.
    rbac = client.RbacAuthorizationV1Api(bed.api)
    for name in ("granted", "nothing"):
        account: Any = {"metadata": {"name": name}}
        await bed.core.create_namespaced_service_account(bed.namespace, account)
    role: Any = {
        "metadata": {"name": "worker-admin"},
        "rules": [
            {
                "apiGroups": ["dynamo.dev"],
                "resources": ["dynamoworkers/admin"],
                "resourceNames": [WORKER],
                "verbs": ["update"],
            }
        ],
    }
    await rbac.create_namespaced_role(bed.namespace, role)
    binding: Any = {
        "metadata": {"name": "worker-admin"},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": "worker-admin",
        },
        "subjects": [{"kind": "ServiceAccount", "name": "granted", "namespace": bed.namespace}],
    }
    await rbac.create_namespaced_role_binding(bed.namespace, binding)
    body = {"lora_name": "by-hand", "source": {"uri": bed.uri("poet-lora")}}
    nothing = await _service_account_token(bed, bed.namespace, "nothing")
    status, answer = await http_json(
        "POST", url, body, headers={"Authorization": f"Bearer {nothing}"}
    )
    assert status == 403, answer
    granted = await _service_account_token(bed, bed.namespace, "granted")
    headers = {"Authorization": f"Bearer {granted}"}
    status, answer = await http_json("POST", url, body, headers=headers)
    assert status == 200, answer
    assert "by-hand" in await loras(ip)
    status, answer = await http_json("DELETE", f"{url}/by-hand", headers=headers)
    assert status == 200, answer
    assert "by-hand" not in await loras(ip)


async def test_a_killed_worker_gets_the_adapter_back(bed: Bed) -> None:
    victim = (await bed.pods())[0]
    signal_pod(victim, signal.SIGKILL)
    await wait_restarted(bed, victim, 120, _ready)
    await bed.wait_adapter("sql", all_loaded(2, bed.uri("sql-lora")), within=60)
    assert "sql" in await loras(victim.status.pod_ip)
    notes = [e.get("note") or "" for e in await bed.events() if e.get("reason") == "Reloading"]
    assert any(victim.metadata.name in note for note in notes), notes


async def test_a_new_pod_gets_the_adapter(bed: Bed) -> None:
    await bed.custom.patch_namespaced_custom_object_scale(
        GROUP, VERSION, bed.namespace, "dynamoworkers", WORKER, {"spec": {"replicas": 3}}, **MERGE
    )
    pods = await bed.ready_pods(3, within=150)
    await bed.wait_adapter("sql", all_loaded(3, bed.uri("sql-lora")), within=60)
    assert all(["sql" in await loras(p.status.pod_ip) for p in pods])


async def test_a_new_source_rolls_out_without_a_gap(bed: Bed) -> None:
    poet = bed.adapters["poet-lora"]
    v2 = bed.uri("poet-lora")
    pods = await bed.pods()
    ips = [p.status.pod_ip for p in pods]
    await bed.custom.patch_namespaced_custom_object(
        GROUP, VERSION, bed.namespace, "loraadapters", "sql",
        {"spec": {"source": {"uri": v2, "sha256": adapter_digest(poet)}}}, **MERGE,
    )  # fmt: skip
    deadline = time.monotonic() + 90
    polls = 0
    while True:
        served = await asyncio.gather(*(loras(ip) for ip in ips))
        polls += 1
        assert any("sql" in s for s in served), "no pod served the adapter during the rollout"
        found = await bed.adapter("sql")
        if all_loaded(3, v2)(found):
            break
        assert time.monotonic() < deadline, f"rollout incomplete: {found['status']}"
        await asyncio.sleep(0.1)
    assert polls > 1
    texts = {await completion(ip, "sql") for ip in ips}
    assert len(texts) == 1, "every pod serves the same version"
    assert texts != {bed.texts["sql-v1"]}, "the new version answers differently"


async def test_bad_sources_fail_with_reasons_and_backoff(bed: Bed) -> None:
    sql, chat = bed.adapters["sql-lora"], bed.adapters["chat-lora"]
    await bed.create_adapter("missing", {"uri": bed.uri("no-such-adapter")})
    await bed.create_adapter("digest", {"uri": bed.uri("sql-lora"), "sha256": adapter_digest(chat)})
    assert adapter_digest(sql) != adapter_digest(chat)

    def failed(reason: str) -> Callable[[dict[str, Any]], bool]:
        def check(obj: dict[str, Any]) -> bool:
            states = pod_states(obj)
            return len(states) == 3 and all(s[:2] == ("Failed", reason) for s in states.values())

        return check

    missing = await bed.wait_adapter("missing", failed("SourceNotFound"), within=60)
    digest = await bed.wait_adapter("digest", failed("DigestMismatch"), within=60)
    for obj, reason, hint in (
        (missing, "SourceNotFound", "check the bucket and prefix"),
        (digest, "DigestMismatch", "spec.source.sha256"),
    ):
        assert condition(obj, "Ready")["status"] == "False"
        degraded = condition(obj, "Degraded")
        assert (degraded["status"], degraded["reason"]) == ("True", reason)
        assert hint in degraded["message"]
        for entry in obj["status"]["pods"]:
            assert hint in entry["message"]
    failures = bed.operator.metrics()
    for reason in ("SourceNotFound", "DigestMismatch"):
        key = ("dynamo_operator_lora_load_failures_total", (("reason", reason),))
        assert failures.get(key, 0) >= 3, reason
    # Retries follow the backoff: 2 s after the first failure, 4 s after the second...
    # Watched until each pod has retried twice more: from attempt k that takes 3 x 2^k s, and
    # the watch may start just after an attempt (k is 2 or 3 by now).
    attempts: dict[str, list[tuple[int, float]]] = {}
    end = time.monotonic() + 60
    while time.monotonic() < end:
        for entry in (await bed.adapter("missing"))["status"]["pods"]:
            seen = attempts.setdefault(entry["pod"], [])
            if not seen or seen[-1][0] != entry["attempts"]:
                seen.append((entry["attempts"], time.monotonic()))
        if len(attempts) == 3 and all(len(seen) >= 3 for seen in attempts.values()):
            break
        await asyncio.sleep(0.2)
    for pod, seen in attempts.items():
        for (before, _), (after, _) in itertools.pairwise(seen):
            assert after == before + 1, f"{pod}: attempts jumped {seen}"
        assert len(seen) >= 3, f"{pod}: fewer than two retries seen in 60 s {seen}"
    # Seconds between failures >= the backoff, timed by each failure's Event (stamped to the
    # microsecond as the load's answer is recorded): when the status showed a failure depends
    # on how soon a reconcile wrote it, on a busy machine up to seconds later. The operator
    # keeps failure times to the second, as its status does, so a retry may come up to 1 s
    # before the backoff has passed since the failure itself.
    failures_at: dict[str, list[float]] = {}
    for event in await bed.events():
        if event["regarding"]["name"] == "missing" and event["reason"] == "SourceNotFound":
            pod = event["note"].removeprefix("pod ").split(":", 1)[0]
            at = datetime.fromisoformat(event["eventTime"]).timestamp()
            failures_at.setdefault(pod, []).append(at)
    assert set(failures_at) == set(attempts)
    for pod, times in failures_at.items():
        times.sort()
        for attempt, (failed_at, retried_at) in enumerate(itertools.pairwise(times), start=1):
            backoff = 2.0 * 2 ** (attempt - 1)
            assert retried_at - failed_at > backoff - 1.0, f"{pod}: attempt {attempt + 1} early"
    for name in ("missing", "digest"):
        await bed.delete_adapter(name)
    await bed.eventually("missing deleted", lambda: bed.gone("missing"), 30, bool)
    await bed.eventually("digest deleted", lambda: bed.gone("digest"), 30, bool)


async def test_capacity_exceeded_leaves_the_others_alone(bed: Bed) -> None:
    await bed.create_adapter("chat", {"uri": bed.uri("chat-lora")})
    await bed.wait_adapter("chat", all_loaded(3, bed.uri("chat-lora")), within=60)
    # Two adapters per pod fill maxLoras: one more does not fit anywhere.
    await bed.create_adapter("extra", {"uri": bed.uri("sql-lora")})

    def over_capacity(obj: dict[str, Any]) -> bool:
        states = pod_states(obj)
        return len(states) == 3 and all(
            s[:2] == ("Failed", "CapacityExceeded") for s in states.values()
        )

    extra = await bed.wait_adapter("extra", over_capacity, within=60)
    degraded = condition(extra, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "CapacityExceeded")
    assert "spec.lora.maxLoras" in degraded["message"]
    for name, source in (("sql", "poet-lora"), ("chat", "chat-lora")):
        assert all_loaded(3, bed.uri(source))(await bed.adapter(name))
    for pod in await bed.pods():
        assert set(await loras(pod.status.pod_ip)) == {"sql", "chat"}
    await bed.delete_adapter("extra")
    await bed.eventually("extra deleted", lambda: bed.gone("extra"), 30, bool)


async def test_delete_unloads_everywhere(bed: Bed) -> None:
    await bed.delete_adapter("sql")
    await bed.eventually("sql deleted", lambda: bed.gone("sql"), 30, bool)
    for pod in await bed.pods():
        assert "sql" not in await loras(pod.status.pod_ip)
    unloaded = [e for e in await bed.events() if e.get("reason") == "Unloaded"]
    assert any("sql unloaded from pods" in (e.get("note") or "") for e in unloaded)


async def test_delete_with_a_pod_not_answering_is_bounded(bed: Bed) -> None:
    pods = await bed.pods()
    frozen = pods[0]
    signal_pod(frozen, signal.SIGSTOP)
    try:
        started = time.monotonic()
        await bed.delete_adapter("chat")
        await bed.eventually("chat deleted", lambda: bed.gone("chat"), 30, bool)
        took = time.monotonic() - started
        assert took < UNLOAD_BOUND_SECONDS + 8, f"deletion took {took:.1f}s"
    finally:
        signal_pod(frozen, signal.SIGCONT)
    incomplete = [e for e in await bed.events() if e.get("reason") == "UnloadIncomplete"]
    assert len(incomplete) == 1
    note = incomplete[0]["note"]
    assert frozen.metadata.name in note
    assert incomplete[0]["type"] == "Warning"
    for pod in pods[1:]:
        assert "chat" not in await loras(pod.status.pod_ip)


async def test_deleting_the_worker_first_never_blocks_an_adapter(bed: Bed) -> None:
    await bed.create_adapter("orphan", {"uri": bed.uri("chat-lora")})
    await bed.wait_adapter("orphan", lambda o: (o.get("status") or {}).get("loadedReplicas", 0) > 0)
    await bed.custom.delete_namespaced_custom_object(
        GROUP, VERSION, bed.namespace, "dynamoworkers", WORKER
    )

    async def worker_gone() -> bool:
        try:
            await bed.worker()
        except ApiException as err:
            return err.status == 404
        return False

    await bed.eventually("DynamoWorker deleted", worker_gone, 60, bool)
    orphan = await bed.wait_adapter(
        "orphan", lambda o: condition(o, "Ready").get("reason") == "WorkerNotFound", within=30
    )
    assert "spec.workerRef.name" in condition(orphan, "Ready")["message"]
    started = time.monotonic()
    await bed.delete_adapter("orphan")
    await bed.eventually("orphan deleted", lambda: bed.gone("orphan"), 30, bool)
    assert time.monotonic() - started < UNLOAD_BOUND_SECONDS + 8


async def test_the_secret_never_leaves_the_pods(bed: Bed) -> None:
    log = bed.operator.log_path.read_text(errors="replace")
    assert "LoRAAdapter" in log  # the log is the operator's, and it talked about adapters
    events = json.dumps(await bed.events())
    assert bed.statuses, "statuses were collected"
    for where, text in (("log", log), ("status", "\n".join(bed.statuses)), ("events", events)):
        assert bed.canary not in text, f"the canary leaked into the operator's {where}"
