"""The chart's images as a user runs them: built by hack/build-images with no registry, each
started with a read-only root as uid 10001 with every capability dropped.

- each answers `--help` with no network at all;
- the worker image serves the tiny model from a read-only mount: /health turns 200 and a chat
  completion answers;
- no image holds a compiler;
- `pip check` is clean in each (the frontend's names exactly the requirements its build left
  out, from its `skipped-requirements` label).
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from support.images import DOCKER, Images, docker, env_flags, label, run_args
from support.tiny_model import TinyModel
from support.worker_process import LOOPBACK_ENV, WorkerProcess

pytestmark = pytest.mark.images

IMAGES = ("operator", "worker", "frontend")
USAGE = {
    "operator": "usage: dynamo-operator",
    "worker": "usage: dynamo-worker",
    # Upstream's argparse names the module's file (`python3 -m dynamo.frontend`).
    "frontend": "usage: __main__.py",
}
ENGINE = "dynamo.engines.transformers_engine:TransformersEngine"
MODEL_MOUNT = "/models/tiny"
# Compilers by the names their packages install them under (gcc-12, x86_64-linux-gnu-gcc, ...).
COMPILER = r"/([^/]*-)?(cc|c\+\+|gcc|g\+\+|clang|clang\+\+|tcc)(-[0-9.]+)?$"


@pytest.mark.parametrize("name", IMAGES)
def test_each_image_answers_help_read_only_as_10001_without_network(
    images: Images, name: str
) -> None:
    result = docker(*run_args(images[name]), "--help")
    assert result.returncode == 0, f"{images[name]} --help:\n{result.stdout}\n{result.stderr}"
    assert USAGE[name] in result.stdout, result.stdout


@pytest.mark.parametrize("name", IMAGES)
def test_no_image_holds_a_compiler(images: Images, name: str) -> None:
    # Every executable file on the root filesystem whose name is a C compiler's.
    script = f"find / -xdev -type f -perm -u+x 2>/dev/null | grep -E '{COMPILER}' || true"
    result = docker(*run_args(images[name], entrypoint="sh"), "-c", script)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"compilers in {images[name]}:\n{result.stdout}"


@pytest.mark.parametrize("name", IMAGES)
def test_pip_check_is_clean(images: Images, name: str) -> None:
    image = images[name]
    result = docker(*run_args(image, entrypoint="python3"), "-m", "pip", "check")
    skipped = set(label(image, "dev.dynamo.skipped-requirements").split())
    if not skipped:
        assert result.returncode == 0, f"pip check in {image}:\n{result.stdout}{result.stderr}"
        return
    # "ai-dynamo 1.6.1 requires aisimulate, which is not installed." for each one left out.
    missing = {
        line.split(" requires ", 1)[1].split(",", 1)[0]
        for line in result.stdout.splitlines()
        if line.endswith("which is not installed.")
    }
    assert missing == skipped, f"pip check in {image}:\n{result.stdout}{result.stderr}"
    assert len(result.stdout.splitlines()) == len(skipped), result.stdout


@pytest.fixture
def readable_model(tiny_model: TinyModel) -> Iterator[Path]:
    """The tiny model where uid 10001 may read it: pytest's temp root is the runner's alone
    (0700), as a volume's files are the pod's, not the node user's."""
    shared = Path(tempfile.mkdtemp(prefix="dynamo-image-model-"))
    shared.chmod(0o755)
    model = Path(shutil.copytree(tiny_model.base, shared / "base"))
    for path in (model, *model.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)
    yield model
    shutil.rmtree(shared)


@pytest.fixture
def container_name() -> Iterator[str]:
    """A unique container name, the container removed at the end whatever happened."""
    name = f"dynamo-image-test-{uuid.uuid4().hex[:8]}"
    yield name
    docker("rm", "-f", name)


async def test_worker_image_serves_the_tiny_model_from_a_read_only_mount(
    images: Images, readable_model: Path, container_name: str
) -> None:
    # Nothing writable but the image's own /tmp volume: the image needs no mount of ours.
    command = run_args(
        images["worker"],
        "--name",
        container_name,
        "-v",
        f"{readable_model}:{MODEL_MOUNT}:ro",
        *env_flags(list(LOOPBACK_ENV)),
        network="host",
    )
    worker = WorkerProcess(["--engine", ENGINE, "--model", MODEL_MOUNT], command=[DOCKER, *command])
    try:
        await worker.wait_health(200, within=180)
        http = worker.http_url()
        async with aiohttp.ClientSession() as session, session.get(http + "/v1/models") as models:
            served = (await models.json())["data"][0]["id"]
        chat = {
            "model": served,
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 4,
            "temperature": 0,
        }
        status, answer = await post_json(http + "/v1/chat/completions", chat)
        assert status == 200, f"{answer}\n{worker.log()}"
        assert answer["choices"][0]["message"]["role"] == "assistant"
        assert 0 < answer["usage"]["completion_tokens"] <= 4
        worker.terminate()
        assert await worker.wait_exit() == 0, worker.log()
    finally:
        worker.close()


async def post_json(url: str, body: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
        return response.status, await response.json(content_type=None)


def test_worker_image_names_a_model_directory_it_may_not_read(
    images: Images, readable_model: Path
) -> None:
    # A volume whose files belong to another uid: the worker says so, not "no such file".
    readable_model.chmod(0o700)
    command = run_args(images["worker"], "-v", f"{readable_model}:{MODEL_MOUNT}:ro")
    result = docker(*command, "--engine", ENGINE, "--model", MODEL_MOUNT)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"--model {MODEL_MOUNT}: the directory is not readable by uid 10001" in result.stderr
