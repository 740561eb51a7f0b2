"""What status reports of the KV-cache hand-over between a disaggregated worker's roles.

With spec.prefill, a decode pod pulls each request's prompt blocks from the prefill pod that
computed them (vLLM's NixlConnector over NIXL). vLLM counts both sides on the pods' `/metrics`
(`vllm:nixl_*`): the decode side its pulls, their bytes and its failed pulls; the prefill side
the requests whose blocks it released unpulled when their lease expired. The operator reads
those counters from each role's ready pods and reports them per role, with a health that turns
Failing for a while after any failure.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from dynamo_operator.api.base import StatusModel
from dynamo_operator.api.common import JSON_SAFE_INT_MAX, MAX_REPLICAS, Timestamp

# How long a role stays Failing after its last failed transfer or expired request.
FAILURE_WINDOW_SECONDS = 300

KvTransferHealth = Literal["Healthy", "Failing", "Unknown"]


class KvTransferStatus(StatusModel):
    """One role's KV-cache transfers, summed over its ready pods (each pod counts since it
    started; the operator reads them every few seconds)."""

    health: KvTransferHealth = Field(
        description=(
            f"Failing: a transfer failed or a prefilled request's blocks expired unpulled on "
            f"this role's pods in the last {FAILURE_WINDOW_SECONDS} s (seen since the operator "
            "started reading them); Healthy: none did; Unknown: no pod of the role was read."
        )
    )
    transfers: int = Field(
        default=0, ge=0, le=JSON_SAFE_INT_MAX, description="KV-cache pulls completed."
    )
    bytes_transferred: int = Field(
        default=0, ge=0, le=JSON_SAFE_INT_MAX, description="Bytes those pulls moved."
    )
    failed_transfers: int = Field(
        default=0,
        ge=0,
        le=JSON_SAFE_INT_MAX,
        description="Failed pulls, handshakes and notifications (vllm:nixl_num_failed_transfers).",
    )
    expired_requests: int = Field(
        default=0,
        ge=0,
        le=JSON_SAFE_INT_MAX,
        description=(
            "Prefilled requests whose blocks were released unpulled when their lease expired "
            "(counted on prefill pods, vllm:nixl_num_kv_expired_reqs)."
        ),
    )
    pods_read: int = Field(
        default=0, ge=0, le=MAX_REPLICAS, description="Ready pods of the role that answered."
    )
    last_failure_time: Timestamp | None = Field(
        default=None, description="When the operator last saw a failure or an expiry appear."
    )
