"""The model cache (issue 29): `dynamo-model-cache fill` and `prune` as the operator's Job runs
them (a subprocess, against a real S3 server on loopback), the completeness contract, and a
worker that must load from the cache (`DYN_MODEL_CACHE_REQUIRED`)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import pytest

from dynamo.common.lora.errors import LoRADownloadError
from dynamo.common.lora.s3_source import S3Object
from dynamo.runtime import cli, model_cache
from dynamo.runtime.model_cache import MARKER, ExpectedFile, cache_key
from support.counting_proxy import counting_proxy
from support.fake_hf_hub import FakeHub, running_hub
from support.s3 import S3Server
from support.s3_sigv4 import sigv4_s3_server

pytestmark = pytest.mark.unit

FILES = {
    "config.json": b'{"model_type": "llama"}',
    "tokenizer.json": b"{}",
    "weights/model-00001-of-00002.safetensors": b"0123456789" * 1000,
    "weights/model-00002-of-00002.safetensors": b"abcdef" * 500,
}
TOTAL = sum(len(content) for content in FILES.values())
#: `dynamo-model-cache`, run from this venv without reinstalling the project for the script.
TOOL = (sys.executable, "-m", "dynamo.runtime.model_cache_cli")
# Variables of the host that would change what the subprocess does.
_DROPPED_ENV = (
    "AWS_ENDPOINT",
    "AWS_ENDPOINT_URL_S3",
    "AWS_PROFILE",
    "AWS_SESSION_TOKEN",
    model_cache.MODEL_CACHE_ENV,
    model_cache.REQUIRED_ENV,
)


@pytest.fixture
def closed_port() -> str:
    """An endpoint on loopback where nothing listens (connections are refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def s3_env(s3_server: S3Server, tmp_path: Path) -> dict[str, str]:
    """The environment of a fill Job pointed at the loopback S3 server."""
    env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV}
    env |= s3_server.env
    env["AWS_ALLOW_HTTP"] = "true"
    env["DYN_TERMINATION_LOG"] = str(tmp_path / "termination-log")
    return env


@pytest.fixture
def source(s3_server: S3Server) -> str:
    bucket = s3_server.new_bucket("models")
    s3_server.put_files(bucket, "org/tiny", FILES)
    return f"s3://{bucket}/org/tiny"


