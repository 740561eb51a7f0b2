"""A wrong S3 secret key, end to end: the operator (a subprocess) loads an adapter from an S3
server that checks request signatures (versitygw, `support.s3_sigv4`; moto accepts any) onto a
worker process running as a process-node pod, whose credential Secret holds a wrong secret key.

The key is a planted canary value. The LoRAAdapter fails with the reason (AuthFailed) in its
status and in a Warning Event, and the canary appears nowhere: not in any status seen, any
Event of the namespace, the operator's log, the test bed's component logs, nor any file of
the worker pods under `.testbed/pods/` (their output, every run), checked while the failing
pod runs (the process node removes a pod's files with it). Then the Secret is fixed and the
pods restarted (a pod reads its Secret's keys once, at start): the same LoRAAdapter loads, and
the canary is still nowhere.
"""

from __future__ import annotations

import base64
import datetime
import json
import shutil
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from kubernetes_asyncio import client

from dynamo.common.lora import adapter_digest
from support.cluster import Cluster
from support.dynamo_workers import condition
from support.operator_namespace import (
    GROUP,
    TRANSFORMERS_ENGINE,
    VERSION,
    OperatorNamespace,
    operator_namespace,
    serving_worker_spec,
)
from support.s3 import TESTBED_HOST, S3Server
from support.s3_sigv4 import sigv4_s3_server
from support.tiny_model import TinyModel

pytestmark = pytest.mark.e2e

WORKER = "tiny"
ADAPTER = "sql"
SECRET = "s3-creds"


@dataclass
class Bed(OperatorNamespace):
    """The namespace and operator, the S3 server and what the checks collect on the way."""

    s3: S3Server | None = None
    testbed_dir: Path = Path()
    uri: str = ""
    digest: str = ""
    canary: str = ""
    statuses: list[str] = field(default_factory=list)

    async def adapter(self) -> dict[str, Any]:
        found: dict[str, Any] = await self.custom.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, "loraadapters", ADAPTER
        )
        self.statuses.append(json.dumps(found.get("status") or {}))
        return found

    async def worker(self) -> dict[str, Any]:
        found: dict[str, Any] = await self.custom.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, "dynamoworkers", WORKER
        )
        self.statuses.append(json.dumps(found.get("status") or {}))
        return found

    async def pods(self) -> list[Any]:
        listing = await self.core.list_namespaced_pod(
            self.namespace, label_selector=f"dynamo.dev/worker={WORKER}"
        )
        return [p for p in listing.items if p.metadata.deletion_timestamp is None]

    async def ready_pods(self, within: float) -> list[Any]:
        def one_ready(pods: list[Any]) -> bool:
            return len(pods) == 1 and _ready(pods[0])

        return await self.eventually("one ready pod", self.pods, within, one_ready)

    async def events(self) -> list[dict[str, Any]]:
        # Raw JSON: kopf's core/v1 Events have no eventTime, which the model refuses.
        response: Any = await client.EventsV1Api(self.api).list_namespaced_event(
            self.namespace, _preload_content=False
        )
        return list(json.loads(await response.read())["items"])

    async def set_secret_key(self, secret_key: str) -> None:
        assert self.s3 is not None
        data = {
            "AWS_ACCESS_KEY_ID": self.s3.env["AWS_ACCESS_KEY_ID"],
            "AWS_SECRET_ACCESS_KEY": secret_key,
        }
        body: Any = {
            "metadata": {"name": SECRET},
            "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
        }
        if secret_key == self.canary:
            await self.core.create_namespaced_secret(self.namespace, body)
        else:
            await self.core.replace_namespaced_secret(SECRET, self.namespace, body)

    def pod_folder(self, pod: Any) -> Path:
        return self.testbed_dir / "pods" / pod.metadata.uid

    def worker_environment(self, pod: Any) -> str:
        """The environment of the pod's running worker process."""
        state = json.loads((self.pod_folder(pod) / "kubelet.json").read_text())
        pid = state["containers"]["main"]["pid"]
        return Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")

    async def leaks(self) -> list[str]:
        """Where the canary is: any status seen, the namespace's Events, the operator's log,
        the test bed's component logs, or any file the process node keeps for the worker pods
        (their output, every run, and their volumes). The process node removes a pod's files
        when the pod is gone, so this runs while the pods that saw the canary live."""
        await self.adapter()
        await self.worker()
        log = self.operator.log_path.read_text(errors="replace")
        assert "AuthFailed" in log, "the operator's log is the one that saw the failure"
        places = [
            ("the operator's log", log),
            ("a status", "\n".join(self.statuses)),
            ("the namespace's Events", json.dumps(await self.events())),
        ]
        for f in (self.testbed_dir / "logs").glob("*.log"):
            places.append((str(f), f.read_text(errors="replace")))
        for pod in await self.pods():
            files = [f for f in self.pod_folder(pod).rglob("*") if f.is_file()]
            assert any(f.suffix == ".log" and f.stat().st_size for f in files), "its output"
            places += [(str(f), f.read_bytes().decode(errors="replace")) for f in files]
        return [where for where, text in places if self.canary in text]


def _ready(pod: Any) -> bool:
    conditions = pod.status.conditions or []
    return bool(pod.status.pod_ip) and any(
        c.type == "Ready" and c.status == "True" for c in conditions
    )


def pod_states(obj: dict[str, Any]) -> list[tuple[str, str | None]]:
    return [(p["state"], p.get("reason")) for p in (obj.get("status") or {}).get("pods") or []]


