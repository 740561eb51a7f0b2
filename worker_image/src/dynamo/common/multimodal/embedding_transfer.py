"""Moving encoder embeddings from an encode worker to the LLM worker that consumes them.

Three transports share one interface (`AbstractEmbeddingSender` / `AbstractEmbeddingReceiver`):

* Local: the sender writes a safetensors file and the request carries its path. Both sides
  need the same filesystem.
* NIXL WRITE: the receiver owns one registered ring buffer; on each request it tells the sender
  (by NIXL notification) where to write, and waits for the sender's "done" notification.
* NIXL READ: the sender registers the tensor and publishes where it lives; the receiver reads
  it into a pre-registered slot (or a buffer registered for that request) and the completion
  notification tells the sender it may drop the tensor.

The wire formats (the JSON `NixlTransferRequest`, the msgpack handshake tuple, the decimal
"done" signal) match upstream Dynamo so mixed deployments interoperate. Improvements over
upstream: requests whose shape/dtype disagree with the bytes sent are refused with a clear
message; a sender that cannot serve a write request tells the receiver at once instead of
letting it time out; unknown tensor ids in `release_tensor` raise `UnknownTensorIdError`;
non-contiguous tensors are made contiguous instead of failing inside NIXL; the NIXL WRITE
receiver aligns its ring-buffer pieces, so every dtype can view them.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import math
import os
import tempfile
import time
import uuid
from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import msgspec
import torch
from pydantic import BaseModel, ValidationError
from safetensors import torch as safetensors_torch

from dynamo.common.constants import EmbeddingTransferMode

logger = logging.getLogger(__name__)

# NIXL has no awaitable completion: transfer state and notifications are polled. These are
# upstream's intervals (5 ms for ring-buffer space, 1 ms for notifications) and its 60 s limit.
_BUFFER_POLL_S = 0.005
_NOTIF_POLL_S = 0.001
_DEFAULT_TIMEOUT_S = 60.0
# An idle NIXL WRITE sender still answers stale handshakes (so their receivers fail fast),
# at this slower pace.
_IDLE_POLL_S = 0.02
# Received tensors are typed views of int8 buffers; torch needs each view to start at an offset
# that is a multiple of its dtype's size. Buffer pieces start on this boundary, the size of the
# widest dtype (complex128), which also keeps the padding between small pieces small.
_ALIGNMENT = 16

# Key of the tensor inside the safetensors file written by LocalEmbeddingSender.
_LOCAL_TENSOR_KEY = "ec_cache"

# Sent by a NIXL WRITE sender instead of the done signal when it cannot serve a request:
# b"error:<write_done_id>:<reason>". Done signals are bare decimals, so the two never collide.
_WRITE_ERROR_PREFIX = "error:"
# Notifications a NIXL READ receiver sends to the sender: after the READ (as its transfer
# notification) or, when the READ failed, on its own.
_READ_DONE_PREFIX = "read-done:"
_READ_FAILED_PREFIX = "read-failed:"


def torch_dtype_from_string(dtype_str: str) -> torch.dtype:
    """Parse a dtype name such as ``"bfloat16"`` (a ``"torch."`` prefix is accepted).

    Like upstream, an unknown name falls back to ``torch.float32``; the receivers then refuse
    the request because its byte count no longer matches.
    """
    candidate = getattr(torch, dtype_str.removeprefix("torch."), None)
    if isinstance(candidate, torch.dtype):
        return candidate
    logger.warning("Unknown embedding dtype %r; reading the bytes as float32", dtype_str)
    return torch.float32


def torch_dtype_to_string(dtype: torch.dtype) -> str:
    """Name of a dtype without the ``"torch."`` prefix, e.g. ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


# Opaque to the caller: each transport puts its own data in `serialized_request`
# (a file path, a JSON NIXL handshake, a dict of RDMA metadata).
class TransferRequest(BaseModel):
    """Data class for transfer requests containing necessary information for embedding transfer."""

    embeddings_shape: list[int]
    embedding_dtype_str: str
    serialized_request: Any


class UnknownTensorIdError(KeyError):
    """`release_tensor` was given an id that is not held (never returned, or already released)."""

    def __str__(self) -> str:
        # KeyError would print the message with quotes around it.
        return str(self.args[0]) if self.args else ""


def _unknown_tensor_id(owner: str, tensor_id: int) -> UnknownTensorIdError:
    return UnknownTensorIdError(
        f"{owner}.release_tensor: unknown tensor_id {tensor_id}; pass an id returned by "
        "receive_embeddings() that has not been released yet"
    )


def _checked_dtype(request: TransferRequest, nbytes: int, source: str) -> torch.dtype:
    """The request's dtype, after checking its shape and dtype describe exactly `nbytes`."""
    shape = request.embeddings_shape
    if any(dim < 0 for dim in shape):
        raise ValueError(
            f"TransferRequest.embeddings_shape {shape} has a negative dimension; "
            "use the request returned by send_embeddings() unchanged"
        )
    dtype = torch_dtype_from_string(request.embedding_dtype_str)
    expected = math.prod(shape) * dtype.itemsize
    if expected != nbytes:
        raise ValueError(
            f"TransferRequest.embeddings_shape {shape} with embedding_dtype_str "
            f"{request.embedding_dtype_str!r} describes {expected} bytes, but {source} holds "
            f"{nbytes} bytes; use the request returned by send_embeddings() unchanged"
        )
    return dtype


_Model = TypeVar("_Model", bound=BaseModel)


