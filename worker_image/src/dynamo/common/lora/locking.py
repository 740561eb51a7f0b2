"""One download per cache key at a time, across threads and processes.

Upstream lets concurrent downloads of one URI race (each into its own temp dir, last rename
wins). Here a file lock next to the cache entry serialises them: the first caller downloads,
the others wait and then find the finished entry in the cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TypeVar

from filelock import FileLock, Timeout

from dynamo.common.lora.errors import REASON_TIMEOUT, LoRADownloadError

T = TypeVar("T")


@contextlib.asynccontextmanager
async def hold_key_lock(lock_path: Path, wait_secs: float, uri: str) -> AsyncIterator[None]:
    """Hold the exclusive lock at `lock_path` for the body, waiting at most `wait_secs` seconds.

    The blocking `flock` wait runs in a worker thread so the event loop keeps serving. Each
    call opens its own lock file handle, so two threads of one process exclude each other
    just like two processes do.
    """
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    # thread_local=False: the lock is taken in a worker thread and released in the loop thread.
    lock = FileLock(str(lock_path), thread_local=False)
    acquiring = asyncio.get_running_loop().run_in_executor(None, _acquire, lock, wait_secs)
    try:
        # shield: a cancelled caller must not lose track of a lock the thread may still take.
        await asyncio.shield(acquiring)
    except asyncio.CancelledError:
        acquiring.add_done_callback(lambda done: _release_if_taken(lock, done))
        raise
    except Timeout:
        raise LoRADownloadError(
            f"timed out after {wait_secs:g} s waiting for another download of {uri} to finish; "
            "retry later or raise LORA_DOWNLOAD_TIMEOUT_SECS",
            REASON_TIMEOUT,
        ) from None
    try:
        yield
    finally:
        lock.release()


def _acquire(lock: FileLock, timeout: float) -> None:
    # filelock spells "wait forever" as -1.
    lock.acquire(timeout=timeout if math.isfinite(timeout) else -1)


def _release_if_taken(lock: FileLock, done: asyncio.Future[None]) -> None:
    if not done.cancelled() and done.exception() is None:
        lock.release()


async def run_in_thread(fn: Callable[[threading.Event], T]) -> T:
    """Run blocking `fn(cancel)` in a worker thread.

    If the caller is cancelled, `cancel` is set and the thread is awaited before the
    cancellation propagates, so a lock held around this call is released only once the
    thread has stopped writing. `fn` should check `cancel` between files.
    """
    cancel = threading.Event()
    running = asyncio.get_running_loop().run_in_executor(None, fn, cancel)
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        cancel.set()
        with contextlib.suppress(Exception):
            await running
        raise
