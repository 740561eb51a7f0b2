"""The process node renews its pods' service-account tokens before they expire, as the kubelet
does (`testbed.tokens`): at 80 % of a token's lifetime or after a day, whichever is first.

The API server issues tokens for 10 minutes at least, so the renewal against it runs the
agent's `TokenKeeper` with a rule that is due at once; the rule itself is checked alone.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client

from support.cluster import REPO, eventually

sys.path.insert(0, str(REPO / "hack"))
from testbed.tokens import TokenFile, TokenKeeper, refresh_due

AUDIENCE = "dynamo.dev/token-renewal-test"
DAY = 24 * 3600


@pytest.mark.unit
def test_renewal_is_due_at_80_percent_of_the_lifetime_or_after_a_day() -> None:
    issued = 1_000_000.0
    assert refresh_due(issued + 3600, 3600) == issued + 2880
    assert refresh_due(issued + 600, 600) == issued + 480
    assert refresh_due(issued + 7 * DAY, 7 * DAY) == issued + DAY


@pytest.mark.cluster
async def test_a_token_file_is_renewed_when_due_and_the_new_token_authenticates(
    api: client.ApiClient, namespace: str, tmp_path: Path
) -> None:
    core = client.CoreV1Api(api)
    # Bound to a pod, as the agent's tokens are (a KWOK node's pod: nothing needs to run).
    body: Any = {
        "metadata": {"name": "holder"},
        "spec": {"nodeName": "kwok-gpu-0", "containers": [{"name": "c", "image": "none"}]},
    }
    pod = await core.create_namespaced_pod(namespace, body)
    token = TokenFile(
        tmp_path / "token", namespace, "default", "holder", pod.metadata.uid, (AUDIENCE,), 600
    )
    rule_said: list[float] = []

    def at_once(expires_at: float, lifetime: float) -> float:
        rule_said.append(refresh_due(expires_at, lifetime) - time.time())
        return time.time()

    keeper = TokenKeeper(core, due=at_once)
    due = {token: await keeper.issue(token)}
    first = token.path.read_text()
    # The real rule would renew this 10-minute token after 8 minutes.
    assert 470 < rule_said[0] <= 480, rule_said

    async def current() -> str:
        return token.path.read_text()

    renewing = asyncio.create_task(keeper.keep_fresh(due))
    try:
        second = await eventually(current, 30, until=lambda text: text not in ("", first))
    finally:
        renewing.cancel()
        await asyncio.gather(renewing, return_exceptions=True)
    left = await asyncio.to_thread(os.listdir, tmp_path)
    assert left == ["token"], "written in place, atomically"

    review: Any = {"spec": {"token": second, "audiences": [AUDIENCE]}}
    answer = await client.AuthenticationV1Api(api).create_token_review(review)
    assert answer.status.authenticated, answer.status.error
    assert answer.status.user.username == f"system:serviceaccount:{namespace}:default"
    assert answer.status.user.extra["authentication.kubernetes.io/pod-name"] == ["holder"]
