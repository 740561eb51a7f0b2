"""The chart's images, built by hack/build-images, and a way to run them as the chart does.

`images` (session fixture) runs hack/build-images, which skips every image whose tag exists, so
a warm call returns in seconds; `hack/test` builds them before pytest starts. The tests skip
only when the script says no container engine can run here (its exit code 3).

`run_args` is `docker run` with the restrictions the chart's pods have: a read-only root,
uid/gid 10001 and every capability dropped, no privilege escalation.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD_IMAGES = REPO / "hack" / "build-images"
# Debian's docker CLI: hack/build-images uses it (BuildKit built in) and starts its engine.
DOCKER = "/usr/bin/docker"
NO_ENGINE = 3  # hack/build-images' exit code when no container engine can be had
RESTRICTED = (
    "--read-only",
    "--user",
    "10001:10001",
    "--cap-drop",
    "ALL",
    "--security-opt",
    "no-new-privileges",
)


# Each image hack/build-images made (`image:tag`), by its name there (`operator`, `worker`, ...).
Images = dict[str, str]


@pytest.fixture(scope="session")
def images() -> Images:
    result = subprocess.run(
        [str(BUILD_IMAGES)], capture_output=True, text=True, timeout=3000, check=False
    )
    if result.returncode == NO_ENGINE:
        pytest.skip(f"no container engine can run here: {result.stderr.strip().splitlines()[-1]}")
    assert result.returncode == 0, f"hack/build-images failed:\n{result.stderr[-6000:]}"
    return dict(line.split("=", 1) for line in result.stdout.split())


def docker(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`docker ARGS`, its output captured (never raises on a non-zero exit)."""
    return subprocess.run(
        [DOCKER, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def run_args(
    image: str, *options: str, entrypoint: str | None = None, network: str = "none"
) -> list[str]:
    """`docker run --rm` of `image` restricted as the chart's pods are; `options` go before the
    image (mounts, env), the command's arguments after the returned list."""
    run = ["run", "--rm", "--network", network, *RESTRICTED, *options]
    if entrypoint is not None:
        run += ["--entrypoint", entrypoint]
    return [*run, image]


def label(image: str, key: str) -> str:
    """The value of one of the image's labels ("" when unset)."""
    result = docker("image", "inspect", "-f", f'{{{{index .Config.Labels "{key}"}}}}', image)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def env_flags(names: Sequence[str]) -> list[str]:
    """`-e NAME` for each name: docker passes the value from its own environment."""
    return [flag for name in names for flag in ("-e", name)]


@pytest.fixture(scope="session")
def node_images(images: Images, testbed: Any) -> Images:
    """`images`, imported into the test bed's kubelet node (`hack/cluster import-images`:
    only those it lacks), where pods use them with `imagePullPolicy: Never`."""
    result = subprocess.run(
        [str(REPO / "hack" / "cluster"), "import-images", "--docker", DOCKER, *images.values()],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    assert result.returncode == 0, f"hack/cluster import-images failed:\n{result.stderr[-4000:]}"
    return images
