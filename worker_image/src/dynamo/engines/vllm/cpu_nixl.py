"""A vLLM general plugin: on the CPU platform, NIXL runs without its progress thread.

vLLM loads the `vllm.general_plugins` entry points in every process it starts (the engine
core and each worker), which is where its NixlConnector makes its NIXL agent; our worker
process cannot reach those otherwise.

Why: NIXL's Python API starts its UCX backend with a progress thread that polls with a delay
of zero, so each worker with a NixlConnector keeps a core busy even when idle. On a GPU node
that costs one core of many; on a CPU node the engine's own threads need those cores.
Measured on 2 cores with one prefill and one decode worker behind upstream's frontend (a
384-token prompt, 16 tokens back): 0.32 s per request and 200 % CPU while idle with the
thread, 0.18 s and 22 % without it.

Without the thread UCX still progresses: vLLM's connector polls NIXL for its transfers and
notifications on every engine step, and an engine keeps stepping while a transfer it takes
part in is unfinished (a prefill keeps its finished requests' blocks until the decode side
has read them). Other platforms are left as vLLM configures them.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

# Where vLLM's connector looks the config class up: the module that loads NIXL lazily, and
# the connector's worker module, which imports the name when it is first imported.
_CONFIG_HOLDERS = (
    "vllm.distributed.nixl_utils",
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker",
)


def register() -> None:
    """The entry point vLLM calls in each of its processes."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        without_progress_thread()


def without_progress_thread() -> None:
    """Make vLLM's NIXL agent config ask for no progress thread (idempotent)."""
    import vllm.distributed.nixl_utils as nixl_utils

    original = nixl_utils.nixl_agent_config
    if original is None or getattr(original, "_without_progress_thread", False):
        return  # NIXL is not installed, or this process is already set
    config = _no_progress_thread(original)
    for name in _CONFIG_HOLDERS:
        module = sys.modules.get(name)
        if module is not None:
            module.nixl_agent_config = config  # type: ignore[attr-defined]
    logger.debug("NIXL on the CPU platform: no progress thread (vLLM steps poll UCX)")


def _no_progress_thread(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def config(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **{**kwargs, "enable_prog_thread": False})

    config._without_progress_thread = True  # type: ignore[attr-defined]
    return config
