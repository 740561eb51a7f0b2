"""The service proxy: what kube-proxy's old userspace mode did, for the test bed's Services.

For every Service with a cluster IP (types ClusterIP, NodePort and LoadBalancer; not headless
Services, not ExternalName; `default/kubernetes` included, where the kubelet node's pods find
the API server), it puts the cluster IP on the host's `lo` and, for each TCP port
that has a ready endpoint, listens on clusterIP:port and forwards each connection to one ready
endpoint of the Service's EndpointSlices, round robin. A port with no ready endpoint has no
listener, so a connection to it is refused at once, as kube-proxy's REJECT rule does. Pods
reach the listeners too: their one route leads to the host, where the cluster IP is local.

Run it as `python -m testbed.service_proxy` (hack/cluster does); on SIGTERM it closes every
listener and removes every address it added.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import logging
import signal
import socket
import struct
import subprocess
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes_asyncio import client, config, watch
from kubernetes_asyncio.client.exceptions import ApiException

from . import network
from .layout import SERVICE_CIDR, Layout

log = logging.getLogger("service-proxy")

PROXIED_TYPES = frozenset({"ClusterIP", "NodePort", "LoadBalancer"})
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
SERVICE_NETWORK = ipaddress.ip_network(SERVICE_CIDR)
# Per endpoint tried; a process-node pod answers or refuses at once, and a KWOK pod's address
# is unreachable at once, so this only bounds a pod whose listen queue is full.
CONNECT_TIMEOUT = 2.0
# Retry what failed (a port held by another process, an address not added) this often.
RESYNC_SECONDS = 10.0
WATCH_SECONDS = 300
CHUNK = 64 * 1024

ServiceKey = tuple[str, str]  # (namespace, name)
Backend = tuple[str, int]  # (endpoint IP, port)


@dataclass(frozen=True)
class ServiceView:
    """What the proxy needs of a Service: its cluster IP and its TCP ports by port name
    (`""` for the one unnamed port)."""

    namespace: str
    name: str
    cluster_ip: str
    ports: dict[str, int]


@dataclass(frozen=True)
class SliceView:
    """What the proxy needs of an EndpointSlice: its Service, its TCP ports by name, and the
    address of each ready endpoint."""

    namespace: str
    service: str
    ports: dict[str, int]
    ready: tuple[str, ...]


def service_view(service: client.V1Service) -> ServiceView | None:
    """The proxied view of a Service, or None when the proxy leaves it alone."""
    meta, spec = service.metadata, service.spec
    cluster_ip = spec.cluster_ip
    if (spec.type or "ClusterIP") not in PROXIED_TYPES or cluster_ip in (None, "", "None"):
        return None
    if ipaddress.ip_address(cluster_ip) not in SERVICE_NETWORK:
        # Never put an address outside the guarded range on the host.
        ns, name = _key(service)
        log.warning(
            "service %s/%s: cluster IP %s is outside %s; not proxied",
            ns,
            name,
            cluster_ip,
            SERVICE_CIDR,
        )
        return None
    ports = {p.name or "": p.port for p in spec.ports or [] if (p.protocol or "TCP") == "TCP"}
    if not ports:
        return None
    return ServiceView(meta.namespace, meta.name, cluster_ip, ports)


def slice_view(endpoint_slice: client.V1EndpointSlice) -> SliceView | None:
    """The proxied view of an EndpointSlice, or None when it serves no Service over IPv4."""
    meta = endpoint_slice.metadata
    service = (meta.labels or {}).get(SERVICE_NAME_LABEL)
    if not service or endpoint_slice.address_type != "IPv4":
        return None
    ports = {
        p.name or "": p.port
        for p in endpoint_slice.ports or []
        if (p.protocol or "TCP") == "TCP" and p.port is not None
    }
    ready = tuple(
        e.addresses[0] for e in endpoint_slice.endpoints or [] if e.addresses and _ready(e)
    )
    return SliceView(meta.namespace, service, ports, ready)


def _ready(endpoint: client.V1Endpoint) -> bool:
    # The EndpointSlice rule: a missing `ready` condition is to be read as ready.
    conditions = endpoint.conditions
    return conditions is None or conditions.ready is None or bool(conditions.ready)


def _key(obj: Any) -> ServiceKey:
    return (obj.metadata.namespace, obj.metadata.name)


def backends(service: ServiceView, port_name: str, slices: Iterable[SliceView]) -> list[Backend]:
    """The ready endpoints of one Service port, across its slices: the slice port is the one
    with the Service port's name, as kube-proxy resolves it (targetPort is already applied)."""
    found = {
        (ip, s.ports[port_name])
        for s in slices
        if (s.namespace, s.service) == (service.namespace, service.name) and port_name in s.ports
        for ip in s.ready
    }
    return sorted(found)


