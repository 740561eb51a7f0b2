"""Capture the environment variables that shape a worker, with secrets redacted."""

from __future__ import annotations

import os

# Variables read by Dynamo, inference engines, CUDA/NCCL/UCX/NIXL and the HF stack.
DEFAULT_ENV_PREFIXES: tuple[str, ...] = (
    "DYN_",
    "CUDA_",
    "NCCL_",
    "HF_",
    "TRANSFORMERS_",
    "SGLANG_",
    "SGL_",
    "MC_",
    "VLLM_",
    "TENSORRT_",
    "TORCH_",
    "UCX_",
    "NIXL_",
    "OMPI_",
    "LLM_",
    "TLLM_",
    "TRT_LLM_",
    "TRTLLM_",
    "NVIDIA_",
    "NSYS_",
    "GENERATE_CU_",
    "OVERRIDE_",
    "TOKENIZERS_",
    "DISABLE_TORCH_",
    "PYTORCH_",
    "ENABLE_PERFECT_ROUTER",
    "FLA_",
    "NEMOTRON_",
)

# A name containing any of these (upper-cased) is treated as a secret.
SENSITIVE_PATTERNS: tuple[str, ...] = (
    "TOKEN",
    "API_KEY",
    "SECRET",
    "PASSWORD",
    "CREDENTIAL",
    "AUTH",
)

REDACTED = "<REDACTED>"


def is_sensitive(name: str) -> bool:
    """Whether an environment variable name looks like it holds a secret."""
    upper = name.upper()
    return any(pattern in upper for pattern in SENSITIVE_PATTERNS)


def get_environment_vars(
    prefixes: list[str] | None = None,
    include_sensitive: bool = False,
    additional_vars: set[str] | None = None,
) -> dict[str, str]:
    """Return the variables whose names start with one of `prefixes` (default set if None).

    Names in `additional_vars` are included regardless of prefix. Values of sensitive
    names are replaced by "<REDACTED>" unless `include_sensitive` is True.
    """
    wanted_prefixes = tuple(prefixes) if prefixes is not None else DEFAULT_ENV_PREFIXES
    extra = additional_vars or set()
    captured: dict[str, str] = {}
    for name, value in sorted(os.environ.items()):
        if not (name.startswith(wanted_prefixes) or name in extra):
            continue
        captured[name] = REDACTED if not include_sensitive and is_sensitive(name) else value
    return captured