def run_tool(
    env: dict[str, str], *args: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*TOOL, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def fill(env: dict[str, str], source: str, cache: Path) -> subprocess.CompletedProcess[str]:
    return run_tool(env, "fill", "--source", source, "--cache", str(cache))


def read_tree(root: Path) -> dict[str, bytes]:
    return {
        path.relative_to(root).as_posix(): path.read_bytes()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


def entries(root: Path) -> list[str]:
    """The names in `root`, sorted; none when it does not exist."""
    return sorted(entry.name for entry in root.iterdir()) if root.exists() else []


def json_lines(stdout: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in stdout.splitlines()]


def termination(env: dict[str, str]) -> dict[str, str]:
    record = json.loads(Path(env["DYN_TERMINATION_LOG"]).read_text())
    assert set(record) == {"reason", "message"}
    return {str(k): str(v) for k, v in record.items()}


def test_cache_key_is_the_operators() -> None:
    # The operator computes the same key from the same string: pinned here.
    assert cache_key("s3://models/org/tiny") == "0d3e327f7f290488"
    assert len(cache_key("anything")) == 16


def test_fill_makes_a_complete_directory_once(
    s3_env: dict[str, str], source: str, tmp_path: Path, closed_port: str
) -> None:
    cache = tmp_path / "cache"
    with counting_proxy(s3_env["AWS_ENDPOINT_URL"]) as proxy:
        done = fill(s3_env | {"AWS_ENDPOINT_URL": proxy.url}, source, cache)
        assert done.returncode == 0, done.stderr
        assert proxy.object_gets() == len(FILES)
        directory = cache / cache_key(source)
        assert [entry.name for entry in cache.iterdir()] == [directory.name]  # nothing partial
        assert read_tree(directory) == FILES | {MARKER: (directory / MARKER).read_bytes()}
        marker = json.loads((directory / MARKER).read_text())
        assert marker["source"] == source
        assert marker["bytes"] == TOTAL
        assert {name: info["size"] for name, info in marker["files"].items()} == {
            name: len(content) for name, content in FILES.items()
        }
        assert all(len(info["etag"]) == 32 for info in marker["files"].values())
        assert json_lines(done.stdout)[-1] == {
            "bytesDone": TOTAL,
            "bytesTotal": TOTAL,
            "complete": True,
            "directory": str(directory),
        }

        # A second fill finds it complete and sends S3 nothing at all.
        before = len(proxy.requests)
        again = fill(s3_env | {"AWS_ENDPOINT_URL": proxy.url}, source, cache)
        assert again.returncode == 0, again.stderr
        assert len(proxy.requests) == before
    assert "already complete" in again.stderr
    assert json_lines(again.stdout) == [json_lines(done.stdout)[-1]]
    # Nor does it need S3 to be there.
    offline = fill(s3_env | {"AWS_ENDPOINT_URL": closed_port}, source, cache)
    assert offline.returncode == 0, offline.stderr
    assert [entry.name for entry in cache.iterdir()] == [directory.name]


def test_progress_lines_about_every_second(
    s3_env: dict[str, str], source: str, tmp_path: Path
) -> None:
    with counting_proxy(s3_env["AWS_ENDPOINT_URL"]) as proxy:
        # Hold the objects back until the fill has reported twice while waiting for them:
        # a condition, not a timer, since the tool's start takes seconds on a busy machine.
        proxy.release_gets.clear()
        fill_process = subprocess.Popen(
            [*TOOL, "fill", "--source", source, "--cache", str(tmp_path / "cache")],
            env=s3_env | {"AWS_ENDPOINT_URL": proxy.url},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert fill_process.stdout is not None
            held_lines = [fill_process.stdout.readline() for _ in range(2)]
            proxy.release_gets.set()
            stdout, stderr = fill_process.communicate(timeout=120)
        finally:
            proxy.release_gets.set()
            fill_process.kill()
            fill_process.wait()
    assert fill_process.returncode == 0, stderr
    lines = json_lines("".join(held_lines) + stdout)
    *progress, last = lines
    assert len(progress) >= 2, lines
    for line in progress:
        assert set(line) == {"bytesDone", "bytesTotal"}
        assert line["bytesTotal"] == TOTAL
        assert 0 <= int(str(line["bytesDone"])) <= TOTAL
    done_bytes = [int(str(line["bytesDone"])) for line in progress]
    assert done_bytes == sorted(done_bytes)
    assert last["complete"] is True
    assert last["bytesDone"] == last["bytesTotal"] == TOTAL


def test_missing_credentials_are_permanent(
    s3_env: dict[str, str], source: str, tmp_path: Path
) -> None:
    env = {k: v for k, v in s3_env.items() if k != "AWS_SECRET_ACCESS_KEY"}
    failed = fill(env, source, tmp_path / "cache")
    assert failed.returncode == 2, failed.stderr
    record = termination(env)
    assert record["reason"] == "auth"
    assert "AWS_SECRET_ACCESS_KEY" in record["message"]
    assert record["message"] in failed.stderr
    assert not (tmp_path / "cache" / cache_key(source)).exists()


@pytest.fixture
def sigv4(tmp_path: Path) -> Iterator[S3Server]:
    with sigv4_s3_server(tmp_path / "versitygw") as server:
        yield server


def test_a_wrong_secret_is_permanent(
    sigv4: S3Server, s3_env: dict[str, str], tmp_path: Path
) -> None:
    bucket = sigv4.new_bucket("models")
    sigv4.put_files(bucket, "org/tiny", FILES)
    source = f"s3://{bucket}/org/tiny"
    env = s3_env | sigv4.env | {"AWS_SECRET_ACCESS_KEY": "not-the-secret"}
    cache = tmp_path / "cache"
    failed = fill(env, source, cache)
    assert failed.returncode == 2, failed.stderr
    record = termination(env)
    assert record["reason"] == "auth"
    assert source in record["message"]
    assert "not-the-secret" not in failed.stderr + failed.stdout + json.dumps(record)
    assert list(cache.iterdir()) == []  # the partial directory went with the failure

    right = fill(s3_env | sigv4.env, source, cache)
    assert right.returncode == 0, right.stderr
    assert read_tree(cache / cache_key(source)).keys() == FILES.keys() | {MARKER}


def test_a_missing_prefix_is_permanent(
    s3_env: dict[str, str], s3_server: S3Server, tmp_path: Path
) -> None:
    source = f"s3://{s3_server.new_bucket('models')}/no/such/model"
    failed = fill(s3_env, source, tmp_path / "cache")
    assert failed.returncode == 2, failed.stderr
    record = termination(s3_env)
    assert record["reason"] == "not found"
    assert source in record["message"]
    assert list((tmp_path / "cache").iterdir()) == []


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ("ftp://host/tiny", "s3:// and hf:// sources only, not ftp://"),
        ("/models/tiny", "s3:// and hf:// sources only, not a local path"),
        ("hf://org/../tiny", "does not name a Hub repository"),
        ("s3://bucket", "empty prefix"),
        ("s3://key:secret@bucket/model", "embeds credentials"),
    ],
)
def test_unsupported_sources_are_permanent(
    s3_env: dict[str, str], tmp_path: Path, source: str, says: str
) -> None:
    failed = fill(s3_env, source, tmp_path / "cache")
    assert failed.returncode == 2, failed.stderr
    record = termination(s3_env)
    assert record["reason"] == "bad uri"
    assert says in record["message"]
    assert "LoRA" not in record["message"]
    assert "secret" not in record["message"]
    assert not (tmp_path / "cache").exists()


def test_an_unreachable_endpoint_is_transient(
    s3_env: dict[str, str], source: str, tmp_path: Path, closed_port: str
) -> None:
    env = s3_env | {"AWS_ENDPOINT_URL": closed_port}
    failed = fill(env, source, tmp_path / "cache")
    assert failed.returncode == 1, failed.stderr
    record = termination(env)
    assert record["reason"] == "download failed"
    assert closed_port in record["message"]
    assert list((tmp_path / "cache").iterdir()) == []


def test_an_unwritable_termination_log_is_ignored(s3_env: dict[str, str], tmp_path: Path) -> None:
    env = s3_env | {"DYN_TERMINATION_LOG": str(tmp_path / "no" / "such" / "dir" / "log")}
    failed = fill(env, "ftp://host/tiny", tmp_path / "cache")
    assert failed.returncode == 2
    assert "bad uri" in failed.stderr


def test_sigterm_stops_the_fill_without_leaving_a_partial_directory(
    s3_env: dict[str, str], source: str, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    with counting_proxy(s3_env["AWS_ENDPOINT_URL"]) as proxy:
        proxy.release_gets.clear()
        env = s3_env | {"AWS_ENDPOINT_URL": proxy.url}
        process = subprocess.Popen(
            [*TOOL, "fill", "--source", source, "--cache", str(cache)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert proxy.object_get_seen.wait(timeout=60), "the fill never fetched an object"
            (partial,) = entries(cache)
            assert partial.startswith(f".{cache_key(source)}.partial-")
            process.send_signal(signal.SIGTERM)
            _, stderr = process.communicate(timeout=60)
        finally:
            proxy.release_gets.set()
            if process.poll() is None:
                process.kill()
                process.wait()
    assert process.returncode == 1, stderr
    assert termination(env)["reason"] == "download failed"
    assert list(cache.iterdir()) == []


def s3_plan(files: dict[str, bytes], etags: dict[str, str]) -> list[ExpectedFile]:
    return [
        ExpectedFile.from_s3(
            S3Object(f"bucket/p/{name}", PurePosixPath(name), len(content), etags.get(name, ""))
        )
        for name, content in files.items()
    ]


@pytest.fixture
def two_files(tmp_path: Path) -> dict[str, bytes]:
    files = {"a.json": b"{}", "w/b.bin": b"weights"}
    for name, content in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(content)
    return files


def test_verify_checks_sizes_and_single_part_etags(
    tmp_path: Path, two_files: dict[str, bytes]
) -> None:
    md5 = {name: hashlib.md5(content).hexdigest() for name, content in two_files.items()}
    # S3 quotes ETags; the listing keeps them as the server sent them, in any case.
    quoted = {name: f'"{tag.upper()}"' for name, tag in md5.items()}
    assert s3_plan(two_files, quoted)[0].digest is None, "quotes are the S3 client's to strip"

    good = model_cache.verify(tmp_path, s3_plan(two_files, md5))
    assert good == {name: {"size": len(two_files[name]), "etag": md5[name]} for name in two_files}

    wrong_md5 = md5 | {"w/b.bin": hashlib.md5(b"other!!").hexdigest()}
    with pytest.raises(LoRADownloadError, match=r"w/b\.bin has md5") as mismatch:
        model_cache.verify(tmp_path, s3_plan(two_files, wrong_md5))
    assert mismatch.value.reason == "download failed"  # transient: the Job retries

    # A multipart ETag is no MD5 of the file: the size is all that can be checked.
    multipart = md5 | {"w/b.bin": "0123456789abcdef0123456789abcdef-3"}
    assert model_cache.verify(tmp_path, s3_plan(two_files, multipart))["w/b.bin"]["size"] == 7

    short = s3_plan(two_files, md5)
    short[1] = dataclasses.replace(short[1], size=8)
    with pytest.raises(LoRADownloadError, match="has 7 bytes, the listing says 8"):
        model_cache.verify(tmp_path, short)

    (tmp_path / "a.json").unlink()
    with pytest.raises(LoRADownloadError, match=r"a\.json is missing"):
        model_cache.verify(tmp_path, s3_plan(two_files, md5))


def test_verify_checks_hub_lfs_digests(tmp_path: Path, two_files: dict[str, bytes]) -> None:
    sha = hashlib.sha256(two_files["w/b.bin"]).hexdigest()
    lfs = ExpectedFile(PurePosixPath("w/b.bin"), 7, sha, ("sha256", sha))
    blob = ExpectedFile(PurePosixPath("a.json"), None, "blob-id")  # a size the Hub did not give
    assert model_cache.verify(tmp_path, [lfs, blob]) == {
        "w/b.bin": {"size": 7, "etag": sha},
        "a.json": {"size": 2, "etag": "blob-id"},
    }
    wrong = dataclasses.replace(lfs, digest=("sha256", "0" * 64))
    with pytest.raises(LoRADownloadError, match="has sha256"):
        model_cache.verify(tmp_path, [wrong])


def test_a_stale_partial_directory_is_never_complete_and_is_removed(
    s3_env: dict[str, str], source: str, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    key = cache_key(source)
    stale = cache / f".{key}.partial-7"
    (stale / "weights").mkdir(parents=True)
    (stale / "config.json").write_bytes(b"half")
    (stale / MARKER).write_text(json.dumps({"source": source, "bytes": 4, "files": {}}))
    other = cache / f".{cache_key('s3://b/other')}.partial-7"
    other.mkdir()

    with pytest.raises(model_cache.ModelCacheMissingError):
        model_cache.lookup(source, cache)
    done = fill(s3_env, source, cache)
    assert done.returncode == 0, done.stderr
    assert not stale.exists()
    assert other.exists(), "another key's partial directory is its own fill's business"
    assert read_tree(cache / key).keys() == FILES.keys() | {MARKER}
    assert model_cache.lookup(source, cache) == cache / key


def test_a_directory_without_the_marker_is_replaced(
    s3_env: dict[str, str], source: str, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    unmarked = cache / cache_key(source)
    unmarked.mkdir(parents=True)
    (unmarked / "config.json").write_bytes(b"left by hand")
    done = fill(s3_env, source, cache)
    assert done.returncode == 0, done.stderr
    assert read_tree(unmarked).keys() == FILES.keys() | {MARKER}
    assert (unmarked / "config.json").read_bytes() == FILES["config.json"]
    assert [entry.name for entry in cache.iterdir()] == [unmarked.name]


def test_prune_keeps_only_the_kept_keys(s3_env: dict[str, str], tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    kept, gone, gone_too = (cache_key(f"s3://b/{name}") for name in ("kept", "gone", "gone2"))
    for name in (
        kept,
        gone,
        gone_too,
        f".{kept}.partial-3",
        f".{gone}.partial-9",
        "lost+found",
        "notakey",
        gone.upper(),
    ):
        (cache / name).mkdir(parents=True)
        (cache / name / "f").write_bytes(b"x")
    (cache / "0123456789abcdef.txt").write_bytes(b"not a key")

    pruned = run_tool(s3_env, "prune", "--cache", str(cache), "--keep", kept)
    assert pruned.returncode == 0, pruned.stderr
    assert sorted(pruned.stdout.splitlines()) == sorted(
        f"removed {cache / name}" for name in (gone, gone_too, f".{gone}.partial-9")
    )
    assert sorted(entry.name for entry in cache.iterdir()) == sorted(
        [kept, f".{kept}.partial-3", "lost+found", "notakey", gone.upper(), "0123456789abcdef.txt"]
    )

    refused = run_tool(s3_env, "prune", "--cache", str(cache), "--keep", "Not-A-Key")
    assert refused.returncode == 2
    assert "not a cache key" in refused.stderr
    assert (cache / kept).exists()
    assert run_tool(s3_env, "prune", "--cache", str(cache)).returncode == 2  # --keep required


def test_usage_errors_exit_2(s3_env: dict[str, str]) -> None:
    for argv in ([], ["fill"], ["fill", "--source", "s3://b/m"], ["frobnicate"]):
        assert run_tool(s3_env, *argv).returncode == 2, argv


@pytest.fixture
def worker_env(monkeypatch: pytest.MonkeyPatch, s3_server: S3Server, tmp_path: Path) -> Path:
    s3_server.apply_env(monkeypatch)
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    cache = tmp_path / "models"
    monkeypatch.setenv("DYN_MODEL_CACHE", str(cache))
    monkeypatch.delenv(model_cache.REQUIRED_ENV, raising=False)
    return cache


async def test_required_mode_loads_only_a_complete_directory(
    worker_env: Path, source: str, s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = worker_env / cache_key(source)
    monkeypatch.setenv(model_cache.REQUIRED_ENV, "true")
    with counting_proxy(s3_env["AWS_ENDPOINT_URL"]) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        # Missing: refused, naming the directory and the source, and nothing downloaded.
        with pytest.raises(model_cache.ModelCacheMissingError) as missing:
            await cli.resolve_model(source)
        message = str(missing.value)
        assert str(directory) in message
        assert source in message
        assert "fill Job has not completed it" in message
        assert "no download is attempted" in message
        assert entries(worker_env) == []

        # There but incomplete (no marker): refused just the same.
        directory.mkdir(parents=True)
        (directory / "config.json").write_bytes(b"{}")
        with pytest.raises(model_cache.ModelCacheMissingError, match="is incomplete"):
            await cli.resolve_model(source)

        assert proxy.requests == []

    # Once the Job has filled it, the worker loads from it.
    assert fill(s3_env, source, worker_env).returncode == 0
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # S3 is not needed now
    assert await cli.resolve_model(source) == str(directory)
    monkeypatch.setenv(model_cache.REQUIRED_ENV, "1")
    assert await cli.resolve_model(source) == str(directory)


@pytest.mark.parametrize("value", ["yes", "on", "maybe"])
async def test_an_unclear_required_value_is_refused(
    worker_env: Path, source: str, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(model_cache.REQUIRED_ENV, value)
    with pytest.raises(ValueError, match="DYN_MODEL_CACHE_REQUIRED"):
        await cli.resolve_model(source)
    assert entries(worker_env) == []


@pytest.mark.parametrize("value", [None, "", "false", "0"])
async def test_without_required_mode_the_worker_downloads_as_before(
    worker_env: Path, source: str, monkeypatch: pytest.MonkeyPatch, value: str | None
) -> None:
    if value is not None:
        monkeypatch.setenv(model_cache.REQUIRED_ENV, value)
    local = Path(str(await cli.resolve_model(source)))
    assert local == worker_env / cache_key(source)
    assert read_tree(local) == FILES | {MARKER: (local / MARKER).read_bytes()}
    assert entries(worker_env) == [local.name]
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    assert await cli.resolve_model(source) == str(local)


async def test_a_worker_leaves_other_processes_partial_directories_alone(
    worker_env: Path, source: str
) -> None:
    # Another worker process sharing this cache may be filling the same source right now.
    theirs = worker_env / f".{cache_key(source)}.partial-999999"
    theirs.mkdir(parents=True)
    local = Path(str(await cli.resolve_model(source)))
    assert model_cache.is_complete(local)
    assert theirs.exists()


# -- hf:// sources, against a local imitation of the Hub ---------------------------------------


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[FakeHub]:
    with running_hub() as fake:
        yield fake


@pytest.fixture
def hub_env(s3_env: dict[str, str], hub: FakeHub, tmp_path: Path) -> dict[str, str]:
    dropped = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "HF_HUB_CACHE")
    env = {k: v for k, v in s3_env.items() if k not in dropped}
    return env | {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home")}


def test_a_hub_source_fills_once(hub: FakeHub, hub_env: dict[str, str], tmp_path: Path) -> None:
    hub.add_commit("org/tiny", FILES)
    cache = tmp_path / "cache"
    source = "hf://org/tiny"
    done = fill(hub_env, source, cache)
    assert done.returncode == 0, done.stderr
    directory = cache / cache_key(source)
    assert entries(cache) == [directory.name]
    assert read_tree(directory) == FILES | {MARKER: (directory / MARKER).read_bytes()}
    marker = json.loads((directory / MARKER).read_text())
    assert (marker["source"], marker["bytes"]) == (source, TOTAL)
    assert json_lines(done.stdout)[-1]["complete"] is True
    # The files land in the cache directory only, not also in the hub cache.
    assert not list((tmp_path / "hf-home").rglob("models--org--tiny"))

    requests = len(hub.requests)
    assert fill(hub_env, source, cache).returncode == 0
    assert len(hub.requests) == requests  # complete: the Hub is not asked


@pytest.mark.parametrize(
    ("token", "reason"),
    [("wrong-token", "auth"), (None, "not found")],  # the Hub hides private repos without one
)
def test_hub_credentials_and_missing_repos_are_permanent(
    hub: FakeHub, hub_env: dict[str, str], tmp_path: Path, token: str | None, reason: str
) -> None:
    hub.add_commit("org/private", FILES, token="the-token")
    env = hub_env | ({"HF_TOKEN": token} if token else {})
    failed = fill(env, "hf://org/private", tmp_path / "cache")
    assert failed.returncode == 2, failed.stderr
    record = termination(env)
    assert record["reason"] == reason
    assert "hf://org/private" in record["message"]
    assert "the-token" not in record["message"]
    assert entries(tmp_path / "cache") == []

    right = fill(hub_env | {"HF_TOKEN": "the-token"}, "hf://org/private", tmp_path / "cache")
    assert right.returncode == 0, right.stderr
    missing = fill(hub_env, "hf://org/nothing", tmp_path / "cache")
    assert missing.returncode == 2
    assert termination(hub_env)["reason"] == "not found"


async def test_required_mode_loads_a_hub_model_only_from_the_cache(
    worker_env: Path, hub: FakeHub, hub_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    hub.add_commit("org/tiny", FILES)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HOME", hub_env["HF_HOME"])
    monkeypatch.setenv(model_cache.REQUIRED_ENV, "true")
    with pytest.raises(model_cache.ModelCacheMissingError, match="no download is attempted"):
        await cli.resolve_model("hf://org/tiny")
    assert hub.requests == []
    assert fill(hub_env, "hf://org/tiny", worker_env).returncode == 0
    requests = len(hub.requests)
    assert await cli.resolve_model("hf://org/tiny") == str(worker_env / cache_key("hf://org/tiny"))
    assert len(hub.requests) == requests
