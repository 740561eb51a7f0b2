"""A vLLM general plugin: on the CPU platform, NIXL's threads yield the cores to the engines.

vLLM loads the `vllm.general_plugins` entry points in every process it starts (the engine core
and each worker), and its NixlConnector makes its NIXL agent in those processes, which our
worker process cannot reach otherwise.

Why: NIXL's Python API (1.4 and 1.5) starts each agent's UCX progress thread with no pause
between polls (fixed, with no setting), so every worker with a NixlConnector keeps one core
busy even when idle. On a GPU node that is one core of many; on a CPU node it is what the
engines need. With a prefill and a decode worker on 2 cores, the two busy threads starved the
decode worker's request handling until upstream's frontend gave the request up (its request
plane waits 5 s for the worker to answer).

The threads the agent starts run under SCHED_IDLE, the kernel's policy for work that should
use only a core nothing else wants: they still poll whenever a core is free, and any other
thread that wakes takes the core at once. Like nice 19 before it, the policy ranks a thread
only against the threads of its own scheduling group (a pod's cgroup on a node; its session
when the kernel groups sessions), so each pod's NIXL thread still takes what its pod's other
threads leave of the pod's share. Measured since, on 2 cores: a decode pod's thread got no CPU
for 24 s while its engine stepped waiting for a pull, and the pull stalled (the guide's Limits);
a thread with a small guaranteed share is the next step. Two other fixes stalled transfers
between test-bed pods: no progress thread (a prefill engine with nothing to step must still
progress UCX for the decode side's pulls), and a pause between polls (the first read between
two pods then waited about 30 s). Other platforms are left as vLLM configures them.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

_TASKS = "/proc/self/task"


def register() -> None:
    """The entry point vLLM calls in each of its processes."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        yield_to_engines()


def yield_to_engines() -> None:
    """Run the threads of every NIXL agent this process makes from now on under SCHED_IDLE
    (idempotent). NIXL itself is left unloaded until vLLM's connector asks vLLM's
    loader for it, so a worker without a KV connector never loads NIXL or UCX."""
    import vllm.distributed.nixl_utils as nixl_utils

    load = nixl_utils.__getattr__  # vLLM's lazy loader (a module __getattr__)
    if getattr(load, "_yields_to_engines", False):
        return

    @functools.wraps(load)
    def load_idled(name: str) -> Any:
        found = load(name)
        if name == "NixlWrapper" and found is not None:
            _idle_new_threads(found)
        return found

    load_idled._yields_to_engines = True  # type: ignore[attr-defined]
    nixl_utils.__getattr__ = load_idled


def _idle_new_threads(agent_class: Any) -> None:
    """Wrap NIXL's agent constructor so that the threads it starts run under SCHED_IDLE
    (once)."""
    if getattr(agent_class.__init__, "_yields_to_engines", False):
        return
    agent_class.__init__ = _idle_threads(agent_class.__init__)
    logger.debug("NIXL on the CPU platform: its agents' threads run under SCHED_IDLE")


def _idle_threads(init: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(init)
    def wrapper(agent: Any, *args: Any, **kwargs: Any) -> None:
        before = _thread_ids()
        init(agent, *args, **kwargs)
        for tid in _thread_ids() - before:
            # Linux applies a thread id's policy to that thread alone.
            try:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            except ProcessLookupError:
                pass  # it already ended
            except PermissionError as exc:
                # A seccomp profile stricter than the runtime's default can forbid the call:
                # the transfers still work, the thread just competes with the engines.
                logger.warning(
                    "NIXL's thread %d keeps its scheduling policy (%s): on a CPU node it "
                    "competes with the engines for the cores",
                    tid,
                    exc,
                )

    wrapper._yields_to_engines = True  # type: ignore[attr-defined]
    return wrapper


def _thread_ids() -> set[int]:
    return {int(tid) for tid in os.listdir(_TASKS)} if sys.platform == "linux" else set()
