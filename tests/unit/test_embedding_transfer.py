"""Embedding transfer: local files, and NIXL WRITE / READ between two real processes.

The NIXL tests use the real `nixl` package with its UCX backend: on a host without a GPU it
moves host-memory (DRAM) buffers over loopback. The peer process (tests/support/nixl_peer.py)
is a separate interpreter, so every byte compared has crossed a process boundary through NIXL.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch

from dynamo.common.constants import EmbeddingTransferMode
from dynamo.common.multimodal import (
    EMBEDDING_RECEIVER_FACTORIES,
    EMBEDDING_SENDER_FACTORIES,
    AbstractEmbeddingReceiver,
    AbstractEmbeddingSender,
    LocalEmbeddingReceiver,
    LocalEmbeddingSender,
    NixlReadEmbeddingReceiver,
    NixlReadEmbeddingSender,
    NixlWriteEmbeddingReceiver,
    NixlWriteEmbeddingSender,
    TransferRequest,
)
from dynamo.common.multimodal.embedding_transfer import (
    NixlReadRequest,
    NixlTransferRequest,
    UnknownTensorIdError,
    torch_dtype_from_string,
    torch_dtype_to_string,
)
from support.nixl_peer import NixlPeer, PeerError, tensor_bytes

pytestmark = pytest.mark.unit

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="torch.cuda.is_available() is False: no CUDA device"
)


@pytest.fixture(scope="module", autouse=True)
def _loopback_only() -> Iterator[None]:
    """Keep UCX on the loopback device (tests talk to 127.0.0.1 only); the peer inherits it.

    UCX already prefers `lo` between processes of one host; this makes it a rule.
    """
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("UCX_NET_DEVICES", "lo")
        yield


def _embeddings(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    return torch.randint(-(2**40), 2**40, shape, generator=generator, dtype=dtype)


# -- helpers and the request model ----------------------------------------------------------


def test_dtype_names_round_trip_and_unknown_names_fall_back_to_float32() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8):
        assert torch_dtype_from_string(torch_dtype_to_string(dtype)) is dtype
    assert torch_dtype_to_string(torch.bfloat16) == "bfloat16"
    assert torch_dtype_from_string("torch.float16") is torch.float16
    assert torch_dtype_from_string("no_such_dtype") is torch.float32
    # A torch attribute that is not a dtype must not be taken for one.
    assert torch_dtype_from_string("zeros") is torch.float32


def test_factories_cover_every_mode() -> None:
    assert set(EMBEDDING_SENDER_FACTORIES) == set(EmbeddingTransferMode)
    assert set(EMBEDDING_RECEIVER_FACTORIES) == set(EmbeddingTransferMode)
    assert isinstance(
        EMBEDDING_SENDER_FACTORIES[EmbeddingTransferMode.LOCAL](), LocalEmbeddingSender
    )
    receiver = EMBEDDING_RECEIVER_FACTORIES[EmbeddingTransferMode.NIXL_READ]()
    assert isinstance(receiver, NixlReadEmbeddingReceiver)
    assert receiver.slot_bytes > 0  # defaults kept, but no slot pre-registered


def test_abstract_classes_cannot_be_instantiated() -> None:
    with pytest.raises(TypeError):
        AbstractEmbeddingSender()  # type: ignore[abstract]
    with pytest.raises(TypeError):
        AbstractEmbeddingReceiver()  # type: ignore[abstract]


# -- Local ------------------------------------------------------------------------------------


async def test_local_round_trip_and_release_deletes_the_file() -> None:
    sender = LocalEmbeddingSender()
    receiver = LocalEmbeddingReceiver()
    # Non-contiguous on purpose: the transposed view must arrive as the logical tensor.
    source = _embeddings(torch.bfloat16, (7, 5), seed=1).t()
    request, done = await sender.send_embeddings(source)
    await done
    path = request.serialized_request
    assert os.path.basename(path).startswith(f"encoder_cache.{sender.sender_id}_0.")
    assert path.endswith(".safetensors")
    assert request.embeddings_shape == [5, 7]
    assert request.embedding_dtype_str == "bfloat16"
    # The request survives a JSON round trip, as it does between workers.
    request = TransferRequest.model_validate_json(request.model_dump_json())

    tensor_id, received = await receiver.receive_embeddings(request)
    assert received.dtype is torch.bfloat16
    assert tensor_bytes(received) == tensor_bytes(source)
    second_request, _ = await sender.send_embeddings(source)
    second_id, _ = await receiver.receive_embeddings(second_request)
    assert second_id == tensor_id + 1

    receiver.release_tensor(tensor_id)
    assert not await asyncio.to_thread(Path(path).exists)
    with pytest.raises(UnknownTensorIdError, match=rf"unknown tensor_id {tensor_id}; pass an id"):
        receiver.release_tensor(tensor_id)
    with pytest.raises(FileNotFoundError, match="already released, or the sender runs on"):
        await receiver.receive_embeddings(request)
    receiver.release_tensor(second_id)


async def test_local_receiver_refuses_a_request_that_does_not_match_the_file() -> None:
    sender = LocalEmbeddingSender()
    receiver = LocalEmbeddingReceiver()
    request, _ = await sender.send_embeddings(torch.ones(2, 3))
    try:
        wrong_shape = request.model_copy(update={"embeddings_shape": [3, 2]})
        with pytest.raises(ValueError, match=r"says shape \[3, 2\].*holds shape \[2, 3\]"):
            await receiver.receive_embeddings(wrong_shape)
        wrong_dtype = request.model_copy(update={"embedding_dtype_str": "float16"})
        with pytest.raises(ValueError, match=r"dtype 'float16'.*dtype 'float32'"):
            await receiver.receive_embeddings(wrong_dtype)
        not_a_path = request.model_copy(update={"serialized_request": {"tensor_id": 1}})
        with pytest.raises(ValueError, match="must be the file path written by"):
            await receiver.receive_embeddings(not_a_path)
    finally:
        os.remove(request.serialized_request)


# -- NIXL, in one process: argument and request checks --------------------------------------


async def test_nixl_write_receiver_refuses_bad_requests_before_any_transfer() -> None:
    receiver = NixlWriteEmbeddingReceiver(buffer_size=4096)
    good = NixlTransferRequest(
        sender_agent_id="sender_x", agent_metadata=None, tensor_id=0, tensor_size=24
    )
    mismatched = TransferRequest(
        embeddings_shape=[2, 3],
        embedding_dtype_str="bfloat16",
        serialized_request=good.model_dump_json(),
    )
    with pytest.raises(
        ValueError, match=r"\[2, 3\] with embedding_dtype_str 'bfloat16'.*12 bytes.*24 bytes"
    ):
        await receiver.receive_embeddings(mismatched)
    too_big = TransferRequest(
        embeddings_shape=[2048],
        embedding_dtype_str="float32",
        serialized_request=good.model_copy(update={"tensor_size": 8192}).model_dump_json(),
    )
    with pytest.raises(ValueError, match="can never fit the receiver's ring buffer of 4096 bytes"):
        await receiver.receive_embeddings(too_big)
    unknown_sender = TransferRequest(
        embeddings_shape=[2, 3],
        embedding_dtype_str="float32",
        serialized_request=good.model_dump_json(),
    )
    with pytest.raises(ValueError, match="Missing agent metadata for new sender sender_x"):
        await receiver.receive_embeddings(unknown_sender)
    garbage = unknown_sender.model_copy(update={"serialized_request": "/tmp/some-file"})
    with pytest.raises(ValueError, match="not a nixl-write request"):
        await receiver.receive_embeddings(garbage)
    with pytest.raises(UnknownTensorIdError, match=r"NixlWriteEmbeddingReceiver\.release_tensor"):
        receiver.release_tensor(0)


async def test_nixl_read_receiver_refuses_bad_requests_before_any_transfer() -> None:
    receiver = NixlReadEmbeddingReceiver(embedding_hidden_size=16, max_item_mm_token=4, max_items=1)
    source = NixlReadRequest(
        agent_name="read_sender_x",
        agent_metadata=base64.b64encode(b"x").decode(),
        tensor_id=3,
        address=4096,
        size=40,
        device_id=0,
        mem_type="DRAM",
    )
    wrong_shape = TransferRequest(
        embeddings_shape=[3, 3],
        embedding_dtype_str="float32",
        serialized_request=source.model_dump(),
    )
    with pytest.raises(
        ValueError, match=r"\[3, 3\].*describes 36 bytes, but sender tensor_id 3 holds 40"
    ):
        await receiver.receive_embeddings(wrong_shape)
    write_style = wrong_shape.model_copy(
        update={"serialized_request": json.dumps({"tensor_id": 1})}
    )
    with pytest.raises(ValueError, match="not a nixl-read request"):
        await receiver.receive_embeddings(write_style)
    with pytest.raises(UnknownTensorIdError, match="unknown tensor_id 7"):
        receiver.release_tensor(7)
    with pytest.raises(ValueError, match="max_items must be >= 0, got -1"):
        NixlReadEmbeddingReceiver(max_items=-1)


async def test_nixl_senders_refuse_empty_tensors() -> None:
    for sender in (NixlWriteEmbeddingSender(), NixlReadEmbeddingSender()):
        with pytest.raises(ValueError, match=r"empty \(shape \[0, 4\]\); there is nothing"):
            await sender.send_embeddings(torch.empty(0, 4))


async def test_nixl_write_receiver_times_out_when_the_ring_buffer_stays_full() -> None:
    """A receiver whose buffer is held by an unreleased tensor gives up with a clear message."""
    sender = NixlWriteEmbeddingSender()
    receiver = NixlWriteEmbeddingReceiver(buffer_size=256)
    try:
        first, _ = await sender.send_embeddings(torch.arange(64, dtype=torch.float32))
        held_id, held = await receiver.receive_embeddings(first)
        assert torch.equal(held, torch.arange(64, dtype=torch.float32))
        second, _ = await sender.send_embeddings(torch.ones(64))
        with pytest.raises(TimeoutError, match="1 received tensor\\(s\\) not yet released"):
            await receiver.receive_embeddings(second, receive_timeout=0.05)
        receiver.release_tensor(held_id)
        _, after_release = await receiver.receive_embeddings(second)
        assert torch.equal(after_release, torch.ones(64))
    finally:
        sender.close()


async def _receive_held(
    sender: NixlWriteEmbeddingSender, receiver: NixlWriteEmbeddingReceiver, source: torch.Tensor
) -> tuple[int, int]:
    """Send `source` and receive it (kept, not released): its tensor id and buffer offset."""
    request, _ = await sender.send_embeddings(source)
    tensor_id, received = await receiver.receive_embeddings(request, receive_timeout=5)
    assert torch.equal(received, source)
    return tensor_id, received.data_ptr() - receiver.transfer_tensor.data_ptr()


async def test_nixl_write_receiver_fills_its_ring_buffer_and_wraps() -> None:
    """Issue 16's cases, end to end through NIXL: pieces that fit are never refused."""
    sender = NixlWriteEmbeddingSender()
    receiver = NixlWriteEmbeddingReceiver(buffer_size=128)
    try:
        held = [await _receive_held(sender, receiver, torch.full((n,), n / 2)) for n in (8, 8, 16)]
        assert [offset for _, offset in held] == [0, 32, 64]  # 32 + 32 + 64 bytes: full
        receiver.release_tensor(held[0][0])
        _, offset = await _receive_held(sender, receiver, torch.arange(8, dtype=torch.float32))
        assert offset == 0  # wrapped to the start
    finally:
        sender.close()


