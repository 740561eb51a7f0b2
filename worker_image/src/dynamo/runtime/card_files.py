"""The model-card files a worker serves from its system server, as upstream self-hosts them.

A model card names its files (config.json, tokenizer.json, tokenizer_config.json, the chat
template, generation_config.json) as upstream's CheckedFile, `{"path", "checksum":
"blake3:<hex>", "size"}`; the frontend fetches `path`, re-hashes it and rejects a mismatch.
A local path only works for a frontend on this machine's filesystem (file and mem discovery).
Under Kubernetes discovery the frontend runs in another pod, so the cards name
`http://<advertised host>:<system port>/v1/metadata/<namespace>/<component>/<endpoint>/<card
slug>/<suffix>/<file name>` instead (the suffix is an adapter card's slug, `_base` on the base
card), with the same checksum and size, and the system server answers those paths with the
file's bytes.

The server looks a request up in an allow-list built from the cards themselves: each key is a
URL's six segments and maps to the local path the card names, so no part of a URL ever reaches
the filesystem; every other path is 404.
"""

from __future__ import annotations

import copy
import ipaddress
import logging
import os
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any, NamedTuple
from urllib.parse import quote

from dynamo.runtime.tcp_plane import address

logger = logging.getLogger(__name__)

# The suffix segment of the base model's files (upstream's sentinel); no adapter slug can
# equal it, since slugs never start with an underscore.
BASE_SUFFIX = "_base"
ROUTE_PREFIX = "/v1/metadata"
# The card fields holding CheckedFiles, each `{<variant>: CheckedFile}`; the chat template's
# variant wraps it as `{"is_custom": bool, "file": CheckedFile}`.
_FILE_FIELDS = ("model_info", "tokenizer", "prompt_formatter", "chat_template_file", "gen_config")


class CardFileKey(NamedTuple):
    """The six path segments after `/v1/metadata` that one card file is served under."""

    namespace: str
    component: str
    endpoint: str
    model_slug: str
    model_suffix: str
    filename: str

    def url(self, base_url: str) -> str:
        """`<base_url>/v1/metadata/<segments>`, each segment percent-encoded on its own."""
        return base_url + ROUTE_PREFIX + "".join("/" + quote(part, safe="") for part in self)


def checked_files(card: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The CheckedFile objects a card (`card_json`) names, in card order (the objects
    themselves, so that a caller holding a copy of the card can rewrite their paths)."""
    found: list[dict[str, Any]] = []
    for field_name in _FILE_FIELDS:
        variants = card.get(field_name)
        if not isinstance(variants, dict):
            continue
        for value in variants.values():
            entry = value.get("file") if isinstance(value, dict) and "file" in value else value
            if isinstance(entry, dict) and isinstance(entry.get("path"), str):
                found.append(entry)
    return found


def allow_list(metadata: Mapping[str, Any]) -> dict[CardFileKey, Path]:
    """What the system server may answer: each local file the cards of `metadata` (a
    DiscoveryMetadata with local paths) name, by the key its URL carries."""
    out: dict[CardFileKey, Path] = {}
    for key, entry in _local_files(metadata):
        path = Path(entry["path"])
        if out.setdefault(key, path) != path:
            raise ValueError(
                f"two files of one card are both served as {key.url('')}: {out[key]} and {path};"
                " a card names each file name once"
            )
    return out


def with_urls(metadata: Mapping[str, Any], base_url: str) -> dict[str, Any]:
    """A copy of `metadata` whose cards name each local file by its URL under `base_url`
    (`http://host:port` of the system server); checksums and sizes are kept."""
    out = copy.deepcopy(dict(metadata))
    for key, entry in list(_local_files(out)):
        entry["path"] = key.url(base_url)
    return out


def card_file_base_url(
    discovery_backend: str,
    system_host: str,
    system_port: int | None,
    environ: Mapping[str, str],
) -> str | None:
    """Where the frontend fetches card files: `http://<host>:<system port>` when it runs on
    another machine (Kubernetes discovery), None when the cards keep local paths.

    File and mem discovery share this machine's filesystem with their readers, so they keep
    local paths. The host is chosen as the TCP request plane advertises its own: the bound
    host, or `POD_IP` when bound to a wildcard; an IPv6 address is bracketed.
    """
    if discovery_backend.strip().lower() != "kubernetes":
        return None
    if system_port is None:
        logger.warning(
            "Kubernetes discovery without a system status server (DYN_SYSTEM_PORT < 0): the"
            " model cards name local file paths, which a frontend in another pod cannot read;"
            " set DYN_SYSTEM_PORT to serve them"
        )
        return None
    try:
        host = address.advertised_host(system_host, environ)
    except ValueError:
        raise ValueError(
            f"DYN_SYSTEM_HOST {system_host!r} (or POD_IP {environ.get('POD_IP', '')!r} when it is"
            " a wildcard) is neither an IP address nor a resolvable host name, so the model"
            " cards' file URLs cannot name this worker; set it to this worker's IP address"
        ) from None
    shown = f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    return f"http://{shown}:{system_port}"


def _local_files(metadata: Mapping[str, Any]) -> list[tuple[CardFileKey, dict[str, Any]]]:
    """(key, CheckedFile) for every file the cards name by an absolute local path (a URL,
    e.g. hf:// or one already rewritten, is not ours to serve)."""
    found: list[tuple[CardFileKey, dict[str, Any]]] = []
    for record in metadata.get("model_cards", {}).values():
        card = record["card_json"]
        suffix = record.get("model_suffix") or BASE_SUFFIX
        for entry in checked_files(card):
            if not os.path.isabs(entry["path"]):
                continue
            key = CardFileKey(
                record["namespace"],
                record["component"],
                record["endpoint"],
                card["slug"],
                suffix,
                PurePosixPath(entry["path"]).name,
            )
            found.append((key, entry))
    return found
