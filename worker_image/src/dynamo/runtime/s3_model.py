"""`--model s3://bucket/prefix`: the weights fetched once into the model cache, then loaded
from there like any local path.

The cache and its layout are `dynamo.runtime.model_cache`'s: `DYN_MODEL_CACHE` (else
`~/.cache/dynamo/models`), one directory per source, trusted only once its fill verified it and
wrote the marker. The objects are fetched with the LoRA downloader's S3 code: the same
credentials (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_ENDPOINT_URL`, ...), endpoint
checks and key validation. With `DYN_MODEL_CACHE_REQUIRED` on, the operator's fill Job owns the
download and this module only looks the directory up.
"""

from __future__ import annotations

import logging
import time

from dynamo.runtime import model_cache

log = logging.getLogger(__name__)


async def fetch_s3_model(uri: str) -> str:
    """The local directory holding the objects under `uri`: looked up only when the cache is
    required, else downloaded unless a complete copy is cached."""
    cache = model_cache.default_cache()
    if model_cache.cache_required():
        return str(model_cache.lookup(uri, cache))
    started = time.monotonic()
    # Other worker processes may share this cache and be filling the same source: their
    # partial directories are theirs to remove.
    result = await model_cache.fill(uri, cache, clear_stale=False)
    if result.fetched:
        log.info(
            "model %s: %.1f MB into %s in %.1f s",
            uri,
            result.bytes_total / 1e6,
            result.directory,
            time.monotonic() - started,
        )
    else:
        log.info("model %s: using the cached copy in %s", uri, result.directory)
    return str(result.directory)
