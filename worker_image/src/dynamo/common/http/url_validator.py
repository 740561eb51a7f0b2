"""SSRF policy for user-supplied media URLs and local paths.

By default (`UrlValidationPolicy()`) only `https://` and `data:` URLs pass; private,
loopback, link-local (cloud metadata) and other internal addresses are refused, and so is
local filesystem access. `UrlValidationPolicy.from_env()` loosens that from `DYN_MM_*`.

Every check that needs a host name resolved goes through the policy's `resolver`
(default: `socket.getaddrinfo`, off the event loop), so tests can substitute a stub resolver.

Beyond upstream (which relies on `ipaddress.ip_address` plus `getaddrinfo`):

* numeric host spellings that `inet_aton` accepts (`2130706433`, `0x7f.1`, `0177.0.0.1`)
  are decoded and checked as IP literals here, not left to whatever resolver runs;
* IPv6 addresses that embed an IPv4 address (6to4 `2002::/16`, NAT64 `64:ff9b::/96`) are
  also checked by their embedded IPv4 address;
* a trailing dot on a host name (`localhost.`) does not slip past the blocked-name list;
* `allowed_networks` exempts chosen networks (e.g. one internal CDN subnet, or loopback in
  tests) without turning off the whole policy the way `allow_private_ips` does.

DNS rebinding between this check and the client's own connect is not prevented (as upstream).
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final
from urllib.parse import ParseResult, unquote, urlparse

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

#: Resolves a host name to the IP addresses (as text) a client would connect to.
Resolver = Callable[[str], Awaitable[Iterable[str]]]

#: Longest number of redirects `HttpClient.fetch_bytes(policy=...)` follows.
MAX_REDIRECTS: Final = 3


class UrlValidationError(ValueError):
    """A URL or filesystem path failed the configured policy (a client error, not a 500)."""


# Ranges a user-controlled URL must never reach: RFC 1918 private, RFC 6598 CGNAT, loopback,
# link-local (169.254.169.254 is the AWS/GCP/Azure/OpenStack metadata address), documentation
# and benchmark ranges, multicast, reserved, broadcast; IPv6 unspecified, loopback,
# IPv4-mapped, unique-local, link-local and multicast.
BLOCKED_NETWORKS: Final[tuple[IPNetwork, ...]] = tuple(
    ipaddress.ip_network(net)
    for net in (
        "0.0.0.0/8",
        "10.0.0.0/8",
        "100.64.0.0/10",
        "127.0.0.0/8",
        "169.254.0.0/16",
        "172.16.0.0/12",
        "192.0.0.0/24",
        "192.0.2.0/24",
        "192.168.0.0/16",
        "198.18.0.0/15",
        "198.51.100.0/24",
        "203.0.113.0/24",
        "224.0.0.0/4",
        "240.0.0.0/4",
        "255.255.255.255/32",
        "::/128",
        "::1/128",
        "::ffff:0:0/96",
        "fc00::/7",
        "fe80::/10",
        "ff00::/8",
    )
)

# Names that reach internal services whatever DNS says. Compared lower-cased, without a
# trailing dot.
BLOCKED_HOSTS: Final = frozenset(
    {
        "localhost",
        "localhost.localdomain",
        "ip6-localhost",
        "ip6-loopback",
        "metadata",
        "metadata.google.internal",
        "metadata.goog",
        "kubernetes.default",
        "kubernetes.default.svc",
    }
)

_NAT64_PREFIX: Final = ipaddress.ip_network("64:ff9b::/96")

# Longest a client-supplied source may render inside an error message or a log line.
SOURCE_LABEL_LIMIT: Final = 120


def describe_media_source(source: str, limit: int = SOURCE_LABEL_LIMIT) -> str:
    """Render `source` as a bounded label that is safe to put in an error or a log line.

    A `data:` URL carries its whole payload inline, so it is described by media type and
    length, never by content; anything else longer than `limit` is truncated.
    """
    if source.startswith("data:"):
        media_type = source[len("data:") :].partition(",")[0].split(";")[0]
        media_type = media_type or "application/octet-stream"
        if len(media_type) > limit:
            media_type = f"{media_type[:limit]}... ({len(media_type)} chars)"
        return f"data:{media_type} ({len(source)} chars, payload elided)"
    if len(source) > limit:
        return f"{source[:limit]}... ({len(source)} chars)"
    return source


async def resolve_with_getaddrinfo(host: str) -> list[str]:
    """Default resolver: every address `getaddrinfo` returns for `host`, off the event loop.

    `socket.getaddrinfo` is looked up through this module at each call, so patching
    `url_validator.socket.getaddrinfo` (as upstream's tests do) replaces the lookup.
    """
    loop = asyncio.get_running_loop()
    infos = await loop.run_in_executor(None, socket.getaddrinfo, host, None)
    return [str(info[4][0]) for info in infos]


@dataclass(frozen=True)
class UrlValidationPolicy:
    """Which media URLs and local paths are allowed.

    `allow_http`: accept `http://` as well as `https://`.
    `allow_private_ips`: skip every address and host-name check (trusted deployments).
    `allowed_local_path`: directory local media may be read from; `None` refuses local media.
    `allowed_networks`: networks exempt from the blocked ranges while the rest of the policy
    stays in force (e.g. `ip_network("127.0.0.1/32")` for a loopback test server).
    `resolver`: how host names are resolved; defaults to `getaddrinfo`.
    """

    allow_http: bool = False
    allow_private_ips: bool = False
    allowed_local_path: str | None = None
    allowed_networks: tuple[IPNetwork, ...] = ()
    resolver: Resolver | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        # Accept networks spelled as strings too; a frozen dataclass needs object.__setattr__.
        networks = tuple(ipaddress.ip_network(net) for net in self.allowed_networks)
        object.__setattr__(self, "allowed_networks", networks)

    @classmethod
    def from_env(cls) -> UrlValidationPolicy:
        """Build a policy from `DYN_MM_ALLOW_INTERNAL` and `DYN_MM_LOCAL_PATH`.

        `DYN_MM_ALLOW_INTERNAL` must be exactly `1` to allow both `http://` and internal
        addresses; `DYN_MM_LOCAL_PATH` (stripped, empty means unset) enables local media.
        """
        allow_internal = os.environ.get("DYN_MM_ALLOW_INTERNAL", "0") == "1"
        return cls(
            allow_http=allow_internal,
            allow_private_ips=allow_internal,
            allowed_local_path=os.environ.get("DYN_MM_LOCAL_PATH", "").strip() or None,
        )

    def is_blocked_address(self, address: IPAddress) -> bool:
        """Whether connecting to `address` is refused under this policy."""
        if self.allow_private_ips:
            return False
        if any(address in net for net in self.allowed_networks):
            return False
        return _in_blocked_ranges(address)


def _in_blocked_ranges(address: IPAddress) -> bool:
    """Whether `address`, or the IPv4 address a 6to4/NAT64 address tunnels to, is blocked.

    The one classification behind every check here: `BLOCKED_NETWORKS`, with no policy
    exemptions applied.
    """
    return any(
        candidate in net for candidate in _with_embedded_ipv4(address) for net in BLOCKED_NETWORKS
    )


def is_blocked_ip(ip_text: str) -> bool:
    """Whether `ip_text` is an IP address in the blocked ranges (upstream's helper).

    False for text that is not an IP address (a host name, empty text); otherwise whether
    the address is private, loopback, link-local, multicast, reserved or unspecified, IPv4
    or IPv6, IPv4-mapped IPv6 included. Numeric spellings `inet_aton` accepts (`127.1`,
    `2130706433`) count as addresses, as they do for URL hosts.
    """
    address = parse_ip_literal(ip_text)
    return address is not None and _in_blocked_ranges(address)


def _with_embedded_ipv4(address: IPAddress) -> list[IPAddress]:
    """`address` plus the IPv4 address it tunnels to, if it is a 6to4 or NAT64 address."""
    candidates: list[IPAddress] = [address]
    if isinstance(address, ipaddress.IPv6Address):
        if address.sixtofour is not None:
            candidates.append(address.sixtofour)
        if address in _NAT64_PREFIX:
            candidates.append(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
    return candidates


_DIGITS: Final = {
    16: frozenset("0123456789abcdefABCDEF"),
    8: frozenset("01234567"),
    10: frozenset("0123456789"),
}


def _parse_inet_aton_part(part: str) -> int | None:
    """One dotted part as `inet_aton` reads it: `0x` hex, leading-zero octal, else decimal."""
    if part[:2] in ("0x", "0X"):
        digits, base = part[2:], 16
    elif len(part) > 1 and part.startswith("0"):
        digits, base = part[1:], 8
    else:
        digits, base = part, 10
    # ASCII digits only: int() alone would also take spaces, "_" and non-ASCII digits.
    if not set(digits) <= _DIGITS[base]:
        return None
    return int(digits, base) if digits else 0


def parse_ip_literal(host: str) -> IPAddress | None:
    """Parse `host` as an IP address in any spelling a resolver would accept, else `None`.

    Besides canonical IPv4/IPv6 text this decodes the `inet_aton` forms (1 to 4 dotted parts,
    each decimal, octal or hex, the last part filling the remaining bytes), so `2130706433`,
    `0x7f000001`, `0177.0.0.1` and `127.1` are all recognised as 127.0.0.1.
    """
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    parts = host.split(".")
    if not 1 <= len(parts) <= 4 or any(not part for part in parts):
        return None
    values = [_parse_inet_aton_part(part) for part in parts]
    if any(value is None for value in values):
        return None
    numbers = [value for value in values if value is not None]
    head, last = numbers[:-1], numbers[-1]
    if any(value > 0xFF for value in head) or last >= 1 << (8 * (4 - len(head))):
        return None
    packed = 0
    for value in head:
        packed = (packed << 8) | value
    packed = (packed << (8 * (4 - len(head)))) | last
    return ipaddress.IPv4Address(packed)


def parse_url(url: str) -> ParseResult:
    """`urlparse(url)`, with a malformed URL reported as `UrlValidationError`."""
    try:
        return urlparse(url)
    except ValueError as exc:  # e.g. an unbalanced "[" around an IPv6 host
        raise UrlValidationError(f"URL is malformed: {describe_media_source(url)!r}") from exc


def _check_without_dns(url: str, policy: UrlValidationPolicy) -> str | None:
    """Check syntax, scheme and literal rules; return the host name that still needs DNS."""
    if not url:
        raise UrlValidationError("URL is empty")
    parsed = parse_url(url)
    scheme = parsed.scheme.lower()
    if scheme == "data":
        return None
    if scheme not in ("http", "https"):
        raise UrlValidationError(f"URL scheme '{describe_media_source(scheme)}' not allowed")
    if scheme == "http" and not policy.allow_http:
        raise UrlValidationError(
            "http:// URLs are not allowed; set DYN_MM_ALLOW_INTERNAL=1 to enable"
        )
    invalid_host = UrlValidationError(f"URL has an invalid host: {describe_media_source(url)!r}")
    # Characters on which URL parsers disagree (a WHATWG parser reads "\\" as "/") could make
    # this check and the HTTP client see different hosts; refuse them outright.
    if any(c == "\\" or c.isspace() or not c.isprintable() for c in parsed.netloc):
        raise invalid_host
    try:
        raw_host = parsed.hostname or ""
        # IDNA folding, as the resolver will apply it: "ⓛocalhost" is "localhost" and
        # fullwidth digits are ASCII digits, so the checks below see the real name.
        host = raw_host.rstrip(".").encode("idna").decode("ascii").lower()
    except ValueError as exc:  # a UnicodeError from an empty or oversized label
        raise invalid_host from exc
    if not host:
        raise UrlValidationError(f"URL has no host component: {describe_media_source(url)!r}")
    if policy.allow_private_ips:
        return None
    if host in BLOCKED_HOSTS:
        raise UrlValidationError(
            f"Host '{describe_media_source(host)}' is blocked (resolves to internal service)"
        )
    literal = parse_ip_literal(host)
    if literal is not None:
        if policy.is_blocked_address(literal):
            raise UrlValidationError(f"IP literal '{host}' is in a blocked range")
        return None
    return host


async def validate_url(url: str, policy: UrlValidationPolicy) -> str:
    """Check `url` against `policy`; return it unchanged if it passes.

    `data:` always passes; `https://` passes, `http://` only with `allow_http`; any other
    scheme is refused. Unless `allow_private_ips`, blocked host names are refused, IP
    literals are checked directly, and other host names are resolved through the policy's
    resolver: every resolved address must be outside the blocked ranges.

    Raises `UrlValidationError` on any violation.
    """
    host = _check_without_dns(url, policy)
    if host is None:
        return url
    resolver = policy.resolver or resolve_with_getaddrinfo
    label = describe_media_source(host)
    try:
        addresses = list(await resolver(host))
    except (OSError, UnicodeError) as exc:  # socket.gaierror is an OSError
        raise UrlValidationError(f"Could not resolve host '{label}': {exc}") from exc
    if not addresses:
        raise UrlValidationError(f"Could not resolve host '{label}': no addresses returned")
    for text in addresses:
        try:
            address = ipaddress.ip_address(text)
        except ValueError as exc:
            raise UrlValidationError(f"Host '{label}' resolved to a non-address {text!r}") from exc
        if policy.is_blocked_address(address):
            raise UrlValidationError(f"Host '{label}' resolves to blocked IP '{text}'")
    return url


def validate_local_path(path: str, policy: UrlValidationPolicy) -> Path:
    """Resolve `path` (following symlinks) and confirm it lies inside `allowed_local_path`.

    Local access is refused outright when `allowed_local_path` is unset (the default).
    Raises `UrlValidationError` if refused, missing, or outside the allowed directory.
    """
    if not policy.allowed_local_path:
        raise UrlValidationError(
            "Local media paths are not permitted; set DYN_MM_LOCAL_PATH to enable"
        )
    label = describe_media_source(path)
    try:
        resolved = Path(path).expanduser().resolve(strict=True)
    except FileNotFoundError as exc:
        raise UrlValidationError(f"File not found: {label}") from exc
    except OSError as exc:
        raise UrlValidationError(f"Could not resolve path '{label}': {exc.strerror}") from exc
    except ValueError as exc:  # an embedded NUL (e.g. from a percent-decoded %00)
        raise UrlValidationError(f"Invalid path '{label}': {exc}") from exc
    try:
        allowed = Path(policy.allowed_local_path).expanduser().resolve(strict=True)
    except FileNotFoundError as exc:
        # The configured directory is deployment detail: keep it out of client messages.
        raise UrlValidationError("Configured allowed_local_path does not exist") from exc
    if not resolved.is_relative_to(allowed):
        raise UrlValidationError(f"Path '{label}' is outside the allowed directory")
    return resolved


async def validate_media_url(url: str, policy: UrlValidationPolicy) -> str:
    """Validate any media reference and return it in canonical form.

    Bare paths and `file:` URLs go through `validate_local_path` and come back as a resolved
    `file://` URI; everything else goes through `validate_url` and is returned unchanged.
    """
    if not url:
        raise UrlValidationError("URL is empty")
    parsed = parse_url(url)
    if parsed.scheme.lower() in ("", "file"):
        # file: URLs are percent-encoded; a bare path is taken literally.
        raw_path = unquote(parsed.path) if parsed.scheme else url
        return validate_local_path(raw_path, policy).as_uri()
    return await validate_url(url, policy)
