"""A vLLM general plugin: on the CPU platform, NIXL's progress threads sleep between polls.

vLLM loads the `vllm.general_plugins` entry points in every process it starts (the engine core
and each worker), and its NixlConnector makes its NIXL agent in those processes, which our
worker process cannot reach otherwise.

Why: NIXL's Python API (1.4 and 1.5) makes each agent with a progress-thread delay of 0 (fixed,
with no setting), and its UCX backend's shared progress thread then calls poll() with a 0 ms
timeout: it spins, so every worker with a NixlConnector keeps a core busy even when idle. On a
GPU node that is one core of many; on a CPU node it is what the engines need.

With a delay of `PROGRESS_PAUSE_US`, the same thread waits in poll() on UCX's event file
descriptors, at most that long, between rounds of progress: it wakes when a message arrives,
and at least every millisecond besides (NIXL's own guard against a wake-up UCX misses). A
thread that sleeps most of the time is what the kernel's fair scheduler serves first when it
wakes, so a pending pull progresses even while the pod's engine spins waiting for it, and an
idle agent costs about 1.5 % of a core instead of one core.

Tried before and dropped (the disaggregation guide's Limits): running the spinning thread under
SCHED_IDLE (a decode pod's thread then got 0 to 25 ms of CPU per second while its engine
stepped waiting for a pull, and pulls stalled past the prefill's 30 s lease) or nice 19 (it
ranks a thread only within its pod's group), and no progress thread at all (a prefill engine
with nothing to step must still progress UCX for the decode side's pulls). Other platforms are
left as vLLM configures them.
"""

from __future__ import annotations

import functools
import logging
import sys
from typing import Any

logger = logging.getLogger(__name__)

#: The progress thread's longest sleep between rounds, in microseconds (NIXL rounds it up to
#: whole milliseconds, poll()'s unit).
PROGRESS_PAUSE_US = 1000


def register() -> None:
    """The entry point vLLM calls in each of its processes."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        pause_progress_threads()


def pause_progress_threads() -> None:
    """Make every NIXL agent this process makes from now on sleep between polls (idempotent).
    NIXL itself is left unloaded until vLLM's connector asks vLLM's loader for it, so a
    worker without a KV connector never loads NIXL or UCX."""
    import vllm.distributed.nixl_utils as nixl_utils

    load = nixl_utils.__getattr__  # vLLM's lazy loader (a module __getattr__)
    if getattr(load, "_pauses_progress", False):
        return

    @functools.wraps(load)
    def load_paused(name: str) -> Any:
        found = load(name)
        if name == "NixlWrapper" and found is not None:
            _pause_agents_of(sys.modules[found.__module__])
        return found

    load_paused._pauses_progress = True  # type: ignore[attr-defined]
    nixl_utils.__getattr__ = load_paused


def _pause_agents_of(api: Any) -> None:
    """Give the agents `api` (NIXL's `_api` module) makes the pause (once). Its agent class
    builds the native config and the native agent in one constructor, so the pause goes into
    the config as the native agent is made from it."""
    bindings = getattr(api, "nixlBind", None)
    if bindings is None or isinstance(bindings, _PausedBindings):
        if bindings is None:
            logger.warning(
                "NIXL's API (%s) has no nixlBind: its progress threads spin, competing with "
                "the engines for the cores",
                api.__name__,
            )
        return
    api.nixlBind = _PausedBindings(bindings)
    logger.debug("NIXL on the CPU platform: progress threads sleep up to %d us", PROGRESS_PAUSE_US)


class _PausedBindings:
    """NIXL's native module as its API sees it, but for agents made with the pause."""

    def __init__(self, bindings: Any) -> None:
        self._bindings = bindings

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bindings, name)

    def nixlAgent(self, name: str, config: Any) -> Any:
        config.pthrDelay = max(int(config.pthrDelay), PROGRESS_PAUSE_US)
        return self._bindings.nixlAgent(name, config)
