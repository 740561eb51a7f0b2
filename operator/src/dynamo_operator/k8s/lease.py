"""The election's Lease (coordination.k8s.io/v1) on the API server: read, create, replace.

Replacing carries the resourceVersion last read, so the write succeeds only if nobody wrote
the Lease since (`LeaseConflict` otherwise): that is what makes the election safe between
racing candidates. Each request has a timeout shorter than the retry period, so a hung API
server cannot hold a renew past the leader's deadline unnoticed.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, cast

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from dynamo_operator.k8s.election import LeaseRecord


class LeaseConflict(Exception):
    """Someone else wrote (or created) the Lease first."""


def micro_time(moment: datetime) -> str:
    """A Kubernetes MicroTime (RFC 3339 with microseconds, UTC)."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _text(moment: datetime | None) -> str | None:
    return micro_time(moment) if moment is not None else None


def _record(lease: client.V1Lease) -> LeaseRecord:
    spec = lease.spec or client.V1LeaseSpec()
    return LeaseRecord(
        holder=spec.holder_identity or None,
        duration_seconds=float(spec.lease_duration_seconds or 0),
        transitions=int(spec.lease_transitions or 0),
        acquire_time=_text(spec.acquire_time),
        renew_time=_text(spec.renew_time),
        resource_version=lease.metadata.resource_version,
    )


def _manifest(name: str, record: LeaseRecord) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name}
    if record.resource_version is not None:
        metadata["resourceVersion"] = record.resource_version
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": metadata,
        "spec": {
            "holderIdentity": record.holder,
            "leaseDurationSeconds": max(1, round(record.duration_seconds)),
            "leaseTransitions": record.transitions,
            "acquireTime": record.acquire_time,
            "renewTime": record.renew_time,
        },
    }


class LeaseStore:
    """One Lease, `namespace`/`name`."""

    def __init__(
        self, api: client.ApiClient, namespace: str, name: str, *, timeout_seconds: float
    ) -> None:
        self._leases = client.CoordinationV1Api(api)
        self.namespace = namespace
        self.name = name
        self._timeout = timeout_seconds
        self.uid = ""

    async def read(self) -> LeaseRecord | None:
        """The Lease, or None when it does not exist."""
        try:
            lease = await self._leases.read_namespaced_lease(
                self.name, self.namespace, _request_timeout=self._timeout
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        self.uid = lease.metadata.uid or ""
        return _record(lease)

    async def write(self, record: LeaseRecord) -> LeaseRecord:
        """Create the Lease (`record.resource_version` None) or replace the version read; the
        record as written (with its new resourceVersion)."""
        # A plain dict goes out as it is: the client's own datetime formatting drops the
        # microseconds of a whole second, which a MicroTime field refuses.
        body = cast(client.V1Lease, _manifest(self.name, record))
        try:
            if record.resource_version is None:
                lease = await self._leases.create_namespaced_lease(
                    self.namespace, body, _request_timeout=self._timeout
                )
            else:
                lease = await self._leases.replace_namespaced_lease(
                    self.name, self.namespace, body, _request_timeout=self._timeout
                )
        except ApiException as exc:
            if exc.status == 409:
                raise LeaseConflict(f"Lease {self.namespace}/{self.name} changed") from None
            raise
        self.uid = lease.metadata.uid or ""
        return _record(lease)
