"""Where the TCP request plane listens and what address it advertises.

`DYN_TCP_RPC_HOST` is both the bind and the advertised address when it names one interface;
unset (or a wildcard) binds every interface and advertises `POD_IP`, else 127.0.0.1. The
frontend parses the advertised address as a socket address, so it must be an IP literal
(a host name is resolved here once); IPv6 is written `[addr]:port`.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping

WILDCARDS = ("", "0.0.0.0", "::", "[::]")


def bind_host(configured: str | None) -> str:
    """The interface to listen on."""
    return configured.strip("[]") if configured and configured not in WILDCARDS else "0.0.0.0"


def advertised_host(configured: str | None, environ: Mapping[str, str]) -> str:
    """The IP literal peers dial (see the module docstring)."""
    if configured and configured not in WILDCARDS:
        return ip_literal(configured.strip("[]"))
    pod_ip = environ.get("POD_IP")
    return ip_literal(pod_ip) if pod_ip else "127.0.0.1"


def ip_literal(host: str) -> str:
    """`host` if it is an IP address, else the IPv4 address it resolves to."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        return socket.gethostbyname(host)
    except OSError as exc:
        raise ValueError(
            f"DYN_TCP_RPC_HOST/POD_IP {host!r} is neither an IP address nor a resolvable "
            f"host name ({exc}); set it to this worker's IP address"
        ) from None


def endpoint_path(instance_id: int, namespace: str, component: str, endpoint: str) -> str:
    """The path requests carry: `<instance id hex>/<namespace>/<component>/<endpoint>`
    (upstream 1.6's layout; the frontend sends it back verbatim)."""
    return f"{instance_id:x}/{namespace}/{component}/{endpoint}"


def transport_address(host: str, port: int, path: str) -> str:
    """The Endpoint record's `transport.tcp` value: `ip:port/path`."""
    shown = f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    return f"{shown}:{port}/{path}"
