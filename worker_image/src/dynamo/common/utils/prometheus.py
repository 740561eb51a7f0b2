"""Prometheus exposition helpers: scrape a registry to text, filter it, inject labels.

`prometheus_client` is imported inside the functions: it picks single- or multi-process
mode when first imported, and engines (SGLang) set `PROMETHEUS_MULTIPROC_DIR` late.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Mapping, Sequence
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import CollectorRegistry

logger = logging.getLogger(__name__)

# Labels with a fixed meaning in histograms and summaries; injecting them would corrupt data.
RESERVED_LABELS = frozenset({"le", "quantile"})


class LabelInjectingCollector:
    """Re-exposes another registry's metrics with extra labels on every sample.

    A label already present on a sample keeps its value: injected labels never overwrite.
    """

    def __init__(self, source: CollectorRegistry, labels: Mapping[str, str]) -> None:
        reserved = sorted(RESERVED_LABELS.intersection(labels))
        if reserved:
            raise ValueError(
                f"cannot inject reserved Prometheus label(s) {', '.join(reserved)}; "
                "they are owned by histograms and summaries"
            )
        self._source = source
        self._labels = dict(labels)

    def collect(self) -> Iterator[Metric]:
        """Yield copies of the source's metric families with the labels added."""
        from prometheus_client.metrics_core import Metric

        for family in self._source.collect():
            copy = Metric(family.name, family.documentation, family.type, family.unit)
            copy.samples = [
                sample._replace(labels={**self._labels, **sample.labels})
                for sample in family.samples
            ]
            yield copy


@lru_cache(maxsize=64)
def _prefix_pattern(prefixes: tuple[str, ...]) -> re.Pattern[str] | None:
    # Matches sample lines and their HELP/TYPE comment lines; None when no prefixes given.
    if not prefixes:
        return None
    alternatives = "|".join(re.escape(prefix) for prefix in prefixes)
    return re.compile(rf"^(# (HELP|TYPE) )?({alternatives})")


def get_prometheus_expfmt(
    registry: CollectorRegistry,
    metric_prefix_filters: Sequence[str] | None = None,
    exclude_prefixes: Sequence[str] | None = None,
    inject_custom_labels: Mapping[str, str] | None = None,
) -> str:
    """Scrape `registry` to Prometheus text, optionally filtered and relabelled.

    Keeps only lines whose metric starts with one of `metric_prefix_filters` (all when
    None) and drops those starting with one of `exclude_prefixes`. Labels in
    `inject_custom_labels` are added where absent. The result ends with a newline unless
    empty; any error is logged and gives "".
    """
    from prometheus_client import CollectorRegistry, generate_latest

    try:
        source = registry
        if inject_custom_labels:
            source = CollectorRegistry(auto_describe=False)
            source.register(LabelInjectingCollector(registry, inject_custom_labels))
        text = generate_latest(source).decode("utf-8")
        if metric_prefix_filters or exclude_prefixes:
            include = _prefix_pattern(tuple(metric_prefix_filters or ()))
            exclude = _prefix_pattern(tuple(exclude_prefixes or ()))
            kept = [
                line
                for line in text.split("\n")
                if line.strip()
                and not (exclude is not None and exclude.match(line))
                and (include is None or include.match(line))
            ]
            text = "\n".join(kept)
        if text and not text.endswith("\n"):
            text += "\n"
        return text
    except Exception:
        logger.exception("Error collecting Prometheus metrics")
        return ""


def gather_with_labels(
    registry: CollectorRegistry,
    auto_labels: Mapping[str, str],
    *,
    prefix_filters: Sequence[str] | None = None,
    exclude_prefixes: Sequence[str] | None = None,
) -> str:
    """Scrape `registry` with `auto_labels` injected (existing labels on samples win)."""
    return get_prometheus_expfmt(
        registry,
        metric_prefix_filters=prefix_filters,
        exclude_prefixes=exclude_prefixes,
        inject_custom_labels=auto_labels or None,
    )