async def test_nixl_write_receiver_serves_steady_batches_without_waiting() -> None:
    """Batches of 64 bytes, each released after the next arrives, in a 192-byte buffer."""
    sender = NixlWriteEmbeddingSender()
    receiver = NixlWriteEmbeddingReceiver(buffer_size=192)
    try:
        previous: list[int] = []
        for batch in range(12):
            current = [
                (await _receive_held(sender, receiver, torch.full((n,), float(batch))))[0]
                for n in ((16,), (8, 8), (4, 12))[batch % 3]
            ]
            for tensor_id in previous:
                receiver.release_tensor(tensor_id)
            previous = current
    finally:
        sender.close()


async def test_nixl_write_receiver_pieces_take_any_dtype_view() -> None:
    """Pieces start aligned: a float64 tensor right after three bfloat16 values still views."""
    sender = NixlWriteEmbeddingSender()
    receiver = NixlWriteEmbeddingReceiver(buffer_size=64)
    try:
        sources = [
            torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16),  # 6 bytes
            torch.tensor([0.1, 0.2], dtype=torch.float64),
            torch.tensor([7, -9], dtype=torch.int64),
            torch.tensor([1 + 2j], dtype=torch.complex128),
        ]
        offsets = [(await _receive_held(sender, receiver, source))[1] for source in sources]
        assert offsets == [0, 16, 32, 48]
    finally:
        sender.close()


