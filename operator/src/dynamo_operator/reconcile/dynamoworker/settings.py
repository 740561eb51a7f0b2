"""What the builders need to know beyond the DynamoWorker itself: operator-wide defaults and
facts about the cluster. Built once at startup (the cluster facts refreshed by the handlers)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReconcileSettings:
    """Operator-wide inputs of the builders.

    `worker_image` is used when a DynamoWorker sets no spec.image (`vllm_worker_image` when
    its engine is vLLM), and
    `worker_image_pull_secrets` (Secret names) are the worker pods' imagePullSecrets, for a
    private registry (the frontend pods' too). `frontend_image` is used when spec.frontend sets
    no image. `pod_monitor_crd` says
    whether the Prometheus Operator's PodMonitor kind exists in the cluster (spec.metrics
    `Auto` then picks a PodMonitor over prometheus.io annotations). `operator_namespace`: where
    the operator's pods run (the worker pods' NetworkPolicy admits them from there; from any
    namespace when unknown).
    """

    worker_image: str | None = None
    vllm_worker_image: str | None = None
    worker_image_pull_secrets: tuple[str, ...] = ()
    frontend_image: str | None = None
    pod_monitor_crd: bool = False
    operator_namespace: str | None = None
