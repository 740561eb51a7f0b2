"""Endpoint-path parsing and running coroutines from synchronous code."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

_ENDPOINT_SCHEME = "dyn://"


def parse_endpoint(endpoint: str) -> tuple[str, str, str]:
    """Split `"dyn://ns.comp.ep"` or `"ns.comp.ep"` into `(namespace, component, endpoint)`."""
    path = endpoint.removeprefix(_ENDPOINT_SCHEME)
    parts = path.split(".")
    if len(parts) != 3 or not all(parts):
        raise ValueError(
            f"Invalid endpoint format: {endpoint!r}; expected 'dyn://namespace.component.endpoint'"
            " or 'namespace.component.endpoint' (exactly three non-empty dot-separated parts)"
        )
    return parts[0], parts[1], parts[2]


def run_async(fn: Callable[..., Awaitable[T]], *args: object) -> T:
    """Run `fn(*args)` to completion from synchronous code.

    Uses `asyncio.run` when no loop is running in this thread; otherwise runs it on a fresh
    loop in a worker thread, because a running loop cannot be re-entered.
    """

    async def call() -> T:
        return await fn(*args)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(call())
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, call()).result()