async def test_nixl_read_of_memory_the_sender_does_not_expose_fails_clearly() -> None:
    sender = NixlReadEmbeddingSender()
    receiver = NixlReadEmbeddingReceiver(max_items=0)
    try:
        request, done = await sender.send_embeddings(torch.ones(8))
        moved = dict(
            request.serialized_request, address=request.serialized_request["address"] + (1 << 30)
        )
        altered = request.model_copy(update={"serialized_request": moved})
        with pytest.raises(RuntimeError, match="the sender does not expose 32 bytes at address"):
            await receiver.receive_embeddings(altered)
        # The receiver told the sender, which dropped the tensor: its awaitable completes.
        await asyncio.wait_for(done, 10)
    finally:
        sender.close()


# -- NIXL between two processes ------------------------------------------------------------


@pytest.fixture(scope="module")
def peer() -> Iterator[NixlPeer]:
    process = NixlPeer.start()
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture
async def write_sender() -> AsyncIterator[NixlWriteEmbeddingSender]:
    sender = NixlWriteEmbeddingSender()
    yield sender
    sender.close()


@pytest.fixture
async def read_sender() -> AsyncIterator[NixlReadEmbeddingSender]:
    sender = NixlReadEmbeddingSender()
    yield sender
    sender.close()


_CASES = [
    (torch.float32, (16, 32), False),
    (torch.bfloat16, (3, 7, 5), True),
    (torch.int64, (9,), False),
    (torch.float16, (33, 3), True),
]


