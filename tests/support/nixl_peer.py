"""A second process holding embedding senders/receivers, for two-process NIXL tests.

`NixlPeer.start()` spawns a fresh interpreter (multiprocessing "spawn": no state shared with
the test process) that runs an asyncio loop and answers commands over a pipe. Its loop keeps
running between commands, so a sender living in the peer keeps serving transfers while the
test process receives. Tensors cross the pipe as raw bytes plus dtype and shape, so a test
compares exactly the bytes NIXL moved.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from dynamo.common.multimodal.embedding_transfer import (
    AbstractEmbeddingReceiver,
    AbstractEmbeddingSender,
    NixlReadEmbeddingReceiver,
    NixlReadEmbeddingSender,
    NixlWriteEmbeddingReceiver,
    NixlWriteEmbeddingSender,
    RingBuffer,
    TransferRequest,
    torch_dtype_from_string,
    torch_dtype_to_string,
)


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's elements as raw bytes, in row-major order."""
    return tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def tensor_from_bytes(data: bytes, dtype_str: str, shape: list[int]) -> torch.Tensor:
    """Inverse of `tensor_bytes`."""
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return raw.view(torch_dtype_from_string(dtype_str)).view(shape).clone()


class PeerError(Exception):
    """An operation failed in the peer; carries the peer's exception type name and message."""

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.message = message


_FACTORIES: dict[str, type[Any]] = {
    "write_receiver": NixlWriteEmbeddingReceiver,
    "read_receiver": NixlReadEmbeddingReceiver,
    "write_sender": NixlWriteEmbeddingSender,
    "read_sender": NixlReadEmbeddingSender,
}


class _Server:
    def __init__(self) -> None:
        self.objects: dict[str, Any] = {}
        self.send_futures: dict[int, Any] = {}

    async def handle(self, op: str, args: dict[str, Any]) -> Any:
        if op == "create":
            self.objects[args["name"]] = _FACTORIES[args["kind"]](**args.get("kwargs", {}))
            return None
        if op == "receive":
            receiver: AbstractEmbeddingReceiver = self.objects[args["name"]]
            request = TransferRequest.model_validate_json(args["request"])
            extra = {"receive_timeout": args["timeout"]} if "timeout" in args else {}
            tensor_id, tensor = await receiver.receive_embeddings(request, **extra)
            return {
                "tensor_id": tensor_id,
                "data": tensor_bytes(tensor),
                "dtype": torch_dtype_to_string(tensor.dtype),
                "shape": list(tensor.shape),
            }
        if op == "release":
            self.objects[args["name"]].release_tensor(args["tensor_id"])
            return None
        if op == "ring_live_count":
            ring: RingBuffer = self.objects[args["name"]].ring_buffer
            return ring.live_count
        if op == "send":
            sender: AbstractEmbeddingSender = self.objects[args["name"]]
            tensor = tensor_from_bytes(args["data"], args["dtype"], args["shape"])
            request, done = await sender.send_embeddings(tensor, args.get("stage", False))
            key = len(self.send_futures)
            self.send_futures[key] = (asyncio.ensure_future(done), tensor)
            return {"request": request.model_dump_json(), "key": key}
        if op == "send_done":
            future, _ = self.send_futures[args["key"]]
            await asyncio.wait_for(future, args.get("timeout", 30))
            return None
        raise ValueError(f"unknown peer op {op!r}")


async def _serve(conn: Connection) -> None:
    server = _Server()
    while True:
        # Receive off-loop so the peer's NIXL background tasks keep running meanwhile.
        message = await asyncio.to_thread(conn.recv)
        if message is None:
            return
        op, args = message
        try:
            result = await server.handle(op, args)
        except Exception as exc:
            conn.send(("error", type(exc).__name__, str(exc), traceback.format_exc()))
        else:
            conn.send(("ok", result))


def _peer_main(conn: Connection) -> None:
    asyncio.run(_serve(conn))


@dataclass
class NixlPeer:
    """Handle on the peer process."""

    process: multiprocessing.process.BaseProcess
    conn: Connection

    @classmethod
    def start(cls) -> NixlPeer:
        context = multiprocessing.get_context("spawn")
        parent_end, child_end = context.Pipe()
        process = context.Process(target=_peer_main, args=(child_end,), daemon=True)
        process.start()
        child_end.close()
        return cls(process, parent_end)

    def _exchange(self, op: str, args: dict[str, Any]) -> Any:
        self.conn.send((op, args))
        reply = self.conn.recv()
        if reply[0] == "error":
            raise PeerError(reply[1], reply[2])
        return reply[1]

    async def call(self, op: str, **args: Any) -> Any:
        """Run one operation in the peer; raises `PeerError` if it failed there."""
        # The blocking pipe exchange runs off-loop: senders in this process must keep going.
        return await asyncio.to_thread(self._exchange, op, args)

    def stop(self) -> None:
        if self.process.is_alive():
            self.conn.send(None)
            self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()
