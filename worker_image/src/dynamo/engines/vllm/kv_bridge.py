"""vLLM's KV cache events (its ZMQ publisher) bridged into our event plane.

Each vLLM engine core publishes `KVEventBatch`es on a ZMQ PUB socket: multipart messages
`[topic, seq (8 bytes, big-endian), msgpack(batch)]`, where a batch is the array
`[ts, events, data_parallel_rank]` and each event a map tagged by `type`: `BlockStored`
(`block_hashes`, `parent_block_hash`, `token_ids`, `block_size`, `lora_name`, `medium`, ...),
`BlockRemoved` (`block_hashes`, `medium`) or `AllBlocksCleared`. A `KvEventBridge` thread
per rank subscribes and re-publishes them through the runtime's `KvEventPublisher` in
upstream's router format, as upstream Dynamo's vLLM worker does.

Block hashes are vLLM's 32-byte digests unless `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` is set;
a digest becomes its big-endian value's low 64 bits, which is what vLLM's own conversion to
integers gives. Events of offload tiers (`medium` CPU or STORAGE) are not device blocks and
are skipped. The vLLM LoRA name of a block is mapped back to the adapter's served name, so
the router's hash of a request's tokens for that adapter matches.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

logger = logging.getLogger(__name__)

_U64_MASK = (1 << 64) - 1
_DEVICE_MEDIA = (None, "GPU")
_POLL_MS = 100


def block_hash(value: bytes | int) -> int:
    """vLLM's block hash as the 64-bit id the router keys blocks by."""
    if isinstance(value, bytes):
        return int.from_bytes(value, "big") & _U64_MASK
    return int(value) & _U64_MASK


def forward_batch(
    payload: bytes, publisher: Any, adapter_name: Callable[[str | None], str | None]
) -> int:
    """Re-publish one msgpack `KVEventBatch`; returns how many events went out."""
    batch = msgspec.msgpack.decode(payload)
    events = batch[1] if isinstance(batch, list | tuple) else batch.get("events", [])
    sent = 0
    for event in events:
        kind = event.get("type")
        if event.get("medium") not in _DEVICE_MEDIA:
            continue
        if kind == "BlockStored":
            hashes = [block_hash(h) for h in event["block_hashes"]]
            tokens = list(event["token_ids"])
            size = int(event["block_size"])
            counts = [size] * len(hashes)
            # vLLM stores full blocks only; a short tail would be the last block's.
            if counts and sum(counts) != len(tokens):
                counts[-1] = len(tokens) - size * (len(hashes) - 1)
            parent = event.get("parent_block_hash")
            publisher.publish_stored(
                token_ids=tokens,
                num_block_tokens=counts,
                block_hashes=hashes,
                parent_hash=None if parent is None else block_hash(parent),
                lora_name=adapter_name(event.get("lora_name")),
            )
        elif kind == "BlockRemoved":
            publisher.publish_removed([block_hash(h) for h in event["block_hashes"]])
        elif kind == "AllBlocksCleared":
            publisher.publish_cleared()
        else:
            logger.debug("vLLM KV event of type %r ignored", kind)
            continue
        sent += 1
    return sent


class KvEventBridge:
    """A thread that subscribes to one rank's vLLM KV-event socket and re-publishes."""

    def __init__(
        self,
        endpoint: str,
        topic: str,
        publisher: Any,
        adapter_name: Callable[[str | None], str | None],
        dp_rank: int,
    ) -> None:
        self.endpoint = endpoint
        self.topic = topic
        self.publisher = publisher
        self.adapter_name = adapter_name
        self.dp_rank = dp_rank
        self.forwarded = 0
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"vllm-kv-events-{dp_rank}", daemon=True
        )

    def start(self) -> None:
        """Subscribe (returns once the socket is connected)."""
        self._thread.start()
        self._ready.wait(5)

    def stop(self) -> None:
        """Stop the thread and close its socket (idempotent)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2)

    def _run(self) -> None:
        socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        try:
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
            socket.connect(self.endpoint)
            self._ready.set()
            last_seq: int | None = None
            while not self._stop.is_set():
                if not socket.poll(_POLL_MS):
                    continue
                frames = socket.recv_multipart()
                if len(frames) != 3:
                    logger.warning("vLLM KV event with %d frames ignored", len(frames))
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                if last_seq is not None and seq != last_seq + 1:
                    logger.warning(
                        "vLLM KV events of rank %d: %d batch(es) missed",
                        self.dp_rank,
                        seq - last_seq - 1,
                    )
                last_seq = seq
                try:
                    self.forwarded += forward_batch(frames[2], self.publisher, self.adapter_name)
                except Exception:
                    logger.exception("vLLM KV event batch %d of rank %d dropped", seq, self.dp_rank)
        finally:
            self._ready.set()
            socket.close(0)
