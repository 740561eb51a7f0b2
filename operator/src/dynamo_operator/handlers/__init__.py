"""kopf handlers: glue only (the only package that imports kopf).

`run(config)` builds a registry with every handler, the kopf settings and the shared context,
and runs kopf until it is stopped.

- `settings`: `OperatorConfig` (the command line's options); `context`: the services built at
  startup and the per-object wake-ups (kopf's memo); `metrics_server`: `/metrics`.
- `indices`: every kopf index, behind one typed view; `resync`: the one resync loop.
- `dynamoworker`, `loraadapter`: each kind's handlers; `lifecycle`: kopf's settings, login,
  startup and cleanup, the liveness probe.
"""

from __future__ import annotations

import asyncio
import logging

import kopf

from dynamo_operator.handlers import dynamoworker, indices, lifecycle, loraadapter
from dynamo_operator.handlers.context import OperatorContext
from dynamo_operator.handlers.settings import HEALTH_HOST, OperatorConfig


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


async def operate(config: OperatorConfig) -> None:
    """Run the operator in the current event loop until it is stopped."""
    await kopf.operator(
        registry=build_registry(),
        settings=lifecycle.operator_settings(),
        memo=OperatorContext(config),
        standalone=True,
        clusterwide=config.all_namespaces,
        namespaces=list(config.namespaces),
        liveness_endpoint=f"http://{HEALTH_HOST}:{config.health_port}/healthz",
    )


def run(config: OperatorConfig) -> None:
    """Run the operator until SIGINT or SIGTERM."""
    asyncio.run(operate(config))


__all__ = ["OperatorConfig", "OperatorContext", "build_registry", "operate", "run"]
