"""`Worker`: the seed's entry point that serves one engine with the worker runtime.

`Worker(engine, config).run()` drives the engine through upstream's unified lifecycle. The
lifecycle itself lives in `dynamo.runtime` (upstream: Rust); `run()` reads the runtime's
settings from the environment (`dynamo.runtime.settings.RuntimeSettings`). This is the one
place `dynamo.common` reaches forward into `dynamo.runtime` (declared in the import-linter
contract), and only when `run()` is called.
"""

from __future__ import annotations

import logging

from dynamo.common.backend.engine import BaseEngine
from dynamo.common.backend.worker_config import WorkerConfig


class Worker:
    """Drive one engine instance: start it, serve it, shut it down on SIGTERM/SIGINT.

    Accepts any `BaseEngine`: an `LLMEngine` (token pipeline) or a `RawEngine`/
    `DiffusionEngine` (raw media pipeline); `config.model_input` is validated against the
    engine kind.
    """

    def __init__(self, engine: BaseEngine, config: WorkerConfig) -> None:
        self.engine = engine
        self.config = config

    async def run(self) -> None:
        """Run until a shutdown signal has been handled (startup errors raise).

        Exits the process with 911 when graceful shutdown overruns its hard deadline.
        """
        # Imported only when run: the one forward reach (see the module docstring).
        from dynamo.runtime.lifecycle import WorkerRuntime
        from dynamo.runtime.settings import RuntimeSettings

        if not logging.getLogger().handlers:
            logging.basicConfig(
                level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
            )
        await WorkerRuntime(self.engine, self.config, RuntimeSettings.from_env()).run()
