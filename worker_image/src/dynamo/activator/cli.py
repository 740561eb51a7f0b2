"""`dynamo-activator`: stands in for a DynamoWorker's pods while it is scaled to zero.

Configuration comes from the environment (the operator sets it); see `ENVIRONMENT` below or
`dynamo-activator --help`. A bad value is reported naming the variable, with exit status 2.
SIGTERM (and SIGINT): step out of discovery, stop accepting, answer held requests 503 with
Retry-After, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence

from dynamo.activator.app import Activator
from dynamo.activator.config import ActivatorConfig, ConfigError
from dynamo.activator.kube_presence import KubePresence
from dynamo.activator.kube_source import KubePodSource

ENVIRONMENT = """environment:
  DYN_ACTIVATOR_WORKER   the DynamoWorker to stand in for (= its Service name); required
  POD_NAME, POD_NAMESPACE, POD_UID, POD_IP
                         this pod (downward API); required
  DYN_ACTIVATOR_MAX_HELD requests held at once; more are refused at once (default 256)
  DYN_ACTIVATOR_HOLD_TIMEOUT_SECONDS
                         seconds a request waits for a ready pod (default 300)
  DYN_HTTP_PORT          OpenAI HTTP port (default 8000)
  DYN_SYSTEM_PORT        system port: /health /ready /metrics, card files (default 9090)
  DYN_TCP_RPC_PORT       upstream's TCP request plane (default 0 = ephemeral)
  DYN_ACTIVATOR_BIND_HOST
                         interface to listen on (default 0.0.0.0)
  KUBECONFIG             outside a pod: the cluster to talk to
"""


def build_parser() -> argparse.ArgumentParser:
    """The command line (options: only --help; the environment configures it)."""
    return argparse.ArgumentParser(
        prog="dynamo-activator",
        description=(
            "Stands in for a DynamoWorker's pods while it is scaled to zero: keeps its model"
            " in discovery, holds requests until a pod is ready, then forwards them."
        ),
        epilog=ENVIRONMENT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


async def serve(config: ActivatorConfig, environ: Mapping[str, str]) -> None:
    """Run until SIGTERM/SIGINT, then shut down."""
    activator = Activator(config, KubePodSource(config, environ), KubePresence(config, environ))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await activator.start()
    await stop.wait()
    logging.getLogger(__name__).info("signal received: stepping out and stopping")
    await activator.stop()


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    parse_args(sys.argv[1:] if argv is None else argv)
    env = os.environ if environ is None else environ
    logging.basicConfig(
        level=env.get("DYN_LOG", "INFO").upper() if env.get("DYN_LOG", "").isalpha() else "INFO",
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        config = ActivatorConfig.from_env(env)
    except ConfigError as exc:
        print(f"dynamo-activator: {exc}", file=sys.stderr)
        return 2
    asyncio.run(serve(config, env))
    return 0


if __name__ == "__main__":
    sys.exit(main())
