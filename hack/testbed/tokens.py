"""Service-account token files of process-node pods, kept fresh as the kubelet keeps them.

Each token is issued by a TokenRequest bound to its pod and written atomically (a reader
never sees half a token). Like the kubelet, the agent issues a new one once 80 % of the
token's lifetime has passed, or once it is 24 hours old, whichever comes first; so a process
that re-reads its token file, as clients of projected tokens do, never sends an expired one.
A request that fails is tried again shortly (the API server may be restarting).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client

log = logging.getLogger("process-node")

REFRESH_AT = 0.8  # of the lifetime (the kubelet's rule)
MAX_AGE_SECONDS = 24 * 3600
RETRY_SECONDS = 10.0


@dataclass(frozen=True)
class TokenFile:
    """One token file of a pod: who the token is for and how long it lives."""

    path: Path
    namespace: str
    service_account: str
    pod_name: str
    pod_uid: str
    audiences: tuple[str, ...] = ()
    expiration_seconds: int = 3600


def refresh_due(expires_at: float, lifetime_seconds: float) -> float:
    """When (epoch seconds) to issue a new token for one that expires at `expires_at` and was
    issued for `lifetime_seconds`."""
    issued_at = expires_at - lifetime_seconds
    return min(issued_at + REFRESH_AT * lifetime_seconds, issued_at + MAX_AGE_SECONDS)


class TokenKeeper:
    """Issues token files and re-issues them when due. `due` and `clock` are the rule and the
    time (epoch seconds); tests pass their own to see a rotation within seconds."""

    def __init__(
        self,
        core: client.CoreV1Api,
        due: Callable[[float, float], float] = refresh_due,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.core = core
        self.due = due
        self.clock = clock

    async def issue(self, token: TokenFile) -> float:
        """Request the token, write it, and return when it is due for renewal."""
        request: Any = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "audiences": list(token.audiences),
                "expirationSeconds": token.expiration_seconds,
                "boundObjectRef": {
                    "apiVersion": "v1", "kind": "Pod", "name": token.pod_name, "uid": token.pod_uid,
                },
            },
        }  # fmt: skip
        answer = await self.core.create_namespaced_service_account_token(
            token.service_account, token.namespace, request
        )
        partial = token.path.with_name(f".{token.path.name}.tmp")
        partial.write_text(answer.status.token)
        os.replace(partial, token.path)
        expires: dt.datetime = answer.status.expiration_timestamp
        return self.due(expires.timestamp(), float(answer.spec.expiration_seconds))

    async def keep_fresh(self, due: dict[TokenFile, float]) -> None:
        """Re-issue each token of `due` (token -> when) when due, until cancelled."""
        while due:
            token = min(due, key=lambda t: due[t])
            await asyncio.sleep(max(due[token] - self.clock(), 0.0))
            try:
                due[token] = await self.issue(token)
            except Exception as exc:  # keep the old token until a request succeeds
                log.warning("renewing %s failed (%s); trying again", token.path, exc)
                due[token] = self.clock() + RETRY_SECONDS