async def test_nixl_write_moves_tensors_to_another_process(
    peer: NixlPeer, write_sender: NixlWriteEmbeddingSender
) -> None:
    await peer.call("create", name="w", kind="write_receiver", kwargs={"buffer_size": 1 << 16})
    received_ids = []
    for index, (dtype, shape, stage) in enumerate(_CASES):
        source = _embeddings(dtype, shape, seed=index)
        request, done = await write_sender.send_embeddings(source, stage_embeddings=stage)
        assert request.embeddings_shape == list(shape)
        assert request.embedding_dtype_str == torch_dtype_to_string(dtype)
        # Unstaged sends work on a copy, so the caller's tensor is free at once.
        assert done.done() is not stage
        reply = await peer.call("receive", name="w", request=request.model_dump_json())
        await asyncio.wait_for(done, 30)
        assert reply["dtype"] == torch_dtype_to_string(dtype)
        assert reply["shape"] == list(shape)
        assert reply["data"] == tensor_bytes(source)
        received_ids.append(reply["tensor_id"])
    assert write_sender.transfer_tracker == {}  # every registration dropped
    assert await peer.call("ring_live_count", name="w") == len(_CASES)
    for tensor_id in received_ids:
        await peer.call("release", name="w", tensor_id=tensor_id)
    assert await peer.call("ring_live_count", name="w") == 0
    with pytest.raises(PeerError, match="unknown tensor_id") as caught:
        await peer.call("release", name="w", tensor_id=received_ids[0])
    assert caught.value.type_name == "UnknownTensorIdError"


async def test_nixl_write_replayed_request_fails_fast_with_the_reason(
    peer: NixlPeer, write_sender: NixlWriteEmbeddingSender
) -> None:
    await peer.call("create", name="replay", kind="write_receiver", kwargs={"buffer_size": 4096})
    request, _ = await write_sender.send_embeddings(torch.arange(10, dtype=torch.int32))
    first = await peer.call("receive", name="replay", request=request.model_dump_json())
    await peer.call("release", name="replay", tensor_id=first["tensor_id"])
    # The sender already wrote tensor 0: it answers the second handshake with an error
    # instead of leaving the receiver to time out.
    with pytest.raises(PeerError, match="no embeddings pending for tensor_id 0") as caught:
        await peer.call("receive", name="replay", request=request.model_dump_json(), timeout=20)
    assert caught.value.type_name == "RuntimeError"
    assert await peer.call("ring_live_count", name="replay") == 0


async def test_nixl_write_from_another_process_into_this_one(peer: NixlPeer) -> None:
    """The other direction: the peer sends (staged) and this process receives."""
    await peer.call("create", name="ws", kind="write_sender")
    receiver = NixlWriteEmbeddingReceiver(buffer_size=1 << 14)
    source = _embeddings(torch.float32, (12, 12), seed=42)
    sent = await peer.call(
        "send",
        name="ws",
        data=tensor_bytes(source),
        dtype="float32",
        shape=[12, 12],
        stage=True,
    )
    request = TransferRequest.model_validate_json(sent["request"])
    tensor_id, received = await receiver.receive_embeddings(request)
    await peer.call("send_done", key=sent["key"])
    assert tensor_bytes(received) == tensor_bytes(source)
    receiver.release_tensor(tensor_id)
    assert receiver.ring_buffer.live_count == 0


