"""The embedding cache refuses a non-contiguous tensor the way upstream's does.

Its byte size (`element_size * numel`) is only right for a contiguous tensor, so such a
tensor is refused. Upstream raises `AssertionError` ("Tensor must be contiguous ...") and
code written for upstream catches that type; ours raises the same type, explicitly rather
than with `assert`, so the check survives `python -O`. Upstream's 1.6.1 cache is asked the
same question in its own venv.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig

import pytest
import torch

from dynamo.common.memory import CachedEmbedding, MultimodalEmbeddingCacheManager
from support.upstream import run_json_driver, upstream_python

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "tensor",
    [
        torch.zeros(10, 20).t(),
        torch.zeros(8, 8)[:, ::2],
        torch.zeros(4, 4, 4).permute(2, 0, 1),
    ],
    ids=["transposed", "strided", "permuted"],
)
def test_a_non_contiguous_tensor_is_refused_with_an_assertion_error(
    tensor: torch.Tensor,
) -> None:
    cache = MultimodalEmbeddingCacheManager(capacity_bytes=1 << 20)
    with pytest.raises(AssertionError, match="Tensor must be contiguous"):
        cache.set("k", CachedEmbedding(tensor))
    # Refused before anything was stored or counted.
    assert len(cache) == 0
    assert cache.stats["current_bytes"] == 0


def test_the_refusal_survives_optimised_mode() -> None:
    # `python -O` strips `assert` statements; the check must not depend on one.
    script = (
        "import torch\n"
        "from dynamo.common.memory import CachedEmbedding, MultimodalEmbeddingCacheManager\n"
        "cache = MultimodalEmbeddingCacheManager(capacity_bytes=1 << 20)\n"
        "try:\n"
        "    cache.set('k', CachedEmbedding(torch.zeros(10, 20).t()))\n"
        "except AssertionError:\n"
        "    print('refused')\n"
    )
    ran = subprocess.run(
        [sys.executable, "-O", "-c", script], capture_output=True, text=True, check=True
    )
    assert ran.stdout.strip() == "refused"


# Runs in upstream's venv, with this project's site-packages (read from stdin) appended for
# torch (that venv has none); upstream's own packages still come first. Prints the exception's
# type name and whether its message starts as upstream's tests expect.
_UPSTREAM_DRIVER = """
import json, sys
sys.path.append(json.load(sys.stdin))
import torch
from dynamo.common.memory.multimodal_embedding_cache_manager import (
    CachedEmbedding, MultimodalEmbeddingCacheManager)
cache = MultimodalEmbeddingCacheManager(capacity_bytes=1 << 20)
try:
    cache.set("k", CachedEmbedding(torch.zeros(10, 20).t()))
except Exception as exc:
    print(json.dumps(f"{type(exc).__name__} {str(exc).startswith('Tensor must be contiguous')}"))
"""


def test_same_refusal_as_upstreams_cache() -> None:
    upstream = run_json_driver(
        str(upstream_python()), _UPSTREAM_DRIVER, sysconfig.get_paths()["purelib"]
    )
    cache = MultimodalEmbeddingCacheManager(capacity_bytes=1 << 20)
    try:
        cache.set("k", CachedEmbedding(torch.zeros(10, 20).t()))
    except Exception as exc:  # the type is what is compared
        ours = f"{type(exc).__name__} {str(exc).startswith('Tensor must be contiguous')}"
    assert upstream == ours == "AssertionError True"
