"""The worker runtime's interface as the operator drives it: command, arguments, env var names,
ports, probe paths, mount paths, and the shutdown arithmetic.

This is the one table to change when the runtime's CLI (`dynamo-worker`,
worker_image/src/dynamo/runtime/cli.py) changes; the system server's port and routes are
`pods.routes`. Env names and ports are upstream Dynamo's
(its Rust runtime reads the same ones), so an upstream worker image driven by this operator
behaves the same way.
"""

from __future__ import annotations

from enum import StrEnum

from dynamo_operator.api.dynamoworker import Drain, DynamoWorkerSpec, WorkerRole
from dynamo_operator.reconcile.dynamoworker import disaggregation
from dynamo_operator.reconcile.dynamoworker.engine_args import engine_args

CONTAINER_NAME = "main"
COMMAND = ["dynamo-worker"]
# DYN_COMPONENT: upstream's operator sets the component's type; ours are all workers.
COMPONENT = "worker"
DISCOVERY_BACKEND = "kubernetes"
# Upstream's request plane: the worker serves it beside its own HTTP routes, so upstream's
# frontend (spec.frontend, or one a user runs) can route to every worker the operator makes.
REQUEST_PLANE = "tcp"
# The mutating system routes answer only callers allowed `update` on this DynamoWorker's
# `dynamoworkers/admin` (TokenReview + SubjectAccessReview; the operator's token is
# `pods.credentials`).
SYSTEM_ADMIN_AUTH = "kubernetes"

# The system server's port and routes are in `pods.routes` (the pod clients use them too).
HTTP_PORT = 8000
HTTP_PORT_NAME = "http"

# Writable places under a read-only root filesystem, each an emptyDir (or the LoRA cache's
# PVC): /tmp and HOME, the model download cache, LoRA adapters, and the in-memory /dev/shm.
TMP_PATH = "/tmp"  # an emptyDir of the pod's own
CACHE_PATH = "/var/cache/dynamo"
HF_HOME_PATH = f"{CACHE_PATH}/huggingface"
MODEL_CACHE_PATH = f"{CACHE_PATH}/models"  # s3:// model sources (the worker's DYN_MODEL_CACHE)
LORA_PATH = "/var/lib/dynamo/loras"
SHM_PATH = "/dev/shm"

# Non-root identity for the worker (a restricted pod must not run as root): the user the
# worker images create (worker_image/Dockerfile*: USER 10001:10001), above 10000 so that it is
# no user of the node's own; fsGroup makes volumes, the LoRA PVC included, writable by it.
RUN_AS_USER = 10001
RUN_AS_GROUP = 10001

