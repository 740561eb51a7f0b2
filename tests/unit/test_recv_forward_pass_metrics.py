"""The FPM receiver CLI against a real ZMQ publisher on loopback.

The publisher is an XPUB socket: it receives the subscriber's subscription message, so the
tests send only once the receiver is known to be subscribed (no sleeps, no lost messages).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator

import msgspec
import pytest
import zmq
import zmq.asyncio

from dynamo.common.forward_pass_metrics import ForwardPassMetrics, encode
from dynamo.common.recv_forward_pass_metrics import build_parser, run

pytestmark = pytest.mark.unit

TOPIC = b"forward-pass-metrics"


@pytest.fixture
async def publisher() -> AsyncIterator[tuple[zmq.asyncio.Socket, str]]:
    context = zmq.asyncio.Context()
    socket = context.socket(zmq.XPUB)
    socket.setsockopt(zmq.LINGER, 0)
    socket.bind("tcp://127.0.0.1:*")
    endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT)
    yield socket, endpoint
    socket.close()
    context.term()


async def wait_for_subscriber(socket: zmq.asyncio.Socket) -> None:
    message = await asyncio.wait_for(socket.recv(), timeout=30)
    assert message[:1] == b"\x01", "expected a subscribe message"


async def send(socket: zmq.asyncio.Socket, seq: int, payload: bytes) -> None:
    await socket.send_multipart([TOPIC, seq.to_bytes(8, "big"), payload])


async def test_recv_mode_prints_each_valid_message_as_json(
    publisher: tuple[zmq.asyncio.Socket, str], capsys: pytest.CaptureFixture[str]
) -> None:
    socket, endpoint = publisher
    args = build_parser().parse_args(["--zmq-endpoint", endpoint, "--max-messages", "3"])
    receiver = asyncio.create_task(run(args))
    await wait_for_subscriber(socket)

    await socket.send_multipart([TOPIC, b"only two frames"])
    await send(socket, 0, b"garbage")
    await send(socket, 1, encode(ForwardPassMetrics(version=2, counter_id=99)))
    for counter in range(3):
        await send(
            socket, counter + 2, encode(ForwardPassMetrics(worker_id="w", counter_id=counter))
        )
    await asyncio.wait_for(receiver, timeout=30)

    lines = capsys.readouterr().out.strip().splitlines()
    decoded = [json.loads(line) for line in lines]
    assert [item["counter_id"] for item in decoded] == [0, 1, 2]
    assert decoded[0] == msgspec.to_builtins(ForwardPassMetrics(worker_id="w", counter_id=0))


async def test_tracking_mode_prints_latest_per_worker_and_rank(
    publisher: tuple[zmq.asyncio.Socket, str], capsys: pytest.CaptureFixture[str]
) -> None:
    socket, endpoint = publisher
    args = build_parser().parse_args(
        ["--zmq-endpoint", endpoint, "--mode", "tracking", "--max-messages", "4"]
    )
    receiver = asyncio.create_task(run(args))
    await wait_for_subscriber(socket)
    for worker, rank, counter in [("a", 0, 1), ("b", 1, 1), ("a", 0, 2), ("b", 1, 5)]:
        await send(
            socket,
            counter,
            encode(ForwardPassMetrics(worker_id=worker, dp_rank=rank, counter_id=counter)),
        )
    await asyncio.wait_for(receiver, timeout=30)

    final = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert sorted(final) == ["a/0", "b/1"]
    assert final["a/0"]["counter_id"] == 2
    assert final["b/1"]["counter_id"] == 5


async def test_save_plot_without_matplotlib_fails_with_a_clear_message(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    args = build_parser().parse_args(["--save-plot", "out.png", "--max-messages", "1"])
    with pytest.raises(SystemExit, match="--save-plot needs matplotlib"):
        await run(args)


def test_defaults_follow_upstream_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_DISCOVERY_BACKEND", "kubernetes")
    monkeypatch.delenv("DYN_REQUEST_PLANE", raising=False)
    args = build_parser().parse_args([])
    assert (args.namespace, args.component, args.endpoint) == ("dynamo", "backend", "generate")
    assert (args.discovery_backend, args.request_plane) == ("kubernetes", "nats")
    assert (args.mode, args.poll_interval, args.save_plot) == ("recv", 2.0, None)


async def test_module_entry_point_runs_as_a_process(
    publisher: tuple[zmq.asyncio.Socket, str],
) -> None:
    socket, endpoint = publisher
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "dynamo.common.recv_forward_pass_metrics",
        "--zmq-endpoint",
        endpoint,
        "--max-messages",
        "2",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        await wait_for_subscriber(socket)
        await send(socket, 0, encode(ForwardPassMetrics(counter_id=10)))
        await send(socket, 1, encode(ForwardPassMetrics(counter_id=11)))
        stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=60)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 0, stderr.decode()
    assert [json.loads(line)["counter_id"] for line in stdout.decode().splitlines()] == [10, 11]
    assert "Receiving forward-pass metrics for dynamo.backend.generate" in stderr.decode()
