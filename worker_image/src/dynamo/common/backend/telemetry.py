"""Tracing helpers for engine authors, over the request context's span API.

The runtime's per-request context exposes `current_span()`, `start_span(name, attrs)`
and `trace_headers()`. When a context has no tracing support (or no parent span) these
helpers return no-op spans, so engine code never has to branch on tracing.
"""

from __future__ import annotations

import logging
from types import TracebackType
from typing import Any

logger = logging.getLogger(__name__)


class NoopSpan:
    """A span that records nothing; also a context manager."""

    def set_attribute(self, key: str, value: Any) -> None:
        """Ignore the attribute."""

    def add_event(self, name: str, **attributes: Any) -> None:
        """Ignore the event."""

    def set_status(self, status: Any, description: str | None = None) -> None:
        """Ignore the status."""

    def end(self) -> None:
        """Nothing to end."""

    def __enter__(self) -> NoopSpan:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        return None


_NOOP_SPAN = NoopSpan()


def current_span(context: Any) -> Any:
    """Return the framework's `engine.generate` span for this request (or a no-op span)."""
    method = getattr(context, "current_span", None)
    span = method() if callable(method) else None
    return span if span is not None else _NOOP_SPAN


def start_span(context: Any, name: str, **attrs: Any) -> Any:
    """Open a child span named `name`; use it with `with` so it ends on exit."""
    method = getattr(context, "start_span", None)
    span = method(name, dict(attrs) if attrs else None) if callable(method) else None
    return span if span is not None else NoopSpan()


def trace_headers(context: Any) -> dict[str, str] | None:
    """W3C trace headers to forward to the inference engine, or None without a trace."""
    method = getattr(context, "trace_headers", None)
    if not callable(method):
        return None
    headers: dict[str, str] | None = method()
    return headers


def engine_trace_kwargs(
    context: Any, *, kwarg_name: str = "trace_headers", enabled: bool = True
) -> dict[str, dict[str, str]]:
    """Return `{kwarg_name: headers}` to splat into the engine call, or {} (no trace/disabled)."""
    if not enabled:
        return {}
    headers = trace_headers(context)
    if headers is None:
        return {}
    return {kwarg_name: headers}
