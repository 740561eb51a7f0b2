"""The ring buffer behind the NIXL WRITE receiver: upstream's allocation semantics.

Allocation is contiguous and packed; when the space at the end is too short a piece starts
again at offset 0 if the space before the oldest live piece suffices; releases may come in
any order and are reclaimed as the oldest live piece is freed; an empty buffer starts at 0.
`ReferenceRing` states those rules over plain intervals, and a property test holds the real
`RingBuffer` to it. Where upstream's 1.6.1 venv can import its own RingBuffer, the same
sequences run on both and must give the same offsets.
"""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sysconfig
from dataclasses import dataclass, field
from typing import Literal

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo.common.multimodal.embedding_transfer import RingBuffer
from support.upstream import upstream_python

pytestmark = pytest.mark.unit


def _offset(ring: RingBuffer, view: torch.Tensor | None) -> int | None:
    return None if view is None else view.data_ptr() - ring.buffer_tensor.data_ptr()


def _take(ring: RingBuffer, size: int) -> tuple[int, int]:
    """Allocate `size` bytes, which must succeed: its (buffer_id, offset)."""
    buffer_id, view = ring.get_buffer(size)
    assert buffer_id is not None, f"{size} bytes refused by {ring!r}"
    assert view is not None
    assert view.numel() == size
    offset = _offset(ring, view)
    assert offset is not None
    return buffer_id, offset


# -- the cases the issue names ----------------------------------------------------------------


def test_pieces_are_packed_back_to_back() -> None:
    ring = RingBuffer(128)
    assert [_take(ring, size)[1] for size in (32, 32, 64)] == [0, 32, 64]
    assert ring.get_buffer(1) == (None, None)  # exactly full


def test_a_piece_wraps_to_the_start_once_the_oldest_is_released() -> None:
    ring = RingBuffer(128)
    first, _ = _take(ring, 32)
    _take(ring, 32)
    _take(ring, 64)
    ring.release_buffer(first)
    assert _take(ring, 32)[1] == 0
    assert ring.get_buffer(1) == (None, None)


@pytest.mark.parametrize("batch", [[64], [32, 32], [16, 48], [8, 8, 48], [1, 63]])
def test_steady_batches_with_the_previous_one_released_never_fail(batch: list[int]) -> None:
    ring = RingBuffer(192)
    previous: list[int] = []
    for _ in range(200):
        current = [_take(ring, size)[0] for size in batch]
        for buffer_id in previous:
            ring.release_buffer(buffer_id)
        previous = current
    assert ring.live_count == len(batch)


def test_out_of_order_releases_are_reclaimed_with_the_oldest() -> None:
    ring = RingBuffer(96)
    a, _ = _take(ring, 32)
    b, _ = _take(ring, 32)
    _take(ring, 32)
    # Releasing a younger piece first frees nothing yet: space comes back oldest first.
    ring.release_buffer(b)
    assert ring.get_buffer(1) == (None, None)
    assert ring.live_count == 2
    # Releasing the oldest reclaims it and the already released piece after it.
    ring.release_buffer(a)
    assert _take(ring, 64)[1] == 0


def test_wrapped_pieces_only_use_the_space_before_the_oldest() -> None:
    ring = RingBuffer(100)
    a, _ = _take(ring, 40)
    _take(ring, 40)
    ring.release_buffer(a)
    # 20 bytes left at the end: 30 restarts at 0, before the oldest live piece (at 40).
    assert _take(ring, 30)[1] == 0
    # Wrapped: the 20 bytes at the end stay unused until the pieces before them are reclaimed.
    assert ring.get_buffer(11) == (None, None)
    assert _take(ring, 10)[1] == 30


def test_an_empty_buffer_starts_again_at_offset_zero() -> None:
    ring = RingBuffer(256)
    a, _ = _take(ring, 100)
    b, _ = _take(ring, 50)
    ring.release_buffer(b)
    ring.release_buffer(a)
    assert ring.live_count == 0
    assert _take(ring, 256)[1] == 0  # the whole buffer, though the last piece ended at 150


def test_impossible_sizes_and_unknown_ids() -> None:
    ring = RingBuffer(256)
    assert ring.get_buffer(257) == (None, None)
    with pytest.raises(ValueError, match="size must be positive"):
        ring.get_buffer(0)
    with pytest.raises(ValueError, match="buffer_size must be a positive byte count"):
        RingBuffer(0)
    buffer_id, _ = _take(ring, 8)
    ring.release_buffer(12345)  # unknown ids are ignored
    ring.release_buffer(buffer_id)
    ring.release_buffer(buffer_id)  # and so are ids already released
    assert ring.live_count == 0


# -- the semantics as a reference model -------------------------------------------------------


@dataclass
class ReferenceRing:
    """Unreclaimed pieces as [start, end, live] intervals, oldest first.

    The free space is the arc from the newest piece's end (the head) to the oldest piece's
    start, going round the end of the buffer. A piece is contiguous, so it takes the part
    of that arc up to the end of the buffer if it fits there, else the part from offset 0.
    """

    size: int
    pieces: list[list[int]] = field(default_factory=list)

    def allocate(self, size: int) -> int | None:
        if not self.pieces:
            start = 0 if size <= self.size else None
        else:
            oldest, head = self.pieces[0][0], self.pieces[-1][1]
            if head <= oldest:  # the arc does not cross the end: [head, oldest)
                start = head if head + size <= oldest else None
            elif head + size <= self.size:  # [head, end) then [0, oldest)
                start = head
            else:
                start = 0 if size <= oldest else None
        if start is not None:
            self.pieces.append([start, start + size, 1])
        return start

    def release(self, index: int) -> None:
        """Release the `index`-th live piece, oldest first."""
        live = [piece for piece in self.pieces if piece[2]]
        live[index][2] = 0
        while self.pieces and not self.pieces[0][2]:
            self.pieces.pop(0)


