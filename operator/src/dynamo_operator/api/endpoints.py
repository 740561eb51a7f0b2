"""Endpoints the workers connect to with their credentials: never a cloud metadata service.

`spec.credentials.s3.endpoint` is refused when its host is a link-local address
(169.254.0.0/16, fe80::/10: the AWS, GCP, Azure and OpenStack metadata services), another
provider's metadata address (AWS's fd00:ec2::254, GCP's fd20:ce::254, Alibaba's
100.100.100.200) or a metadata host name. A numeric host must be written plainly (dotted
decimal IPv4 or IPv6 that CEL's `ip()` accepts): resolvers read `2852039166`, `0xa9fea9fe`
or `::ffff:169.254.169.254` as the metadata address, which a plain comparison would miss.
Private and loopback addresses stay allowed: in-cluster S3 servers (MinIO) live there.

The API server checks the CEL rule; the worker checks again after resolving the name
(`dynamo.common.lora.endpoint_guard`), since DNS can point anywhere.
"""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

from dynamo_operator.api.base import Rule
from dynamo_operator.api.common import cel_string

METADATA_HOST_PATTERN = r"(?i)^metadata([.]google[.]internal|[.]goog)?[.]?$"
# inet_aton's spellings: 1 to 4 dotted parts, each decimal, octal (leading 0) or hex (0x).
NUMERIC_HOST_PATTERN = r"^(0[xX][0-9a-fA-F]*|[0-9]+)([.](0[xX][0-9a-fA-F]*|[0-9]+)){0,3}[.]?$"
METADATA_ADDRESSES = ("fd00:ec2::254/128", "fd20:ce::254/128", "100.100.100.200/32")

_METADATA_CEL = " || ".join(
    f"cidr({cel_string(net)}).containsIP(ip(h))" for net in METADATA_ADDRESSES
)
ENDPOINT_HOST_CEL = (
    "!has(self.endpoint) || !isURL(self.endpoint) || "
    # A one-element list's all() names the host once (CRD validation has no cel.bind).
    "[url(self.endpoint).getHostname()].all(h, "
    f"!h.matches({cel_string(METADATA_HOST_PATTERN)}) && (isIP(h) ? "
    f"!(ip(h).isLinkLocalUnicast() || {_METADATA_CEL}) : "
    f"!(h.contains(':') || h.matches({cel_string(NUMERIC_HOST_PATTERN)}))))"
)
ENDPOINT_HOST_MESSAGE = (
    "spec.credentials.s3.endpoint: must not point at a link-local or cloud metadata address "
    "(169.254.0.0/16, fe80::/10, fd00:ec2::254, fd20:ce::254, 100.100.100.200, "
    "metadata.google.internal); write a numeric host as plain dotted-decimal IPv4 or IPv6"
)
_LINK_LOCAL = (ipaddress.ip_network("169.254.0.0/16"), ipaddress.ip_network("fe80::/10"))
_METADATA = tuple(ipaddress.ip_network(net) for net in METADATA_ADDRESSES)


def is_allowed_endpoint(url: str | None) -> bool:
    """The CEL rule in Python: False for a metadata host or an obscured numeric one."""
    if url is None:
        return True
    try:
        host = urlsplit(url).hostname or ""
    except ValueError:
        return True  # not a URL: the endpoint's shape rule reports it
    if re.search(METADATA_HOST_PATTERN, host):
        return False
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return ":" not in host and re.search(NUMERIC_HOST_PATTERN, host) is None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return False  # CEL's ip() refuses the mapped form: refused there too
    return not any(address in net for net in (*_LINK_LOCAL, *_METADATA))


ENDPOINT_HOST_RULE = Rule(
    rule=ENDPOINT_HOST_CEL,
    message=ENDPOINT_HOST_MESSAGE,
    check=lambda s3: is_allowed_endpoint(s3.endpoint),
    field_path=".endpoint",
)
