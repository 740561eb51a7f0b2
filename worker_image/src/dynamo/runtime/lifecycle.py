"""`WorkerRuntime`: one engine's whole life, upstream's unified worker lifecycle in Python.

Startup: validate the config; own SIGTERM/SIGINT; start the system server (health 503);
`engine.start(worker_id)` timed into `model_load_time_seconds`; metrics (engine registry,
per-rank snapshot gauges, forward-pass metrics); the request plane; `on_endpoint_ready`;
discovery registration; admin routes; then Running (health 200).

Shutdown (signal): see `shutdown.ShutdownOrchestrator`: health 503 and unregister at once,
grace period, drain every mode, cleanup exactly once, exit 0 (911 past the hard deadline).

The pieces it wires: one `serving.Serving` given to both request planes (`http_plane`,
`tcp_plane`), the system server and its admin routes (`system`), and the worker's entry in
discovery (`registration`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynamo.common.backend.engine import BaseEngine, EngineConfig, LLMEngine, RawEngine
from dynamo.common.backend.health_check import HEALTH_CHECK_KEY, load_health_check_from_env
from dynamo.common.backend.model_input import ModelInput
from dynamo.common.backend.publisher import PushSource
from dynamo.common.backend.worker_config import WorkerConfig
from dynamo.common.constants import DisaggregationMode
from dynamo.common.model_taints import MODEL_TAINT_ROUTE, make_model_taint_handler
from dynamo.common.token_budget import TOKEN_BUDGET_RUNTIME_KEY
from dynamo.runtime import card_files
from dynamo.runtime.adapters import EngineUpdates
from dynamo.runtime.budget import budget_from_runtime_data
from dynamo.runtime.canary import Canary
from dynamo.runtime.discovery import records
from dynamo.runtime.discovery.base import DiscoveryBackend, WorkerAdvertisement
from dynamo.runtime.endpoint import Endpoint
from dynamo.runtime.event_plane import EventPlane
from dynamo.runtime.event_plane.kv_metrics import SnapshotTee
from dynamo.runtime.fpm import ForwardPassPublisher
from dynamo.runtime.health import HealthState
from dynamo.runtime.http_plane import RequestPlane
from dynamo.runtime.inflight import InflightTracker
from dynamo.runtime.metrics import EngineMetrics, LifecycleGauges, RuntimeMetrics, auto_labels
from dynamo.runtime.models import ServedModels
from dynamo.runtime.registration import advertise
from dynamo.runtime.registration.registrar import Registration
from dynamo.runtime.request_limits import limits_of
from dynamo.runtime.serving import Serving
from dynamo.runtime.settings import RuntimeSettings
from dynamo.runtime.shutdown import Closer, ShutdownOrchestrator
from dynamo.runtime.snapshot import SnapshotPublisher
from dynamo.runtime.system import SystemServer
from dynamo.runtime.system import auth as system_auth
from dynamo.runtime.system.admin import RUNNING, SHUTTING_DOWN, AdminRoutes, EngineRoutes, Lifecycle
from dynamo.runtime.tcp_plane import TcpRequestPlane, address

logger = logging.getLogger(__name__)

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def validate_config(engine: BaseEngine, config: WorkerConfig) -> None:
    """Upstream's startup checks; ValueError naming the field and the fix."""
    raw = isinstance(engine, RawEngine)
    if raw and config.model_input is ModelInput.Tokens:
        raise ValueError(
            "model_input is Tokens but the engine is a RawEngine; set WorkerConfig.model_input "
            "to ModelInput.Text or ModelInput.Tensor"
        )
    if not raw and config.model_input is not ModelInput.Tokens:
        raise ValueError(
            f"model_input is {config.model_input.name} but an LLMEngine takes token ids; set "
            "WorkerConfig.model_input to ModelInput.Tokens"
        )
    if config.route_to_encoder and config.disaggregation_mode not in (
        DisaggregationMode.AGGREGATED,
        DisaggregationMode.PREFILL,
    ):
        raise ValueError(
            "route_to_encoder is only valid for aggregated or prefill workers, not "
            f"{config.disaggregation_mode.value}"
        )
    advertise.model_type(config)  # raises for unknown endpoint_types
    if "model_taints" in engine.supported_updates():
        raise ValueError(
            "the engine advertises an update named 'model_taints', which the runtime owns "
            "(/engine/update/model_taints); rename the engine's update"
        )
    if config.request_plane not in ("http", "tcp"):
        logger.warning(
            "request_plane=%r: this runtime serves the HTTP request plane", config.request_plane
        )


