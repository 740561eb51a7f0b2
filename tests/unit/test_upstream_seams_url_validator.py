"""Host resolution in `url_validator` goes through the module's own `socket`.

Upstream's tests replace `dynamo.common.http.url_validator.socket.getaddrinfo` to decide
what a host name resolves to; code written against upstream does the same. That replacement
must be what `validate_url` consults, and its answers must be judged by the one
classification `is_blocked_ip` also uses. The same fake answers are given to upstream's
1.6.1 `validate_url`, in its own venv, and the verdicts compared.
"""

from __future__ import annotations

import socket
import sys
from typing import Any

import pytest

from dynamo.common.http import url_validator
from dynamo.common.http.url_validator import (
    UrlValidationError,
    UrlValidationPolicy,
    is_blocked_ip,
    validate_url,
)
from support.upstream import run_json_driver, upstream_python

pytestmark = pytest.mark.unit

URL = "https://media.example.com/x.png"


def _answers(addresses: list[str], asked: list[str]) -> Any:
    """A `getaddrinfo` stand-in: `addresses` for any host, recording the hosts asked."""

    def getaddrinfo(host: str, *_: Any, **__: Any) -> list[tuple[Any, ...]]:
        asked.append(host)
        return [
            (socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, 0))
            for a in addresses
        ]

    return getaddrinfo


@pytest.mark.parametrize(
    ("addresses", "refused"),
    [
        (["93.184.216.34"], False),
        (["2606:4700:4700::1111"], False),
        (["10.0.0.5"], True),
        # One internal address among public ones is enough to refuse the host.
        (["8.8.8.8", "169.254.169.254"], True),
        (["::ffff:127.0.0.1"], True),
    ],
)
async def test_validate_url_resolves_through_the_modules_socket(
    monkeypatch: pytest.MonkeyPatch, addresses: list[str], refused: bool
) -> None:
    asked: list[str] = []
    monkeypatch.setattr(url_validator.socket, "getaddrinfo", _answers(addresses, asked))
    if refused:
        with pytest.raises(UrlValidationError, match="blocked IP"):
            await validate_url(URL, UrlValidationPolicy())
    else:
        assert await validate_url(URL, UrlValidationPolicy()) == URL
    assert asked == ["media.example.com"]


async def test_a_failed_lookup_is_a_validation_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*_: Any, **__: Any) -> Any:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(url_validator.socket, "getaddrinfo", fail)
    with pytest.raises(UrlValidationError, match="Could not resolve"):
        await validate_url(URL, UrlValidationPolicy())


async def test_no_lookup_when_private_addresses_are_allowed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[str] = []
    monkeypatch.setattr(url_validator.socket, "getaddrinfo", _answers(["10.0.0.5"], asked))
    assert await validate_url(URL, UrlValidationPolicy(allow_private_ips=True)) == URL
    assert asked == []


@pytest.mark.parametrize(
    "address",
    [
        "8.8.8.8",
        "127.0.0.1",
        "100.64.0.1",
        "192.0.2.1",
        "224.0.0.1",
        "fe80::1",
        "fc00::1",
        "2002:a00:1::",  # 6to4, tunnelling to 10.0.0.1
        "64:ff9b::a00:1",  # NAT64, likewise
        "2606:4700:4700::1111",
    ],
)
async def test_a_resolved_address_is_judged_as_is_blocked_ip_judges_it(
    monkeypatch: pytest.MonkeyPatch, address: str
) -> None:
    monkeypatch.setattr(url_validator.socket, "getaddrinfo", _answers([address], []))
    try:
        await validate_url(URL, UrlValidationPolicy())
        refused = False
    except UrlValidationError:
        refused = True
    assert refused == is_blocked_ip(address)


# --- against upstream's 1.6.1 validate_url ------------------------------------------------------

# Runs unchanged in both venvs: each case is the list `getaddrinfo` answers with (None: the
# lookup fails); the verdict is "ok" or "refused".
_DRIVER = """
import asyncio, json, socket
from unittest.mock import patch
from dynamo.common.http.url_validator import UrlValidationError, UrlValidationPolicy, validate_url

def answers(addresses):
    def getaddrinfo(host, *args, **kwargs):
        if addresses is None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        family = lambda a: socket.AF_INET6 if ":" in a else socket.AF_INET
        return [(family(a), socket.SOCK_STREAM, 6, "", (a, 0)) for a in addresses]
    return getaddrinfo

async def verdict(addresses):
    with patch("dynamo.common.http.url_validator.socket.getaddrinfo", answers(addresses)):
        try:
            await validate_url("https://media.example.com/x.png", UrlValidationPolicy())
        except UrlValidationError:
            return "refused"
    return "ok"

async def main():
    print(json.dumps([await verdict(case) for case in json.loads(input())]))

asyncio.run(main())
"""

# Where 1.6.1 and this project agree. Beyond upstream, this project also refuses 6to4 and
# NAT64 addresses that tunnel to internal IPv4 ones and a lookup that returns nothing
# (see url_validator's module docstring); those are left out here.
_CASES: list[list[str] | None] = [
    ["93.184.216.34"],
    ["2606:4700:4700::1111"],
    ["8.8.8.8", "1.1.1.1"],
    ["10.0.0.5"],
    ["172.16.5.5"],
    ["192.168.1.1"],
    ["127.0.0.1"],
    ["169.254.169.254"],
    ["8.8.8.8", "169.254.169.254"],
    ["100.64.0.1"],
    ["0.0.0.0"],
    ["192.0.2.1"],
    ["198.18.0.1"],
    ["224.0.0.1"],
    ["240.0.0.1"],
    ["::1"],
    ["::ffff:127.0.0.1"],
    ["fe80::1"],
    ["fc00::1"],
    None,
]


def _run_driver(python: str) -> list[str]:
    verdicts: list[str] = run_json_driver(python, _DRIVER, _CASES)
    return verdicts


def test_verdicts_on_patched_lookups_match_upstream() -> None:
    upstream = _run_driver(str(upstream_python()))
    ours = _run_driver(sys.executable)
    for case, mine, theirs in zip(_CASES, ours, upstream, strict=True):
        assert mine == theirs, f"getaddrinfo answering {case}"
