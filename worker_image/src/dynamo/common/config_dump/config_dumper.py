"""Serialize a worker's configuration plus its environment into one canonical JSON document.

The dump is for diagnosis and reproducibility: sorted keys, compact separators, no NaN,
so two dumps of the same setup compare equal byte for byte.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import logging
import os
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

from dynamo.common.config_dump.environment import get_environment_vars
from dynamo.common.config_dump.system_info import get_gpu_info, get_runtime_info, get_system_info

logger = logging.getLogger(__name__)

DUMP_CONFIG_ENV = "DYN_DUMP_CONFIG_TO"

# Inference frameworks whose versions are recorded when installed (never imported).
_FRAMEWORK_DISTRIBUTIONS = {
    "sglang_version": "sglang",
    "trtllm_version": "tensorrt_llm",
    "vllm_version": "vllm",
}

_F = TypeVar("_F", bound=Callable[[Any], Any])
_ENCODERS: dict[type, Callable[[Any], Any]] = {}


def register_encoder(type_class: type) -> Any:
    """Decorator registering how objects of `type_class` become JSON-compatible values.

    ```
    @register_encoder(MyClass)
    def encode_my_class(obj: MyClass) -> dict:
        return {"field": obj.field}
    ```
    """

    def decorator(encoder: _F) -> _F:
        _ENCODERS[type_class] = encoder
        return encoder

    return decorator


def _encode(obj: Any) -> Any:
    """`json.dumps(default=...)`: turn a non-JSON object into something JSON can hold."""
    for cls in type(obj).__mro__:
        encoder = _ENCODERS.get(cls)
        if encoder is not None:
            return encoder(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    model_dump = getattr(obj, "model_dump", None)
    if callable(model_dump):  # pydantic v2 models
        return model_dump()
    if isinstance(obj, set | frozenset):
        try:
            return sorted(obj)
        except TypeError:
            # Mixed element types cannot be ordered; order by text for a stable dump.
            return sorted(obj, key=repr)
    if isinstance(obj, argparse.Namespace):
        return vars(obj)
    if isinstance(obj, Enum):
        return str(obj)
    if hasattr(obj, "__dict__"):
        return vars(obj)
    return str(obj)


def _canonical_json(value: Any) -> str:
    return json.dumps(
        value,
        default=_encode,
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,
    )


def _installed_packages() -> dict[str, str]:
    packages: dict[str, str] = {}
    for distribution in importlib.metadata.distributions():
        name = distribution.metadata["Name"]
        if name:
            packages[name] = distribution.version
    return packages


def _dynamo_version() -> str:
    from dynamo.common import __version__

    return __version__


def get_config_dump(config: Any, extra_info: dict[str, Any] | None = None) -> str:
    """Collect the backend's configuration plus host details as canonical JSON.

    Keys: system_info, environment, config, runtime_info, dynamo_version, gpu_info,
    installed_packages, the version of each installed inference framework, and
    `extra_info`'s keys. If collection or encoding fails, returns
    `{"error": "Failed to collect config dump: ...", "system_info": ...}` instead, so
    some diagnostic data is always available.
    """
    try:
        dump: dict[str, Any] = {
            "system_info": get_system_info(),
            "environment": get_environment_vars(),
            "config": config,
            "runtime_info": get_runtime_info(),
            "dynamo_version": _dynamo_version(),
            "gpu_info": get_gpu_info(),
            "installed_packages": _installed_packages(),
        }
        for key, distribution in _FRAMEWORK_DISTRIBUTIONS.items():
            try:
                dump[key] = importlib.metadata.version(distribution)
            except importlib.metadata.PackageNotFoundError:
                continue
        if extra_info:
            dump.update(extra_info)
        return _canonical_json(dump)
    except Exception as exc:
        logger.exception("Failed to collect config dump")
        return _canonical_json(
            {"error": f"Failed to collect config dump: {exc}", "system_info": get_system_info()}
        )


def dump_config(dump_config_to: str | None, config: Any) -> None:
    """Write the config dump to `dump_config_to`, or log it at DEBUG when no path is given.

    Parent directories are created. If the file cannot be written the dump is logged
    (prefixed `CONFIG_DUMP:`) so it is not lost.
    """
    if dump_config_to is None:
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("CONFIG_DUMP: %s", get_config_dump(config))
        return
    dump = get_config_dump(config)
    try:
        path = Path(dump_config_to)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(dump, encoding="utf-8")
    except OSError as exc:
        logger.error(
            "Could not write config dump to %s (%s); logging it instead", dump_config_to, exc
        )
        logger.info("CONFIG_DUMP: %s", dump)
        return
    logger.info("Dumped config to %s", dump_config_to)


def add_config_dump_args(parser: argparse.ArgumentParser) -> None:
    """Add `--dump-config-to PATH` (default: `$DYN_DUMP_CONFIG_TO`) to `parser`."""
    parser.add_argument(
        "--dump-config-to",
        dest="dump_config_to",
        type=str,
        default=os.environ.get(DUMP_CONFIG_ENV) or None,
        help=(
            "write the resolved configuration, environment and host details as JSON to this "
            f"path (env: {DUMP_CONFIG_ENV})"
        ),
    )