class PortProxy:
    """One Service port: a listener on its address (while it has ready endpoints) and the
    connections it forwards to them."""

    def __init__(self, service: ServiceKey, port_name: str, host: str, port: int) -> None:
        self.service, self.port_name, self.host, self.port = service, port_name, host, port
        self.backends: list[Backend] = []
        self.listen_error = ""
        self._turn = 0
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[Any]] = set()

    @property
    def label(self) -> str:
        ns, name = self.service
        return f"{ns}/{name}:{self.port_name or self.port} ({self.host}:{self.port})"

    @property
    def listening(self) -> bool:
        return self._server is not None

    @property
    def bound_port(self) -> int:
        """The port listened on (differs from `port` only when `port` is 0)."""
        assert self._server is not None, "not listening"
        return int(self._server.sockets[0].getsockname()[1])

    async def listen(self) -> None:
        """Start accepting connections; raises OSError when the address cannot be bound."""
        if self._server is None:
            self._server = await asyncio.start_server(self._accept, self.host, self.port)

    def stop_listening(self) -> None:
        """Refuse new connections; those already forwarded keep flowing."""
        if self._server is not None:
            self._server.close()
            self._server = None

    async def close(self) -> None:
        """Stop listening and end every forwarded connection (the port is going away)."""
        self.stop_listening()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)

    def _rotation(self) -> list[Backend]:
        # Round robin: each connection starts one further along; the rest are fallbacks.
        if not self.backends:
            return []
        start = self._turn % len(self.backends)
        self._turn += 1
        return self.backends[start:] + self.backends[:start]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        spliced = False
        try:
            upstream = await self._connect()
            if upstream is not None:
                spliced = True  # splice closes both sides, however it ends
                await splice(reader, writer, *upstream)
        finally:
            if not spliced:  # no endpoint answered, or the port is closing
                reset(writer)
            self._connections.discard(task)

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        for ip, port in self._rotation():
            try:
                return await asyncio.wait_for(asyncio.open_connection(ip, port), CONNECT_TIMEOUT)
            except (OSError, TimeoutError) as exc:
                log.warning("%s: endpoint %s:%s failed: %r", self.label, ip, port, exc)
        log.info("%s: no ready endpoint answers; connection reset", self.label)
        return None


async def splice(
    a_reader: asyncio.StreamReader,
    a_writer: asyncio.StreamWriter,
    b_reader: asyncio.StreamReader,
    b_writer: asyncio.StreamWriter,
) -> None:
    """Copy bytes both ways until both directions end. An EOF is passed on as a half-close
    while the other direction keeps flowing; an error on either side resets both."""
    copies = [
        asyncio.create_task(_copy(a_reader, b_writer)),
        asyncio.create_task(_copy(b_reader, a_writer)),
    ]
    clean = True
    try:
        for finished in asyncio.as_completed(copies):
            if not await finished:
                clean = False
                break
    finally:
        for task in copies:
            task.cancel()
        await asyncio.gather(*copies, return_exceptions=True)
        for writer in (a_writer, b_writer):
            if clean:
                writer.close()
            else:
                reset(writer)


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """Copy until EOF and pass the EOF on; False when either side failed."""
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:
        return False
    return True


