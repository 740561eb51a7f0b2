"""kopf handlers: glue only (the only package that imports kopf).

`run(config)` builds a registry with every handler, the kopf settings and the shared context,
and runs kopf until it is stopped.

- `settings`: `OperatorConfig` (the command line's options); `context`: the services built at
  startup and the per-object wake-ups (kopf's memo); `metrics_server`: `/metrics`.
- `indices`: every kopf index, behind one typed view; `resync`: the one resync loop.
- `leadership`: the Lease elector around kopf (`--leader-election`); `fence`: its write
  fence on kopf's and the worker pods' HTTP sessions.
- `dynamoworker`, `loraadapter`: each kind's handlers; `lifecycle`: kopf's settings, login,
  startup and cleanup, the liveness probe.
"""

from __future__ import annotations

import asyncio
import logging
import time

import kopf

from dynamo_operator.handlers import dynamoworker, indices, lifecycle, loraadapter
from dynamo_operator.handlers.context import OperatorContext
from dynamo_operator.handlers.leadership import (
    Leadership,
    candidate_identity,
    lost_leadership,
    serve_health,
)
from dynamo_operator.handlers.settings import HEALTH_HOST, OperatorConfig
from dynamo_operator.k8s.client import Cluster, connect
from dynamo_operator.k8s.election import Election
from dynamo_operator.k8s.lease import LeaseStore
from dynamo_operator.reconcile.events import EventRecorder


def build_registry() -> kopf.OperatorRegistry:
    """A registry holding all of the operator's handlers."""
    registry = kopf.OperatorRegistry()
    lifecycle.register(registry)
    indices.register(registry)
    dynamoworker.register(registry)
    loraadapter.register(registry)
    return registry


def configure_logging(verbose: bool, quiet: bool) -> None:
    """kopf's log format and level (INFO; DEBUG when verbose, WARNING when quiet) for all."""
    kopf.configure(verbose=verbose, quiet=quiet)
    # kopf logs every handler run at INFO ("Handler 'pod_changed' succeeded"), once per watch
    # event; keep that for --verbose. The operator's own messages use their module loggers.
    if not verbose:
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)


async def _kopf(memo: OperatorContext, liveness_endpoint: str | None) -> None:
    config = memo.config
    await kopf.operator(
        registry=build_registry(),
        settings=lifecycle.operator_settings(),
        memo=memo,
        standalone=True,
        clusterwide=config.all_namespaces,
        namespaces=list(config.namespaces),
        liveness_endpoint=liveness_endpoint,
    )


async def operate(config: OperatorConfig) -> None:
    """Run the operator in the current event loop until it is stopped."""
    if config.leader_election:
        await _operate_when_elected(config)
        return
    memo = OperatorContext(config)
    memo.metrics.leader.set(1)
    await _kopf(memo, f"http://{HEALTH_HOST}:{config.health_port}/healthz")


async def _operate_when_elected(config: OperatorConfig) -> None:
    """Stand by until this replica holds the Lease, then run kopf while renewing it
    (`handlers.leadership`)."""
    api = await connect()
    namespace = config.lease_namespace
    assert namespace is not None  # OperatorConfig checked it
    timing = config.election_timing()
    store = LeaseStore(api, namespace, config.lease_name, timeout_seconds=timing.retry_period)
    election = Election(candidate_identity(), timing)
    memo = OperatorContext(config)
    leadership = Leadership(store, election, memo.metrics)
    memo.fence = leadership.check
    health = await serve_health(
        HEALTH_HOST,
        config.health_port,
        lambda: leadership.role,
        lambda: lifecycle.liveness_problem(memo),
        leadership.standby_problem,
    )
    await memo.serve_metrics()
    try:
        await leadership.campaign()
        await leadership.record_takeover(
            EventRecorder(Cluster(api, memo.metrics, fence=leadership.check), election.identity)
        )
        memo.started_at = time.monotonic()
        operator = asyncio.create_task(_kopf(memo, None), name="kopf")
        holding = asyncio.create_task(leadership.hold(), name="lease renewal")
        await asyncio.wait({operator, holding}, return_when=asyncio.FIRST_COMPLETED)
        if holding.done():
            lost_leadership(election.identity)
        # kopf stopped (SIGTERM): step down so that a standby takes over at once.
        holding.cancel()
        await leadership.release()
        operator.result()
    finally:
        await health.cleanup()
        await api.close()


def run(config: OperatorConfig) -> None:
    """Run the operator until SIGINT or SIGTERM."""
    asyncio.run(operate(config))


__all__ = ["OperatorConfig", "OperatorContext", "build_registry", "operate", "run"]
