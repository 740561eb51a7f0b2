"""Collect a worker's configuration, environment and host details as canonical JSON."""

from dynamo.common.config_dump.config_dumper import (
    add_config_dump_args,
    dump_config,
    get_config_dump,
    register_encoder,
)
from dynamo.common.config_dump.environment import get_environment_vars
from dynamo.common.config_dump.system_info import get_gpu_info, get_runtime_info, get_system_info

__all__ = [
    "add_config_dump_args",
    "dump_config",
    "get_config_dump",
    "get_environment_vars",
    "get_gpu_info",
    "get_runtime_info",
    "get_system_info",
    "register_encoder",
]
