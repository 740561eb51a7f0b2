"""A thread-safe cell that is initialised at most once (the Rust `OnceLock` idea)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class OnceLock(Generic[T]):
    """Holds a value computed on first use.

    `get_or_init` runs the initializer under a lock so concurrent first callers compute the
    value once. An initializer that raises stores nothing, so the next call retries. A `None`
    result cannot be told apart from "not initialised yet" and is computed again next time.
    """

    def __init__(self) -> None:
        self._value: T | None = None
        self._lock = threading.Lock()

    def get_or_init(self, initializer: Callable[[], T]) -> T:
        """Return the stored value, computing it with `initializer` if there is none yet."""
        value = self._value
        if value is not None:
            return value
        with self._lock:
            # Another thread may have initialised the cell while this one waited.
            value = self._value
            if value is None:
                value = initializer()
                self._value = value
            return value

    def get(self) -> T | None:
        """Return the stored value, or None when the cell is not initialised."""
        return self._value
