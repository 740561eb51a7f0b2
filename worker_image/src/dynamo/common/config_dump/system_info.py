"""Host, Python runtime and GPU details for the config dump (best effort, never raising)."""

from __future__ import annotations

import logging
import platform
import socket
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

NVIDIA_SMI_TIMEOUT_S = 5.0


def _collect(fields: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    # Each field on its own: one failing probe must not hide the others.
    info: dict[str, Any] = {}
    for name, probe in fields.items():
        try:
            info[name] = probe()
        except Exception as exc:
            logger.debug("Could not read %s: %s", name, exc)
    return info


def get_system_info() -> dict[str, Any]:
    """Platform, architecture, processor, hostname and operating-system details."""
    return _collect(
        {
            "platform": platform.platform,
            "architecture": platform.machine,
            "processor": platform.processor,
            "hostname": socket.gethostname,
            "os_name": platform.system,
            "os_release": platform.release,
            "os_version": platform.version,
        }
    )


def get_runtime_info() -> dict[str, Any]:
    """Python version, interpreter path and command-line arguments."""
    return _collect(
        {
            "python_version": lambda: sys.version,
            "python_version_info": lambda: {
                "major": sys.version_info.major,
                "minor": sys.version_info.minor,
                "micro": sys.version_info.micro,
                "releaselevel": sys.version_info.releaselevel,
                "serial": sys.version_info.serial,
            },
            "executable": lambda: sys.executable,
            "argv": lambda: list(sys.argv),
        }
    )


def _text(element: ElementTree.Element | None, path: str) -> str | None:
    if element is None:
        return None
    found = element.find(path)
    return found.text.strip() if found is not None and found.text else None


def get_gpu_info() -> dict[str, Any] | None:
    """GPU details from `nvidia-smi -q -x`, or None when they cannot be obtained.

    Returns `{"gpus": [{name, driver_version, memory_total, board_part_number,
    gpu_part_number}], "count": n}`. No nvidia-smi, a failing or slow (over 5 s) run, or
    unparseable output give None.
    """
    try:
        completed = subprocess.run(
            ["nvidia-smi", "-q", "-x"],
            capture_output=True,
            timeout=NVIDIA_SMI_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        logger.debug("nvidia-smi unavailable: %s", exc)
        return None
    if completed.returncode != 0:
        logger.debug("nvidia-smi exited with %d", completed.returncode)
        return None
    try:
        root = ElementTree.fromstring(completed.stdout)
    except ElementTree.ParseError as exc:
        logger.debug("nvidia-smi output is not XML: %s", exc)
        return None
    driver_version = _text(root, "driver_version")
    gpus = [
        {
            "name": _text(gpu, "product_name"),
            "driver_version": driver_version,
            "memory_total": _text(gpu, "fb_memory_usage/total"),
            "board_part_number": _text(gpu, "board_part_number"),
            "gpu_part_number": _text(gpu, "gpu_part_number"),
        }
        for gpu in root.findall("gpu")
    ]
    return {"gpus": gpus, "count": len(gpus)}
