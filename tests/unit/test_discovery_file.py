"""The file discovery backend on a temporary folder: upstream's names and contents, atomic
replacement, liveness touches, withdrawal order, and upstream's taint-only rewrite rule."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from dynamo.runtime.discovery import AdapterCard, EndpointAddress, WorkerAdvertisement
from dynamo.runtime.discovery.file import (
    INSTANCES,
    MDC,
    TOUCH_INTERVAL_S,
    FileBackend,
    decode_key,
    encode_key,
)
from dynamo.runtime.discovery.records import metadata_for
from support.cluster import eventually

pytestmark = pytest.mark.unit

GOLDEN = json.loads(
    (Path(__file__).parent / "golden" / "discovery_upstream_1_6_1.json").read_text()
)
KEY = "dynamo/backend/generate/43710f49c0cff"


def advertisement(**changes: Any) -> WorkerAdvertisement:
    fields: dict[str, Any] = {
        "address": EndpointAddress("dynamo", "backend", "generate"),
        "instance_id": 0x43710F49C0CFF,
        "served_model_name": "tiny",
        "model": "/nonexistent/tiny",
        "transport": {"http": "http://127.0.0.1:8000"},
        "runtime_config": {"context_length": 512},
    }
    fields.update(changes)
    return WorkerAdvertisement(**fields)


def tainted(adv: WorkerAdvertisement, *taints: str) -> WorkerAdvertisement:
    return WorkerAdvertisement(
        **{**adv.__dict__, "runtime_config": {**adv.runtime_config, "taints": list(taints)}}
    )


def listing(root: Path) -> dict[str, set[str]]:
    return {
        bucket: {p.name for p in (root / bucket).iterdir()} if (root / bucket).is_dir() else set()
        for bucket in (INSTANCES, MDC)
    }


def read(root: Path, bucket: str, key: str) -> Any:
    return json.loads((root / bucket / encode_key(key)).read_text())


class SpyBackend(FileBackend):
    """Records the order of file operations (the real ones still run)."""

    def __init__(self, root: Path, **kwargs: Any) -> None:
        super().__init__(root, **kwargs)
        self.ops: list[tuple[str, str, str]] = []

    def _write(self, bucket: str, key: str, record: dict[str, Any]) -> None:
        self.ops.append(("write", bucket, key))
        super()._write(bucket, key, record)

    def _delete(self, bucket: str, key: str) -> None:
        self.ops.append(("delete", bucket, key))
        super()._delete(bucket, key)


@pytest_asyncio.fixture
async def backend(tmp_path: Path) -> AsyncIterator[SpyBackend]:
    spy = SpyBackend(tmp_path / "kv", touch_interval=0.1)
    yield spy
    await spy.close()


# --- names ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "name"),
    [
        (
            "dynamo/sample/generate/49244d652b228010",
            "dynamo%2Fsample%2Fgenerate%2F49244d652b228010",
        ),
        (
            "dynamo/sample/worker_kv_query_source_e0cdc31bfd04b/49244d652b228010",
            "dynamo%2Fsample%2Fworker%5Fkv%5Fquery%5Fsource%5Fe0cdc31bfd04b%2F49244d652b228010",
        ),
        (
            "loratest/backend/generate/e3a109b307798f2e/my-lora_adapter_v1",
            "loratest%2Fbackend%2Fgenerate%2Fe3a109b307798f2e%2Fmy%2Dlora%5Fadapter%5Fv1",
        ),
        ("a.b é", "a%2Eb%20%C3%A9"),
    ],
)
def test_file_names_use_rust_non_alphanumeric_encoding(key: str, name: str) -> None:
    assert encode_key(key) == name
    assert decode_key(name) == key


async def test_layout_matches_upstream_for_the_observed_model(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    for name, text in GOLDEN["model_files"].items():
        (model / name).write_text(text, encoding="utf-8")
    given = GOLDEN["advertisement"]
    adapter = given["adapter"]
    adv = advertisement(
        instance_id=given["instance_id"],
        served_model_name=given["served_model_name"],
        model=str(model),
        runtime_config=given["runtime_config"],
        adapters=(AdapterCard(adapter["lora_name"], adapter["lora_id"], "s3://b/a"),),
    )
    files = FileBackend(tmp_path / "kv")
    await files.register(adv)
    try:
        for relative, record in GOLDEN["file_records"].items():
            expected = json.dumps(record, separators=(",", ":")).replace(
                "{model_dir}", str(model.resolve())
            )
            assert (tmp_path / "kv" / relative).read_text() == expected
        assert listing(tmp_path / "kv")[MDC] == {Path(name).name for name in GOLDEN["file_records"]}
        assert listing(tmp_path / "kv")[INSTANCES] == {
            "dynamo%2Fbackend%2Fgenerate%2Ffce726c2c4e2dc24"
        }
    finally:
        await files.close()


# --- register / update / unregister / close -----------------------------------------------


async def test_register_writes_cards_then_the_endpoint(backend: SpyBackend, tmp_path: Path) -> None:
    adv = advertisement(adapters=(AdapterCard("Lo.Ra", 5, "s3://b/l"),))
    await backend.register(adv)
    root = tmp_path / "kv"
    assert listing(root) == {
        INSTANCES: {encode_key(KEY)},
        MDC: {encode_key(KEY), encode_key(f"{KEY}/lo_ra")},
    }
    assert backend.ops[-1] == ("write", INSTANCES, KEY)
    assert {op[1] for op in backend.ops[:-1]} == {MDC}
    expected = metadata_for(adv)
    assert read(root, INSTANCES, KEY) == expected["endpoints"][KEY]
    assert read(root, MDC, f"{KEY}/lo_ra") == expected["model_cards"][f"{KEY}/lo_ra"]
    assert backend.metadata() == expected
    assert (root / INSTANCES / encode_key(KEY)).stat().st_mode & 0o777 == 0o644


async def test_adapter_load_and_unload(backend: SpyBackend, tmp_path: Path) -> None:
    await backend.register(advertisement())
    with_adapter = advertisement(adapters=(AdapterCard("a1", 1, "s3://b/a1"),))
    await backend.update(with_adapter)
    assert encode_key(f"{KEY}/a1") in listing(tmp_path / "kv")[MDC]
    backend.ops.clear()
    await backend.update(advertisement())
    assert backend.ops == [("delete", MDC, f"{KEY}/a1")]
    assert listing(tmp_path / "kv")[MDC] == {encode_key(KEY)}


async def test_taint_change_rewrites_in_place_other_changes_recreate(
    backend: SpyBackend, tmp_path: Path
) -> None:
    adv = advertisement()
    await backend.register(adv)
    backend.ops.clear()
    await backend.update(tainted(adv, "gpu=h100", "team=a"))
    assert backend.ops == [("write", MDC, KEY)]  # replaced by rename, never absent
    card = read(tmp_path / "kv", MDC, KEY)["card_json"]
    assert card["runtime_config"]["taints"] == ["gpu=h100", "team=a"]
    backend.ops.clear()
    await backend.update(tainted(adv, "team=b"))
    assert backend.ops == [("write", MDC, KEY)]
    backend.ops.clear()
    await backend.update(advertisement(runtime_config={"context_length": 1024}))
    assert backend.ops == [("delete", MDC, KEY), ("write", MDC, KEY)]
    assert read(tmp_path / "kv", MDC, KEY)["card_json"]["context_length"] == 1024
    backend.ops.clear()
    await backend.update(advertisement(runtime_config={"context_length": 1024}))
    assert backend.ops == []  # nothing changed, nothing written


async def test_unregister_deletes_the_endpoint_only_and_close_the_rest(
    backend: SpyBackend, tmp_path: Path
) -> None:
    adv = advertisement(adapters=(AdapterCard("a1", 1, "s3://b/a1"),))
    await backend.register(adv)
    backend.ops.clear()
    await backend.unregister()
    assert backend.ops == [("delete", INSTANCES, KEY)]
    assert listing(tmp_path / "kv")[INSTANCES] == set()
    assert len(listing(tmp_path / "kv")[MDC]) == 2
    metadata = backend.metadata()
    assert metadata is not None
    assert metadata["endpoints"] == {}
    # A LoRA change while draining updates the cards but does not bring the endpoint back.
    await backend.update(advertisement())
    assert listing(tmp_path / "kv") == {INSTANCES: set(), MDC: {encode_key(KEY)}}
    await backend.close()
    assert listing(tmp_path / "kv") == {INSTANCES: set(), MDC: set()}
    assert backend.metadata() is None


async def test_close_without_unregister_withdraws_the_endpoint_first(
    backend: SpyBackend,
) -> None:
    await backend.register(advertisement(adapters=(AdapterCard("a1", 1, "s3://b/a1"),)))
    backend.ops.clear()
    await backend.close()
    assert backend.ops[0] == ("delete", INSTANCES, KEY)
    assert sorted(backend.ops[1:]) == [("delete", MDC, KEY), ("delete", MDC, f"{KEY}/a1")]
    await backend.close()  # idempotent


# --- atomicity ------------------------------------------------------------------------


async def test_readers_never_see_a_partial_record(backend: SpyBackend, tmp_path: Path) -> None:
    """A reader polling the bucket while the card is rewritten 200 times (taints only) always
    finds the file, always parses it, and never sees anything but finished records."""
    adv = advertisement(
        runtime_config={"context_length": 512, "runtime_data": {"pad": "x" * 50_000}}
    )
    await backend.register(adv)
    card = tmp_path / "kv" / MDC / encode_key(KEY)
    stop = threading.Event()
    problems: list[str] = []
    reads = 0

    def reader() -> None:
        nonlocal reads
        while not stop.is_set():
            for entry in os.scandir(card.parent):
                if entry.name.startswith(".tmp_"):
                    continue  # upstream readers skip these too
                if entry.name != card.name:
                    problems.append(f"unexpected file {entry.name}")
            try:
                json.loads(card.read_bytes())
                reads += 1
            except FileNotFoundError:
                problems.append("card missing during a taint rewrite")
            except ValueError as exc:
                problems.append(f"partial record: {exc}")

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for index in range(200):
            await backend.update(tainted(adv, f"t={index}"))
    finally:
        stop.set()
        thread.join()
    assert problems == []
    assert reads > 0
    assert [p.name for p in card.parent.iterdir()] == [card.name]  # no temp files left


async def test_writes_wait_for_the_bucket_lock(backend: SpyBackend, tmp_path: Path) -> None:
    adv = advertisement()
    await backend.register(adv)
    bucket = os.open(tmp_path / "kv" / MDC, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(bucket, fcntl.LOCK_EX)  # as an upstream process mutating the bucket
        update = asyncio.ensure_future(backend.update(tainted(adv, "x")))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.shield(update), 0.3)
        card = read(tmp_path / "kv", MDC, KEY)["card_json"]
        assert "taints" not in card["runtime_config"]
    finally:
        os.close(bucket)
    await update
    assert read(tmp_path / "kv", MDC, KEY)["card_json"]["runtime_config"]["taints"] == ["x"]


# --- liveness -------------------------------------------------------------------------


async def _until(condition: Callable[[], bool], within: float = 5.0) -> None:
    async def probe() -> bool:
        return condition()

    await eventually(probe, within, bool, every=0.02)


def test_default_touch_interval_is_well_inside_the_readers_ttl() -> None:
    assert TOUCH_INTERVAL_S <= 3.0


async def test_touches_keep_every_record_fresh(backend: SpyBackend, tmp_path: Path) -> None:
    await backend.register(advertisement(adapters=(AdapterCard("a1", 1, "s3://b/a1"),)))
    paths = [p for bucket in (INSTANCES, MDC) for p in (tmp_path / "kv" / bucket).iterdir()]
    for path in paths:
        os.utime(path, (1_000_000, 1_000_000))  # as if untouched since 1970
    await _until(lambda: all(p.stat().st_mtime > 1_000_000 for p in paths))


async def test_a_record_expired_by_a_reader_is_written_again(
    backend: SpyBackend, tmp_path: Path
) -> None:
    await backend.register(advertisement())
    endpoint = tmp_path / "kv" / INSTANCES / encode_key(KEY)
    endpoint.unlink()  # what a reader does to a record older than its TTL
    await _until(endpoint.exists)
    assert read(tmp_path / "kv", INSTANCES, KEY)["instance_id"] == 0x43710F49C0CFF


async def test_touches_stop_after_close(tmp_path: Path) -> None:
    files = FileBackend(tmp_path / "kv", touch_interval=0.05)
    await files.register(advertisement())
    toucher = files._toucher
    assert toucher is not None
    await files.close()
    assert toucher.done()
    assert listing(tmp_path / "kv") == {INSTANCES: set(), MDC: set()}