def in_every_pod(state: str, reason: str | None) -> Callable[[dict[str, Any]], bool]:
    def check(obj: dict[str, Any]) -> bool:
        states = pod_states(obj)
        return bool(states) and all(s == (state, reason) for s in states)

    return check


@pytest_asyncio.fixture(scope="module")
async def bed(
    api: client.ApiClient,
    testbed: Cluster,
    tiny_model: TinyModel,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[Bed]:
    log_dir = tmp_path_factory.mktemp("lora-credentials-operator")
    # On the test bed's host address, where process-node pods reach it.
    with sigv4_s3_server(tmp_path_factory.mktemp("versitygw"), TESTBED_HOST) as s3:
        async with operator_namespace(api, testbed, "t-lora-cred", log_dir) as space:
            shutil.copytree(tiny_model.base, space.shared / "base")
            bucket = s3.new_bucket("lora")
            sql = tiny_model.adapters["sql-lora"]
            s3.upload_dir(bucket, "adapters/sql-lora", sql)
            bed = Bed(
                **vars(space),
                s3=s3,
                testbed_dir=Path(testbed.kubeconfig).parent,
                uri=f"s3://{bucket}/adapters/sql-lora",
                digest=adapter_digest(sql),
                canary=f"canary-{uuid.uuid4().hex}",
            )
            assert bed.canary != s3.env["AWS_SECRET_ACCESS_KEY"]
            await bed.set_secret_key(bed.canary)
            worker: Any = {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "DynamoWorker",
                "metadata": {"name": WORKER},
                "spec": serving_worker_spec(
                    space.shared / "base",
                    1,
                    engine=TRANSFORMERS_ENGINE,
                    max_loras=1,
                    s3={"secretName": SECRET, "endpoint": s3.endpoint_url, "region": "us-east-1"},
                ),
            }
            await space.create("dynamoworkers", worker)
            await bed.ready_pods(within=180)
            yield bed


# --- the steps, in order ----------------------------------------------------------------------


async def test_a_wrong_secret_key_fails_with_the_reason(bed: Bed) -> None:
    (pod,) = await bed.pods()
    # The planted value is the key the worker signs with.
    assert bed.canary in bed.worker_environment(pod)

    source = {"uri": bed.uri, "sha256": bed.digest}
    await bed.create(
        "loraadapters",
        {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "LoRAAdapter",
            "metadata": {"name": ADAPTER},
            "spec": {"workerRef": {"name": WORKER}, "source": source},
        },
    )
    failed = await bed.eventually(
        "AuthFailed", bed.adapter, 90, in_every_pod("Failed", "AuthFailed")
    )
    assert condition(failed, "Ready")["status"] == "False"
    degraded = condition(failed, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "AuthFailed")
    assert "spec.credentials" in degraded["message"], "the fix names the field"
    (entry,) = failed["status"]["pods"]
    assert "AWS_SECRET_ACCESS_KEY" in entry["message"], "the pod's message says what to check"

    def warned(events: list[dict[str, Any]]) -> bool:
        return any(
            e.get("reason") == "AuthFailed"
            and e.get("type") == "Warning"
            and (e.get("regarding") or {}).get("name") == ADAPTER
            for e in events
        )

    events = await bed.eventually("an AuthFailed Event", bed.events, 30, warned)
    notes = [e.get("note", "") for e in events if e.get("reason") == "AuthFailed"]
    assert all(pod.metadata.name in note for note in notes), notes


async def test_the_planted_key_appears_nowhere(bed: Bed) -> None:
    leaks = await bed.leaks()
    assert not leaks, f"the planted secret key leaked into {leaks}"


async def test_the_right_key_after_a_restart_loads_the_same_adapter(bed: Bed) -> None:
    before = await bed.adapter()
    (old,) = await bed.pods()
    assert bed.s3 is not None
    await bed.set_secret_key(bed.s3.env["AWS_SECRET_ACCESS_KEY"])
    # What `kubectl rollout restart` does: a pod takes its Secret's keys when it starts.
    apps = client.AppsV1Api(bed.api)
    (deployment,) = (await apps.list_namespaced_deployment(bed.namespace)).items
    stamp = datetime.datetime.now(datetime.UTC).isoformat()
    annotations = {"kubectl.kubernetes.io/restartedAt": stamp}
    patch = {"spec": {"template": {"metadata": {"annotations": annotations}}}}
    await apps.patch_namespaced_deployment(deployment.metadata.name, bed.namespace, patch)

    def replaced(pods: list[Any]) -> bool:
        return len(pods) == 1 and pods[0].metadata.uid != old.metadata.uid and _ready(pods[0])

    (new,) = await bed.eventually("a restarted pod", bed.pods, 180, replaced)
    assert bed.canary not in bed.worker_environment(new)

    def loaded_on_new(obj: dict[str, Any]) -> bool:
        pods = (obj.get("status") or {}).get("pods") or []
        served = [(p["pod"], p["state"], p.get("uri")) for p in pods]
        ready = condition(obj, "Ready").get("status") == "True"
        return ready and served == [(new.metadata.name, "Loaded", bed.uri)]

    after = await bed.eventually("Loaded on the new pod", bed.adapter, 120, loaded_on_new)
    assert after["metadata"]["uid"] == before["metadata"]["uid"], "the same LoRAAdapter"
    leaks = await bed.leaks()
    assert not leaks, f"after the recovery, the planted secret key leaked into {leaks}"
