"""An S3 server that checks every request's SigV4 signature, for the tests in which a wrong
secret key must be refused (moto accepts any signature): versitygw, built by
hack/build-versitygw, serving a directory through its posix backend.

`versitygw_binary()` finds the binary (`$DYNAMO_VERSITYGW_BIN`, else the test bed's cache
keyed by the version hack/versions.env pins). `sigv4_s3_server(workdir, host)` runs it on a
free port of `host` with credentials of its own and yields a `support.s3.S3Server` that holds
the right ones; the test skips, saying how to build it, when there is no binary. Its access
log counts what it served: `object_reads(server)`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from support.cluster import REPO
from support.operator_process import free_port
from support.s3 import REGION, S3Server, s3_server_at

sys.path.insert(0, str(REPO / "hack"))
from testbed.layout import read_versions

ACCESS_KEY = "sigv4-tester"
START_SECONDS = 30.0


def versitygw_binary() -> Path | None:
    """Where hack/build-versitygw leaves versitygw, or None when it has not been built."""
    if os.environ.get("DYNAMO_VERSITYGW_BIN"):
        return Path(os.environ["DYNAMO_VERSITYGW_BIN"])
    cache = Path(
        os.environ.get("DYNAMO_TESTBED_CACHE")
        or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dynamo-testbed"
    )
    built = cache / "bin" / f"versitygw-{read_versions()['VERSITYGW_VERSION']}" / "versitygw"
    return built if built.is_file() else None


@contextmanager
def sigv4_s3_server(workdir: Path, host: str = "127.0.0.1") -> Iterator[S3Server]:
    """versitygw on `host`, its buckets and log under `workdir`; stopped on exit."""
    binary = versitygw_binary()
    if binary is None or not binary.is_file():
        pytest.skip("needs versitygw: run hack/build-versitygw or set DYNAMO_VERSITYGW_BIN")
    port = free_port()
    buckets = workdir / "buckets"
    buckets.mkdir(parents=True)
    log = workdir / "versitygw.log"
    access_log = workdir / "access.log"
    server = dataclasses.replace(
        s3_server_at(f"http://{host}:{port}", key=ACCESS_KEY, secret=uuid.uuid4().hex),
        access_log=access_log,
    )
    # The root credentials go through the environment, so that no process listing shows them.
    env = {
        **os.environ,
        "ROOT_ACCESS_KEY_ID": ACCESS_KEY,
        "ROOT_SECRET_ACCESS_KEY": server.env["AWS_SECRET_ACCESS_KEY"],
    }
    argv = [str(binary), "--port", f"{host}:{port}", "--region", REGION,
            "--access-log", str(access_log), "posix", str(buckets)]  # fmt: skip
    with log.open("wb") as out:
        process = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_listening(process, host, port, log)
        yield server
    finally:
        process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=20)
        process.kill()  # nothing happens once it has exited
        process.wait()


# A successful GetObject in versitygw's access log: its operation, the key, the request URI
# (which may hold spaces), then the HTTP status.
_OBJECT_READ = re.compile(r" s3_GetObject (\S+) .*? (\d{3}) ")


def object_reads(server: S3Server) -> dict[str, int]:
    """The successful GetObject requests the server answered, per object key, as its own
    access log counts them (a ranged read of a large object counts once per range)."""
    assert server.access_log is not None, "this S3 server keeps no access log"
    counts: Counter[str] = Counter()
    for line in server.access_log.read_text(errors="replace").splitlines():
        found = _OBJECT_READ.search(line)
        if found is not None and found.group(2) == "200":
            counts[found.group(1)] += 1
    return dict(counts)


def _wait_listening(process: subprocess.Popen[bytes], host: str, port: int, log: Path) -> None:
    deadline = time.monotonic() + START_SECONDS
    while True:
        if process.poll() is not None:
            raise AssertionError(f"versitygw exited: {log.read_text(errors='replace')}")
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                tail = log.read_text(errors="replace")
                raise AssertionError(f"versitygw not listening on {host}:{port}: {tail}") from None
            time.sleep(0.1)