# Probe timings: upstream's worker defaults, but for liveness's failure threshold. The startup
# probe allows 720 x 10 s = 2 h for model and adapter loading before the liveness probe takes
# over. Upstream restarts a worker on one liveness answer slower than 4 s; a busy CPU host (two
# vLLM engines and their NIXL threads on 2 cores) missed one now and then, and the restart
# killed requests and the KV blocks a decode pod was about to pull. Three in a row (15 s) still
# catches a hung worker, and readiness takes a slow one out of routing sooner.
LIVENESS = {"periodSeconds": 5, "timeoutSeconds": 4, "failureThreshold": 3}
READINESS = {"periodSeconds": 10, "timeoutSeconds": 4, "failureThreshold": 3}
STARTUP = {"periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 720}
STARTUP_BUDGET_SECONDS = STARTUP["periodSeconds"] * STARTUP["failureThreshold"]

# Shutdown arithmetic. On SIGTERM the runtime turns /health to 503, sleeps the grace period,
# drains for up to min(DYN_PREFILL_DRAIN_TIMEOUT_S, DYN_WORKER_GRACEFUL_SHUTDOWN_TIMEOUT - 5),
# runs cleanup, and exits 911 if all that takes longer than
# DYN_WORKER_GRACEFUL_SHUTDOWN_TIMEOUT + grace. So the shutdown timeout is drain + a cleanup
# margin (at least the runtime's 5 s reserve, so the drain budget is the full drain timeout),
# and the pod's terminationGracePeriodSeconds adds a kill margin on top, so that the kubelet's
# SIGKILL never lands before the runtime's own deadline.
CLEANUP_MARGIN_SECONDS = 15
KILL_MARGIN_SECONDS = 5
RUNTIME_DRAIN_RESERVE_SECONDS = 5
assert CLEANUP_MARGIN_SECONDS >= RUNTIME_DRAIN_RESERVE_SECONDS


class Env(StrEnum):
    """Environment variables the worker runtime reads."""

    NAMESPACE = "DYN_NAMESPACE"
    COMPONENT = "DYN_COMPONENT"
    SYSTEM_PORT = "DYN_SYSTEM_PORT"
    HTTP_PORT = "DYN_HTTP_PORT"
    DISCOVERY_BACKEND = "DYN_DISCOVERY_BACKEND"
    REQUEST_PLANE = "DYN_REQUEST_PLANE"
    LORA_ENABLED = "DYN_LORA_ENABLED"
    SYSTEM_ADMIN_AUTH = "DYN_SYSTEM_ADMIN_AUTH"
    SYSTEM_ADMIN_AUTH_WORKER = "DYN_SYSTEM_ADMIN_AUTH_WORKER"
    LORA_PATH = "DYN_LORA_PATH"
    MAX_LORAS = "DYN_MAX_LORAS"
    GRACE_PERIOD = "DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS"
    PREFILL_DRAIN_TIMEOUT = "DYN_PREFILL_DRAIN_TIMEOUT_S"
    SHUTDOWN_TIMEOUT = "DYN_WORKER_GRACEFUL_SHUTDOWN_TIMEOUT"
    TOKEN_BUDGET_COMBINED_LIMIT = "DYN_TOKEN_BUDGET_COMBINED_LIMIT"
    TOKEN_BUDGET_REJECT_PROMPT = "DYN_TOKEN_BUDGET_REJECT_PROMPT_OVERFLOW"
    TOKEN_BUDGET_REJECT_TOTAL = "DYN_TOKEN_BUDGET_REJECT_TOTAL_OVERFLOW"
    POD_NAME = "POD_NAME"
    POD_NAMESPACE = "POD_NAMESPACE"
    POD_UID = "POD_UID"
    POD_IP = "POD_IP"
    HOME = "HOME"
    HF_HOME = "HF_HOME"
    MODEL_CACHE = "DYN_MODEL_CACHE"
    MODEL_CACHE_REQUIRED = "DYN_MODEL_CACHE_REQUIRED"
    AWS_ACCESS_KEY_ID = "AWS_ACCESS_KEY_ID"
    AWS_SECRET_ACCESS_KEY = "AWS_SECRET_ACCESS_KEY"
    AWS_SESSION_TOKEN = "AWS_SESSION_TOKEN"
    AWS_ENDPOINT_URL = "AWS_ENDPOINT_URL"
    AWS_REGION = "AWS_REGION"
    AWS_ALLOW_HTTP = "AWS_ALLOW_HTTP"
    HF_TOKEN = "HF_TOKEN"


# Downward-API env: what each pod learns about itself.
DOWNWARD_ENV = {
    Env.POD_NAME: "metadata.name",
    Env.POD_NAMESPACE: "metadata.namespace",
    Env.POD_UID: "metadata.uid",
    Env.POD_IP: "status.podIP",
}


# Upstream's frontend (spec.frontend): `python3 -m dynamo.frontend`, configured by env (each
# flag has a DYN_* twin, so spec.frontend.extraArgs may still add flags). It serves the
# OpenAI API, /health (200 once serving; 503 while draining) and /live on one port.
FRONTEND_COMMAND = ["python3", "-m", "dynamo.frontend"]
FRONTEND_PORT = 8000
FRONTEND_PORT_NAME = "http"
FRONTEND_LIVENESS = {"periodSeconds": 10, "timeoutSeconds": 4, "failureThreshold": 3}
FRONTEND_READINESS = {"periodSeconds": 5, "timeoutSeconds": 4, "failureThreshold": 3}


class FrontendEnv(StrEnum):
    """Environment variables upstream's frontend reads (each the twin of a flag; see
    `python3 -m dynamo.frontend --help`)."""

    NAMESPACE = "DYN_NAMESPACE"
    DISCOVERY_BACKEND = "DYN_DISCOVERY_BACKEND"
    REQUEST_PLANE = "DYN_REQUEST_PLANE"
    HTTP_PORT = "DYN_HTTP_PORT"
    ROUTER_MODE = "DYN_ROUTER_MODE"


def dynamo_namespace(namespace: str, worker: str) -> str:
    """DYN_NAMESPACE, upstream's convention `<kubernetes namespace>-<deployment name>`."""
    return f"{namespace}-{worker}"


def shutdown_timeout_seconds(drain: Drain) -> int:
    """DYN_WORKER_GRACEFUL_SHUTDOWN_TIMEOUT: the drain plus the cleanup margin."""
    return drain.drain_timeout_seconds + CLEANUP_MARGIN_SECONDS


def termination_grace_period_seconds(drain: Drain) -> int:
    """The pod's terminationGracePeriodSeconds: grace + drain + cleanup + kill margins, so it is
    never shorter than what spec.drain asks for."""
    return drain.grace_period_seconds + shutdown_timeout_seconds(drain) + KILL_MARGIN_SECONDS


def worker_args(spec: DynamoWorkerSpec, role: WorkerRole | None = None) -> list[str]:
    """`dynamo-worker` arguments: the model and the name clients use, the engine (by name
    or class), the data-parallel layout, the role of a disaggregated worker's pods; after `--`
    (the worker hands them to the engine) the engine flags the spec implies (`engine_args`),
    then spec.engine.extraArgs. `spec` is the role's (`DynamoWorkerSpec.for_role`). Aliases
    are not passed: the worker has no option for them yet."""
    args = ["--model", spec.model.source, "--served-model-name", spec.model.served_name]
    engine = spec.engine.name or spec.engine.engine_class
    if engine is not None:
        args += ["--engine", engine]
    if spec.data_parallel.size != 1 or spec.data_parallel.start_rank != 0:
        args += [
            "--data-parallel-size",
            str(spec.data_parallel.size),
            "--data-parallel-start-rank",
            str(spec.data_parallel.start_rank),
        ]
    args += disaggregation.worker_args(role)
    passed = [*engine_args(spec, role), *spec.engine.extra_args]
    if passed:
        args += ["--", *passed]
    return args
