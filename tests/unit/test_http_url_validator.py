"""SSRF policy: which URLs and local paths `validate_url` / `validate_media_url` accept.

Host names are resolved through stub resolvers (no DNS traffic); the stub records what it
was asked, so tests can also prove that IP literals and blocked names never reach DNS.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dynamo.common.http import UrlValidationError, UrlValidationPolicy, validate_url
from dynamo.common.http.url_validator import (
    describe_media_source,
    is_blocked_ip,
    parse_ip_literal,
    validate_local_path,
    validate_media_url,
)

pytestmark = pytest.mark.unit


class StubResolver:
    """Answers from a fixed table and records every host it is asked about."""

    def __init__(self, table: dict[str, list[str]]) -> None:
        self.table = table
        self.asked: list[str] = []

    async def __call__(self, host: str) -> Iterable[str]:
        self.asked.append(host)
        if host not in self.table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return self.table[host]


PUBLIC_TABLE = {
    "images.example.com": ["93.184.215.14"],
    "cdn.example.org": ["2606:2800:21f:cb07:6820:80da:af6b:8b2c", "93.184.215.14"],
    "rebind.example.com": ["93.184.215.14", "10.1.2.3"],
    "metadata-alias.example.com": ["169.254.169.254"],
    "internal.example.com": ["192.168.1.20"],
    "v6-local.example.com": ["fd00::1"],
    "mapped.example.com": ["::ffff:127.0.0.1"],
}


def strict_policy(resolver: StubResolver) -> UrlValidationPolicy:
    return UrlValidationPolicy(resolver=resolver)


# Every one of these must be refused by the default policy, with the reason in the message.
REFUSED = [
    ("https://169.254.169.254/latest/meta-data/", "blocked range"),  # cloud metadata
    ("https://169.254.170.2/v2/credentials", "blocked range"),  # ECS credentials
    ("https://10.0.0.5/a.png", "blocked range"),
    ("https://172.16.3.4/a.png", "blocked range"),
    ("https://172.31.255.255/a.png", "blocked range"),
    ("https://192.168.0.1/a.png", "blocked range"),
    ("https://100.64.0.1/a.png", "blocked range"),  # CGNAT
    ("https://127.0.0.1/a.png", "blocked range"),
    ("https://127.8.9.10/a.png", "blocked range"),
    ("https://0.0.0.0/a.png", "blocked range"),
    ("https://224.0.0.1/a.png", "blocked range"),
    ("https://255.255.255.255/a.png", "blocked range"),
    ("https://198.18.0.1/a.png", "blocked range"),
    ("https://[::1]/a.png", "blocked range"),  # IPv6 loopback
    ("https://[::]/a.png", "blocked range"),
    ("https://[fd12:3456::1]/a.png", "blocked range"),  # IPv6 unique-local
    ("https://[fe80::1]/a.png", "blocked range"),  # IPv6 link-local
    ("https://[ff02::1]/a.png", "blocked range"),
    ("https://[::ffff:127.0.0.1]/a.png", "blocked range"),  # IPv4-mapped loopback
    ("https://[::ffff:169.254.169.254]/a.png", "blocked range"),  # IPv4-mapped metadata
    ("https://[::ffff:8.8.8.8]/a.png", "blocked range"),  # all IPv4-mapped
    ("https://[2002:a9fe:a9fe::1]/a.png", "blocked range"),  # 6to4 -> 169.254.169.254
    ("https://[64:ff9b::a00:1]/a.png", "blocked range"),  # NAT64 -> 10.0.0.1
    ("https://2130706433/a.png", "blocked range"),  # decimal 127.0.0.1
    ("https://2852039166/a.png", "blocked range"),  # decimal 169.254.169.254
    ("https://0x7f000001/a.png", "blocked range"),  # hex
    ("https://0x7f.0.0.1/a.png", "blocked range"),
    ("https://0177.0.0.1/a.png", "blocked range"),  # octal
    ("https://0251.0376.0251.0376/a.png", "blocked range"),  # octal metadata
    ("https://127.1/a.png", "blocked range"),  # short form
    ("https://10.1/a.png", "blocked range"),
    ("https://localhost/a.png", "is blocked"),
    ("https://LOCALHOST/a.png", "is blocked"),
    ("https://localhost./a.png", "is blocked"),  # trailing dot
    ("https://localhost.localdomain/a.png", "is blocked"),
    ("https://ip6-localhost/a.png", "is blocked"),
    ("https://ip6-loopback/a.png", "is blocked"),
    ("https://metadata/computeMetadata/v1/", "is blocked"),
    ("https://metadata.google.internal/computeMetadata/v1/", "is blocked"),
    ("https://metadata.goog/", "is blocked"),
    ("https://kubernetes.default/api", "is blocked"),
    ("https://kubernetes.default.svc/api", "is blocked"),
    ("https://user:pw@localhost:8443/a.png", "is blocked"),
    ("https://rebind.example.com/a.png", "resolves to blocked IP '10.1.2.3'"),
    ("https://metadata-alias.example.com/", "resolves to blocked IP '169.254.169.254'"),
    ("https://internal.example.com/a.png", "resolves to blocked IP"),
    ("https://v6-local.example.com/a.png", "resolves to blocked IP 'fd00::1'"),
    ("https://mapped.example.com/a.png", "resolves to blocked IP"),
    ("https://nowhere.example.com/a.png", "Could not resolve host 'nowhere.example.com'"),
    ("http://images.example.com/a.png", "set DYN_MM_ALLOW_INTERNAL=1 to enable"),
    ("ftp://images.example.com/a.png", "URL scheme 'ftp' not allowed"),
    ("file:///etc/passwd", "URL scheme 'file' not allowed"),
    ("gopher://images.example.com/", "URL scheme 'gopher' not allowed"),
    ("/etc/passwd", "URL scheme '' not allowed"),
    ("https:///a.png", "URL has no host component"),
    ("https://169.254.169.254\\@images.example.com/", "invalid host"),  # parser differential
    ("https://images.exa mple.com/", "invalid host"),
    ("https://[::1/a.png", "URL is malformed"),
    ("https://a..b/", "invalid host"),
    ("https://\u24dbocalhost/a.png", "is blocked"),  # circled l: IDNA folds it to localhost
    ("https://\uff11\uff12\uff17.0.0.1/a.png", "blocked range"),  # fullwidth 127
    ("", "URL is empty"),
]


@pytest.mark.parametrize(("url", "reason"), REFUSED)
async def test_default_policy_refuses(url: str, reason: str) -> None:
    resolver = StubResolver(PUBLIC_TABLE)
    with pytest.raises(UrlValidationError, match=_escaped(reason)):
        await validate_url(url, strict_policy(resolver))


def _escaped(text: str) -> str:
    import re

    return re.escape(text)


@pytest.mark.parametrize(
    "url",
    [
        "https://images.example.com/a.png",
        "https://IMAGES.example.com:8443/a.png?x=1",
        "https://cdn.example.org/v.mp4",
        "https://93.184.215.14/a.png",
        "https://[2606:2800:21f:cb07:6820:80da:af6b:8b2c]/a.png",
        "https://1572394766/a.png",  # decimal spelling of a public address
        "data:image/png;base64,iVBORw0KGgo=",
        "DATA:text/plain,hello",
    ],
)
async def test_default_policy_allows_public_hosts(url: str) -> None:
    resolver = StubResolver(PUBLIC_TABLE)
    assert await validate_url(url, strict_policy(resolver)) == url


async def test_ip_literals_and_blocked_names_never_reach_the_resolver() -> None:
    resolver = StubResolver(PUBLIC_TABLE)
    policy = strict_policy(resolver)
    for url in ("https://169.254.169.254/", "https://2130706433/", "https://localhost/"):
        with pytest.raises(UrlValidationError):
            await validate_url(url, policy)
    assert await validate_url("https://93.184.215.14/", policy)
    assert resolver.asked == []
    await validate_url("https://images.example.com/", policy)
    assert resolver.asked == ["images.example.com"]


async def test_every_resolved_address_must_be_public() -> None:
    # One public and one private answer: an attacker controlling DNS could pick either.
    resolver = StubResolver({"split.example.com": ["8.8.8.8", "172.20.0.1"]})
    with pytest.raises(UrlValidationError, match=r"172\.20\.0\.1"):
        await validate_url("https://split.example.com/", strict_policy(resolver))


async def test_resolver_returning_nothing_or_garbage_is_refused() -> None:
    resolver = StubResolver({"empty.example.com": [], "junk.example.com": ["not-an-ip"]})
    policy = strict_policy(resolver)
    with pytest.raises(UrlValidationError, match="no addresses"):
        await validate_url("https://empty.example.com/", policy)
    with pytest.raises(UrlValidationError, match="non-address"):
        await validate_url("https://junk.example.com/", policy)


async def test_default_policy_refuses_loopback() -> None:
    # The real default policy and resolver (getaddrinfo), no stub.
    policy = UrlValidationPolicy()
    with pytest.raises(UrlValidationError, match="is blocked"):
        await validate_url("https://localhost/", policy)
    for url in ("https://127.0.0.1:9/", "https://[::1]:9/", "http://127.0.0.1:9/"):
        with pytest.raises(UrlValidationError):
            await validate_url(url, policy)
    # This machine's own name resolves (via /etc/hosts) to loopback or a private address,
    # or not at all: refused either way.
    with pytest.raises(UrlValidationError):
        await validate_url(f"https://{socket.gethostname()}/", policy)


async def test_allow_private_ips_and_http_open_everything_up() -> None:
    resolver = StubResolver({})
    policy = UrlValidationPolicy(allow_http=True, allow_private_ips=True, resolver=resolver)
    for url in (
        "http://169.254.169.254/latest/meta-data/",
        "http://localhost:8080/",
        "http://[::1]/",
        "http://unresolvable.internal/",
    ):
        assert await validate_url(url, policy) == url
    assert resolver.asked == []  # trusted mode does no DNS at all
    # Non-http schemes stay refused even then.
    with pytest.raises(UrlValidationError, match="scheme 'file'"):
        await validate_url("file:///etc/passwd", policy)


async def test_allowed_networks_exempt_only_those_networks() -> None:
    resolver = StubResolver({"svc.example.com": ["127.0.0.1"], "other.example.com": ["10.0.0.9"]})
    policy = UrlValidationPolicy(
        allow_http=True,
        allowed_networks=(ipaddress.ip_network("127.0.0.1/32"),),
        resolver=resolver,
    )
    assert await validate_url("http://127.0.0.1:8080/x", policy)
    assert await validate_url("http://svc.example.com/x", policy)
    for url in ("http://127.0.0.2/", "http://other.example.com/", "http://169.254.169.254/"):
        with pytest.raises(UrlValidationError):
            await validate_url(url, policy)
    # Blocked host names stay blocked even when their address is exempt.
    with pytest.raises(UrlValidationError, match="is blocked"):
        await validate_url("http://localhost/", policy)


def test_allowed_networks_accept_strings() -> None:
    policy = UrlValidationPolicy(allowed_networks=("10.0.0.0/8",))  # type: ignore[arg-type]
    assert policy.allowed_networks == (ipaddress.ip_network("10.0.0.0/8"),)
    assert not policy.is_blocked_address(ipaddress.ip_address("10.2.3.4"))
    assert policy.is_blocked_address(ipaddress.ip_address("192.168.0.1"))


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("127.0.0.1", "127.0.0.1"),
        ("2130706433", "127.0.0.1"),
        ("0x7f000001", "127.0.0.1"),
        ("0X7F.0.0.1", "127.0.0.1"),
        ("0177.0.0.01", "127.0.0.1"),
        ("127.1", "127.0.0.1"),
        ("127.0.1", "127.0.0.1"),
        ("10.65535", "10.0.255.255"),
        ("0", "0.0.0.0"),
        ("::1", "::1"),
        ("example.com", None),
        ("1.2.3.4.5", None),
        ("256.1.1.1", None),
        ("4294967296", None),
        ("08.0.0.1", None),  # 8 is not an octal digit
        ("1..2", None),
        ("12abc", None),
    ],
)
def test_parse_ip_literal(host: str, expected: str | None) -> None:
    parsed = parse_ip_literal(host)
    assert (str(parsed) if parsed is not None else None) == expected


@pytest.mark.parametrize(
    "ip_text",
    [
        "10.1.2.3",  # private
        "172.16.0.1",
        "192.168.1.1",
        "100.64.0.1",  # CGNAT
        "127.0.0.1",  # loopback
        "169.254.169.254",  # link-local (cloud metadata)
        "224.0.0.1",  # multicast
        "240.0.0.1",  # reserved
        "255.255.255.255",
        "0.0.0.0",  # unspecified
        "::",
        "::1",
        "fd00::1",  # unique-local
        "fe80::1",
        "fe80::1%eth0",  # with a zone
        "ff02::1",
        "::ffff:127.0.0.1",  # IPv4-mapped
        "::ffff:10.0.0.1",
        "::ffff:8.8.8.8",  # every IPv4-mapped address, as in BLOCKED_NETWORKS
        "2002:a9fe:a9fe::1",  # 6to4 of 169.254.169.254
        "64:ff9b::a00:1",  # NAT64 of 10.0.0.1
        "127.1",  # inet_aton spellings are addresses too
        "2130706433",
    ],
)
def test_is_blocked_ip_blocks_internal_addresses(ip_text: str) -> None:
    assert is_blocked_ip(ip_text)


@pytest.mark.parametrize(
    "ip_text",
    [
        "8.8.8.8",
        "93.184.215.14",
        "2606:2800:21f:cb07:6820:80da:af6b:8b2c",
        "2001:4860:4860::8888",
        # Not IP addresses at all: False, not an error.
        "",
        "localhost",
        "metadata.google.internal",
        "not-an-ip",
        "[::1]",
        " 127.0.0.1",
        "127.0.0.1:80",
        "10.0.0.0/8",
        "0x 7f.0.0.1",  # int() would take the space
        "0x7f_00_00_01",  # and the underscores
        "\u0661\u0662\u0667.0.0.1",  # and non-ASCII digits
    ],
)
def test_is_blocked_ip_passes_public_addresses_and_non_addresses(ip_text: str) -> None:
    assert not is_blocked_ip(ip_text)


@given(st.ip_addresses(v=4))
def test_is_blocked_ip_covers_every_internal_ipv4_class(address: ipaddress.IPv4Address) -> None:
    internal = (
        address.is_private
        or address.is_loopback
        or address.is_link_local
        or address.is_multicast
        or address.is_reserved
        or address.is_unspecified
    )
    if internal:
        assert is_blocked_ip(str(address))
    # An IPv4-mapped IPv6 address is never a way around the check.
    assert is_blocked_ip(f"::ffff:{address}")


@given(st.ip_addresses())
def test_is_blocked_ip_is_the_default_policys_classification(
    address: ipaddress.IPv4Address | ipaddress.IPv6Address,
) -> None:
    # One classification: the bare helper and the default policy never disagree.
    assert is_blocked_ip(str(address)) == UrlValidationPolicy().is_blocked_address(address)


def test_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DYN_MM_ALLOW_INTERNAL", raising=False)
    monkeypatch.delenv("DYN_MM_LOCAL_PATH", raising=False)
    assert UrlValidationPolicy.from_env() == UrlValidationPolicy()
    monkeypatch.setenv("DYN_MM_ALLOW_INTERNAL", "1")
    monkeypatch.setenv("DYN_MM_LOCAL_PATH", "  /srv/media  ")
    policy = UrlValidationPolicy.from_env()
    assert policy.allow_http
    assert policy.allow_private_ips
    assert policy.allowed_local_path == "/srv/media"
    # Exactly "1": other truthy spellings do not open the policy.
    for value in ("true", "yes", " 1", "on"):
        monkeypatch.setenv("DYN_MM_ALLOW_INTERNAL", value)
        assert not UrlValidationPolicy.from_env().allow_http
    monkeypatch.setenv("DYN_MM_LOCAL_PATH", "   ")
    assert UrlValidationPolicy.from_env().allowed_local_path is None


def test_local_paths_need_an_allowed_directory(tmp_path: Path) -> None:
    media = tmp_path / "media"
    media.mkdir()
    inside = media / "clip.wav"
    inside.write_bytes(b"x")
    outside = tmp_path / "secret.txt"
    outside.write_text("secret")
    (media / "escape").symlink_to(outside)

    with pytest.raises(UrlValidationError, match="set DYN_MM_LOCAL_PATH to enable"):
        validate_local_path(str(inside), UrlValidationPolicy())
    policy = UrlValidationPolicy(allowed_local_path=str(media))
    assert validate_local_path(str(inside), policy) == inside.resolve()
    with pytest.raises(UrlValidationError, match="outside the allowed directory"):
        validate_local_path(str(outside), policy)
    with pytest.raises(UrlValidationError, match="outside the allowed directory"):
        validate_local_path(str(media / "escape"), policy)  # symlink out of the directory
    with pytest.raises(UrlValidationError, match="outside the allowed directory"):
        validate_local_path(str(media / ".." / "secret.txt"), policy)
    with pytest.raises(UrlValidationError, match="File not found"):
        validate_local_path(str(media / "missing.wav"), policy)
    with pytest.raises(UrlValidationError, match="Invalid path"):
        validate_local_path(str(media / "a\x00b"), policy)
    gone = UrlValidationPolicy(allowed_local_path=str(tmp_path / "nope"))
    with pytest.raises(UrlValidationError, match="allowed_local_path does not exist"):
        validate_local_path(str(inside), gone)


async def test_validate_media_url_canonicalises_local_references(tmp_path: Path) -> None:
    media = tmp_path / "my media"
    media.mkdir()
    clip = media / "a b.wav"
    clip.write_bytes(b"x")
    policy = UrlValidationPolicy(allowed_local_path=str(media), resolver=StubResolver(PUBLIC_TABLE))
    assert await validate_media_url(str(clip), policy) == clip.resolve().as_uri()
    assert await validate_media_url(clip.as_uri(), policy) == clip.resolve().as_uri()
    (tmp_path / "secret").write_text("s")
    with pytest.raises(UrlValidationError, match="outside"):
        await validate_media_url(media.as_uri() + "/%2e%2e/secret", policy)
    with pytest.raises(UrlValidationError, match="blocked range"):
        await validate_media_url("https://10.0.0.1/", policy)
    assert await validate_media_url("https://images.example.com/a", policy)


def test_describe_media_source_bounds_labels() -> None:
    payload = "data:image/png;base64," + "A" * 100_000
    label = describe_media_source(payload)
    assert label == f"data:image/png ({len(payload)} chars, payload elided)"
    long_url = "https://example.com/" + "x" * 500
    assert describe_media_source(long_url).endswith(f"... ({len(long_url)} chars)")
    assert len(describe_media_source(long_url)) < 200
    assert describe_media_source("https://a/b") == "https://a/b"