def _parse_serialized(model: type[_Model], serialized: Any, transport: str) -> _Model:
    """Validate `TransferRequest.serialized_request` as `model` (JSON text or a dict)."""
    try:
        if isinstance(serialized, str | bytes):
            return model.model_validate_json(serialized)
        return model.model_validate(serialized)
    except ValidationError as exc:
        raise ValueError(
            f"TransferRequest.serialized_request is not a {transport} request "
            f"({model.__name__}): {exc.error_count()} problem(s): {exc.errors()[0]['msg']} at "
            f"{'.'.join(str(p) for p in exc.errors()[0]['loc']) or '<root>'}; pair this "
            f"receiver with the matching sender ({transport})"
        ) from exc


def _align_up(offset: int) -> int:
    return -(-offset // _ALIGNMENT) * _ALIGNMENT


def _done_future() -> asyncio.Future[None]:
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    future.set_result(None)
    return future


class AbstractEmbeddingReceiver(ABC):
    """Abstract base class for a receiver of precomputed embeddings from the encode worker."""

    @abstractmethod
    async def receive_embeddings(self, request: TransferRequest) -> tuple[int, torch.Tensor]:
        """Receive the embeddings described by `request`.

        Returns ``(tensor_id, tensor)``; call ``release_tensor(tensor_id)`` once the tensor is
        no longer needed so its resources can be reused.
        """

    @abstractmethod
    def release_tensor(self, tensor_id: int) -> None:
        """Indicate that the tensor associated with `tensor_id` is no longer in use."""


class AbstractEmbeddingSender(ABC):
    """Abstract base class for a sender of precomputed embeddings to the downstream worker."""

    @abstractmethod
    async def send_embeddings(
        self, embeddings: torch.Tensor, stage_embeddings: bool = False
    ) -> tuple[TransferRequest, Awaitable[None]]:
        """Prepare `embeddings` for the receiver.

        Returns the `TransferRequest` to hand to the receiver and an awaitable that completes
        when the send no longer needs the caller's tensor. With ``stage_embeddings=True`` the
        tensor itself may serve as the transfer buffer and must stay alive and unchanged until
        the awaitable completes; with False the sender works on its own copy.
        """


class LocalEmbeddingSender(AbstractEmbeddingSender):
    """Sender that saves embeddings to a local file and sends the file path as the request.

    The file path is the `serialized_request`; the receiver needs the same filesystem.
    """

    def __init__(self) -> None:
        self.sender_id = uuid.uuid4().hex
        self.embedding_counter = 0

    def save_embeddings_to_file(self, embedding_key: str, embeddings: torch.Tensor) -> str:
        """Save `embeddings` to a new temporary safetensors file and return its path."""
        fd, tensor_path = tempfile.mkstemp(
            prefix=f"encoder_cache.{embedding_key}.", suffix=".safetensors"
        )
        os.close(fd)
        try:
            # safetensors only stores contiguous CPU tensors.
            tensor = embeddings.detach().cpu().contiguous()
            safetensors_torch.save_file({_LOCAL_TENSOR_KEY: tensor}, tensor_path)
        except BaseException:
            os.remove(tensor_path)
            raise
        return tensor_path

    async def send_embeddings(
        self, embeddings: torch.Tensor, stage_embeddings: bool = False
    ) -> tuple[TransferRequest, Awaitable[None]]:
        """Write `embeddings` to a file; the request carries its path. Already complete."""
        embedding_key = f"{self.sender_id}_{self.embedding_counter}"
        self.embedding_counter += 1
        tensor_path = await asyncio.to_thread(
            self.save_embeddings_to_file, embedding_key, embeddings
        )
        request = TransferRequest(
            embeddings_shape=list(embeddings.shape),
            embedding_dtype_str=torch_dtype_to_string(embeddings.dtype),
            serialized_request=tensor_path,
        )
        return request, _done_future()


class LocalEmbeddingReceiver(AbstractEmbeddingReceiver):
    """Receiver that reads embeddings from a local file path provided in the serialized request."""

    def __init__(self) -> None:
        super().__init__()
        self.received_tensors: dict[int, str] = {}
        self.tensor_id_counter = 0

    async def receive_embeddings(self, request: TransferRequest) -> tuple[int, torch.Tensor]:
        """Load the file named by the request; `release_tensor` deletes it."""
        tensor_path = request.serialized_request
        if not isinstance(tensor_path, str) or not tensor_path:
            raise ValueError(
                "TransferRequest.serialized_request must be the file path written by "
                f"LocalEmbeddingSender, got {type(tensor_path).__name__}; pair this receiver "
                "with LocalEmbeddingSender"
            )
        try:
            tensors = await asyncio.to_thread(safetensors_torch.load_file, tensor_path)
        except FileNotFoundError as exc:
            raise FileNotFoundError(
                f"Embedding file {tensor_path!r} named by TransferRequest.serialized_request "
                "does not exist: it was already released, or the sender runs on another host "
                "(local transfer needs a shared filesystem; use nixl-write or nixl-read there)"
            ) from exc
        embeddings = tensors.get(_LOCAL_TENSOR_KEY)
        if embeddings is None:
            raise ValueError(
                f"Embedding file {tensor_path!r} has no {_LOCAL_TENSOR_KEY!r} tensor; it was not "
                "written by LocalEmbeddingSender"
            )
        dtype = torch_dtype_from_string(request.embedding_dtype_str)
        if list(embeddings.shape) != request.embeddings_shape or embeddings.dtype != dtype:
            raise ValueError(
                f"TransferRequest says shape {request.embeddings_shape} dtype "
                f"{request.embedding_dtype_str!r}, but {tensor_path!r} holds shape "
                f"{list(embeddings.shape)} dtype {torch_dtype_to_string(embeddings.dtype)!r}; "
                "use the request returned by send_embeddings() unchanged"
            )
        tensor_id = self.tensor_id_counter
        self.tensor_id_counter += 1
        self.received_tensors[tensor_id] = tensor_path
        return tensor_id, embeddings

    def release_tensor(self, tensor_id: int) -> None:
        """Forget the tensor and delete its file."""
        tensor_path = self.received_tensors.pop(tensor_id, None)
        if tensor_path is None:
            raise _unknown_tensor_id(type(self).__name__, tensor_id)
        try:
            os.remove(tensor_path)
        except FileNotFoundError:
            logger.warning("Embedding file %s was already deleted", tensor_path)


class RingBuffer:
    """A byte buffer handed out in contiguous pieces, reused in allocation order (as upstream).

    Pieces are packed: each starts where the newest live piece ends. A piece never wraps
    around the end: when the space left at the end is too short, it starts again at offset 0
    if the space before the oldest live piece suffices. Releases may come in any order; space
    is reclaimed from the oldest piece forward, so a piece released early is reused once every
    older piece is released too. When nothing is live the next piece starts at offset 0.

    Offsets are not aligned here: a caller that views pieces as wider dtypes asks for sizes
    rounded up to the alignment it needs (see `NixlWriteEmbeddingReceiver`).
    """

    def __init__(self, buffer_size: int) -> None:
        if buffer_size <= 0:
            raise ValueError(
                f"RingBuffer buffer_size must be a positive byte count, got {buffer_size}"
            )
        self.buffer_size = buffer_size
        self.buffer_tensor = torch.zeros(buffer_size, dtype=torch.int8)
        # Live and released-but-not-yet-reclaimed pieces, oldest first: id -> (start, end).
        self._pieces: OrderedDict[int, tuple[int, int]] = OrderedDict()
        self._released: set[int] = set()
        self._next_id = 0

    def __repr__(self) -> str:
        return (
            f"RingBuffer(size={self.buffer_size}, pieces={dict(self._pieces)}, "
            f"released={sorted(self._released)})"
        )

    @property
    def live_count(self) -> int:
        """Number of pieces handed out and not yet released."""
        return len(self._pieces) - len(self._released)

    def _free_range(self, size: int) -> int | None:
        """Start offset where `size` bytes fit, or None."""
        if not self._pieces:
            return 0
        oldest_start = next(iter(self._pieces.values()))[0]
        newest_start, newest_end = next(reversed(self._pieces.values()))
        if newest_start < oldest_start:
            # Wrapped: the only free space is between the newest and the oldest piece.
            return newest_end if newest_end + size <= oldest_start else None
        if newest_end + size <= self.buffer_size:
            return newest_end
        return 0 if size <= oldest_start else None

    def get_buffer(self, size: int) -> tuple[int, torch.Tensor] | tuple[None, None]:
        """Take `size` bytes as ``(buffer_id, int8 view)``; ``(None, None)`` if no room now."""
        if size <= 0:
            raise ValueError(f"RingBuffer.get_buffer size must be positive, got {size}")
        if size > self.buffer_size:
            return None, None
        start = self._free_range(size)
        if start is None:
            return None, None
        buffer_id = self._next_id
        self._next_id += 1
        self._pieces[buffer_id] = (start, start + size)
        return buffer_id, self.buffer_tensor[start : start + size]

    def release_buffer(self, buffer_id: int) -> None:
        """Give a piece back; unknown or already released ids are ignored."""
        if buffer_id not in self._pieces or buffer_id in self._released:
            return
        self._released.add(buffer_id)
        while self._pieces:
            oldest = next(iter(self._pieces))
            if oldest not in self._released:
                break
            del self._pieces[oldest]
            self._released.discard(oldest)


def _new_nixl_agent(name: str) -> Any:
    """A NIXL agent with the UCX backend, configured as upstream does."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as exc:
        raise RuntimeError(
            "NIXL embedding transfer needs the `nixl` package (pip install 'nixl>=0.7'), "
            f"which failed to import: {exc}"
        ) from exc
    agent = nixl_agent(name, nixl_agent_config(num_threads=8, capture_telemetry=True))
    if "UCX" not in agent.backends:
        raise RuntimeError(
            f"NIXL agent {name!r} has no UCX backend (plugins found: {agent.get_plugin_list()}); "
            "point NIXL_PLUGIN_DIR at the directory holding libplugin_UCX.so"
        )
    return agent


def _agent_name(name: str | bytes) -> str:
    return name.decode() if isinstance(name, bytes) else name


class _Registrations:
    """NIXL memory registrations shared by sends of the same buffer, counted per user.

    The same tensor may be sent several times at once; it is registered on first use and
    deregistered when the last transfer using it completes.
    """

    def __init__(self, agent: Any) -> None:
        self._agent = agent
        self._entries: dict[tuple[int, int, int], list[Any]] = {}

    @staticmethod
    def _key(tensor: torch.Tensor) -> tuple[int, int, int]:
        return (tensor.data_ptr(), tensor.get_device(), tensor.nbytes)

    def acquire(self, tensor: torch.Tensor) -> Any:
        """Register `tensor` (or count one more user of it); returns its registration list."""
        key = self._key(tensor)
        entry = self._entries.get(key)
        if entry is None:
            entry = [self._agent.register_memory(tensor), 0]
            self._entries[key] = entry
        entry[1] += 1
        return entry[0]

    def release(self, tensor: torch.Tensor) -> None:
        """Drop one user; deregister when none is left."""
        key = self._key(tensor)
        entry = self._entries.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._entries[key]
            self._agent.deregister_memory(entry[0])

    def release_all(self) -> None:
        for registration, _ in self._entries.values():
            self._agent.deregister_memory(registration)
        self._entries.clear()


def _transfer_buffer(
    registrations: _Registrations, embeddings: torch.Tensor, stage_embeddings: bool
) -> tuple[torch.Tensor, Any]:
    """The registered tensor NIXL will move: the caller's own when staged, else a copy.

    NIXL describes a tensor by (address, length), so it must be contiguous. A device tensor
    whose registration fails (no CUDA support in the transport) is staged through host memory.
    """
    if embeddings.numel() == 0:
        raise ValueError(
            f"send_embeddings: the embeddings tensor is empty (shape {list(embeddings.shape)}); "
            "there is nothing to transfer"
        )
    if stage_embeddings:
        buffer = embeddings.contiguous()
    else:
        buffer = embeddings.detach().clone(memory_format=torch.contiguous_format)
    try:
        return buffer, registrations.acquire(buffer)
    except Exception as exc:
        if not buffer.is_cuda:
            raise
        logger.warning(
            "NIXL could not register the %s tensor (%s); staging it through host memory",
            buffer.device,
            exc,
        )
        buffer = buffer.cpu()
        return buffer, registrations.acquire(buffer)


class NixlTransferRequest(BaseModel):
    """`serialized_request` of a NIXL WRITE transfer (JSON text)."""

    sender_agent_id: str
    # Base64 NIXL metadata of the sender; None when the receiver is known to have it already.
    agent_metadata: str | None
    # The sender's id for the tensor to write.
    tensor_id: int
    tensor_size: int


@dataclass
class _PendingWrite:
    """A tensor waiting to be written, and the write once a receiver asked for it."""

    tensor: torch.Tensor
    descs: Any
    future: asyncio.Future[None]
    handle: Any = None
    receiver: str = ""
    write_done_id: int = -1
    started: float = field(default=0.0)


class NixlWriteEmbeddingSender(AbstractEmbeddingSender):
    """NIXL WRITE-based implementation of the embedding sender interface.

    The sender registers each tensor it sends (the tensors are allocated elsewhere), while
    the receiver writes into one pre-registered ring buffer, so it is the sender that starts
    the WRITE. Protocol:

    1. `send_embeddings` registers the tensor and returns a `TransferRequest` whose
       `serialized_request` is a JSON `NixlTransferRequest`: the sender's agent name and
       metadata, the tensor id and its byte size.
    2. The receiver answers with a NIXL notification: msgpack
       ``(tensor_id, (address, size, device_id, "cuda"|"cpu"), write_done_id, metadata)``,
       carrying its own agent metadata the first time.
    3. The sender WRITEs the tensor into that buffer with ``str(write_done_id)`` as the
       transfer notification, which tells the receiver the bytes have landed.

    A background task, started on the first send and stopped by `close()`, polls NIXL for
    handshakes and transfer states (every millisecond while sends are pending, every 20 ms
    when idle). When a request cannot be served (unknown or already written tensor id, size
    mismatch, failed WRITE) the receiver is told with ``b"error:<write_done_id>:<why>"``
    rather than left to time out.
    """

    def __init__(self) -> None:
        self.sender_id = f"sender_{uuid.uuid4()}"
        self.nixl_agent = _new_nixl_agent(self.sender_id)
        self.remote_agents: dict[str, str] = {}
        self.agent_metadata: bytes = self.nixl_agent.get_agent_metadata()
        self.agent_metadata_b64 = base64.b64encode(self.agent_metadata).decode("utf-8")
        # Tensors sent and not yet written (or abandoned), by the sender's tensor id.
        self.transfer_tracker: dict[int, _PendingWrite] = {}
        # A WRITE still in progress after this long is logged (and its timer restarted).
        self.transfer_timeout = _DEFAULT_TIMEOUT_S
        self._registrations = _Registrations(self.nixl_agent)
        self._next_tensor_id = 0
        self._progress_task: asyncio.Task[None] | None = None
        self._work_arrived = asyncio.Event()

    async def send_embeddings(
        self, embeddings: torch.Tensor, stage_embeddings: bool = False
    ) -> tuple[TransferRequest, asyncio.Future[None]]:
        """Register `embeddings` for a WRITE the receiver will request.

        The returned future completes when the caller's tensor is no longer needed: at once
        when the sender works on a copy, else when the WRITE is done (or failed).
        """
        buffer, _ = _transfer_buffer(self._registrations, embeddings, stage_embeddings)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if buffer is not embeddings:
            future.set_result(None)
        tensor_id = self._next_tensor_id
        self._next_tensor_id += 1
        descs = self.nixl_agent.get_xfer_descs(buffer)
        self.transfer_tracker[tensor_id] = _PendingWrite(buffer, descs, future)
        self._work_arrived.set()
        self._ensure_progress()
        request = TransferRequest(
            embeddings_shape=list(embeddings.shape),
            embedding_dtype_str=torch_dtype_to_string(embeddings.dtype),
            serialized_request=NixlTransferRequest(
                sender_agent_id=self.sender_id,
                agent_metadata=self.agent_metadata_b64,
                tensor_id=tensor_id,
                tensor_size=buffer.nbytes,
            ).model_dump_json(),
        )
        return request, future

    def close(self) -> None:
        """Stop the background task and drop every pending tensor (their futures complete)."""
        if self._progress_task is not None:
            self._progress_task.cancel()
            self._progress_task = None
        for tensor_id in list(self.transfer_tracker):
            self._complete_transfer(tensor_id)
        self._registrations.release_all()

    def _ensure_progress(self) -> None:
        if self._progress_task is None or self._progress_task.done():
            self._progress_task = asyncio.get_running_loop().create_task(
                self._progress(), name=f"{self.sender_id}-progress"
            )

    async def _progress(self) -> None:
        while True:
            try:
                for remote_name, messages in self.nixl_agent.get_new_notifs().items():
                    for message in messages:
                        self._start_write(_agent_name(remote_name), message)
                self._reap_writes()
            except Exception:
                # Keep serving the other transfers; back off so a persistent fault cannot spin.
                logger.exception("NIXL WRITE sender %s: error while polling", self.sender_id)
                await asyncio.sleep(1.0)
            if self.transfer_tracker:
                await asyncio.sleep(_NOTIF_POLL_S)
            else:
                # Idle: wake at once when a send begins, else poll for stale handshakes.
                self._work_arrived.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._work_arrived.wait(), _IDLE_POLL_S)

    def _start_write(self, remote_name: str, message: bytes) -> None:
        """Handle one receiver handshake: start the WRITE it asks for."""
        try:
            tensor_id, target, write_done_id, remote_metadata = msgspec.msgpack.decode(message)
            address, size, device_id, memory = target
            tensor_id, write_done_id = int(tensor_id), int(write_done_id)
        except (msgspec.DecodeError, TypeError, ValueError):
            logger.warning("Ignoring a malformed NIXL notification from %s", remote_name)
            return
        if remote_name not in self.remote_agents:
            if not remote_metadata:
                logger.error(
                    "Write request from unknown agent %s carries no metadata; cannot write "
                    "tensor_id %d to it",
                    remote_name,
                    tensor_id,
                )
                # Unblock the caller: this tensor can never be delivered.
                self._complete_transfer(tensor_id)
                return
            self.remote_agents[remote_name] = _agent_name(
                self.nixl_agent.add_remote_agent(remote_metadata)
            )
        pending = self.transfer_tracker.get(tensor_id)
        if pending is None or pending.handle is not None:
            state = "never sent" if pending is None else "already being written"
            self._refuse(
                remote_name,
                write_done_id,
                f"sender {self.sender_id} has no embeddings pending for tensor_id {tensor_id} "
                f"(already written, or {state}); a TransferRequest can be received only once",
            )
            return
        if size != pending.tensor.nbytes or memory not in ("cuda", "cpu"):
            self._refuse(
                remote_name,
                write_done_id,
                f"target buffer ({size} bytes, {memory!r}) does not fit tensor_id {tensor_id} "
                f"({pending.tensor.nbytes} bytes)",
            )
            return
        done_signal = str(write_done_id).encode()
        try:
            target_descs = self.nixl_agent.get_xfer_descs(
                [(address, size, device_id)], mem_type=memory
            )
            handle = self.nixl_agent.initialize_xfer(
                "WRITE", pending.descs, target_descs, remote_name, done_signal
            )
            self.nixl_agent.transfer(handle, done_signal)
        except Exception as exc:
            self._refuse(remote_name, write_done_id, f"NIXL WRITE could not start: {exc}")
            self._complete_transfer(tensor_id)
            return
        pending.handle = handle
        pending.receiver = remote_name
        pending.write_done_id = write_done_id
        pending.started = time.perf_counter()

    def _reap_writes(self) -> None:
        now = time.perf_counter()
        for tensor_id, pending in list(self.transfer_tracker.items()):
            if pending.handle is None:
                continue
            state = self.nixl_agent.check_xfer_state(pending.handle)
            if state == "DONE":
                logger.debug("Sent tensor_id %d in %.3f s", tensor_id, now - pending.started)
            elif state == "ERR":
                logger.error("NIXL WRITE of tensor_id %d failed", tensor_id)
                self._refuse(pending.receiver, pending.write_done_id, "NIXL WRITE failed")
            else:
                if now - pending.started > self.transfer_timeout:
                    logger.warning(
                        "WRITE of tensor_id %d in flight for over %s s; still waiting",
                        tensor_id,
                        self.transfer_timeout,
                    )
                    pending.started = now
                continue
            # As upstream, the future completes on failure too: the tensor is free either way.
            self._complete_transfer(tensor_id)

    def _refuse(self, remote_name: str, write_done_id: int, reason: str) -> None:
        logger.error(
            "Cannot serve write request %d from %s: %s", write_done_id, remote_name, reason
        )
        try:
            self.nixl_agent.send_notif(
                remote_name, f"{_WRITE_ERROR_PREFIX}{write_done_id}:{reason}".encode()
            )
        except Exception as exc:
            logger.error("Could not tell %s about the failure: %s", remote_name, exc)

    def _complete_transfer(self, tensor_id: int) -> None:
        pending = self.transfer_tracker.pop(tensor_id, None)
        if pending is None:
            return
        if pending.handle is not None:
            try:
                pending.handle.release()
            except Exception as exc:
                logger.warning("Releasing the NIXL handle of tensor_id %d: %s", tensor_id, exc)
        self._registrations.release(pending.tensor)
        if not pending.future.done():
            pending.future.set_result(None)


class NixlWriteEmbeddingReceiver(AbstractEmbeddingReceiver):
    """Counter part of 'NixlWriteEmbeddingSender', see 'NixlWriteEmbeddingSender' for details.

    The receiver manages a ring buffer for the sender to write the embeddings into, and
    answers the sender's transfer request with the buffer information for the WRITE.
    """

    # Default: 2 bytes (fp16) x 8192 hidden x 1024 items of 256 tokens x 2 copies = 8 GiB.
    def __init__(self, buffer_size: int = 2 * 8 * 1024 * 1024 * 256 * 2) -> None:
        self.ring_buffer = RingBuffer(buffer_size)
        self.transfer_tensor = self.ring_buffer.buffer_tensor
        self.receiver_id = f"receiver_{uuid.uuid4()}"
        self.nixl_agent = _new_nixl_agent(self.receiver_id)
        self.remote_agents: dict[str, str] = {}
        self.reg_descs = self.nixl_agent.register_memory(self.transfer_tensor)
        self.agent_metadata: bytes = self.nixl_agent.get_agent_metadata()
        self.to_buffer_id: dict[int, int] = {}
        self._next_tensor_id = 0

    async def receive_embeddings(
        self, request: TransferRequest, receive_timeout: float = _DEFAULT_TIMEOUT_S
    ) -> tuple[int, torch.Tensor]:
        """Ask the sender to WRITE the embeddings into the ring buffer and wait for them.

        `receive_timeout` (seconds) applies separately to waiting for buffer space and to
        waiting for the WRITE; either raises `TimeoutError`. The tensor is a view of the ring
        buffer: call `release_tensor` soon, or later requests wait for space.
        """
        nixl_request = _parse_serialized(
            NixlTransferRequest, request.serialized_request, "nixl-write"
        )
        size = nixl_request.tensor_size
        dtype = _checked_dtype(request, size, f"sender tensor_id {nixl_request.tensor_id}")
        if size > self.ring_buffer.buffer_size:
            raise ValueError(
                f"Embeddings of {size} bytes can never fit the receiver's ring buffer of "
                f"{self.ring_buffer.buffer_size} bytes; raise NixlWriteEmbeddingReceiver "
                "buffer_size"
            )
        sender = nixl_request.sender_agent_id
        if sender not in self.remote_agents:
            if nixl_request.agent_metadata is None:
                raise ValueError(f"Missing agent metadata for new sender {sender}")
            try:
                metadata = base64.b64decode(nixl_request.agent_metadata, validate=True)
            except binascii.Error as exc:
                raise ValueError(
                    f"NixlTransferRequest.agent_metadata of sender {sender} is not base64"
                ) from exc
            self.remote_agents[sender] = _agent_name(self.nixl_agent.add_remote_agent(metadata))

        # Every piece spans a whole number of _ALIGNMENT bytes (or runs to the buffer's end),
        # so every piece starts aligned and takes any dtype view; upstream packs exact sizes,
        # which breaks a float32 view after an odd-sized bfloat16 piece.
        buffer_id, piece = await self._allocate(
            min(_align_up(size), self.ring_buffer.buffer_size), receive_timeout
        )
        buffer = piece[:size]
        embeddings = buffer.view(dtype).view(request.embeddings_shape)
        tensor_id = self._next_tensor_id
        self._next_tensor_id += 1
        handshake = msgspec.msgpack.encode(
            (
                nixl_request.tensor_id,
                (
                    buffer.data_ptr(),
                    size,
                    max(buffer.get_device(), 0),  # torch says -1 for host memory
                    "cuda" if buffer.is_cuda else "cpu",
                ),
                tensor_id,
                # The sender may not know this agent yet: send metadata whenever it sent its own.
                self.agent_metadata if nixl_request.agent_metadata else b"",
            )
        )
        try:
            self.nixl_agent.send_notif(sender, handshake)
            await self._wait_for_write(sender, tensor_id, receive_timeout)
        except BaseException:
            # A sender still writing after a timeout could land in a reused piece; upstream
            # accepts that risk rather than leak the space.
            self.ring_buffer.release_buffer(buffer_id)
            raise
        self.to_buffer_id[tensor_id] = buffer_id
        return tensor_id, embeddings

    async def _allocate(self, size: int, limit_s: float) -> tuple[int, torch.Tensor]:
        deadline = time.perf_counter() + limit_s
        while True:
            buffer_id, buffer = self.ring_buffer.get_buffer(size)
            if buffer_id is not None and buffer is not None:
                return buffer_id, buffer
            # Space comes back only through release_tensor() by other requests. A request
            # holding pieces while waiting for more can deadlock with others doing the same:
            # on TimeoutError the caller must release what it holds before retrying.
            if time.perf_counter() > deadline:
                raise TimeoutError(
                    f"Timeout while waiting for available buffer: {size} bytes needed, "
                    f"{self.ring_buffer.live_count} received tensor(s) not yet released in a "
                    f"ring buffer of {self.ring_buffer.buffer_size} bytes; call release_tensor() "
                    "sooner or raise buffer_size"
                )
            await asyncio.sleep(_BUFFER_POLL_S)

    async def _wait_for_write(self, sender: str, tensor_id: int, limit_s: float) -> None:
        # Exact matching on our own list: check_remote_xfer_done matches prefixes, so "1"
        # would consume "11".
        done_signal = str(tensor_id).encode()
        error_prefix = f"{_WRITE_ERROR_PREFIX}{tensor_id}:".encode()
        deadline = time.perf_counter() + limit_s
        while True:
            messages = self.nixl_agent.update_notifs().get(sender, [])
            for message in messages:
                if message == done_signal:
                    messages.remove(message)
                    return
                if message.startswith(error_prefix):
                    messages.remove(message)
                    reason = message[len(error_prefix) :].decode(errors="replace")
                    raise RuntimeError(f"Sender {sender} could not write the embeddings: {reason}")
            if time.perf_counter() > deadline:
                raise TimeoutError(
                    f"Timeout while waiting for transfer completion for tensor_id {tensor_id} "
                    f"for more than {limit_s} seconds"
                )
            await asyncio.sleep(_NOTIF_POLL_S)

    def release_tensor(self, tensor_id: int) -> None:
        """Give the tensor's ring-buffer space back."""
        buffer_id = self.to_buffer_id.pop(tensor_id, None)
        if buffer_id is None:
            raise _unknown_tensor_id(type(self).__name__, tensor_id)
        self.ring_buffer.release_buffer(buffer_id)


class NixlReadRequest(BaseModel):
    """`serialized_request` of a NIXL READ transfer (sent as a dict): where the tensor lives."""

    agent_name: str
    # Base64 NIXL metadata of the sender covering this tensor's registration.
    agent_metadata: str
    tensor_id: int
    address: int
    size: int
    device_id: int
    mem_type: Literal["DRAM", "VRAM"]


@dataclass
class _PendingRead:
    tensor: torch.Tensor
    future: asyncio.Future[None]


class NixlReadEmbeddingSender(AbstractEmbeddingSender):
    """NIXL READ based embedding transfer sender.

    Each sent tensor is registered with this sender's NIXL agent and described (address,
    size, device, agent metadata) in a `NixlReadRequest` dict; the receiver READs it. The
    returned awaitable completes when the receiver reports the READ finished (or failed),
    after which the registration is dropped.
    """

    def __init__(self) -> None:
        self.sender_id = f"read_sender_{uuid.uuid4()}"
        self.nixl_agent = _new_nixl_agent(self.sender_id)
        self._registrations = _Registrations(self.nixl_agent)
        self._pending: dict[int, _PendingRead] = {}
        self._next_tensor_id = 0
        self._progress_task: asyncio.Task[None] | None = None

    async def send_embeddings(
        self, embeddings: torch.Tensor, stage_embeddings: bool = False
    ) -> tuple[TransferRequest, Awaitable[None]]:
        """Register `embeddings` (or a copy) and describe it for the receiver's READ."""
        buffer, registration = _transfer_buffer(self._registrations, embeddings, stage_embeddings)
        tensor_id = self._next_tensor_id
        self._next_tensor_id += 1
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending[tensor_id] = _PendingRead(buffer, future)
        metadata = self.nixl_agent.get_partial_agent_metadata(registration, inc_conn_info=True)
        self._ensure_progress()
        request = TransferRequest(
            embeddings_shape=list(embeddings.shape),
            embedding_dtype_str=torch_dtype_to_string(embeddings.dtype),
            serialized_request=NixlReadRequest(
                agent_name=self.sender_id,
                agent_metadata=base64.b64encode(metadata).decode("ascii"),
                tensor_id=tensor_id,
                address=buffer.data_ptr(),
                size=buffer.nbytes,
                device_id=max(buffer.get_device(), 0),
                mem_type="VRAM" if buffer.is_cuda else "DRAM",
            ).model_dump(),
        )
        return request, future

    def close(self) -> None:
        """Stop the background task and drop every pending tensor (their futures complete)."""
        if self._progress_task is not None:
            self._progress_task.cancel()
            self._progress_task = None
        for tensor_id in list(self._pending):
            self._complete(tensor_id)
        self._registrations.release_all()

    def _ensure_progress(self) -> None:
        if self._progress_task is None or self._progress_task.done():
            self._progress_task = asyncio.get_running_loop().create_task(
                self._progress(), name=f"{self.sender_id}-progress"
            )

    async def _progress(self) -> None:
        while self._pending:
            try:
                for remote_name, messages in self.nixl_agent.get_new_notifs().items():
                    for message in messages:
                        self._on_notification(_agent_name(remote_name), message)
            except Exception:
                # Back off so a persistent fault cannot spin.
                logger.exception("NIXL READ sender %s: error while polling", self.sender_id)
                await asyncio.sleep(1.0)
            await asyncio.sleep(_NOTIF_POLL_S)

    def _on_notification(self, remote_name: str, message: bytes) -> None:
        text = message.decode(errors="replace")
        if text.startswith(_READ_DONE_PREFIX):
            id_text, reason = text[len(_READ_DONE_PREFIX) :], ""
        elif text.startswith(_READ_FAILED_PREFIX):
            id_text, _, reason = text[len(_READ_FAILED_PREFIX) :].partition(":")
        else:
            logger.warning("Ignoring an unexpected NIXL notification from %s", remote_name)
            return
        try:
            tensor_id = int(id_text)
        except ValueError:
            logger.warning("Ignoring a malformed NIXL notification from %s", remote_name)
            return
        if tensor_id not in self._pending:
            logger.warning("%s reported tensor_id %d, which is not pending", remote_name, tensor_id)
            return
        if reason:
            logger.error("%s failed to read tensor_id %d: %s", remote_name, tensor_id, reason)
        self._complete(tensor_id)

    def _complete(self, tensor_id: int) -> None:
        pending = self._pending.pop(tensor_id)
        self._registrations.release(pending.tensor)
        if not pending.future.done():
            pending.future.set_result(None)


@dataclass
class _ReadTarget:
    """Where one received tensor lives: a pre-registered slot, or its own registration."""

    slot: int | None
    registration: Any = None


class NixlReadEmbeddingReceiver(AbstractEmbeddingReceiver):
    """NIXL READ based embedding transfer receiver.

    Pre-registers `max_items` slots of ``max_item_mm_token * embedding_hidden_size`` bytes
    (one NIXL registration for all of them); a request larger than a slot, or arriving when
    every slot is in use, gets a buffer registered for it alone. Received tensors are views
    of those buffers until `release_tensor`.
    """

    def __init__(
        self,
        embedding_hidden_size: int = 8 * 1024,
        max_item_mm_token: int = 1024,
        max_items: int = 1024,
    ) -> None:
        for name, value in (
            ("embedding_hidden_size", embedding_hidden_size),
            ("max_item_mm_token", max_item_mm_token),
            ("max_items", max_items),
        ):
            if value < 0:
                raise ValueError(f"NixlReadEmbeddingReceiver {name} must be >= 0, got {value}")
        super().__init__()
        self.receiver_id = f"read_receiver_{uuid.uuid4()}"
        self.nixl_agent = _new_nixl_agent(self.receiver_id)
        self.slot_bytes = embedding_hidden_size * max_item_mm_token
        # Slots start on an aligned offset so any dtype can view them.
        self._slot_stride = _align_up(self.slot_bytes)
        self.tensor_id_counter = 0
        self._slots: torch.Tensor | None = None
        self._free_slots: deque[int] = deque()
        if max_items > 0 and self.slot_bytes > 0:
            self._slots = torch.zeros(max_items * self._slot_stride, dtype=torch.int8)
            self._slots_registration = self.nixl_agent.register_memory(self._slots)
            self._free_slots.extend(range(max_items))
        self._in_use: dict[int, _ReadTarget] = {}

    async def receive_embeddings(self, request: TransferRequest) -> tuple[int, torch.Tensor]:
        """READ the embeddings from the sender into a local buffer."""
        source = _parse_serialized(NixlReadRequest, request.serialized_request, "nixl-read")
        dtype = _checked_dtype(request, source.size, f"sender tensor_id {source.tensor_id}")
        try:
            metadata = base64.b64decode(source.agent_metadata, validate=True)
        except binascii.Error as exc:
            raise ValueError(
                f"NixlReadRequest.agent_metadata of sender {source.agent_name} is not base64"
            ) from exc
        target, buffer = self._take_buffer(source.size)
        try:
            remote = _agent_name(self.nixl_agent.add_remote_agent(metadata))
            await self._read(remote, source, buffer)
        except BaseException as exc:
            self._give_back(target)
            self._tell_failed(source, exc)
            raise
        tensor_id = self.tensor_id_counter
        self.tensor_id_counter += 1
        self._in_use[tensor_id] = target
        return tensor_id, buffer.view(dtype).view(request.embeddings_shape)

    def _take_buffer(self, size: int) -> tuple[_ReadTarget, torch.Tensor]:
        if self._slots is not None and self._free_slots and size <= self.slot_bytes:
            slot = self._free_slots.popleft()
            start = slot * self._slot_stride
            return _ReadTarget(slot), self._slots[start : start + size]
        logger.debug("No pre-registered slot for %d bytes; registering a buffer", size)
        buffer = torch.empty(size, dtype=torch.int8)
        return _ReadTarget(None, self.nixl_agent.register_memory(buffer)), buffer

    def _give_back(self, target: _ReadTarget) -> None:
        if target.slot is not None:
            self._free_slots.append(target.slot)
        else:
            self.nixl_agent.deregister_memory(target.registration)

    async def _read(self, remote: str, source: NixlReadRequest, buffer: torch.Tensor) -> None:
        done = f"{_READ_DONE_PREFIX}{source.tensor_id}".encode()
        local_descs = self.nixl_agent.get_xfer_descs(buffer)
        remote_descs = self.nixl_agent.get_xfer_descs(
            [(source.address, source.size, source.device_id)], mem_type=source.mem_type
        )
        try:
            handle = self.nixl_agent.initialize_xfer(
                "READ", local_descs, remote_descs, remote, done
            )
        except Exception as exc:
            raise RuntimeError(
                f"NIXL READ of tensor_id {source.tensor_id} from {remote} could not start "
                f"({type(exc).__name__}: {exc}): the sender does not expose {source.size} bytes "
                f"at address {source.address:#x}; use the request returned by send_embeddings() "
                "unchanged, while its sender is alive"
            ) from exc
        try:
            state = self.nixl_agent.transfer(handle, done)
            deadline = time.perf_counter() + _DEFAULT_TIMEOUT_S
            while state == "PROC":
                if time.perf_counter() > deadline:
                    raise TimeoutError(
                        f"NIXL READ of tensor_id {source.tensor_id} from {remote} did not "
                        f"finish within {_DEFAULT_TIMEOUT_S} seconds"
                    )
                await asyncio.sleep(_NOTIF_POLL_S)
                state = self.nixl_agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(
                    f"NIXL READ of tensor_id {source.tensor_id} from {remote} failed"
                )
        finally:
            try:
                handle.release()
            except Exception as exc:
                logger.warning("Releasing the NIXL READ handle: %s", exc)

    def _tell_failed(self, source: NixlReadRequest, exc: BaseException) -> None:
        # Let the sender drop its tensor now rather than hold it forever.
        message = f"{_READ_FAILED_PREFIX}{source.tensor_id}:{type(exc).__name__}"
        try:
            self.nixl_agent.send_notif(source.agent_name, message.encode())
        except Exception as notify_exc:
            logger.debug("Could not notify %s: %s", source.agent_name, notify_exc)

    def release_tensor(self, tensor_id: int) -> None:
        """Return the tensor's buffer: a slot becomes free, a per-request buffer is deregistered."""
        target = self._in_use.pop(tensor_id, None)
        if target is None:
            raise _unknown_tensor_id(type(self).__name__, tensor_id)
        self._give_back(target)


EMBEDDING_SENDER_FACTORIES: dict[EmbeddingTransferMode, Callable[[], AbstractEmbeddingSender]] = {
    EmbeddingTransferMode.LOCAL: LocalEmbeddingSender,
    EmbeddingTransferMode.NIXL_WRITE: NixlWriteEmbeddingSender,
    EmbeddingTransferMode.NIXL_READ: NixlReadEmbeddingSender,
}

EMBEDDING_RECEIVER_FACTORIES: dict[
    EmbeddingTransferMode, Callable[[], AbstractEmbeddingReceiver]
] = {
    EmbeddingTransferMode.LOCAL: LocalEmbeddingReceiver,
    EmbeddingTransferMode.NIXL_WRITE: NixlWriteEmbeddingReceiver,
    # No pre-registered slots by default, as upstream: each request registers its own buffer.
    EmbeddingTransferMode.NIXL_READ: lambda: NixlReadEmbeddingReceiver(max_items=0),
}
