"""`--model s3://bucket/prefix`: the weights fetched once into the model cache, then loaded
from there like any local path.

The cache directory is `DYN_MODEL_CACHE` (the operator points it at the pod's cache volume),
else `~/.cache/dynamo/models`. Each source gets a directory named by a digest of its URI;
a download lands in a temporary directory beside it and is renamed into place only once every
object is written, so a killed download never leaves a directory that looks complete. The
objects are fetched with the LoRA downloader's S3 code: the same credentials
(`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_ENDPOINT_URL`, ...), endpoint checks and
key validation.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from pathlib import Path

from dynamo.common.lora.s3_source import download_s3

MODEL_CACHE_ENV = "DYN_MODEL_CACHE"

log = logging.getLogger(__name__)


def model_cache() -> Path:
    configured = os.environ.get(MODEL_CACHE_ENV, "").strip()
    return Path(configured) if configured else Path.home() / ".cache" / "dynamo" / "models"


async def fetch_s3_model(uri: str) -> str:
    """The local directory holding the objects under `uri`, downloaded unless cached."""
    root = model_cache()
    dest = root / hashlib.sha256(uri.encode()).hexdigest()[:16]
    if dest.is_dir():
        log.info("model %s: using the cached copy in %s", uri, dest)
        return str(dest)
    temp = root / f".{dest.name}.partial-{os.getpid()}"
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir(parents=True)
    started = time.monotonic()
    log.info("model %s: downloading into %s", uri, dest)
    try:
        await download_s3(uri, temp)
        temp.rename(dest)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    log.info("model %s: %.1f MB in %.1f s", uri, size / 1e6, time.monotonic() - started)
    return str(dest)
