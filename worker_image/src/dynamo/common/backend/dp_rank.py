"""Data-parallel rank selection forced by the router (`request.routing.dp_rank`)."""

from __future__ import annotations

import logging

from dynamo.common.backend.engine import GenerateRequest

logger = logging.getLogger(__name__)


def forced_dp_rank(request: GenerateRequest) -> int | None:
    """Return the router-forced global DP rank, or None when the router set none."""
    routing = request.get("routing") or {}
    rank = routing.get("dp_rank")
    return None if rank is None else int(rank)


def validate_global_dp_rank(
    dp_rank: int | None, dp_start: int, dp_size: int, backend_label: str
) -> int | None:
    """Return `dp_rank` if it lies in this worker's slice `[dp_start, dp_start + dp_size)`.

    None (no rank, or a single-rank worker) and out-of-range ranks give None; the latter
    with a warning, so the caller falls back to the engine's own DP load balancing.
    """
    if dp_rank is None or dp_size <= 1:
        return None
    rank = int(dp_rank)
    if not dp_start <= rank < dp_start + dp_size:
        logger.warning(
            "Received DP rank %d outside [%d, %d); falling back to %s internal DP selection",
            rank,
            dp_start,
            dp_start + dp_size,
            backend_label,
        )
        return None
    return rank