class WorkerRuntime:
    """Runs one engine until a signal, then shuts it down (see the module docstring)."""

    def __init__(
        self,
        engine: BaseEngine,
        config: WorkerConfig,
        settings: RuntimeSettings,
        *,
        discovery: DiscoveryBackend | None = None,
        instance_id: int | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        """Validate the config and pick discovery. `discovery` and `instance_id` default to
        what `DYN_DISCOVERY_BACKEND` selects, where `config.discovery_backend` is written
        into that variable first (as upstream does)."""
        validate_config(engine, config)
        self.engine = engine
        self.config = config
        self.settings = settings
        self._environ = dict(os.environ if environ is None else environ)
        if discovery is None or instance_id is None:
            from dynamo.runtime.discovery import backend_from_env, instance_id_from_env

            env = {**self._environ, "DYN_DISCOVERY_BACKEND": config.discovery_backend}
            instance_id = instance_id_from_env(env) if instance_id is None else instance_id
            discovery = backend_from_env(env) if discovery is None else discovery
        self.discovery: DiscoveryBackend = discovery
        self.instance_id: int = instance_id
        self.metrics = RuntimeMetrics(
            auto_labels(config.namespace, config.component, config.endpoint, instance_id),
            extra_labels=config.metrics_labels,
        )
        self.signalled = asyncio.Event()
        self.lifecycle = Lifecycle()
        self.routes = EngineRoutes()
        self.health = HealthState(
            starting_ready=settings.starting_ready,
            use_endpoint_health_status=settings.use_endpoint_health_status,
        )
        self.tracker = InflightTracker()
        self.registration = Registration(discovery, self.advertisement, self.signalled)
        self.shutdown = ShutdownOrchestrator(
            self,
            engine=engine,
            tracker=self.tracker,
            settings=settings,
            prefill=config.disaggregation_mode is DisaggregationMode.PREFILL,
        )
        self.system_port: int | None = None
        self.http_port: int | None = None
        self.gauges: LifecycleGauges | None = None
        self.request_plane: RequestPlane | None = None
        self.tcp_plane: TcpRequestPlane | None = None
        self.event_plane: EventPlane | None = None
        self.system_server: SystemServer | None = None
        self.fpm: ForwardPassPublisher | None = None
        self.canary: Canary | None = None
        self.admin: AdminRoutes | None = None
        self._serving: _Serving | None = None

    # ----- entry point -------------------------------------------------------------------

    async def run(self) -> int:
        """Serve until SIGTERM/SIGINT; return the exit code (0). Startup errors raise."""
        self._install_signal_handlers()
        try:
            return await self._run()
        finally:
            self._remove_signal_handlers()

    async def _run(self) -> int:
        await self._start_system_server()
        if self.signalled.is_set():
            logger.info("signalled before the engine started; exiting without starting it")
            await self.shutdown.close_servers()
            return 0
        try:
            engine_config = await self._start_engine()
        except BaseException:
            await self.shutdown.after_failed_start()
            raise
        if self.signalled.is_set():
            await self.shutdown.run(serving=False)
            return 0
        await self._serve(engine_config)
        await self.signalled.wait()
        await self.shutdown.run(serving=True)
        return 0

    # ----- startup steps -----------------------------------------------------------------

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        original = loop.add_signal_handler
        for sig in _SIGNALS:
            original(sig, self._on_signal, sig)

        # Like upstream, the runtime owns these signals: an engine that registers its own
        # SIGTERM/SIGINT handler later is ignored (with a debug line), not obeyed.
        def guarded(sig: int, callback: Any, *args: Any) -> None:
            if sig in _SIGNALS:
                logger.debug("ignoring an engine's handler for %s: the runtime owns it", sig)
                return
            original(sig, callback, *args)

        try:
            loop.add_signal_handler = guarded  # type: ignore[method-assign,assignment]
        except AttributeError:
            logger.debug("cannot guard add_signal_handler on %r", loop)

    def _remove_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        if "add_signal_handler" in getattr(loop, "__dict__", {}):
            del loop.add_signal_handler  # back to the loop's own method
        for sig in _SIGNALS:
            loop.remove_signal_handler(sig)

    def _on_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if self.signalled.is_set():
            logger.info("received %s again; shutdown is already under way", name)
            return
        logger.info("received %s; shutting down", name)
        self.shutdown.begin()
        self.signalled.set()

    async def _start_system_server(self) -> None:
        settings = self.settings
        if settings.system_port < 0:
            logger.info("system status server disabled (DYN_SYSTEM_PORT < 0)")
            return
        self.system_server = SystemServer(
            health=self.health,
            metrics=self.metrics,
            routes=self.routes,
            metadata=self.discovery.metadata,
            health_path=settings.health_path,
            live_path=settings.live_path,
            lora_enabled=settings.lora_enabled,
            card_files=self._card_file_paths,
            admin_auth=system_auth.from_env(),
        )
        self.system_port = await self.system_server.start(
            settings.system_host, settings.system_port
        )
        logger.info(
            "System status server listening on http://%s:%d", settings.system_host, self.system_port
        )

    async def _start_engine(self) -> EngineConfig:
        started = time.perf_counter()
        engine_config = await self.engine.start(self.instance_id)
        load_time = time.perf_counter() - started
        served = advertise.served_name(self.config, engine_config)
        self.gauges = self.metrics.set_model(engine_config.model, served)
        self.gauges.model_load_time.set(load_time)
        logger.info("engine started in %.2f s (model %s)", load_time, engine_config.model)
        await self.engine.register_prometheus(EngineMetrics(self.metrics))
        self.event_plane = self._event_plane()
        ranks = self.engine.component_metrics_dp_ranks()
        if ranks and self.config.enable_kv_routing:
            publisher = SnapshotPublisher(self.metrics.registry, self.metrics.model_labels, ranks)
            if self.event_plane is None:
                self.engine.attach_snapshot_publisher(publisher)
            else:
                tee = SnapshotTee(publisher, self.event_plane.active_load())
                self.engine.attach_snapshot_publisher(tee)
        if self.event_plane is not None:
            await self._attach_kv_event_sources(self.event_plane)
        attach = getattr(self.engine, "attach_forward_pass_metrics_sink", None)
        if self.settings.fpm_port is not None and callable(attach):
            self.fpm = ForwardPassPublisher(
                self.settings.fpm_host, self.settings.fpm_port, worker_id=str(self.instance_id)
            )
            attach(self.fpm.publish)
            logger.info("forward-pass metrics published on %s", self.fpm.endpoint)
        return engine_config

    def _event_plane(self) -> EventPlane | None:
        """Upstream's ZMQ event plane, beside the TCP request plane unless turned off."""
        settings = self.settings
        if settings.request_plane != "tcp" or not self.config.enable_kv_routing:
            return None
        kind = (settings.event_plane or self.config.event_plane or "zmq").lower()
        if kind != "zmq":
            logger.warning("event plane %r is not supported (only zmq); none started", kind)
            return None
        host = settings.event_plane_host or settings.tcp_host
        return EventPlane(
            worker_id=self.instance_id,
            bind_host=address.bind_host(host),
            advertised_host=address.advertised_host(host, self._environ),
            on_kv_event_dropped=self.metrics.kv_events_dropped.inc,
        )

    async def _attach_kv_event_sources(self, plane: EventPlane) -> None:
        """Give each of the engine's push sources its rank's KV-events publisher."""
        if not isinstance(self.engine, LLMEngine):
            return  # raw engines have no KV cache to report
        for source in await self.engine.kv_event_sources():
            if not isinstance(source, PushSource):
                logger.warning(
                    "KV event source %r is not supported (only PushSource); its events are "
                    "not published",
                    source,
                )
                continue
            source.on_ready(plane.kv_events(source.dp_rank))
            logger.info("KV events of rank %d published on the event plane", source.dp_rank)

    async def _serve(self, engine_config: EngineConfig) -> None:
        config, settings = self.config, self.settings
        served = advertise.served_name(config, engine_config)
        runtime_data = self._merged_runtime_data(engine_config)
        aliases = {engine_config.model, *engine_config.model_aliases} - {served}
        models = ServedModels(base=served, aliases=frozenset(aliases), created=int(time.time()))
        registration = self.registration
        updates = EngineUpdates(
            self.engine, metrics=self.metrics, models=models, republish=registration.republish
        )
        self.canary = self._build_canary(await self._health_check_payload())
        serving = Serving(
            self.engine,
            models=models,
            metrics=self.metrics,
            tracker=self.tracker,
            budget=budget_from_runtime_data(runtime_data),
            limits=limits_of(
                self.engine, engine_config.llm.context_length if engine_config.llm else None
            ),
            on_success=self.canary.record_success if self.canary else None,
        )
        self.request_plane = RequestPlane(serving)
        self.http_port = await self.request_plane.start(settings.http_host, settings.http_port)
        host = advertise.advertise_host(settings.http_host, self._environ)
        logger.info("Request plane listening on http://%s:%d", settings.http_host, self.http_port)
        tcp_address = None
        if settings.request_plane == "tcp":
            tcp_address = await self._start_tcp_plane(serving)
        card_file_base_url = card_files.card_file_base_url(
            config.discovery_backend, settings.system_host, self.system_port, self._environ
        )
        self._serving = _Serving(
            engine_config,
            runtime_data,
            updates,
            f"http://{host}:{self.http_port}",
            tcp_address,
            card_file_base_url,
        )
        endpoint = Endpoint(
            namespace=config.namespace,
            component=config.component,
            name=config.endpoint,
            instance_id=self.instance_id,
            metrics=EngineMetrics(self.metrics),
            register=registration.register,
            unregister=registration.unregister,
            publish_taints=registration.update_taints,
        )
        await self.engine.on_endpoint_ready(endpoint)
        self._register_admin_routes(endpoint, updates)
        await updates.refresh()
        async with registration.lock:
            if self.signalled.is_set():
                logger.info("signalled during startup; not registering in discovery")
                return
            await registration.register()
            registration.registered = True
            logger.info("Serving %s on %s", served, endpoint.path())
            self.lifecycle.phase = RUNNING
            if self.canary is not None:
                self.canary.start()
            else:
                self.health.set_endpoint_ready(config.endpoint, True)
            self.health.set_system_ready(True)

    async def _start_tcp_plane(self, serving: Serving) -> str:
        """Serve upstream's TCP request plane; the `transport.tcp` address to advertise."""
        config, settings = self.config, self.settings
        advertised = address.advertised_host(settings.tcp_host, self._environ)
        path = address.endpoint_path(
            self.instance_id, config.namespace, config.component, config.endpoint
        )
        self.tcp_plane = TcpRequestPlane(
            serving, endpoint_path=path, max_message_bytes=settings.tcp_max_message_bytes
        )
        bind = address.bind_host(settings.tcp_host)
        port = await self.tcp_plane.start(bind, settings.tcp_port)
        logger.info(
            "TCP request plane listening on tcp://%s:%d, advertised as %s:%d",
            bind,
            port,
            advertised,
            port,
        )
        return address.transport_address(advertised, port, path)

    def _merged_runtime_data(self, engine_config: EngineConfig) -> dict[str, Any]:
        data = dict(engine_config.runtime_data or {})
        budget = data.get(TOKEN_BUDGET_RUNTIME_KEY)
        if isinstance(budget, str):
            # `publish_token_budget` semantics: the value travels as JSON text.
            data[TOKEN_BUDGET_RUNTIME_KEY] = json.loads(budget)
        operator_budget = self.settings.token_budget
        if operator_budget is not None:
            # The operator's budget (DYN_TOKEN_BUDGET_*) wins over the engine's own.
            data[TOKEN_BUDGET_RUNTIME_KEY] = {
                "combined_limit": operator_budget.combined_limit,
                "reject_prompt_overflow": operator_budget.reject_prompt_overflow,
                "reject_total_overflow": operator_budget.reject_total_overflow,
            }
        return data

    def _register_admin_routes(self, endpoint: Endpoint, updates: EngineUpdates) -> None:
        admin = AdminRoutes(
            self.lifecycle,
            control=self.engine.engine_control,
            update=updates.call,
            unregister=self.registration.unregister,
            register=self.registration.register,
            discovery_lock=self.registration.lock,
        )
        self.admin = admin
        for name in sorted(self.engine.supported_controls()):
            self.routes.register(f"control/{name}", admin.control_route(name))
        for name in sorted(self.engine.supported_updates()):
            self.routes.register(f"update/{name}", admin.update_route(name))
        # Through `dynamo.common.model_taints.update_model_taints`, upstream's seam.
        taints = make_model_taint_handler(endpoint)

        async def taint_route(body: Any) -> dict[str, Any]:
            refused = admin.unavailable()
            return refused if refused is not None else await taints(body)

        self.routes.register(MODEL_TAINT_ROUTE, taint_route)

    async def _health_check_payload(self) -> dict[str, Any] | None:
        if not self.settings.health_check_enabled:
            return None
        payload = self.config.health_check_payload or load_health_check_from_env()
        if payload is None:
            try:
                payload = await self.engine.health_check_payload()
            except Exception:
                logger.exception("engine.health_check_payload failed; canary disabled")
                return None
        if not isinstance(payload, dict):
            return None
        return {**payload, HEALTH_CHECK_KEY: True}

    def _build_canary(self, payload: dict[str, Any] | None) -> Canary | None:
        if payload is None:
            return None
        return Canary(
            self.engine,
            health=self.health,
            endpoint=self.config.endpoint,
            payload=payload,
            wait_secs=self.settings.canary_wait_secs,
            timeout_secs=self.settings.health_check_timeout_secs,
        )

    # ----- discovery ---------------------------------------------------------------------

    def advertisement(self) -> WorkerAdvertisement:
        """What discovery publishes now (adapters and taints included)."""
        serving = self._serving
        if serving is None:
            raise RuntimeError("the worker is not serving yet: nothing to advertise")
        lora_host = getattr(self.engine, "lora_host", None)
        advertisement = advertise.build_advertisement(
            self.config,
            serving.engine_config,
            instance_id=self.instance_id,
            http_url=serving.http_url,
            runtime_data=serving.runtime_data,
            taints=self.registration.taints,
            adapters=serving.updates.adapters(),
            max_loras=getattr(lora_host, "max_loras", None),
            tcp_address=serving.tcp_address,
            event_channels=self.event_plane.advertised() if self.event_plane else (),
        )
        return dataclasses.replace(advertisement, card_file_base_url=serving.card_file_base_url)

    async def _card_file_paths(self) -> dict[card_files.CardFileKey, Path]:
        """The system server's card-file allow-list: what the current cards name."""
        if self._serving is None:
            return {}
        return await asyncio.to_thread(records.card_file_paths, self.advertisement())

    # ----- what shutdown sees (shutdown.ShutdownSubject) ---------------------------------

    def stop_admitting(self) -> None:
        """Admin routes answer "shutting down"; `/health` turns 503."""
        self.lifecycle.phase = SHUTTING_DOWN
        self.health.set_system_ready(False)
        self.health.set_endpoint_ready(self.config.endpoint, False)

    async def leave_discovery(self) -> None:
        """Unregister once (errors logged)."""
        await self.registration.leave()

    async def stop_canary(self) -> None:
        """Stop the health-check canary, if one runs."""
        if self.canary is not None:
            await self.canary.stop()

    def closers(self) -> list[Closer]:
        """FPM and event-plane sockets, the request planes, discovery, the system server."""
        steps: list[Closer] = []
        if self.fpm is not None:
            steps.append(("forward-pass metrics socket", self.fpm.close))
        if self.event_plane is not None:
            steps.append(("event plane", self.event_plane.close))
        if self.tcp_plane is not None:
            steps.append(("TCP request plane", self.tcp_plane.stop))
        if self.request_plane is not None:
            steps.append(("request plane", self.request_plane.stop))
        steps.append(("discovery", self.discovery.close))
        if self.system_server is not None:
            steps.append(("system server", self.system_server.stop))
        return steps


@dataclass(frozen=True)
class _Serving:
    """What exists once the request plane listens."""

    engine_config: EngineConfig
    runtime_data: dict[str, Any]
    updates: EngineUpdates
    http_url: str
    tcp_address: str | None = None
    card_file_base_url: str | None = None  # cards name files by URL here (card_files.py)
