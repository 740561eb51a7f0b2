"""The unified engine contract: what an engine implements for `Worker` to serve it.

`BaseEngine` is the modality-agnostic lifecycle (`from_args` -> `start` -> requests ->
`cleanup`). `LLMEngine` adds the token pipeline's `generate`; `RawEngine` adds a raw
request/response `generate` for media generation. Request and response shapes are
TypedDicts: engine-specific extra keys pass through untouched.
"""

# No `from __future__ import annotations` here: TypedDict must see `Required[...]` as a real
# annotation to put `token_ids` in `__required_keys__`.

from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Required, TypedDict

if TYPE_CHECKING:
    from dynamo.common.backend.logits_processing import LogitsProcessorSpec
    from dynamo.common.backend.publisher import KvEventSource
    from dynamo.common.backend.worker_config import WorkerConfig

# The per-request context object is owned by the worker runtime (`Context`: id,
# is_stopped, metadata, tracing, ...); engines only pass it around.
Context = Any
# The runtime's per-engine metrics handle (`EngineMetrics`): auto_labels and expfmt callbacks.
EngineMetrics = Any

# Raw engines receive the OpenAI-shaped JSON request and yield JSON response objects.
RawRequest = dict[str, Any]
RawResponseChunk = dict[str, Any]


class GenerateRequest(TypedDict, total=False):
    """Inbound request dict passed to `LLMEngine.generate()`.

    `token_ids` is always present (set by the frontend preprocessor); read the other
    groups defensively with `.get(key, {})`. `prefill_result`/`bootstrap_info` arrive on
    decode requests in disaggregated serving; the multimodal keys and `encoder_result`
    when the request carries media. `routing.dp_rank` is a router-forced DP rank.
    """

    token_ids: Required[list[int]]
    model: str
    sampling_options: dict[str, Any]
    stop_conditions: dict[str, Any]
    output_options: dict[str, Any]
    require_reasoning: bool
    prefill_result: dict[str, Any]
    bootstrap_info: dict[str, Any]
    multi_modal_data: dict[str, Any]
    mm_processor_kwargs: dict[str, Any]
    mm_routing_info: dict[str, Any]
    encoder_result: dict[str, Any]
    extra_args: dict[str, Any]
    routing: dict[str, Any]


class GenerateChunk(TypedDict, total=False):
    """Single chunk yielded by `LLMEngine.generate()`.

    Every chunk carries `token_ids` and `index` (0 for single-choice responses). Exactly
    one terminal chunk carries `finish_reason` (and optionally `completion_usage`);
    nothing follows it. Prefill terminals carry `disaggregated_params`, encode terminals
    `encoder_result`. On cancellation the terminal uses finish reason "cancelled".
    """

    token_ids: Required[list[int]]
    index: Required[int]
    finish_reason: str
    completion_usage: dict[str, Any]
    disaggregated_params: dict[str, Any]
    encoder_result: dict[str, Any]
    log_probs: list[float]
    top_logprobs: list[list[dict[str, Any]]]
    engine_data: dict[str, Any]


@dataclass
class LlmRegistration:
    """Token-pipeline registration metadata (KV cache, data-parallel layout, bootstrap).

    Set by `LLMEngine`s; `RawEngine`s leave `EngineConfig.llm` as None. A None field is
    not advertised (the router falls back to its defaults: DP size 1, start rank 0).
    """

    context_length: int | None = None
    kv_cache_block_size: int | None = None
    total_kv_blocks: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    data_parallel_size: int | None = None
    data_parallel_start_rank: int | None = None
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None


@dataclass
class EngineConfig:
    """Registration metadata returned by an engine's `start`.

    `model`, `served_model_name`, `model_aliases` and `runtime_data` apply to every
    modality; token-pipeline metadata lives in the optional `llm` record.
    """

    model: str
    served_model_name: str | None = None
    runtime_data: dict[str, Any] | None = None
    llm: LlmRegistration | None = None
    model_aliases: list[str] = field(default_factory=list)