def reset(writer: asyncio.StreamWriter) -> None:
    """Close a connection with a TCP reset, so the peer fails at once rather than reading a
    clean end of stream."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class ServiceProxy:
    """Keeps the host's Service addresses and the port listeners in line with the Services
    and EndpointSlices seen (level-based: every change recomputes the whole wanted state)."""

    def __init__(self) -> None:
        self.services: dict[ServiceKey, ServiceView] = {}
        self.slices: dict[ServiceKey, SliceView] = {}  # by (namespace, slice name)
        self.ports: dict[tuple[str, int], PortProxy] = {}
        self.addresses: set[str] = set()
        self._lock = asyncio.Lock()

    async def sync(self) -> None:
        """Bring addresses and listeners to what the current Services and slices ask for."""
        async with self._lock:
            wanted: dict[tuple[str, int], tuple[ServiceView, str]] = {}
            for view in self.services.values():
                for port_name, port in view.ports.items():
                    wanted[(view.cluster_ip, port)] = (view, port_name)
            for key, proxy in list(self.ports.items()):
                want = wanted.get(key)
                # Gone, or the address now belongs to another Service (cluster IPs are reused).
                if want is None or ((want[0].namespace, want[0].name), want[1]) != (
                    proxy.service,
                    proxy.port_name,
                ):
                    del self.ports[key]
                    await proxy.close()
                    log.info("%s: removed", proxy.label)
            await self._sync_addresses({ip for ip, _ in wanted})
            for (ip, port), (view, port_name) in wanted.items():
                if ip in self.addresses:
                    await self._sync_port(ip, port, view, port_name)

    async def _sync_addresses(self, wanted: set[str]) -> None:
        for ip in sorted(self.addresses - wanted):
            await asyncio.to_thread(network.delete_service_address, ip)
            self.addresses.discard(ip)
            log.info("address %s removed from lo", ip)
        for ip in sorted(wanted - self.addresses):
            try:
                await asyncio.to_thread(network.add_service_address, ip)
            except subprocess.CalledProcessError as exc:
                log.error("address %s not added to lo: %s", ip, exc.stderr.strip())
                continue
            self.addresses.add(ip)
            log.info("address %s added to lo", ip)

    async def _sync_port(self, ip: str, port: int, view: ServiceView, port_name: str) -> None:
        proxy = self.ports.get((ip, port))
        if proxy is None:
            proxy = self.ports[(ip, port)] = PortProxy(
                (view.namespace, view.name), port_name, ip, port
            )
        ready = backends(view, port_name, self.slices.values())
        if ready != proxy.backends:
            shown = ", ".join(f"{a}:{p}" for a, p in ready) or "none (connections refused)"
            log.info("%s: ready endpoints %s", proxy.label, shown)
            proxy.backends = ready
        if ready and not proxy.listening:
            try:
                await proxy.listen()
            except OSError as exc:
                if proxy.listen_error != str(exc):
                    log.error(
                        "%s: cannot listen: %s (a host process listening on every address at "
                        "this port holds it too)",
                        proxy.label,
                        exc,
                    )
                proxy.listen_error = str(exc)
                return
            proxy.listen_error = ""
            log.info("%s: listening", proxy.label)
        elif not ready and proxy.listening:
            proxy.stop_listening()
            log.info("%s: not listening until an endpoint is ready", proxy.label)

    async def shutdown(self) -> None:
        """Close every listener and connection and remove every address added."""
        async with self._lock:
            for proxy in self.ports.values():
                await proxy.close()
            self.ports.clear()
        await self._sync_addresses(set())

    async def follow(
        self,
        what: str,
        list_all: Callable[..., Awaitable[Any]],
        store: dict[ServiceKey, Any],
        view: Callable[[Any], Any],
        **params: Any,
    ) -> None:
        """List and watch one kind (all namespaces) into `store`, syncing after each change."""
        while True:
            try:
                listing = await list_all(**params)
                store.clear()
                for obj in listing.items:
                    if (seen := view(obj)) is not None:
                        store[_key(obj)] = seen
                await self.sync()
                async with watch.Watch() as w:
                    async for event in w.stream(
                        list_all,
                        resource_version=listing.metadata.resource_version,
                        timeout_seconds=WATCH_SECONDS,
                        **params,
                    ):
                        obj = event["object"]
                        seen = view(obj) if event["type"] in ("ADDED", "MODIFIED") else None
                        if seen is None:
                            store.pop(_key(obj), None)
                        else:
                            store[_key(obj)] = seen
                        await self.sync()
            except ApiException as exc:
                if exc.status != 410:  # 410 Gone: the watch expired; list again.
                    log.warning("%s watch failed: %s; relisting", what, exc.reason)
                    await asyncio.sleep(1)
            except (TimeoutError, aiohttp.ClientError) as exc:
                log.warning("%s watch interrupted: %r; relisting", what, exc)
                await asyncio.sleep(1)

    async def resync_forever(self) -> None:
        """Retry what could not be done (a busy port, an address not added) now and then."""
        while True:
            await asyncio.sleep(RESYNC_SECONDS)
            await self.sync()


async def amain(kubeconfig: Path) -> None:
    # Addresses a killed proxy left behind: no listener serves them any more.
    for ip in await asyncio.to_thread(network.service_addresses):
        await asyncio.to_thread(network.delete_service_address, ip)
        log.info("stale address %s removed from lo", ip)
    await config.load_kube_config(config_file=str(kubeconfig))
    proxy = ServiceProxy()
    async with client.ApiClient() as api:
        core, discovery = client.CoreV1Api(api), client.DiscoveryV1Api(api)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        tasks = [
            asyncio.create_task(
                proxy.follow(
                    "service", core.list_service_for_all_namespaces, proxy.services, service_view
                )
            ),
            asyncio.create_task(
                proxy.follow(
                    "endpointslice",
                    discovery.list_endpoint_slice_for_all_namespaces,
                    proxy.slices,
                    slice_view,
                    label_selector=SERVICE_NAME_LABEL,
                )
            ),
            asyncio.create_task(proxy.resync_forever()),
        ]
        stopper: asyncio.Task[Any] = asyncio.create_task(stop.wait())
        try:
            done, _ = await asyncio.wait([*tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stopper and task.exception():
                    log.error("proxy loop failed: %r", task.exception())
        finally:
            for task in [*tasks, stopper]:
                task.cancel()
            await asyncio.gather(*tasks, stopper, return_exceptions=True)
            await proxy.shutdown()
            log.info("stopped; every listener and address removed")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="testbed.service_proxy",
        description="Route Service cluster IPs to ready endpoints (a userspace kube-proxy).",
    )
    parser.add_argument("--kubeconfig", type=Path, help="default: the test bed's admin kubeconfig")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    asyncio.run(amain(args.kubeconfig or Layout.from_env().kubeconfig))


if __name__ == "__main__":
    main()
