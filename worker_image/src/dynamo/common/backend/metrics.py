"""Bridge an engine's own Prometheus registry into the worker's `/metrics` output.

Engines call these from `BaseEngine.register_prometheus(metrics)`. `metrics` is the
runtime's handle: `metrics.auto_labels` (namespace, component, endpoint, worker_id, model
labels) and `metrics.register_prometheus_expfmt_callback(fn)`, where `fn()` returns
exposition text appended to every scrape.
"""

from __future__ import annotations

import logging
import os
import tempfile
from typing import TYPE_CHECKING, Any

from dynamo.common.utils.prometheus import gather_with_labels

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

logger = logging.getLogger(__name__)

MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


def ensure_prometheus_multiproc_dir(prefix: str) -> tempfile.TemporaryDirectory[str] | None:
    """Point `PROMETHEUS_MULTIPROC_DIR` at a fresh temp dir unless the operator set it.

    Returns the directory to clean up at engine shutdown, or None when the variable was
    already set (a missing pre-set directory is recreated; the operator owns it).
    """
    existing = os.environ.get(MULTIPROC_DIR_ENV)
    if existing:
        if not os.path.isdir(existing):
            logger.warning("%s=%s does not exist; recreating it", MULTIPROC_DIR_ENV, existing)
            os.makedirs(existing, exist_ok=True)
        return None
    directory = tempfile.TemporaryDirectory(prefix=prefix)
    os.environ[MULTIPROC_DIR_ENV] = directory.name
    return directory


def register_engine_registry(
    metrics: Any,
    registry: CollectorRegistry,
    *,
    prefix_filters: list[str] | None = None,
    exclude_prefixes: list[str] | None = None,
) -> None:
    """Expose `registry` on `/metrics` with the runtime's auto-labels injected at scrape time."""
    labels = dict(metrics.auto_labels)
    metrics.register_prometheus_expfmt_callback(
        lambda: gather_with_labels(
            registry, labels, prefix_filters=prefix_filters, exclude_prefixes=exclude_prefixes
        )
    )


def register_global_registry(
    metrics: Any,
    *,
    engine_prefix: str,
    multiproc_only_prefixes: list[str] | None = None,
    exclude_prefixes: list[str] | None = None,
) -> None:
    """Expose the default `prometheus_client.REGISTRY` (metrics starting `engine_prefix`).

    With a valid `PROMETHEUS_MULTIPROC_DIR`, a `MultiProcessCollector` is attached so
    metrics written by engine subprocesses are included; `multiproc_only_prefixes` names
    prefixes that exist only in those files. If the registry already has such a collector
    (its registration raises ValueError), the engine prefix comes from the registry and
    the multiproc-only prefixes from a separate collector, so nothing is emitted twice.
    """
    from prometheus_client import REGISTRY, CollectorRegistry, multiprocess

    all_prefixes = [engine_prefix, *(multiproc_only_prefixes or [])]
    multiproc_dir = os.environ.get(MULTIPROC_DIR_ENV)
    if multiproc_dir and os.path.isdir(multiproc_dir):
        try:
            multiprocess.MultiProcessCollector(REGISTRY)
        except ValueError as exc:
            logger.debug("MultiProcessCollector already on REGISTRY (%s); splitting sources", exc)
            register_engine_registry(
                metrics, REGISTRY, prefix_filters=[engine_prefix], exclude_prefixes=exclude_prefixes
            )
            if multiproc_only_prefixes:
                multiproc_registry = CollectorRegistry()
                multiprocess.MultiProcessCollector(multiproc_registry)
                register_engine_registry(
                    metrics,
                    multiproc_registry,
                    prefix_filters=list(multiproc_only_prefixes),
                    exclude_prefixes=exclude_prefixes,
                )
            return
    elif multiproc_dir:
        logger.warning(
            "%s=%s is not a directory; using single-process metrics",
            MULTIPROC_DIR_ENV,
            multiproc_dir,
        )
    register_engine_registry(
        metrics, REGISTRY, prefix_filters=all_prefixes, exclude_prefixes=exclude_prefixes
    )
