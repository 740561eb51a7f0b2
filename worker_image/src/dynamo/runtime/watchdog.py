"""The shutdown hard deadline: exit 911 when graceful shutdown overruns.

A thread, not a task: it must fire even when an engine blocks the event loop.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

DEADLINE_EXIT_CODE = 911


class DeadlineWatchdog:
    """Calls `on_expiry` (default: `os._exit(911)`) unless `disarm()` comes in time."""

    def __init__(self, seconds: float, on_expiry: Callable[[], None] | None = None) -> None:
        self._seconds = seconds
        self._on_expiry = on_expiry or _exit_911
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="shutdown-deadline", daemon=True)

    def arm(self) -> None:
        """Start the countdown."""
        self._thread.start()

    def disarm(self) -> None:
        """Shutdown finished in time."""
        self._done.set()

    def _watch(self) -> None:
        if not self._done.wait(self._seconds):
            logger.critical(
                "graceful shutdown did not finish within %.1f s "
                "(DYN_WORKER_GRACEFUL_SHUTDOWN_TIMEOUT + grace period); exiting with %d",
                self._seconds,
                DEADLINE_EXIT_CODE,
            )
            self._on_expiry()


def _exit_911() -> None:
    logging.shutdown()
    os._exit(DEADLINE_EXIT_CODE)