class BaseEngine(ABC):
    """Abstract base for all engines: the modality-agnostic lifecycle.

    1. `from_args(argv)` parses CLI args and returns `(engine, WorkerConfig)`.
    2. `start(worker_id)` starts the engine; `generate` must work once it returns.
    3. `generate` runs per request, concurrently (declared by the subclasses).
    4. `abort` is called when a request is cancelled (default no-op).
    5. `cleanup` runs once on shutdown, also after a failed `start`.
    """

    @classmethod
    @abstractmethod
    async def from_args(cls, argv: list[str] | None = None) -> "tuple[BaseEngine, WorkerConfig]":
        """Parse CLI args (`None` means `sys.argv[1:]`) and build the engine, not started."""

    @abstractmethod
    async def start(self, worker_id: int) -> EngineConfig:
        """Start the engine and return registration metadata.

        `worker_id` is an opaque identifier, unique across replicas and stable for the
        worker's lifetime; derive per-worker keys from it.
        """

    async def abort(self, context: Context) -> None:  # noqa: B027 (documented no-op default)
        """Abort an in-flight request (optional, default no-op)."""

    async def is_quiescent(self) -> bool | None:
        """Whether in-flight KV transfers are done, so `cleanup` may free memory.

        Polled on prefill workers during shutdown drain: True ends the drain, False
        keeps polling, None (default: no introspection) polls until the drain budget
        runs out.
        """
        return None

    @abstractmethod
    async def cleanup(self) -> None:
        """Release all engine resources.

        Must be null-safe (it also runs after `start` raised, on partial state) and
        idempotent (a second call is a no-op).
        """

    async def register_prometheus(self, metrics: EngineMetrics) -> None:  # noqa: B027 (documented no-op default)
        """Bridge a vendor Prometheus registry into `/metrics` (default no-op)."""

    def component_metrics_dp_ranks(self) -> list[int]:
        """Data-parallel ranks this engine publishes snapshots for ([] opts out)."""
        return []

    def attach_snapshot_publisher(self, publisher: Any) -> None:  # noqa: B027 (documented no-op default)
        """Receive the snapshot publisher once (only when DP ranks were declared)."""

    async def health_check_payload(self) -> dict[str, Any] | None:
        """Canary request sent through `generate` when idle; None disables probing."""
        return None

    def supported_controls(self) -> set[str]:
        """Engine-control keys this engine implements (served at /engine/control/<key>)."""
        return set()

    async def engine_control(self, control: str, body: dict[str, Any]) -> dict[str, Any]:
        """Handle one advertised engine-control request."""
        return {"status": "error", "message": f"unsupported engine control: {control}"}

    def supported_updates(self) -> set[str]:
        """Engine-update keys this engine implements (served at /engine/update/<key>)."""
        return set()

    async def engine_update(self, update: str, body: dict[str, Any]) -> dict[str, Any]:
        """Handle one advertised engine-update request."""
        return {"status": "error", "message": f"unsupported engine update: {update}"}

    async def on_endpoint_ready(self, endpoint: Any) -> None:  # noqa: B027 (documented no-op default)
        """Receive the serving endpoint once, before serving; raising is fatal."""


class LLMEngine(BaseEngine):
    """Abstract base for token-based inference engines (registered with `ModelInput.Tokens`).

    The frontend tokenizes the prompt into `token_ids`; `generate` yields token chunks
    that the frontend detokenizes.
    """

    @abstractmethod
    def generate(
        self, request: GenerateRequest, context: Context
    ) -> AsyncGenerator[GenerateChunk, None]:
        """Yield streaming response chunks for one request (called concurrently)."""

    async def kv_event_sources(self) -> "list[KvEventSource]":
        """KV event sources, one per data-parallel rank ([] opts out of KV routing)."""
        return []

    async def logits_processor_spec(self) -> "LogitsProcessorSpec | None":
        """Backend-neutral logits-processor activation data (None opts out)."""
        return None


class RawEngine(BaseEngine):
    """Engines for raw, non-token generation (image, video, audio).

    The frontend forwards the OpenAI-shaped request as a JSON object and `generate`
    yields response objects: one terminal object, or progress objects then a terminal.
    Registered with `ModelInput.Text`/`Tensor`; no tokenization, KV cache or controls.
    """

    @abstractmethod
    def generate(
        self, request: RawRequest, context: Context
    ) -> AsyncGenerator[RawResponseChunk, None]:
        """Yield response object(s) for one raw-media request."""


class DiffusionEngine(RawEngine):
    """A `RawEngine` for diffusion-family generation (image/video); adds no contract."""