Op = tuple[Literal["alloc", "release"], int]

_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(1, 96)),
        st.tuples(st.just("release"), st.integers(0, 1000)),
    ),
    max_size=80,
)


def _run(buffer_size: int, ops: list[Op]) -> list[int | None]:
    """Apply `ops` to a RingBuffer, checking it against ReferenceRing at every step.

    A release's number picks a live piece (modulo how many are live); with none live it is
    skipped. Returns the offset (or None) of every allocation.
    """
    ring = RingBuffer(buffer_size)
    model = ReferenceRing(buffer_size)
    # (buffer_id, offset, view, tag) of every live piece, oldest first.
    live: list[tuple[int, int, torch.Tensor, int]] = []
    outcomes: list[int | None] = []
    for step, (kind, value) in enumerate(ops):
        if kind == "release":
            if live:
                index = value % len(live)
                ring.release_buffer(live.pop(index)[0])
                model.release(index)
            continue
        buffer_id, view = ring.get_buffer(value)
        offset = _offset(ring, view)
        assert offset == model.allocate(value), f"step {step}: {ring!r} vs {model}"
        outcomes.append(offset)
        if buffer_id is not None and view is not None:
            assert view.numel() == value
            assert offset is not None
            assert 0 <= offset <= buffer_size - value
            tag = step % 127 + 1
            view.fill_(tag)
            live.append((buffer_id, offset, view, tag))
        # No two live pieces overlap, by their offsets and by what each still holds.
        spans = sorted((start, piece.numel()) for _, start, piece, _ in live)
        for (start, length), (next_start, _) in itertools.pairwise(spans):
            assert start + length <= next_start, f"step {step}: overlapping pieces {spans}"
        for _, _, piece, piece_tag in live:
            assert bool((piece == piece_tag).all()), f"step {step}: a piece was overwritten"
        assert ring.live_count == len(live)
    return outcomes


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 256), _OPS)
def test_ring_buffer_follows_the_reference_model(buffer_size: int, ops: list[Op]) -> None:
    _run(buffer_size, ops)


@given(st.integers(1, 256), st.lists(st.integers(1, 64), max_size=40))
def test_allocations_that_fit_never_fail_when_each_is_released_at_once(
    buffer_size: int, sizes: list[int]
) -> None:
    # Nothing is live before each allocation, so every size up to the buffer's fits, at 0.
    ring = RingBuffer(buffer_size)
    for size in sizes:
        buffer_id, view = ring.get_buffer(size)
        if size > buffer_size:
            assert buffer_id is None
            continue
        assert buffer_id is not None
        assert _offset(ring, view) == 0
        ring.release_buffer(buffer_id)


# -- against upstream's 1.6.1 RingBuffer -------------------------------------------------------

# Runs in upstream's venv. That venv has no torch (hack/oracle-venv leaves it out), so this
# project's venv is appended to sys.path: upstream's own packages still win, torch comes from
# ours. The module is loaded from its file because `dynamo.common.multimodal`'s __init__
# imports redis, which the oracle venv does not have either.
_UPSTREAM_DRIVER = """
import importlib.util, json, sys
from pathlib import Path
sys.path.append(sys.argv[1])
import dynamo.common
path = Path(dynamo.common.__file__).parent / "multimodal" / "embedding_transfer.py"
spec = importlib.util.spec_from_file_location("upstream_embedding_transfer", path)
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
spec.loader.exec_module(module)
results = []
for case in json.load(sys.stdin):
    ring = module.RingBuffer(case["size"])
    live, offsets = [], []
    for kind, value in case["ops"]:
        if kind == "release":
            if live:
                ring.release_buffer(live.pop(value % len(live)))
            continue
        buffer_id, view = ring.get_buffer(value)
        if buffer_id is None:
            offsets.append(None)
        else:
            offsets.append(view.data_ptr() - ring.buffer_tensor.data_ptr())
            live.append(buffer_id)
    results.append(offsets)
print(json.dumps(results))
"""


def _random_cases(count: int, seed: int) -> list[tuple[int, list[Op]]]:
    rng = random.Random(seed)
    cases: list[tuple[int, list[Op]]] = []
    for _ in range(count):
        ops: list[Op] = [
            ("alloc", rng.randint(1, 96))
            if rng.random() < 0.55
            else ("release", rng.randint(0, 999))
            for _ in range(rng.randint(0, 60))
        ]
        cases.append((rng.randint(1, 256), ops))
    return cases


def test_same_offsets_as_upstreams_ring_buffer() -> None:
    python = upstream_python()
    cases: list[tuple[int, list[Op]]] = [
        (128, [("alloc", 32), ("alloc", 32), ("alloc", 64), ("release", 0), ("alloc", 32)]),
        (192, [("alloc", 32), ("alloc", 32), ("release", 0), ("release", 0)] * 20),
        (96, [("alloc", 32), ("alloc", 32), ("alloc", 32), ("release", 1), ("alloc", 1)]),
        *_random_cases(500, seed=16),
    ]
    ran = subprocess.run(
        [str(python), "-c", _UPSTREAM_DRIVER, sysconfig.get_paths()["purelib"]],
        input=json.dumps([{"size": size, "ops": ops} for size, ops in cases]),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if ran.returncode != 0:
        pytest.skip(f"upstream's RingBuffer does not load in {python}:\n{ran.stderr[-2000:]}")
    upstream = json.loads(ran.stdout)
    for (size, ops), theirs in zip(cases, upstream, strict=True):
        assert _run(size, ops) == theirs, f"RingBuffer({size}) with {ops}"
