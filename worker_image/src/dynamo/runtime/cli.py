"""`dynamo-worker`: build an engine and serve it with the worker runtime.

The worker's own options are below; every one also has a `DYN_*` variable (the flag wins).
Options the worker does not know, and everything after `--`, go to the engine's
`from_args`; the worker also passes the engine `--model`, `--served-model-name`,
`--max-loras`, the data-parallel flags and `--disaggregation-mode` when they are given (so an
engine must accept the ones it is given). `dynamo-worker --engine X -- --help` shows the
engine's own options.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib
import io
import logging
import os
import stat
import sys
from collections.abc import Sequence
from typing import NoReturn

from dynamo.common.backend.disagg import DISAGGREGATION_MODES
from dynamo.common.backend.engine import BaseEngine
from dynamo.common.backend.worker_config import WorkerConfig

logger = logging.getLogger("dynamo.runtime.cli")

PROG = "dynamo-worker"
DEFAULT_ENGINE = "dynamo.engines.transformers_engine:TransformersEngine"
# Engines `--engine` also takes by a short name.
ENGINE_NAMES = {"transformers": DEFAULT_ENGINE, "vllm": "dynamo.engines.vllm:VllmEngine"}
EXIT_USAGE = 2
EXIT_FAILURE = 1

# Flag destination -> the variable it sets for the runtime and engine (the flag wins).
_ENV_FOR = {
    "namespace": "DYN_NAMESPACE",
    "discovery_backend": "DYN_DISCOVERY_BACKEND",
    "request_plane": "DYN_REQUEST_PLANE",
    "event_plane": "DYN_EVENT_PLANE",
    "lora_cache_path": "DYN_LORA_PATH",
    "system_host": "DYN_SYSTEM_HOST",
    "system_port": "DYN_SYSTEM_PORT",
    "system_admin_auth": "DYN_SYSTEM_ADMIN_AUTH",
    "http_host": "DYN_HTTP_HOST",
    "http_port": "DYN_HTTP_PORT",
    "grace_period": "DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS",
    "drain_timeout": "DYN_PREFILL_DRAIN_TIMEOUT_S",
    "shutdown_timeout": "DYN_WORKER_GRACEFUL_SHUTDOWN_TIMEOUT",
    "fpm_port": "DYN_FORWARDPASS_METRIC_PORT",
    "token_budget_combined_limit": "DYN_TOKEN_BUDGET_COMBINED_LIMIT",
}
_FLAG_ENV = {
    "enable_lora": "DYN_LORA_ENABLED",
    "token_budget_reject_prompt_overflow": "DYN_TOKEN_BUDGET_REJECT_PROMPT_OVERFLOW",
    "token_budget_reject_total_overflow": "DYN_TOKEN_BUDGET_REJECT_TOTAL_OVERFLOW",
}

EPILOG = """\
environment (each flag's variable; also read by the runtime):
  DYN_WORKER_ENGINE, DYN_MODEL, DYN_SERVED_MODEL_NAME, DYN_NAMESPACE, DYN_DISCOVERY_BACKEND
  (kubernetes|file|mem; default mem), DYN_REQUEST_PLANE (tcp|http; default tcp: upstream's
  TCP request plane beside the HTTP routes, advertised in discovery so upstream's frontend
  routes here; http: the HTTP routes only), DYN_EVENT_PLANE (zmq|nats; default zmq: KV
  events and load beside the TCP plane; nats: none), DYN_DATA_PARALLEL_SIZE,
  DYN_DATA_PARALLEL_START_RANK, DYN_DISAGGREGATION_MODE, DYN_LORA_ENABLED, DYN_MAX_LORAS,
  DYN_LORA_PATH, DYN_SYSTEM_HOST, DYN_SYSTEM_PORT, DYN_SYSTEM_ADMIN_AUTH
  (+ DYN_SYSTEM_ADMIN_AUTH_WORKER), DYN_HTTP_HOST, DYN_HTTP_PORT,
  DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS, DYN_PREFILL_DRAIN_TIMEOUT_S,
  DYN_WORKER_GRACEFUL_SHUTDOWN_TIMEOUT, DYN_FORWARDPASS_METRIC_PORT,
  DYN_TOKEN_BUDGET_COMBINED_LIMIT, DYN_TOKEN_BUDGET_REJECT_PROMPT_OVERFLOW,
  DYN_TOKEN_BUDGET_REJECT_TOTAL_OVERFLOW, DYN_LOG.
also read: DYN_SYSTEM_HEALTH_PATH, DYN_SYSTEM_LIVE_PATH, DYN_SYSTEM_STARTING_HEALTH_STATUS,
  DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS, DYN_HEALTH_CHECK_ENABLED, DYN_HEALTH_CHECK_PAYLOAD,
  DYN_CANARY_WAIT_TIME, DYN_HEALTH_CHECK_REQUEST_TIMEOUT, DYN_FORWARDPASS_METRIC_HOST,
  DYN_TCP_RPC_HOST, DYN_TCP_RPC_PORT, DYN_TCP_MAX_MESSAGE_SIZE, DYN_EVENT_PLANE_HOST,
  DYN_FILE_KV, POD_NAME/POD_NAMESPACE/POD_UID (kubernetes discovery), AWS_* and HF_* (LoRA
  and model downloads), DYN_MODEL_CACHE (where s3:// and hf:// models are cached) and
  DYN_MODEL_CACHE_REQUIRED (true: load them only from a complete cache directory, never
  download; the operator sets it with spec.model.cache).

shutdown (SIGTERM/SIGINT): /health turns 503 and the worker leaves discovery at once; after
the grace period new requests get 503; in-flight requests may finish within the drain
timeout (every mode, not only prefill), the rest end with finish reason "cancelled"; exit 0,
or 911 when it all takes longer than the shutdown timeout plus the grace period.
"""


class _Parser(argparse.ArgumentParser):
    """Argument errors as one line on stderr, exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def usage_error(message: str) -> NoReturn:
    """Print `dynamo-worker: error: <message>` and exit 2."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(EXIT_USAGE)


def _env(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value else None


def _env_int(name: str) -> int | None:
    value = _env(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        usage_error(f"{name}={value!r} is not an integer")


def build_parser() -> argparse.ArgumentParser:
    """The worker's options (defaults from the environment)."""
    parser = _Parser(
        prog=PROG,
        description="Serve one inference engine with the Dynamo worker runtime: request plane "
        "(OpenAI-compatible and token-level), system status server, discovery, metrics, LoRA "
        "management and graceful shutdown.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    add = parser.add_argument
    add(
        "--engine",
        default=_env("DYN_WORKER_ENGINE") or DEFAULT_ENGINE,
        metavar="MODULE:CLASS",
        help=f"engine class to serve, or one of {', '.join(ENGINE_NAMES)} (default "
        f"{DEFAULT_ENGINE})",
    )
    add(
        "--model",
        default=_env("DYN_MODEL"),
        metavar="PATH_OR_URI",
        help="model directory, file:///dir, or hf://org/repo (fetched into the hub cache)",
    )
    add(
        "--served-model-name",
        default=_env("DYN_SERVED_MODEL_NAME"),
        help="the model id clients use (default: the engine's model)",
    )
    add("--namespace", default=None, help="Dynamo namespace (default $DYN_NAMESPACE or dynamo)")
    add(
        "--discovery-backend",
        default=None,
        choices=("kubernetes", "file", "mem"),
        help="where the worker publishes itself (default $DYN_DISCOVERY_BACKEND or mem)",
    )
    add(
        "--request-plane",
        default=None,
        choices=("tcp", "nats", "http"),
        help="how routers reach the worker (default $DYN_REQUEST_PLANE or tcp): tcp serves "
        "upstream's TCP request plane beside the HTTP routes and advertises it; http "
        "advertises the HTTP routes only; nats is upstream's, not available here",
    )
    add(
        "--event-plane",
        default=None,
        choices=("zmq", "nats"),
        help="where KV events and load go (default $DYN_EVENT_PLANE or zmq); nats is "
        "upstream's, not available here (no events are published)",
    )
    dp = parser.add_argument_group("data parallelism")
    dp.add_argument(
        "--data-parallel-size",
        type=int,
        metavar="N",
        default=_env_int("DYN_DATA_PARALLEL_SIZE"),
        help="data-parallel ranks this worker serves (passed to the engine)",
    )
    dp.add_argument(
        "--data-parallel-start-rank",
        type=int,
        metavar="R",
        default=_env_int("DYN_DATA_PARALLEL_START_RANK"),
        help="first data-parallel rank (passed to the engine)",
    )
    disagg = parser.add_argument_group("disaggregated serving")
    disagg.add_argument(
        "--disaggregation-mode",
        default=_env("DYN_DISAGGREGATION_MODE"),
        choices=DISAGGREGATION_MODES,
        help="the worker's role: agg (prefill and decode; the default), prefill or decode, as "
        "upstream's `python -m dynamo.vllm` takes it (passed to the engine; the vllm engine "
        "also needs --kv-transfer-config; DYN_DISAGGREGATION_MODE)",
    )
    lora = parser.add_argument_group("LoRA")
    lora.add_argument(
        "--enable-lora",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="mount /v1/loras and allow adapter downloads (DYN_LORA_ENABLED)",
    )
    lora.add_argument(
        "--max-loras",
        type=int,
        metavar="N",
        default=_env_int("DYN_MAX_LORAS"),
        help="adapters loaded at once (passed to the engine)",
    )
    lora.add_argument(
        "--lora-cache-path",
        metavar="DIR",
        default=None,
        help="adapter download cache (DYN_LORA_PATH)",
    )
    net = parser.add_argument_group("servers")
    net.add_argument("--system-host", default=None, help="system status server host")
    net.add_argument(
        "--system-port",
        type=int,
        default=None,
        help="system status server port (-1 off, 0 ephemeral; DYN_SYSTEM_PORT)",
    )
    net.add_argument(
        "--system-admin-auth",
        choices=("off", "kubernetes"),
        default=None,
        help="who may call the mutating system routes: anyone (off, the default) or callers "
        "a Kubernetes TokenReview and SubjectAccessReview admit (DYN_SYSTEM_ADMIN_AUTH)",
    )
    net.add_argument("--http-host", default=None, help="request plane host (DYN_HTTP_HOST)")
    net.add_argument(
        "--http-port", type=int, default=None, help="request plane port (0 ephemeral; default 8000)"
    )
    net.add_argument(
        "--fpm-port",
        type=int,
        default=None,
        help="forward-pass metrics ZMQ PUB port (DYN_FORWARDPASS_METRIC_PORT)",
    )
    drain = parser.add_argument_group("shutdown")
    drain.add_argument(
        "--grace-period",
        type=float,
        metavar="SECS",
        default=None,
        help="wait after leaving discovery before draining (default 5)",
    )
    drain.add_argument(
        "--drain-timeout",
        type=float,
        metavar="SECS",
        default=None,
        help="how long in-flight requests may finish (default 30)",
    )
    drain.add_argument(
        "--shutdown-timeout",
        type=float,
        metavar="SECS",
        default=None,
        help="hard deadline after the grace period, else exit 911 (default 30)",
    )
    budget = parser.add_argument_group("token budget")
    budget.add_argument(
        "--token-budget-combined-limit",
        type=int,
        metavar="TOKENS",
        default=None,
        help="publish and enforce prompt + max_tokens <= TOKENS",
    )
    budget.add_argument(
        "--token-budget-reject-prompt-overflow", action=argparse.BooleanOptionalAction, default=None
    )
    budget.add_argument(
        "--token-budget-reject-total-overflow", action=argparse.BooleanOptionalAction, default=None
    )
    add(
        "--log-level",
        default=_env("DYN_LOG") or "info",
        choices=("debug", "info", "warning", "error"),
        help="log level (DYN_LOG)",
    )
    return parser


def check_args(args: argparse.Namespace) -> None:
    """Cross-field checks argparse cannot do; SystemExit(2) with one line."""
    checks = [
        (
            args.data_parallel_size is not None and args.data_parallel_size < 1,
            "--data-parallel-size must be >= 1",
        ),
        (
            args.data_parallel_start_rank is not None and args.data_parallel_start_rank < 0,
            "--data-parallel-start-rank must be >= 0",
        ),
        (args.max_loras is not None and args.max_loras < 0, "--max-loras must be >= 0"),
        (
            args.http_port is not None and not 0 <= args.http_port <= 65535,
            "--http-port must be 0-65535",
        ),
        (
            args.system_port is not None and not -1 <= args.system_port <= 65535,
            "--system-port must be -1-65535",
        ),
        (
            args.token_budget_combined_limit is not None and args.token_budget_combined_limit < 0,
            "--token-budget-combined-limit must be >= 0",
        ),
        (
            ":" not in args.engine and args.engine not in ENGINE_NAMES,
            f"--engine {args.engine!r} must be MODULE:CLASS or one of {', '.join(ENGINE_NAMES)}",
        ),
        (
            args.request_plane == "nats",
            "--request-plane nats needs NATS, which this worker does not have; use tcp "
            "(upstream's frontend routes to it) or http",
        ),
    ]
    for seconds, flag in (
        (args.grace_period, "--grace-period"),
        (args.drain_timeout, "--drain-timeout"),
        (args.shutdown_timeout, "--shutdown-timeout"),
    ):
        checks.append((seconds is not None and seconds < 0, f"{flag} must be >= 0"))
    for failed, message in checks:
        if failed:
            usage_error(message)


def apply_environment(args: argparse.Namespace) -> None:
    """Write the given flags into the environment the runtime and engine read."""
    for dest, name in _ENV_FOR.items():
        value = getattr(args, dest)
        if value is not None:
            os.environ[name] = str(value)
    for dest, name in _FLAG_ENV.items():
        value = getattr(args, dest)
        if value is not None:
            os.environ[name] = "true" if value else "false"


def load_engine_class(spec: str) -> type[BaseEngine]:
    """Import `module:Class` (or a name in `ENGINE_NAMES`); ValueError with one line on any
    problem."""
    module_name, _, class_name = ENGINE_NAMES.get(spec, spec).partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"--engine {spec}: cannot import {module_name}: {exc}") from None
    engine_cls = getattr(module, class_name, None)
    if not isinstance(engine_cls, type) or not issubclass(engine_cls, BaseEngine):
        raise ValueError(
            f"--engine {spec}: {class_name} is not a dynamo.common.backend.BaseEngine subclass "
            f"in {module_name}"
        )
    return engine_cls


def engine_argv(args: argparse.Namespace, model: str | None, extras: Sequence[str]) -> list[str]:
    """What the engine's `from_args` receives."""
    argv: list[str] = []
    if model is not None:
        argv += ["--model", model]
    if args.served_model_name:
        argv += ["--served-model-name", args.served_model_name]
    if args.max_loras is not None:
        argv += ["--max-loras", str(args.max_loras)]
    if args.data_parallel_size is not None:
        argv += ["--data-parallel-size", str(args.data_parallel_size)]
    if args.data_parallel_start_rank is not None:
        argv += ["--data-parallel-start-rank", str(args.data_parallel_start_rank)]
    if args.disaggregation_mode is not None:
        argv += ["--disaggregation-mode", args.disaggregation_mode]
    rest = list(extras)
    if "--" in rest:
        rest.remove("--")
    return argv + rest


async def resolve_model(model: str | None) -> str | None:
    """A local path for `--model`: `file://` is stripped, `hf://org/repo` and
    `s3://bucket/prefix` are fetched; with `DYN_MODEL_CACHE_REQUIRED` on, they come only from
    their complete model cache directory (the operator's fill Job made it) and nothing is
    downloaded."""
    if model is None or "://" not in model:
        return _readable(model)
    scheme, _, rest = model.partition("://")
    if scheme == "file":
        return _readable(rest)
    if scheme == "hf":
        from dynamo.runtime import model_cache

        if model_cache.cache_required():
            return _readable(str(model_cache.lookup(model, model_cache.default_cache())))
        from dynamo.common.model_fetch import fetch_model

        return await fetch_model(rest)
    if scheme == "s3":
        from dynamo.runtime.s3_model import fetch_s3_model

        return _readable(await fetch_s3_model(model))
    raise ValueError(
        f"--model {model}: unsupported scheme {scheme!r}; use a path, file://, hf:// or s3://"
    )


def _readable(path: str | None) -> str | None:
    """`path`, refused when it is a directory this process may not list: the engine would
    otherwise report its files as missing (a volume mounted for another uid, say)."""
    if path is not None and os.path.isdir(path) and not os.access(path, os.R_OK | os.X_OK):
        mode = stat.S_IMODE(os.stat(path).st_mode)
        raise ValueError(
            f"--model {path}: the directory is not readable by uid {os.getuid()} (mode "
            f"{mode:o}, owner uid {os.stat(path).st_uid}); make it readable by this user, "
            "e.g. with the pod's fsGroup or a world-readable copy"
        )
    return path


async def create_engine(
    engine_cls: type[BaseEngine], argv: list[str]
) -> tuple[BaseEngine, WorkerConfig]:
    """`engine_cls.from_args(argv)`; an argument error becomes one line (help passes through)."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured), contextlib.redirect_stdout(captured):
            return await engine_cls.from_args(argv)
    except SystemExit as exc:
        text = captured.getvalue()
        if not exc.code:
            sys.stdout.write(text)
            raise
        lines = [line for line in text.splitlines() if line.strip()]
        reason = lines[-1] if lines else f"exit status {exc.code}"
        usage_error(f"engine arguments: {reason}")


async def run_worker(args: argparse.Namespace, extras: Sequence[str]) -> int:
    """Build the engine and run the runtime until shutdown; the exit code."""
    from dynamo.runtime.lifecycle import WorkerRuntime
    from dynamo.runtime.settings import RuntimeSettings

    engine_cls = load_engine_class(args.engine)
    model = await resolve_model(args.model)
    engine, config = await create_engine(engine_cls, engine_argv(args, model, extras))
    backend = os.environ.get("DYN_DISCOVERY_BACKEND") or "mem"
    settings = RuntimeSettings.from_env()
    # The worker's environment is authoritative for where it publishes itself and how
    # routers reach it.
    config = dataclasses.replace(
        config,
        discovery_backend=backend,
        request_plane=settings.request_plane,
        event_plane=settings.event_plane or config.event_plane,
    )
    return await WorkerRuntime(engine, config, settings).run()


def main(argv: list[str] | None = None) -> int:
    """Entry point of `dynamo-worker`."""
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    check_args(args)
    apply_environment(args)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return asyncio.run(run_worker(args, extras))
    except SystemExit:
        raise
    except KeyboardInterrupt:
        return EXIT_FAILURE
    except Exception as exc:
        logger.debug("worker failed", exc_info=True)
        print(f"{PROG}: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_FAILURE


def _one_line(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return " ".join(text.split())


if __name__ == "__main__":
    sys.exit(main())
