"""Choosing a discovery backend from the environment, instance ids, the in-memory backend, and
the Kubernetes backend's object (its API traffic is tested on the test bed, tests/cluster)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from dynamo.runtime.discovery import (
    AdapterCard,
    DiscoveryBackend,
    EndpointAddress,
    WorkerAdvertisement,
    backend_from_env,
    instance_id_from_env,
)
from dynamo.runtime.discovery.file import FileBackend
from dynamo.runtime.discovery.kubernetes import KubernetesBackend, PodIdentity
from dynamo.runtime.discovery.mem import MemBackend
from dynamo.runtime.discovery.records import metadata_for

pytestmark = pytest.mark.unit

POD = {"POD_NAME": "worker-0", "POD_NAMESPACE": "ns1", "POD_UID": "uid-1"}


def advertisement(instance_id: int = 7, **changes: Any) -> WorkerAdvertisement:
    fields: dict[str, Any] = {
        "address": EndpointAddress("dynamo", "backend", "generate"),
        "instance_id": instance_id,
        "served_model_name": "tiny",
        "model": "/nonexistent/tiny",
        "transport": {"http": "http://127.0.0.1:8000"},
    }
    fields.update(changes)
    return WorkerAdvertisement(**fields)


# --- backend_from_env -------------------------------------------------------------------


def test_default_is_mem_with_a_log_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="dynamo.runtime.discovery"):
        backend = backend_from_env({})
    assert isinstance(backend, MemBackend)
    assert "DYN_DISCOVERY_BACKEND is not set" in caplog.text


def test_file_backend_root(tmp_path: Path) -> None:
    chosen = backend_from_env({"DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(tmp_path)})
    assert isinstance(chosen, FileBackend)
    assert chosen.root == tmp_path
    default = backend_from_env({"DYN_DISCOVERY_BACKEND": "File", "TMPDIR": str(tmp_path)})
    assert isinstance(default, FileBackend)
    assert default.root == tmp_path / "dynamo_store_kv"


def test_kubernetes_backend_reads_the_pod() -> None:
    chosen = backend_from_env({"DYN_DISCOVERY_BACKEND": "kubernetes", **POD})
    assert isinstance(chosen, KubernetesBackend)
    assert chosen.pod == PodIdentity("worker-0", "ns1", "uid-1", "worker-0")


@pytest.mark.parametrize("value", ["etcd", "nats", "zookeeper"])
def test_unsupported_backends_name_the_supported_ones(value: str) -> None:
    with pytest.raises(ValueError, match="use one of: kubernetes, file, mem") as info:
        backend_from_env({"DYN_DISCOVERY_BACKEND": value})
    assert f"DYN_DISCOVERY_BACKEND='{value}'" in str(info.value)


def test_kubernetes_without_pod_env_names_what_is_missing() -> None:
    env = {"DYN_DISCOVERY_BACKEND": "kubernetes", "POD_NAME": "w"}
    with pytest.raises(ValueError, match="needs POD_NAMESPACE, POD_UID set from the downward"):
        backend_from_env(env)


def test_backends_satisfy_the_protocol(tmp_path: Path) -> None:
    backends: list[DiscoveryBackend] = [
        MemBackend(),
        FileBackend(tmp_path),
        KubernetesBackend(PodIdentity("p", "n", "u", "p")),
    ]
    assert all(callable(b.metadata) for b in backends)


# --- instance ids -------------------------------------------------------------------------


def test_instance_id_in_kubernetes_is_the_hash_of_the_pod_name() -> None:
    env = {"DYN_DISCOVERY_BACKEND": "kubernetes", **POD}
    assert instance_id_from_env(env) == 1186445869714687


def test_instance_id_in_container_mode_hashes_pod_and_container() -> None:
    env = {"DYN_DISCOVERY_BACKEND": "kubernetes", **POD, "DYN_KUBE_DISCOVERY_MODE": "container"}
    assert instance_id_from_env({**env, "CONTAINER_NAME": "main"}) == 1186445869714687
    side = PodIdentity.from_env({**env, "CONTAINER_NAME": "side"})
    assert side.cr_name == "worker-0-side"
    assert instance_id_from_env({**env, "CONTAINER_NAME": "side"}) == side.instance_id
    assert side.instance_id != 1186445869714687


def test_instance_id_elsewhere_is_random_and_json_safe() -> None:
    ids = {instance_id_from_env({"DYN_DISCOVERY_BACKEND": "file"}) for _ in range(50)}
    assert len(ids) == 50
    assert all(0 < i < 2**53 for i in ids)


# --- mem backend ------------------------------------------------------------------------


async def test_mem_backend_lifecycle() -> None:
    mem = MemBackend()
    assert mem.metadata() is None
    adv = advertisement()
    await mem.register(adv)
    assert mem.metadata() == metadata_for(adv)
    with_adapter = advertisement(adapters=(AdapterCard("a", 1, "s3://b/a"),))
    await mem.update(with_adapter)
    published = mem.metadata()
    assert published is not None
    assert "dynamo/backend/generate/7/a" in published["model_cards"]
    await mem.unregister()
    withdrawn = mem.metadata()
    assert withdrawn is not None
    assert withdrawn["endpoints"] == {}
    assert len(withdrawn["model_cards"]) == 2
    await mem.update(adv)  # still withdrawn
    after = mem.metadata()
    assert after is not None
    assert after["endpoints"] == {}
    assert len(after["model_cards"]) == 1
    await mem.close()
    assert mem.metadata() is None
    assert [what for what, _ in mem.history] == [
        "register",
        "update",
        "unregister",
        "update",
        "close",
    ]


async def test_mem_backend_returns_copies() -> None:
    mem = MemBackend()
    await mem.register(advertisement())
    first = mem.metadata()
    assert first is not None
    first["endpoints"].clear()
    again = mem.metadata()
    assert again is not None
    assert again["endpoints"]


# --- kubernetes object --------------------------------------------------------------------


def test_kubernetes_manifest_is_upstreams_object() -> None:
    backend = KubernetesBackend(PodIdentity.from_env(POD))
    data = metadata_for(advertisement(instance_id=1186445869714687))
    manifest = backend.manifest(data)
    assert manifest == {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "DynamoWorkerMetadata",
        "metadata": {
            "name": "worker-0",
            "namespace": "ns1",
            "ownerReferences": [
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": "worker-0",
                    "uid": "uid-1",
                    "controller": True,
                    "blockOwnerDeletion": False,
                }
            ],
        },
        "spec": {"data": data},
    }


def test_container_mode_object_is_not_the_pods_controller() -> None:
    env = {**POD, "DYN_KUBE_DISCOVERY_MODE": "container", "CONTAINER_NAME": "side"}
    manifest = KubernetesBackend(PodIdentity.from_env(env)).manifest({})
    assert manifest["metadata"]["name"] == "worker-0-side"
    assert manifest["metadata"]["ownerReferences"][0]["controller"] is False


async def test_kubernetes_refuses_an_instance_id_readers_would_not_expect() -> None:
    backend = KubernetesBackend(PodIdentity.from_env(POD))
    with pytest.raises(ValueError, match="does not match the id upstream readers derive"):
        await backend.register(advertisement(instance_id=7))
    assert backend.metadata() is None
