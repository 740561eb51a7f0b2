"""Card capture: the model cards the worker's pods last published, and their files.

While a worker pod is ready, the activator keeps a copy of the model cards it published
(its DiscoveryMetadata's `model_cards`; the endpoints are the pod's own, and its event
channels point at sockets that go with it, so both are left out), fetches every file those
cards name by `http://` URL from the pod's system server, checks each against the card's
blake3 checksum and size, and keeps the bytes. The kept cards name the files by URL on the
activator's own system server (the path after the host is the pod's, so the same route as
`dynamo.runtime.card_files` answers it), which is what the frontend fetches while the pods
are gone. A capture that fails keeps the previous cards.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

import aiohttp
from blake3 import blake3

from dynamo.runtime.card_files import ROUTE_PREFIX, CardFileKey, checked_files

log = logging.getLogger(__name__)

# Card files are configs and tokenizers; a bound keeps a broken pod from filling memory.
MAX_FILE_BYTES = 256 * 2**20


class CaptureError(RuntimeError):
    """A card file could not be fetched or did not match its checksum."""


@dataclass(frozen=True)
class CapturedCards:
    """Model-card records (by the pod's keys) naming files by URL under `base_url`."""

    source_pod: str
    records: dict[str, dict[str, Any]]
    files: dict[CardFileKey, bytes]

    def listing(self, created: int) -> dict[str, Any]:
        """An OpenAI `/v1/models` body: the base models, then adapters (with their parent),
        like the worker's own listing."""
        bases = sorted(
            r["card_json"]["display_name"] for r in self.records.values() if not _is_adapter(r)
        )
        adapters = sorted(
            r["card_json"]["display_name"] for r in self.records.values() if _is_adapter(r)
        )
        data: list[dict[str, Any]] = [
            {"id": name, "object": "model", "created": created, "owned_by": "dynamo"}
            for name in bases
        ]
        for name in adapters:
            entry = {"id": name, "object": "model", "created": created, "owned_by": "dynamo"}
            if len(bases) == 1:
                entry["parent"] = bases[0]
            data.append(entry)
        return {"object": "list", "data": data}


def _is_adapter(record: Mapping[str, Any]) -> bool:
    return bool(record.get("model_suffix"))


def file_key(url: str) -> CardFileKey | None:
    """The six route segments of a card-file URL, or None for any other URL."""
    path = urlsplit(url).path
    if not path.startswith(ROUTE_PREFIX + "/"):
        return None
    parts = [unquote(part) for part in path[len(ROUTE_PREFIX) + 1 :].split("/")]
    if len(parts) != 6 or not all(parts):
        return None
    return CardFileKey(*parts)


def rewrite(records: Mapping[str, Any], base_url: str) -> dict[str, dict[str, Any]]:
    """A copy of the model-card records whose card-file URLs point under `base_url`."""
    out = copy.deepcopy(dict(records))
    for record in out.values():
        for entry in checked_files(record.get("card_json") or {}):
            key = file_key(entry["path"])
            if key is not None:
                entry["path"] = key.url(base_url)
    return out


async def capture(
    session: aiohttp.ClientSession, pod_name: str, metadata: Mapping[str, Any], base_url: str
) -> CapturedCards:
    """Fetch every card file `metadata` names by URL and return the cards rewritten to
    `base_url`. CaptureError when a file cannot be fetched or does not match its card."""
    records = dict(metadata.get("model_cards") or {})
    if not records:
        raise CaptureError(f"pod {pod_name} published no model card")
    files: dict[CardFileKey, bytes] = {}
    for record in records.values():
        for entry in checked_files(record.get("card_json") or {}):
            key = file_key(entry["path"])
            if key is None or key in files:
                continue  # a local path or hf:// URL is not fetchable here; keep it as is
            files[key] = await _fetch(session, entry)
    return CapturedCards(pod_name, rewrite(records, base_url), files)


async def _fetch(session: aiohttp.ClientSession, entry: Mapping[str, Any]) -> bytes:
    url = entry["path"]
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=60)) as response:
            if response.status != 200:
                raise CaptureError(f"GET {url}: HTTP {response.status}")
            body = await response.content.read(MAX_FILE_BYTES + 1)
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise CaptureError(f"GET {url}: {exc!r}") from exc
    if len(body) > MAX_FILE_BYTES:
        raise CaptureError(f"GET {url}: larger than {MAX_FILE_BYTES} bytes")
    size, checksum = entry.get("size"), entry.get("checksum")
    if isinstance(size, int) and size != len(body):
        raise CaptureError(f"GET {url}: {len(body)} bytes, the card says {size}")
    digest = checksum.removeprefix("blake3:") if isinstance(checksum, str) else None
    if digest and checksum != digest and blake3(body).hexdigest() != digest:
        raise CaptureError(f"GET {url}: the bytes do not match the card's {checksum}")
    return body
