"""Disaggregated serving (spec.prefill): every constant, flag, env var and port of it.

A disaggregated DynamoWorker runs two roles of the same model: prefill pods (spec.prefill, the
`<name>-prefill` children) compute a prompt's KV cache, and vLLM's NixlConnector (NIXL over
UCX) moves it to a decode pod (the top-level spec, the worker's own children), which
generates. Upstream's frontend pairs the two sets through discovery (both roles share the
worker's DYN_NAMESPACE). Each role's `dynamo-worker` is told its role
(`--disaggregation-mode`), and its engine its side of the transfer (`--kv-transfer-config`).

NIXL's handshake (the side channel) listens on `NIXL_SIDE_CHANNEL_PORT` plus the pod's
data-parallel rank index, and UCX moves the blocks over TCP within `UCX_TCP_PORT_RANGE`; the
roles' NetworkPolicies admit exactly these ports, from the other role's pods only.
"""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any

from dynamo_operator.api.dynamoworker import (
    DECODE,
    KV_TRANSFER_CONFIG_FLAG,
    PREFILL,
    DynamoWorkerSpec,
    WorkerRole,
)

# The worker's flag naming its role (before the `--` that starts the engine's arguments).
DISAGGREGATION_MODE_FLAG = "--disaggregation-mode"
KV_CONNECTOR = "NixlConnector"
# vLLM's kv_role of each role: prefill produces the KV cache, decode consumes it.
KV_ROLES: dict[WorkerRole, str] = {PREFILL: "kv_producer", DECODE: "kv_consumer"}
# The first port of NIXL's side channel; vLLM adds the data-parallel rank index to it, so a
# pod with dataParallel.size N listens on NIXL_SIDE_CHANNEL_PORT .. NIXL_SIDE_CHANNEL_PORT + N - 1.
NIXL_SIDE_CHANNEL_PORT = 5600
# The TCP ports UCX may use for the KV transfer (low, high; both included).
UCX_TCP_PORT_RANGE = (20000, 20999)


class KvTransferEnv(StrEnum):
    """Environment variables of the KV transfer, on both roles' worker containers (spec.pod
    may not set them)."""

    NIXL_SIDE_CHANNEL_HOST = "VLLM_NIXL_SIDE_CHANNEL_HOST"
    NIXL_SIDE_CHANNEL_PORT = "VLLM_NIXL_SIDE_CHANNEL_PORT"
    UCX_TCP_PORT_RANGE = "UCX_TCP_PORT_RANGE"


def roles(spec: DynamoWorkerSpec) -> tuple[WorkerRole | None, ...]:
    """The roles whose pods the worker runs: none (None) for an aggregated worker, decode and
    prefill with spec.prefill."""
    return (None,) if spec.prefill is None else (DECODE, PREFILL)


def worker_args(role: WorkerRole | None) -> list[str]:
    """The worker's own flags for `role` (none for an aggregated worker)."""
    return [] if role is None else [DISAGGREGATION_MODE_FLAG, role]


def kv_transfer_args(role: WorkerRole | None) -> list[str]:
    """vLLM's --kv-transfer-config for `role`, as compact JSON (none for an aggregated
    worker)."""
    if role is None:
        return []
    config = {"kv_connector": KV_CONNECTOR, "kv_role": KV_ROLES[role]}
    return [KV_TRANSFER_CONFIG_FLAG, json.dumps(config, separators=(",", ":"))]


def kv_transfer_env() -> list[dict[str, Any]]:
    """The env of both roles' worker containers: NIXL's side channel on the pod's IP (the
    other role's pods connect to it) and base port, and UCX's TCP port range."""
    low, high = UCX_TCP_PORT_RANGE
    return [
        {
            "name": str(KvTransferEnv.NIXL_SIDE_CHANNEL_HOST),
            "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
        },
        {"name": str(KvTransferEnv.NIXL_SIDE_CHANNEL_PORT), "value": str(NIXL_SIDE_CHANNEL_PORT)},
        {"name": str(KvTransferEnv.UCX_TCP_PORT_RANGE), "value": f"{low}-{high}"},
    ]


def kv_transfer_ports(spec: DynamoWorkerSpec) -> list[dict[str, Any]]:
    """The NetworkPolicy ports of the KV transfer, the same on both roles: the side channel of
    the larger of the two roles' data-parallel sizes, and UCX's range."""
    size = max(spec.for_role(role).data_parallel.size for role in roles(spec))
    low, high = UCX_TCP_PORT_RANGE
    return [
        {
            "port": NIXL_SIDE_CHANNEL_PORT,
            "endPort": NIXL_SIDE_CHANNEL_PORT + size - 1,
            "protocol": "TCP",
        },
        {"port": low, "endPort": high, "protocol": "TCP"},
    ]
