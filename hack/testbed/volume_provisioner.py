"""The test bed's volume provisioner: dynamic PersistentVolumes for the StorageClass
`testbed-local` (the default class), as a CSI driver's external provisioner would make them.

The class binds on first use (`WaitForFirstConsumer`): once the scheduler has picked a node for
a claim's first pod (`volume.kubernetes.io/selected-node`), a directory is made under the bed's
state and a `local` PersistentVolume for it, pinned to that node, is created with the claim in
its `claimRef`; Kubernetes' own PV controller binds the two, and the kubelet mounts the
directory. A released volume (its claim deleted) is removed with its directory
(`reclaimPolicy: Delete`). On the kubelet node the volume is mounted for real; a KWOK pod's
claim binds and is never mounted.

Run it as `python -m testbed.volume_provisioner` (hack/cluster does).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import shutil
import signal
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client, config, watch
from kubernetes_asyncio.client.exceptions import ApiException

from .layout import Layout

log = logging.getLogger("volume-provisioner")

STORAGE_CLASS = "testbed-local"
PROVISIONER = "dynamo.dev/testbed-local"
SELECTED_NODE = "volume.kubernetes.io/selected-node"
PROVISIONED_BY = "pv.kubernetes.io/provisioned-by"
WATCH_SECONDS = 300


def storage_class() -> Any:
    return {
        "apiVersion": "storage.k8s.io/v1",
        "kind": "StorageClass",
        "metadata": {
            "name": STORAGE_CLASS,
            "annotations": {"storageclass.kubernetes.io/is-default-class": "true"},
        },
        "provisioner": PROVISIONER,
        "reclaimPolicy": "Delete",
        "volumeBindingMode": "WaitForFirstConsumer",
    }


def volume_for(claim: client.V1PersistentVolumeClaim, node: str, path: Path) -> Any:
    """The PersistentVolume that serves `claim` from `path` on `node`."""
    meta, spec = claim.metadata, claim.spec
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": f"pvc-{meta.uid}", "annotations": {PROVISIONED_BY: PROVISIONER}},
        "spec": {
            "capacity": {"storage": spec.resources.requests["storage"]},
            "accessModes": list(spec.access_modes),
            "volumeMode": spec.volume_mode or "Filesystem",
            "persistentVolumeReclaimPolicy": "Delete",
            "storageClassName": STORAGE_CLASS,
            "claimRef": {"namespace": meta.namespace, "name": meta.name, "uid": meta.uid},
            "local": {"path": str(path)},
            "nodeAffinity": {
                "required": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {
                                    "key": "kubernetes.io/hostname",
                                    "operator": "In",
                                    "values": [node],
                                }
                            ]
                        }
                    ]
                }
            },
        },
    }


class Provisioner:
    def __init__(self, api: client.ApiClient, volumes: Path) -> None:
        self.core = client.CoreV1Api(api)
        self.volumes = volumes

    async def provision(self, claim: client.V1PersistentVolumeClaim) -> None:
        annotations = claim.metadata.annotations or {}
        node = annotations.get(SELECTED_NODE)
        if claim.spec.storage_class_name != STORAGE_CLASS or claim.spec.volume_name or not node:
            return
        path = self.volumes / f"pvc-{claim.metadata.uid}"
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(0o777)  # any pod user may write, as a fresh file system's root lets it
        try:
            await self.core.create_persistent_volume(volume_for(claim, node, path))
        except ApiException as exc:
            if exc.status != 409:  # made already (an earlier event of the same claim)
                raise
            return
        log.info(
            "provisioned %s for %s/%s on %s",
            path.name,
            claim.metadata.namespace,
            claim.metadata.name,
            node,
        )

    async def reclaim(self, volume: client.V1PersistentVolume) -> None:
        annotations = volume.metadata.annotations or {}
        if annotations.get(PROVISIONED_BY) != PROVISIONER or volume.status.phase != "Released":
            return
        shutil.rmtree(self.volumes / volume.metadata.name, ignore_errors=True)
        try:
            await self.core.delete_persistent_volume(volume.metadata.name)
        except ApiException as exc:
            if exc.status != 404:
                raise
        log.info("deleted %s (its claim is gone)", volume.metadata.name)

    async def follow(self, lister: Any, handle: Any) -> None:
        """List, handle each object, then watch and handle each change; again on errors."""
        while True:
            try:
                listing = await lister()
                for item in listing.items:
                    await handle(item)
                stream = watch.Watch().stream(
                    lister,
                    resource_version=listing.metadata.resource_version,
                    timeout_seconds=WATCH_SECONDS,
                )
                async with stream as events:
                    async for event in events:
                        if event["type"] in ("ADDED", "MODIFIED"):
                            await handle(event["object"])
            except Exception as exc:  # a broken watch (an API server restart): list again
                log.warning("watch ended (%r); listing again", exc)
                await asyncio.sleep(1)


async def run(layout: Layout) -> None:
    await config.load_kube_config(config_file=str(layout.kubeconfig))
    async with client.ApiClient() as api:
        try:
            await client.StorageV1Api(api).create_storage_class(storage_class())
        except ApiException as exc:
            if exc.status != 409:
                raise
        provisioner = Provisioner(api, layout.root / "volumes")
        core = provisioner.core
        await asyncio.gather(
            provisioner.follow(
                core.list_persistent_volume_claim_for_all_namespaces, provisioner.provision
            ),
            provisioner.follow(core.list_persistent_volume, provisioner.reclaim),
        )


def main() -> None:
    argparse.ArgumentParser(prog="python -m testbed.volume_provisioner").parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    loop = asyncio.new_event_loop()
    task = loop.create_task(run(Layout.from_env()))
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        loop.run_until_complete(task)


if __name__ == "__main__":
    main()
