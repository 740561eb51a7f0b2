"""The test bed's service proxy: which Services and endpoints it proxies, and how it forwards
(round robin, half-close, reset when no endpoint answers), on loopback sockets."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from kubernetes_asyncio import client

from support.cluster import REPO

sys.path.insert(0, str(REPO / "hack"))
from testbed.service_proxy import (
    PortProxy,
    ServiceView,
    SliceView,
    backends,
    service_view,
    slice_view,
)

pytestmark = pytest.mark.unit


def _service(
    name: str = "web",
    namespace: str = "ns",
    cluster_ip: str | None = "198.19.0.10",
    type_: str | None = "ClusterIP",
    ports: list[client.V1ServicePort] | None = None,
) -> client.V1Service:
    return client.V1Service(
        metadata=client.V1ObjectMeta(name=name, namespace=namespace),
        spec=client.V1ServiceSpec(
            type=type_,
            cluster_ip=cluster_ip,
            ports=ports if ports is not None else [client.V1ServicePort(name="http", port=80)],
        ),
    )


def test_services_with_a_cluster_ip_are_proxied_by_tcp_port_name() -> None:
    ports = [
        client.V1ServicePort(name="http", port=80, protocol="TCP"),
        client.V1ServicePort(name="dns", port=53, protocol="UDP"),
        client.V1ServicePort(name="grpc", port=9000),  # protocol defaults to TCP
    ]
    assert service_view(_service(ports=ports)) == ServiceView(
        "ns", "web", "198.19.0.10", {"http": 80, "grpc": 9000}
    )
    for type_ in (None, "NodePort", "LoadBalancer"):
        assert service_view(_service(type_=type_)) is not None, type_
    # The API server's own: the kubelet points pods at it (KUBERNETES_SERVICE_HOST).
    assert service_view(_service(name="kubernetes", namespace="default")) is not None
    unnamed = service_view(_service(ports=[client.V1ServicePort(port=8080)]))
    assert unnamed is not None
    assert unnamed.ports == {"": 8080}


@pytest.mark.parametrize(
    ("why", "service"),
    [
        ("headless", _service(cluster_ip="None")),
        ("ExternalName", _service(type_="ExternalName", cluster_ip=None)),
        ("UDP only", _service(ports=[client.V1ServicePort(port=53, protocol="UDP")])),
        ("outside the service CIDR", _service(cluster_ip="10.96.0.10")),
    ],
)
def test_services_left_alone(why: str, service: client.V1Service) -> None:
    assert service_view(service) is None, why


def _endpoint(ip: str, ready: bool | None, *, conditions: bool = True) -> client.V1Endpoint:
    cond = client.V1EndpointConditions(ready=ready) if conditions else None
    return client.V1Endpoint(addresses=[ip], conditions=cond)


def _slice(
    service: str | None, endpoints: list[client.V1Endpoint], address_type: str = "IPv4"
) -> client.V1EndpointSlice:
    labels = {"kubernetes.io/service-name": service} if service else {}
    return client.V1EndpointSlice(
        address_type=address_type,
        metadata=client.V1ObjectMeta(name="s", namespace="ns", labels=labels),
        endpoints=endpoints,
        ports=[
            client.DiscoveryV1EndpointPort(name="http", port=8080, protocol="TCP"),
            client.DiscoveryV1EndpointPort(name="dns", port=53, protocol="UDP"),
        ],
    )


def test_slice_endpoints_are_ready_when_the_condition_says_so_or_is_absent() -> None:
    endpoints = [
        _endpoint("198.18.1.2", True),
        _endpoint("198.18.1.3", False),
        _endpoint("198.18.1.4", None),
        _endpoint("198.18.1.5", None, conditions=False),
    ]
    assert slice_view(_slice("web", endpoints)) == SliceView(
        "ns", "web", {"http": 8080}, ("198.18.1.2", "198.18.1.4", "198.18.1.5")
    )
    assert slice_view(_slice(None, endpoints)) is None  # no Service owns it
    assert slice_view(_slice("web", [], address_type="IPv6")) is None


def test_backends_resolve_the_slice_port_by_the_service_port_name() -> None:
    service = ServiceView("ns", "web", "198.19.0.10", {"http": 80, "metrics": 9090})
    slices = [
        SliceView("ns", "web", {"http": 8080, "metrics": 9100}, ("198.18.1.3", "198.18.1.2")),
        # Another slice of the same Service: a second pod serving "http" on another port.
        SliceView("ns", "web", {"http": 8081}, ("198.18.1.4",)),
        SliceView("other", "web", {"http": 1}, ("198.18.1.9",)),  # same name, other namespace
        SliceView("ns", "web-2", {"http": 2}, ("198.18.1.8",)),
    ]
    assert backends(service, "http", slices) == [
        ("198.18.1.2", 8080),
        ("198.18.1.3", 8080),
        ("198.18.1.4", 8081),
    ]
    assert backends(service, "metrics", slices) == [("198.18.1.2", 9100), ("198.18.1.3", 9100)]
    assert backends(service, "grpc", slices) == []


async def _named_server(name: bytes) -> asyncio.Server:
    """Reads the request to EOF (so it needs the client's half-close passed on), then answers
    with its name and the request's length."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await reader.read()
        writer.write(name + b" " + str(len(request)).encode())
        await writer.drain()
        writer.close()

    return await asyncio.start_server(answer, "127.0.0.1", 0)


def _port(server: asyncio.Server) -> int:
    return int(server.sockets[0].getsockname()[1])


@pytest.fixture
async def proxy() -> AsyncIterator[PortProxy]:
    port_proxy = PortProxy(("ns", "web"), "http", "127.0.0.1", 0)
    yield port_proxy
    await port_proxy.close()


async def _request(port: int, payload: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(payload)
    writer.write_eof()  # half-close: the answer must still come back
    try:
        return await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()


async def test_connections_go_round_robin_and_survive_a_half_close(proxy: PortProxy) -> None:
    a, b = await _named_server(b"a"), await _named_server(b"b")
    proxy.backends = sorted([("127.0.0.1", _port(a)), ("127.0.0.1", _port(b))])
    await proxy.listen()
    payload = b"x" * 300_000  # more than one read's worth
    answers = [await _request(proxy.bound_port, payload) for _ in range(4)]
    names = [answer.split()[0] for answer in answers]
    assert sorted(names) == [b"a", b"a", b"b", b"b"]
    assert names[0] != names[1], names  # strictly alternating
    assert names[1] != names[2], names
    assert all(answer.split()[1] == b"300000" for answer in answers)
    a.close()
    b.close()


async def test_a_dead_endpoint_is_skipped(proxy: PortProxy) -> None:
    live = await _named_server(b"live")
    dead = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    dead_port = _port(dead)
    dead.close()
    await dead.wait_closed()
    proxy.backends = [("127.0.0.1", dead_port), ("127.0.0.1", _port(live))]
    await proxy.listen()
    for _ in range(3):
        assert (await _request(proxy.bound_port, b"hi")).split()[0] == b"live"
    live.close()


async def test_no_answering_endpoint_resets_the_connection_at_once(proxy: PortProxy) -> None:
    dead = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    dead_port = _port(dead)
    dead.close()
    await dead.wait_closed()
    proxy.backends = [("127.0.0.1", dead_port)]
    await proxy.listen()
    started = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.bound_port)
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(reader.read(), 5)
    writer.close()
    assert time.monotonic() - started < 2


async def test_close_ends_forwarded_connections_and_refuses_new_ones(proxy: PortProxy) -> None:
    held: list[Any] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        await reader.read()  # waits for the proxy to go away

    backend = await asyncio.start_server(hold, "127.0.0.1", 0)
    proxy.backends = [("127.0.0.1", _port(backend))]
    await proxy.listen()
    port = proxy.bound_port
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    deadline = time.monotonic() + 5
    while not held:  # the proxy has connected through to the backend
        assert time.monotonic() < deadline, "the backend never saw the connection"
        await asyncio.sleep(0.01)
    await proxy.close()
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection("127.0.0.1", port)
    backend.close()