async def test_nixl_read_moves_tensors_to_another_process(
    peer: NixlPeer, read_sender: NixlReadEmbeddingSender
) -> None:
    # Two slots of 512 bytes: small tensors use them, larger ones get their own buffer.
    await peer.call(
        "create",
        name="r",
        kind="read_receiver",
        kwargs={"embedding_hidden_size": 128, "max_item_mm_token": 4, "max_items": 2},
    )
    cases = [
        (torch.float32, (4, 32), False),  # 512 bytes: a slot
        (torch.bfloat16, (3, 5), True),  # 30 bytes: the other slot
        (torch.float32, (40, 40), False),  # 6400 bytes: a dedicated buffer
        (torch.int64, (5,), True),  # slots busy: a dedicated buffer
    ]
    received_ids = []
    for index, (dtype, shape, stage) in enumerate(cases):
        source = _embeddings(dtype, shape, seed=100 + index)
        request, done = await read_sender.send_embeddings(source, stage_embeddings=stage)
        assert isinstance(request.serialized_request, dict)
        reply = await peer.call("receive", name="r", request=request.model_dump_json())
        # The sender learns of the READ from the receiver's notification.
        await asyncio.wait_for(done, 30)
        assert reply["shape"] == list(shape)
        assert reply["data"] == tensor_bytes(source)
        received_ids.append(reply["tensor_id"])
    assert received_ids == sorted(received_ids)
    for tensor_id in received_ids:
        await peer.call("release", name="r", tensor_id=tensor_id)
    with pytest.raises(PeerError, match=f"unknown tensor_id {received_ids[-1]}"):
        await peer.call("release", name="r", tensor_id=received_ids[-1])
    # Released slots are reused.
    source = _embeddings(torch.float32, (2, 2), seed=7)
    request, done = await read_sender.send_embeddings(source)
    reply = await peer.call("receive", name="r", request=request.model_dump_json())
    await asyncio.wait_for(done, 30)
    assert reply["data"] == tensor_bytes(source)
    await peer.call("release", name="r", tensor_id=reply["tensor_id"])


async def test_nixl_read_request_with_a_wrong_dtype_is_refused_in_the_peer(
    peer: NixlPeer, read_sender: NixlReadEmbeddingSender
) -> None:
    await peer.call("create", name="r2", kind="read_receiver", kwargs={"max_items": 0})
    request, _ = await read_sender.send_embeddings(torch.ones(4, 4))
    wrong = request.model_copy(update={"embedding_dtype_str": "float64"})
    with pytest.raises(
        PeerError, match="'float64' describes 128 bytes, but sender tensor_id 0 holds 64"
    ):
        await peer.call("receive", name="r2", request=wrong.model_dump_json())


# -- CUDA variants (sender tensors in device memory, receivers in host memory) ----------------


@pytest.mark.gpu
@needs_cuda
async def test_nixl_write_of_a_cuda_tensor(
    peer: NixlPeer, write_sender: NixlWriteEmbeddingSender
) -> None:
    await peer.call("create", name="wg", kind="write_receiver", kwargs={"buffer_size": 1 << 16})
    source = _embeddings(torch.bfloat16, (64, 48), seed=5).cuda()
    request, done = await write_sender.send_embeddings(source, stage_embeddings=True)
    reply = await peer.call("receive", name="wg", request=request.model_dump_json())
    await asyncio.wait_for(done, 30)
    assert reply["data"] == tensor_bytes(source)
    await peer.call("release", name="wg", tensor_id=reply["tensor_id"])


@pytest.mark.gpu
@needs_cuda
async def test_nixl_read_of_a_cuda_tensor(
    peer: NixlPeer, read_sender: NixlReadEmbeddingSender
) -> None:
    await peer.call("create", name="rg", kind="read_receiver", kwargs={"max_items": 0})
    source = _embeddings(torch.float16, (32, 96), seed=6).cuda()
    request, done = await read_sender.send_embeddings(source)
    reply = await peer.call("receive", name="rg", request=request.model_dump_json())
    await asyncio.wait_for(done, 30)
    assert reply["data"] == tensor_bytes(source)
    await peer.call("release", name="rg", tensor_id=reply["tensor_id"])
