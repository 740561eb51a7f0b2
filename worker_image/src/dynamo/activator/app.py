"""`Activator`: the pieces wired together, started and stopped.

One reconcile loop reacts to every change of the worker's view (the ready pods, the
operator's scaled-to-zero mark) and retries a failed capture: it steps out of discovery first
when a pod is ready and the worker is not scaled to zero (the pods then serve directly),
captures the cards of the first ready pod when they differ from the kept ones, and steps in
when the rule of `presence.decide` says so. Requests never wait for this loop: the hold wakes
on the fleet's own change notice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any

import aiohttp
from aiohttp import web

from dynamo.activator import presence as presence_rule
from dynamo.activator.cards import CapturedCards, CaptureError, capture
from dynamo.activator.config import ActivatorConfig
from dynamo.activator.hold import Hold
from dynamo.activator.http_proxy import HttpProxy
from dynamo.activator.metrics import ActivatorMetrics
from dynamo.activator.pods import Fleet, PodSource, ReadyPod, WorkerView
from dynamo.activator.presence import Presence
from dynamo.activator.system import SystemServer
from dynamo.activator.tcp_relay import TcpRelay

log = logging.getLogger(__name__)

CAPTURE_RETRY_S = 5.0


class Activator:
    """Stands in for a DynamoWorker's pods while none is ready."""

    def __init__(self, config: ActivatorConfig, source: PodSource, presence: Presence) -> None:
        self.config = config
        self.metrics = ActivatorMetrics()
        self.fleet = Fleet()
        self.hold = Hold(
            self.fleet,
            self.metrics,
            worker=f"{config.namespace}/{config.worker}",
            max_held=config.max_held,
            timeout_s=config.hold_timeout_s,
        )
        self.cards: CapturedCards | None = None
        self._captured_from: Mapping[str, Any] | None = None  # the raw cards last captured
        self._source = source
        self._presence = presence
        self._present = False
        self._scaled_to_zero = False  # the operator's mark on the activator's slice
        self._published: dict[str, Any] | None = None
        self._stopping = False
        self._dirty = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._runners: list[web.AppRunner] = []
        self._session: aiohttp.ClientSession | None = None
        self._relay: TcpRelay | None = None
        self.http_port = self.system_port = self.tcp_port = 0
        self._announced = False

    async def start(self) -> None:
        """Listen on every port, then follow the pods."""
        config = self.config
        self._session = aiohttp.ClientSession(auto_decompress=False)
        system = SystemServer(self.metrics, lambda: self.cards, lambda: not self._stopping)
        self.system_port = await self._serve(system.app(), config.system_port)
        proxy = HttpProxy(self.hold, lambda: self.cards, self._session)
        self.http_port = await self._serve(proxy.app(), config.http_port)
        self._relay = TcpRelay(self.hold, config.pod_ip)
        self.tcp_port = await self._relay.start(config.bind_host, config.tcp_port)
        log.info(
            "activator for DynamoWorker %s/%s: HTTP on %s, system on %s, TCP plane on %s",
            config.namespace,
            config.worker,
            self.http_port,
            self.system_port,
            self.tcp_port,
        )
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._source.run(self._on_view), name="activator-pods"),
            loop.create_task(self._reconcile_forever(), name="activator-reconcile"),
        ]

    async def stop(self) -> None:
        """Step out of discovery, answer held requests 503, stop listening."""
        self._stopping = True
        self.hold.close()
        with contextlib.suppress(Exception):
            await self._presence.step_out()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._relay is not None:
            await self._relay.stop()
        for runner in reversed(self._runners):
            await runner.cleanup()
        await self._presence.close()
        if self._session is not None:
            await self._session.close()

    @property
    def card_base_url(self) -> str:
        host = self.config.pod_ip
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{self.system_port}"

    async def _serve(self, app: web.Application, port: int) -> int:
        # handler_cancellation: a client that disconnects cancels its proxied request.
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5)
        await runner.setup()
        site = web.TCPSite(runner, self.config.bind_host, port)
        await site.start()
        self._runners.append(runner)
        return int(runner.addresses[0][1])

    def _on_view(self, view: WorkerView) -> None:
        self.fleet.update(view.pods)
        self._scaled_to_zero = view.scaled_to_zero
        self._dirty.set()

    async def _reconcile_forever(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            try:
                retry = await self.reconcile()
            except Exception:
                log.exception("activator reconcile failed; retrying")
                retry = True
            if retry:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._dirty.wait(), CAPTURE_RETRY_S)
                self._dirty.set()

    async def reconcile(self) -> bool:
        """One pass; True when something failed and should be retried."""
        pods = self.fleet.pods
        failed = False
        if not self._announced:
            # Its address in the slice, not ready: the operator's autoscaler finds the
            # activator there (held requests, whether it holds a card) before it steps in.
            await self._presence.step_out()
            self._announced = True
        if pods and self._present and not self._scaled_to_zero:
            await self._step_out()
        if pods and pods[0].metadata.get("model_cards") != self._captured_from:
            failed = not await self._capture(pods[0])
        want = presence_rule.decide(
            cards_ready=self.cards is not None,
            ready_pods=len(self.fleet.pods),
            scaled_to_zero=self._scaled_to_zero,
            shutting_down=self._stopping,
        )
        if want and self.cards is not None:
            metadata = presence_rule.presence_metadata(
                self.cards, self.config.pod_name, self.config.pod_ip, self.tcp_port
            )
            if not self._present or metadata != self._published:
                await self._presence.step_in(metadata)
                self._present, self._published = True, metadata
                log.info(
                    "%s: the activator is in discovery for %s",
                    "scaled to zero" if self._scaled_to_zero else "no ready pod",
                    self.config.worker,
                )
        elif not want and self._present:
            await self._step_out()
        return failed

    async def _step_out(self) -> None:
        await self._presence.step_out()
        self._present = False
        log.info("a pod is ready: the activator stepped out of discovery")

    async def _capture(self, pod: ReadyPod) -> bool:
        assert self._session is not None
        raw = pod.metadata.get("model_cards")
        try:
            self.cards = await capture(self._session, pod.name, pod.metadata, self.card_base_url)
        except CaptureError as exc:
            log.warning("cannot capture the model cards of pod %s: %s", pod.name, exc)
            return False
        self._captured_from = raw
        self.metrics.card_ready.set(1)
        log.info("captured the model cards of pod %s", pod.name)
        return True
