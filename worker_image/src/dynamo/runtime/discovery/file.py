"""The file discovery backend: upstream Dynamo's `--discovery-backend file` layout.

Upstream processes sharing a folder (`$DYN_FILE_KV`) find each other through it:

* one folder per bucket: `v1/instances` (Endpoint records), `v1/mdc` (model cards),
  `v1/event_channels` and `v1/event_sources` (event-plane publishers);
* one file per record directly in its bucket, named by the record's logical key (e.g.
  `dynamo/backend/generate/43710f49c0cff`, an adapter card adds `/<slug>`) percent-encoded
  like Rust's `NON_ALPHANUMERIC` set: every byte but ASCII letters and digits becomes `%XX`;
* the content is the record's compact JSON, written to a `.tmp_*` file in the bucket (readers
  ignore those) and renamed into place, under an exclusive `flock` on the bucket folder, so a
  reader never sees a partial record;
* liveness is the file's mtime: readers delete records untouched for 10 s, so the owner
  touches its files at least every 3 s;
* readers accept a card rewritten in place only when just its `runtime_config.taints`
  changed; any other change is published as delete + create.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import fcntl
import json
import logging
import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dynamo.runtime.discovery.base import WorkerAdvertisement
from dynamo.runtime.discovery.records import (
    ENDPOINTS,
    EVENT_CHANNELS,
    EVENT_SOURCES,
    MODEL_CARDS,
    build_metadata,
    without_taints,
)

log = logging.getLogger(__name__)

INSTANCES = "v1/instances"
MDC = "v1/mdc"
CHANNELS = "v1/event_channels"
SOURCES = "v1/event_sources"
TOUCH_INTERVAL_S = 3.0  # readers expire records after 10 s without a touch
_BUCKET_OF = {
    ENDPOINTS: INSTANCES,
    MODEL_CARDS: MDC,
    EVENT_CHANNELS: CHANNELS,
    EVENT_SOURCES: SOURCES,
}

Record = tuple[str, str]  # (bucket, logical key)


def encode_key(key: str) -> str:
    """A logical key as a file name: every byte outside [A-Za-z0-9] becomes upper-case `%XX`."""
    return "".join(
        chr(byte) if chr(byte).isascii() and chr(byte).isalnum() else f"%{byte:02X}"
        for byte in key.encode("utf-8")
    )


def decode_key(name: str) -> str:
    """The logical key a file name encodes (the inverse of `encode_key`)."""
    out = bytearray()
    index = 0
    while index < len(name):
        if name[index] == "%":
            out.append(int(name[index + 1 : index + 3], 16))
            index += 3
        else:
            out.extend(name[index].encode("utf-8"))
            index += 1
    return out.decode("utf-8")


class FileBackend:
    """Publishes this worker's records as files under `root` and keeps them alive."""

    def __init__(self, root: str | Path, *, touch_interval: float = TOUCH_INTERVAL_S) -> None:
        self.root = Path(root)
        self.touch_interval = touch_interval
        self._on_disk: dict[Record, dict[str, Any]] = {}
        self._metadata: dict[str, Any] | None = None
        self._withdrawn = False
        self._lock = asyncio.Lock()  # one mutation (or touch round) queued at a time
        # The file work runs in threads; this keeps two of them (say, a touch round whose
        # awaiting task was cancelled, and close) from interleaving.
        self._files_lock = threading.Lock()
        self._stop = asyncio.Event()
        self._toucher: asyncio.Task[None] | None = None

    def path(self, bucket: str, key: str) -> Path:
        """Where the record `key` of `bucket` lives."""
        return self.root / bucket / encode_key(key)

    async def register(self, advertisement: WorkerAdvertisement) -> None:
        """Write the model cards, then the Endpoint record; start the liveness touches."""
        self._withdrawn = False
        await self._publish(await build_metadata(advertisement))
        self._start_touches()

    async def update(self, advertisement: WorkerAdvertisement) -> None:
        """Bring the files in line with `advertisement` (cards added, removed, changed)."""
        await self._publish(await build_metadata(advertisement))
        self._start_touches()

    async def unregister(self) -> None:
        """Delete the Endpoint record first (routing stops); the cards stay until `close`."""
        self._withdrawn = True
        if self._metadata is not None:
            await self._publish(self._metadata)

    async def close(self) -> None:
        """Stop the touches and delete every record this backend wrote (Endpoint first)."""
        if self._toucher is not None:
            self._stop.set()
            await self._toucher  # lets a touch round in progress finish
            self._toucher = None
        async with self._lock:
            await asyncio.to_thread(self._apply, {})
        self._metadata = None

    def metadata(self) -> dict[str, Any] | None:
        """A copy of what is published now, or None before register / after close."""
        return copy.deepcopy(self._metadata)

    async def _publish(self, metadata: dict[str, Any]) -> None:
        metadata = copy.deepcopy(metadata)
        if self._withdrawn:
            metadata[ENDPOINTS] = {}
        wanted: dict[Record, dict[str, Any]] = {}
        for section, bucket in _BUCKET_OF.items():
            for key, record in metadata.get(section, {}).items():
                wanted[(bucket, key)] = record
        async with self._lock:
            await asyncio.to_thread(self._apply, wanted)
        self._metadata = metadata

    def _start_touches(self) -> None:
        if self._toucher is None or self._toucher.done():
            self._stop.clear()
            self._toucher = asyncio.create_task(self._touch_forever(), name="discovery-touch")

    def _apply(self, wanted: dict[Record, dict[str, Any]]) -> None:
        with self._files_lock:
            self._apply_locked(wanted)

    def _apply_locked(self, wanted: dict[Record, dict[str, Any]]) -> None:
        """Make the files equal `wanted`, in the order readers need: withdraw Endpoint records
        before cards, and write cards before the Endpoint record that makes them routable."""
        current = self._on_disk
        gone = [record for record in current if record not in wanted]
        recreate = [
            record
            for record, value in wanted.items()
            if record in current
            and current[record] != value
            and record[0] == MDC
            and without_taints(current[record]) != without_taints(value)
        ]
        for record in sorted(gone + recreate, key=lambda r: r[0] != INSTANCES):
            self._delete(*record)
            current.pop(record, None)
        for record in sorted(wanted, key=lambda r: r[0] == INSTANCES):
            if current.get(record) != wanted[record]:
                self._write(*record, wanted[record])
                current[record] = copy.deepcopy(wanted[record])

    def _write(self, bucket: str, key: str, record: dict[str, Any]) -> None:
        folder = self.root / bucket
        folder.mkdir(parents=True, exist_ok=True)
        data = json.dumps(record, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        with _bucket_lock(folder):
            fd, temp = tempfile.mkstemp(prefix=".tmp_", dir=folder)
            try:
                with os.fdopen(fd, "wb") as handle:
                    handle.write(data)
                    os.fchmod(handle.fileno(), 0o644)  # readers may run as another user
                os.replace(temp, folder / encode_key(key))
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(temp)
                raise

    def _delete(self, bucket: str, key: str) -> None:
        folder = self.root / bucket
        if not folder.is_dir():
            return
        with _bucket_lock(folder), contextlib.suppress(FileNotFoundError):
            os.unlink(folder / encode_key(key))

    def _touch_all(self) -> None:
        with self._files_lock:
            for (bucket, key), record in list(self._on_disk.items()):
                try:
                    os.utime(self.path(bucket, key))
                except FileNotFoundError:
                    # A reader expired it (this process was paused past the TTL): restore it.
                    log.warning("discovery record %s/%s vanished; writing it again", bucket, key)
                    self._write(bucket, key, record)

    async def _touch_forever(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._stop.wait(), self.touch_interval)
                return  # close() asked us to stop
            except TimeoutError:
                pass  # time for the next round
            async with self._lock:
                try:
                    await asyncio.to_thread(self._touch_all)
                except OSError:
                    log.exception("could not refresh the discovery records under %s", self.root)


@contextlib.contextmanager
def _bucket_lock(folder: Path) -> Iterator[None]:
    """Hold the exclusive flock upstream takes on a bucket folder while changing it."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
