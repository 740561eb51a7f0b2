"""Container output as a kubelet keeps it. Each run of a container writes its stdout and
stderr to `logs/<container>/<n>.log` in the CRI log format (`<RFC3339 time> <stream> <P|F>
<text>`, P marking a partial line), which the kubelet API (hack/testbed/kubelet) serves to
`kubectl logs`; the raw output also goes to `<container>.log`, every run appended."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from pathlib import Path
from typing import BinaryIO

# Longer lines are split into partial records, as container runtimes do (16 KiB).
MAX_RECORD = 16 * 1024
CHUNK = 64 * 1024


def timestamp() -> bytes:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ").encode()


def records(stream: str, pending: bytes, chunk: bytes, now: bytes) -> tuple[list[bytes], bytes]:
    """The CRI records for `chunk` read after `pending` (the unterminated tail of earlier
    reads), and the new unterminated tail. An empty chunk means end of stream: the tail goes
    out as a partial record."""
    data = pending + chunk
    out: list[bytes] = []
    head = now + b" " + stream.encode() + b" "
    while True:
        line, newline, rest = data.partition(b"\n")
        if newline and len(line) <= MAX_RECORD:
            out.append(head + b"F " + line + b"\n")
            data = rest
        elif len(data) > MAX_RECORD:
            out.append(head + b"P " + data[:MAX_RECORD] + b"\n")
            data = data[MAX_RECORD:]
        else:
            break
    if not chunk and data:
        out.append(head + b"P " + data + b"\n")
        data = b""
    return out, data


async def _copy(reader: asyncio.StreamReader, stream: str, raw: BinaryIO, cri: BinaryIO) -> None:
    pending = b""
    while True:
        chunk = await reader.read(CHUNK)
        if chunk:
            raw.write(chunk)
            raw.flush()
        lines, pending = records(stream, pending, chunk, timestamp())
        cri.writelines(lines)
        cri.flush()
        if not chunk:
            return


async def copy_output(process: asyncio.subprocess.Process, raw_log: Path, cri_log: Path) -> None:
    """Copy the process's stdout and stderr (pipes) into its logs until both close."""
    if process.stdout is None or process.stderr is None:
        raise ValueError("copy_output needs a process started with stdout and stderr PIPE")
    cri_log.parent.mkdir(parents=True, exist_ok=True)
    with raw_log.open("ab") as raw, cri_log.open("ab") as cri:
        await asyncio.gather(
            _copy(process.stdout, "stdout", raw, cri), _copy(process.stderr, "stderr", raw, cri)
        )


async def finish(copying: asyncio.Task[None], within: float = 2.0) -> None:
    """Wait for the copy to drain what the exited process wrote; a child it left behind
    holding the pipes open is not waited for."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(copying), within)
    copying.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await copying
