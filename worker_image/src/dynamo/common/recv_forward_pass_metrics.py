"""Print the forward-pass metrics an engine publishes.

Run as `python -m dynamo.common.recv_forward_pass_metrics`.

Upstream subscribes through the runtime's event plane (`FpmEventSubscriber`). This
reimplementation reads the engine's raw ZMQ PUB socket directly (multipart frames
`[topic, sequence, payload]`), which is what the event-plane relay itself consumes; the
namespace/component/endpoint/discovery/request-plane options are accepted for command-line
compatibility and echoed in the start-up log line.

Modes:
* `recv` prints every decoded message as one JSON line.
* `tracking` keeps the latest message per `(worker_id, dp_rank)` and prints that snapshot
  (one JSON object) every `--poll-interval` seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from dynamo.common.forward_pass_metrics import ForwardPassMetrics, decode

logger = logging.getLogger(__name__)

DEFAULT_FPM_PORT = 20380
FPM_PORT_ENV = "DYN_FORWARDPASS_METRIC_PORT"
# Frames per message: topic, sequence number, msgpack payload.
_FRAME_COUNT = 3


def _default_zmq_endpoint() -> str:
    port = os.environ.get(FPM_PORT_ENV) or str(DEFAULT_FPM_PORT)
    return f"tcp://127.0.0.1:{port}"


def build_parser() -> argparse.ArgumentParser:
    """Command-line options (upstream's, plus the ZMQ source and a message limit)."""
    parser = argparse.ArgumentParser(
        prog="python -m dynamo.common.recv_forward_pass_metrics",
        description="Receive and print ForwardPassMetrics published by engine workers.",
    )
    parser.add_argument("--namespace", default="dynamo")
    parser.add_argument("--component", default="backend")
    parser.add_argument("--endpoint", default="generate")
    parser.add_argument(
        "--discovery-backend", default=os.environ.get("DYN_DISCOVERY_BACKEND", "etcd")
    )
    parser.add_argument("--request-plane", default=os.environ.get("DYN_REQUEST_PLANE", "nats"))
    parser.add_argument("--mode", choices=("recv", "tracking"), default="recv")
    parser.add_argument(
        "--poll-interval",
        type=float,
        default=2.0,
        help="seconds between snapshots in tracking mode",
    )
    parser.add_argument(
        "--save-plot",
        metavar="PATH",
        default=None,
        help="write a PNG of the received metrics on exit (needs matplotlib)",
    )
    parser.add_argument(
        "--zmq-endpoint",
        action="append",
        default=None,
        help=(
            "engine FPM PUB socket to subscribe to; repeat for several data-parallel ranks "
            f"(default tcp://127.0.0.1:${FPM_PORT_ENV}, else port {DEFAULT_FPM_PORT})"
        ),
    )
    parser.add_argument(
        "--max-messages",
        type=int,
        default=None,
        help="stop after this many decoded messages (default: run until interrupted)",
    )
    return parser


def _to_json(metrics: ForwardPassMetrics) -> str:
    return json.dumps(msgspec.to_builtins(metrics), sort_keys=False)


def _check_plot_support(path: str | None) -> None:
    # Fail before subscribing rather than after a long capture.
    if path is None:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise SystemExit(
            "--save-plot needs matplotlib, which is not installed; "
            "install it with `pip install matplotlib` or drop --save-plot"
        ) from exc


def save_plot(history: Sequence[ForwardPassMetrics], path: str) -> None:
    """Write a five-panel PNG (wall time, scheduled and queued load) of `history` to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: list[tuple[str, list[float]]] = [
        ("wall_time (s)", [m.wall_time for m in history]),
        ("sched. prefill requests", [m.scheduled_requests.num_prefill_requests for m in history]),
        ("sched. prefill tokens", [m.scheduled_requests.sum_prefill_tokens for m in history]),
        ("sched. decode requests", [m.scheduled_requests.num_decode_requests for m in history]),
        (
            "queued requests",
            [
                m.queued_requests.num_prefill_requests + m.queued_requests.num_decode_requests
                for m in history
            ],
        ),
    ]
    figure, axes = plt.subplots(len(panels), 1, figsize=(10, 2.2 * len(panels)), sharex=True)
    for axis, (title, values) in zip(axes, panels, strict=True):
        axis.plot(range(len(values)), values)
        axis.set_title(title)
    axes[-1].set_xlabel("message")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


async def run(args: argparse.Namespace) -> None:
    """Subscribe to the engine FPM socket(s) and print messages until stopped."""
    _check_plot_support(args.save_plot)
    endpoints: list[str] = args.zmq_endpoint or [_default_zmq_endpoint()]
    logger.info(
        "Receiving forward-pass metrics for %s.%s.%s from %s (mode=%s)",
        args.namespace,
        args.component,
        args.endpoint,
        ", ".join(endpoints),
        args.mode,
    )
    context = zmq.asyncio.Context()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    for endpoint in endpoints:
        socket.connect(endpoint)

    history: list[ForwardPassMetrics] = []
    latest: dict[tuple[str, int], ForwardPassMetrics] = {}
    printer: asyncio.Task[None] | None = None
    if args.mode == "tracking":
        printer = asyncio.create_task(_print_snapshots(latest, args.poll_interval))
    try:
        while args.max_messages is None or len(history) < args.max_messages:
            frames = await socket.recv_multipart()
            if len(frames) != _FRAME_COUNT:
                logger.warning("Skipping FPM message with %d frames (expected 3)", len(frames))
                continue
            metrics = decode(frames[2])
            if metrics is None:
                continue
            history.append(metrics)
            if args.mode == "recv":
                print(_to_json(metrics), flush=True)
            else:
                latest[(metrics.worker_id, metrics.dp_rank)] = metrics
    finally:
        if printer is not None:
            printer.cancel()
            await asyncio.gather(printer, return_exceptions=True)
            _print_snapshot(latest)
        socket.close()
        context.term()
        if args.save_plot is not None and history:
            save_plot(history, args.save_plot)


def _print_snapshot(latest: dict[tuple[str, int], ForwardPassMetrics]) -> None:
    snapshot: dict[str, Any] = {
        f"{worker_id}/{dp_rank}": msgspec.to_builtins(metrics)
        for (worker_id, dp_rank), metrics in sorted(latest.items())
    }
    print(json.dumps(snapshot), flush=True)


async def _print_snapshots(
    latest: dict[tuple[str, int], ForwardPassMetrics], interval: float
) -> None:
    while True:
        await asyncio.sleep(interval)
        _print_snapshot(latest)


def main() -> None:
    """Entry point: parse `sys.argv` and run until interrupted (or `--max-messages`)."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    args = build_parser().parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run(args))


if __name__ == "__main__":
    main()
