"""The S3 endpoint the worker signs requests for is never a cloud metadata service.

The API server refuses such an endpoint in `spec.credentials.s3.endpoint` (the operator's
CEL rule); a name can still resolve there (DNS is not the API server's to check), so the
worker resolves the endpoint's host before the first request and refuses link-local
addresses (169.254.0.0/16, fe80::/10: AWS, GCP, Azure and OpenStack metadata) and the other
providers' metadata addresses (AWS's fd00:ec2::254, GCP's fd20:ce::254, Alibaba's
100.100.100.200), IPv4-mapped and 6to4/NAT64 forms included. Private and loopback addresses
are allowed: in-cluster S3 servers live there.
"""

from __future__ import annotations

import ipaddress
from typing import Final

from dynamo.common.http.url_validator import (
    IPAddress,
    Resolver,
    parse_ip_literal,
    parse_url,
    resolve_with_getaddrinfo,
)
from dynamo.common.lora.errors import REASON_UNSAFE, LoRADownloadError

METADATA_NETWORKS: Final = tuple(
    ipaddress.ip_network(net)
    for net in (
        "169.254.0.0/16",
        "fe80::/10",
        "fd00:ec2::254/128",
        "fd20:ce::254/128",
        "100.100.100.200/32",
    )
)
METADATA_HOSTS: Final = frozenset({"metadata", "metadata.google.internal", "metadata.goog"})


def is_metadata_address(address: IPAddress) -> bool:
    """Whether `address` (or the IPv4 address it maps or tunnels to) is a metadata address."""
    candidates: list[IPAddress] = [address]
    if isinstance(address, ipaddress.IPv6Address):
        for embedded in (address.ipv4_mapped, address.sixtofour):
            if embedded is not None:
                candidates.append(embedded)
        if address in ipaddress.ip_network("64:ff9b::/96"):
            candidates.append(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
    return any(c in net for c in candidates for net in METADATA_NETWORKS)


async def check_s3_endpoint(endpoint: str, resolver: Resolver = resolve_with_getaddrinfo) -> None:
    """Raise LoRADownloadError(REASON_UNSAFE) when `endpoint`'s host is, or resolves to, a
    metadata address. A name that does not resolve is left to the S3 client to report."""
    host = (parse_url(endpoint).hostname or "").rstrip(".").lower()
    if host in METADATA_HOSTS:
        raise _refused(endpoint, host)
    literal = parse_ip_literal(host)
    if literal is not None:
        if is_metadata_address(literal):
            raise _refused(endpoint, str(literal))
        return
    try:
        addresses = list(await resolver(host))
    except (OSError, UnicodeError):
        return
    for text in addresses:
        address = parse_ip_literal(text)
        if address is not None and is_metadata_address(address):
            raise _refused(endpoint, f"{host} -> {text}")


def _refused(endpoint: str, what: str) -> LoRADownloadError:
    return LoRADownloadError(
        f"refusing S3 endpoint {endpoint}: {what} is a link-local or cloud metadata address; "
        "set spec.credentials.s3.endpoint (AWS_ENDPOINT_URL) to the S3 server's own address",
        REASON_UNSAFE,
    )
