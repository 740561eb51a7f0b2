"""`TransformersEngine`: the reference engine, any local Hugging Face causal LM on transformers.

Scheduling is iteration-level: an asyncio task runs iterations, and each iteration advances
every active request by exactly one step (the prompt's prefill for a request that just
joined, one decoded token for the others), so requests join and leave between iterations
and stream concurrently. Each request keeps its own `DynamicCache`, and an iteration runs
**one forward per active request** (all of them in one worker thread, so the event loop stays
free). That is a deliberate trade: batching requests with KV caches of different lengths
would mean re-padding the caches whenever a request joins or leaves, and per-request forwards
keep a request's output independent of its neighbours (bit-identical to running it alone).
On a GPU this leaves throughput on the table; the engine contract is unchanged by batching,
so it can come later.

LoRA: adapters are PEFT adapters inside one `PeftModel` wrapped around the base model. Each
request runs with the adapter its `model` field names (PEFT's per-call `adapter_names`, so
requests with different adapters share the iteration), or the bare base model when it names
the served model. Adapters load and unload at run time through the engine updates
(`LoRAAdapterHost`, bounded by `max_loras`). A request keeps the adapter version it started
with: unloading or hot-swapping an adapter never disturbs requests already running on it;
the old weights are freed when the last of them finishes.

KV accounting is bookkeeping over a dynamic cache: a request holds `ceil(tokens / block)`
blocks, and the total is `max_num_seqs` full-context requests, so admission by
`max_num_seqs` alone can never run out of blocks.

Data parallelism (`--data-parallel-size`) runs several logical ranks over the one model
copy: each rank has its own queue, `max_num_seqs`, KV budget, scheduler task, forward-pass
metrics and snapshots, and a request goes to the router's forced rank (`routing.dp_rank`)
or else the least-loaded one. The ranks' iterations take turns on the model, so this adds
no throughput; it gives DP-aware routing and per-rank metrics something real to drive.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import logging
import math
import time
from collections import deque
from collections.abc import AsyncGenerator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dynamo.common.backend import (
    ComponentSnapshot,
    EngineConfig,
    GenerateChunk,
    GenerateRequest,
    LlmRegistration,
    WorkerConfig,
)
from dynamo.common.forward_pass_metrics import WelfordAccumulator
from dynamo.common.lora import LoRAManager
from dynamo.engines import worker_args
from dynamo.engines.fpm import ForwardPassEmitter, ForwardPassMetricsSink
from dynamo.engines.lora_host import AdapterVersion, AdapterVersions, LoRAHostEngine
from dynamo.runtime.errors import CONTEXT_LENGTH_EXCEEDED, RequestError, not_supported
from dynamo.runtime.request_limits import ALL_FEATURES, RESPONSE_FORMAT, RequestLimits

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# PEFT's reserved adapter name for "no adapter" in per-call `adapter_names`.
_PEFT_BASE = "__base__"
_ENGINE_NAME = "the transformers engine"


class FinishReason:
    """The finish reasons this engine reports."""

    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class TransformersEngineArgs:
    """The engine's settings (one per `from_args` flag)."""

    model: str
    served_model_name: str | None = None
    max_loras: int = worker_args.DEFAULT_MAX_LORAS
    max_num_seqs: int = 8
    kv_block_size: int = 16
    device: str = "auto"
    dtype: str = "auto"
    context_length: int | None = None
    data_parallel_size: int = 1
    data_parallel_start_rank: int = 0

    def __post_init__(self) -> None:
        minimums = {
            "max_num_seqs": 1,
            "kv_block_size": 1,
            "context_length": 2,
        }
        worker_args.check_minimums(self, minimums)
        if self.dtype not in _DTYPES:
            raise ValueError(
                f"dtype (--dtype) must be one of {sorted(_DTYPES)}, got {self.dtype!r}"
            )


_DTYPES = {"auto", "float32", "float16", "bfloat16"}


@dataclass(frozen=True)
class SamplingParams:
    """Decoding settings from `sampling_options` (temperature 0 means greedy), checked
    against the ranges every engine publishes (`SAMPLING_RANGES`): the engine's own last
    check, a `RequestError` (400) naming the field.

    `n` > 1 and beam search are refused rather than silently answered with one choice;
    `guided_decoding` (structured output) is kept for the engines that honour it.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # token id -> bias added to its logit
    logit_bias: tuple[tuple[int, float], ...] = ()
    guided_decoding: dict[str, Any] | None = field(default=None, hash=False, compare=False)

    @property
    def greedy(self) -> bool:
        """Whether the most likely token is always taken."""
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether any penalty or bias changes the logits."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> SamplingParams:
        """Parse and check `sampling_options`; None values mean the defaults."""
        limits = RequestLimits(features=ALL_FEATURES)
        limits.check_request({"token_ids": [0], "sampling_options": options})
        values = {
            key: float(_number(options, key, default))
            for key, default in (
                ("temperature", 1.0),
                ("top_p", 1.0),
                ("min_p", 0.0),
                ("presence_penalty", 0.0),
                ("frequency_penalty", 0.0),
                ("repetition_penalty", 1.0),
            )
        }
        bias = options.get("logit_bias") or {}
        guided = options.get("guided_decoding")
        if guided is not None and not isinstance(guided, dict):
            raise RequestError("'guided_decoding' must be an object", param="response_format")
        return cls(
            # -1 and 0 both mean "no top-k", as in vLLM and OpenAI-style APIs.
            top_k=max(int(_number(options, "top_k", 0)), 0),
            seed=options.get("seed"),
            logit_bias=tuple(sorted((int(token), float(b)) for token, b in bias.items())),
            guided_decoding=guided,
            **values,
        )


@dataclass(frozen=True)
class StopParams:
    """When a request finishes, from `stop_conditions`."""

    max_tokens: int
    min_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False

    @classmethod
    def from_conditions(cls, conditions: dict[str, Any], default_max_tokens: int) -> StopParams:
        """Parse and check `stop_conditions`.

        Stop strings (`stop`) are the detokenizer's business, not the engine's.
        `stop_token_ids_hidden` (upstream's name) and `stop_token_ids` both stop.
        """
        max_tokens = conditions.get("max_tokens")
        max_tokens = default_max_tokens if max_tokens is None else _int(conditions, "max_tokens")
        if max_tokens < 1:
            raise RequestError(f"'max_tokens' must be >= 1, got {max_tokens}", param="max_tokens")
        min_tokens = 0 if conditions.get("min_tokens") is None else _int(conditions, "min_tokens")
        if min_tokens < 0:
            raise RequestError(f"'min_tokens' must be >= 0, got {min_tokens}", param="min_tokens")
        stop_ids: set[int] = set()
        for key in ("stop_token_ids", "stop_token_ids_hidden"):
            values = conditions.get(key) or []
            if not isinstance(values, list) or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in values
            ):
                raise RequestError(f"'{key}' must be a list of token ids", param=key)
            stop_ids.update(values)
        return cls(
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            stop_token_ids=frozenset(stop_ids),
            ignore_eos=bool(conditions.get("ignore_eos") or False),
        )


def _number(options: dict[str, Any], key: str, default: float) -> float:
    value = options.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestError(f"'{key}' must be a number, got {value!r}", param=key)
    return float(value)


def _int(conditions: dict[str, Any], key: str) -> int:
    value = conditions[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"'{key}' must be an integer, got {value!r}", param=key)
    return value


@dataclass(eq=False)
class _Adapter(AdapterVersion):
    """One adapter version inside the `PeftModel`."""

    lora_id: int
    peft_name: str


@dataclass
class _Sequence:
    """One request's state in the scheduler."""

    prompt: list[int]
    sampling: SamplingParams
    stop: StopParams
    adapter: _Adapter | None
    rank: _Rank
    context: Any
    generator: torch.Generator
    # Alternatives per token to return with log probabilities (None: no log probabilities).
    logprobs: int | None
    output: list[int] = field(default_factory=list)
    cache: Any = None  # the request's DynamicCache once prefilled
    finished: bool = False
    queue: asyncio.Queue[GenerateChunk | BaseException] = field(default_factory=asyncio.Queue)

    @property
    def kv_tokens(self) -> int:
        """Tokens whose keys and values are in the cache (the last token is not, yet)."""
        if self.cache is None:
            return 0
        return len(self.prompt) + len(self.output) - 1

    def usage(self) -> dict[str, int]:
        """OpenAI-style usage counts."""
        prompt, completion = len(self.prompt), len(self.output)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }


class _Rank:
    """One data-parallel rank: its own queue, running set, KV budget and scheduler task."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.waiting: deque[_Sequence] = deque()
        self.running: list[_Sequence] = []
        self.wakeup = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.iterations = 0
        self.was_active = False
        self.last_snapshot: tuple[int, int] | None = None

    def load(self) -> int:
        """Requests assigned to this rank (for least-loaded placement)."""
        return len(self.waiting) + len(self.running)


@dataclass
class _StepResult:
    """What one forward produced for one sequence."""

    token: int | None = None
    logprob: float | None = None
    top_logprobs: list[dict[str, Any]] | None = None
    error: BaseException | None = None
    prefill: bool = False


def _context_stopped(context: Any) -> bool:
    """Whether the runtime's per-request context says stop (`is_stopped()`/`is_killed()`)."""
    for name in ("is_stopped", "is_killed"):
        probe = getattr(context, name, None)
        if probe is None:
            continue
        value = probe() if callable(probe) else probe
        if value is True:
            return True
    return False


class TransformersEngine(LoRAHostEngine):
    """Serve a local Hugging Face causal-LM checkpoint, with PEFT LoRA adapters per request.

    See the module docstring for the scheduling and LoRA design.
    """

    def __init__(
        self,
        args: TransformersEngineArgs,
        *,
        lora_manager: LoRAManager | None = None,
        fpm_sink: ForwardPassMetricsSink | None = None,
    ) -> None:
        """Build the engine (nothing loads until `start`).

        `lora_manager` downloads adapters; None means `get_lora_manager()` at each load,
        which needs `DYN_LORA_ENABLED`. `fpm_sink` receives one `ForwardPassMetrics` per
        scheduler iteration (see `attach_forward_pass_metrics_sink`).
        """
        super().__init__(max_loras=args.max_loras, lora_manager=lora_manager)
        self.args = args
        self.tokenizer: Any = None
        self._fpm = ForwardPassEmitter(fpm_sink)
        self._snapshot_publisher: Any = None
        first = args.data_parallel_start_rank
        self._ranks = [_Rank(r) for r in range(first, first + args.data_parallel_size)]
        self._base: Any = None
        self._peft: Any = None
        self._device = "cpu"
        self._vocab_size = 0
        self._eos_ids: frozenset[int] = frozenset()
        self._cache_kwarg = "past_key_values"
        self._context_length = 0
        self._total_blocks = 0
        self._served_names: set[str] = set()
        self._adapters = AdapterVersions[_Adapter](self._delete_adapter)
        self._adapter_counter = 0
        self._by_context: dict[int, _Sequence] = {}
        # Held by each iteration's forwards and by adapter loads: PEFT's modules change
        # under a load, so the two never overlap.
        self._model_lock = asyncio.Lock()
        self._closed = False
        # Work started from synchronous code (adapter deletions, async snapshot publishes),
        # referenced until done so it is not garbage-collected mid-flight.
        self._background: set[asyncio.Future[Any]] = set()

    # ----- lifecycle -------------------------------------------------------------------

    @classmethod
    async def from_args(
        cls, argv: list[str] | None = None
    ) -> tuple[TransformersEngine, WorkerConfig]:
        """Parse the engine's flags (`--help` lists them) into an engine and its WorkerConfig."""
        parser = build_arg_parser()
        ns = parser.parse_args(argv)
        model_dir = Path(ns.model)
        if not (model_dir / "config.json").is_file():
            parser.error(
                f"--model {ns.model}: no config.json there; pass a local Hugging Face "
                "checkpoint directory"
            )
        args, config = worker_args.engine_settings(parser, ns, TransformersEngineArgs)
        worker_args.require_aggregated(parser, config, "the transformers engine")
        return cls(args), config

    async def start(self, worker_id: int) -> EngineConfig:
        """Load the tokenizer and weights, start the scheduler, return the registration."""
        self._fpm.worker_id = str(worker_id)
        await asyncio.to_thread(self._load_model)
        for rank in self._ranks:
            rank.task = asyncio.create_task(
                self._run_scheduler(rank), name=f"transformers-scheduler-{rank.rank}"
            )
        blocks_per_seq = math.ceil(self._context_length / self.args.kv_block_size)
        self._total_blocks = self.args.max_num_seqs * blocks_per_seq
        logger.info(
            "TransformersEngine serving %s on %s (context %d, %d KV blocks of %d tokens)",
            self.args.model,
            self._device,
            self._context_length,
            self._total_blocks,
            self.args.kv_block_size,
        )
        return EngineConfig(
            model=self.args.model,
            served_model_name=self.args.served_model_name,
            llm=LlmRegistration(
                context_length=self._context_length,
                kv_cache_block_size=self.args.kv_block_size,
                total_kv_blocks=self._total_blocks,
                max_num_seqs=self.args.max_num_seqs,
                data_parallel_size=self.args.data_parallel_size,
                data_parallel_start_rank=self.args.data_parallel_start_rank,
            ),
        )

    def _load_model(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        device = self.args.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = _resolve_dtype(self.args.dtype, device)
        self.tokenizer = AutoTokenizer.from_pretrained(self.args.model)
        model: Any = AutoModelForCausalLM.from_pretrained(self.args.model, dtype=dtype)
        self._base = model.to(device).eval()
        self._device = device
        config = model.config
        self._vocab_size = int(config.vocab_size)
        limit = getattr(config, "max_position_embeddings", None) or 2048
        self._context_length = min(self.args.context_length or limit, limit)
        self._eos_ids = _eos_token_ids(model, self.tokenizer)
        # transformers 5.x renamed `past_key_values` to `cache` (the old name warns).
        parameters = inspect.signature(type(model).forward).parameters
        self._cache_kwarg = "cache" if "cache" in parameters else "past_key_values"
        served = self.args.served_model_name or self.args.model
        self._served_names = {served, self.args.model}

    async def cleanup(self) -> None:
        """Stop the scheduler, end every request as cancelled, free the model (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for rank in self._ranks:
            if rank.task is not None:
                rank.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await rank.task
                rank.task = None
            for seq in [*rank.waiting, *rank.running]:
                self._finish(seq, FinishReason.CANCELLED)
        self._peft = None
        self._base = None
        if self._device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()

    async def is_quiescent(self) -> bool | None:
        """True when no request is waiting or running."""
        return all(rank.load() == 0 for rank in self._ranks)

    # ----- requests --------------------------------------------------------------------

    async def generate(
        self, request: GenerateRequest, context: Any
    ) -> AsyncGenerator[GenerateChunk, None]:
        """Stream one chunk per generated token; the last carries finish reason and usage."""
        if self._closed or self._base is None:
            raise RuntimeError("TransformersEngine is not started (or already cleaned up)")
        seq = self._new_sequence(request, context)
        seq.rank.waiting.append(seq)
        if context is not None:
            self._by_context[id(context)] = seq
        seq.rank.wakeup.set()
        try:
            while True:
                item = await seq.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if "finish_reason" in item:
                    return
        finally:
            # The consumer went away early (client disconnect, generator closed).
            if not seq.finished:
                self._finish(seq, FinishReason.CANCELLED)
            if context is not None and self._by_context.get(id(context)) is seq:
                del self._by_context[id(context)]

    async def abort(self, context: Any) -> None:
        """End the request of `context` now with finish reason `cancelled`."""
        seq = self._by_context.get(id(context))
        if seq is not None and not seq.finished:
            self._finish(seq, FinishReason.CANCELLED)

    def _new_sequence(self, request: GenerateRequest, context: Any) -> _Sequence:
        import torch

        prompt = request.get("token_ids")
        if not isinstance(prompt, list) or not prompt:
            raise RequestError("token_ids must be a non-empty list of token ids", param="prompt")
        if not all(isinstance(t, int) and 0 <= t < self._vocab_size for t in prompt):
            raise RequestError(
                f"token_ids must be integers in [0, {self._vocab_size})", param="prompt"
            )
        if len(prompt) >= self._context_length:
            raise RequestError(
                f"the prompt has {len(prompt)} tokens; the context length is "
                f"{self._context_length}, so at most {self._context_length - 1} fit",
                param="prompt",
                code=CONTEXT_LENGTH_EXCEEDED,
            )
        # The engine's own last check, the same the request planes make first.
        self.request_limits().check_request(request)
        sampling = SamplingParams.from_options(request.get("sampling_options") or {})
        if sampling.guided_decoding is not None:
            raise not_supported(RESPONSE_FORMAT, _ENGINE_NAME)
        stop = StopParams.from_conditions(
            request.get("stop_conditions") or {}, self._context_length - len(prompt)
        )
        output_options = request.get("output_options") or {}
        logprobs = output_options.get("logprobs")
        served = self.args.served_model_name or self.args.model
        adapter = self._adapters.for_model(request.get("model"), self._served_names, served)
        rank = self._rank_for(request)
        generator = torch.Generator(device=self._device)
        if sampling.seed is None:
            generator.seed()
        else:
            generator.manual_seed(sampling.seed)
        self._adapters.acquire(adapter)
        return _Sequence(
            prompt=list(prompt),
            sampling=sampling,
            stop=stop,
            adapter=adapter,
            rank=rank,
            context=context,
            generator=generator,
            logprobs=None if logprobs is None or logprobs is False else int(logprobs),
        )

    def request_limits(self) -> RequestLimits:
        """What this engine accepts (the request planes check requests against it): its
        context length and vocabulary, vLLM's sampling ranges, every optional field but
        structured output (`response_format`), which needs a grammar engine."""
        return RequestLimits(
            context_length=self._context_length or None,
            vocab_size=self._vocab_size or None,
            features=ALL_FEATURES - {RESPONSE_FORMAT},
            engine=_ENGINE_NAME,
        )

    def _rank_for(self, request: GenerateRequest) -> _Rank:
        """The router's forced rank when it is ours, else the least-loaded rank."""
        first, size = self.args.data_parallel_start_rank, self.args.data_parallel_size
        forced = worker_args.forced_rank(request, first, size, "transformers")
        if forced is not None:
            return self._ranks[forced - first]
        return min(self._ranks, key=_Rank.load)

    def _finish(self, seq: _Sequence, reason: str) -> None:
        """End `seq`: send its terminal chunk, drop it from the queues, release its adapter."""
        if seq.finished:
            return
        seq.finished = True
        seq.cache = None
        seq.queue.put_nowait(
            {"token_ids": [], "index": 0, "finish_reason": reason, "completion_usage": seq.usage()}
        )
        self._forget(seq)

    def _fail(self, seq: _Sequence, error: BaseException) -> None:
        if seq.finished:
            return
        seq.finished = True
        seq.cache = None
        seq.queue.put_nowait(error)
        self._forget(seq)

    def _forget(self, seq: _Sequence) -> None:
        with contextlib.suppress(ValueError):
            seq.rank.waiting.remove(seq)
        with contextlib.suppress(ValueError):
            seq.rank.running.remove(seq)
        adapter, seq.adapter = seq.adapter, None
        self._adapters.release(adapter)

    def _keep(self, task: asyncio.Future[Any]) -> None:
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ----- the scheduler ---------------------------------------------------------------

    async def _run_scheduler(self, rank: _Rank) -> None:
        while True:
            await rank.wakeup.wait()
            try:
                await self._iteration(rank)
            except Exception as exc:
                # A bug here must not leave requests hanging: fail them and carry on.
                logger.exception("scheduler iteration failed; failing the requests in it")
                for seq in [*rank.waiting, *rank.running]:
                    self._fail(seq, RuntimeError(f"scheduler failed: {exc}"))

    async def _iteration(self, rank: _Rank) -> None:
        """Admit waiting requests, step every running one once, stream the tokens."""
        for seq in [*rank.waiting, *rank.running]:
            if _context_stopped(seq.context):
                self._finish(seq, FinishReason.CANCELLED)
        while rank.waiting and len(rank.running) < self.args.max_num_seqs:
            rank.running.append(rank.waiting.popleft())
        if not rank.running:
            rank.wakeup.clear()
            if rank.was_active:
                rank.was_active = False
                self._emit_idle_heartbeat(rank)
                self._publish_snapshot(rank)
            return
        rank.was_active = True
        batch = list(rank.running)
        queued = list(rank.waiting)
        started = time.monotonic()
        # Ranks share the one model: their iterations take turns.
        async with self._model_lock:
            results = await asyncio.to_thread(self._step_all, batch)
        wall_time = time.monotonic() - started
        self._emit_iteration_metrics(rank, batch, results, queued, wall_time)
        for seq, result in zip(batch, results, strict=True):
            self._apply(seq, result)
        self._publish_snapshot(rank)
        # Let consumers and new requests run between iterations.
        await asyncio.sleep(0)

    def _step_all(self, batch: list[_Sequence]) -> list[_StepResult]:
        """One forward for each sequence (runs in a worker thread)."""
        import torch

        results = []
        with torch.inference_mode():
            for seq in batch:
                if seq.finished:
                    results.append(_StepResult())
                    continue
                try:
                    results.append(self._step(seq))
                except Exception as exc:
                    logger.exception("forward pass failed for one request")
                    results.append(_StepResult(error=exc))
        return results

    def _step(self, seq: _Sequence) -> _StepResult:
        import torch
        from transformers import DynamicCache

        prefill = seq.cache is None
        if prefill:
            seq.cache = DynamicCache()
            inputs = seq.prompt
        else:
            inputs = seq.output[-1:]
        input_ids = torch.tensor([inputs], dtype=torch.long, device=self._device)
        kwargs: dict[str, Any] = {
            "input_ids": input_ids,
            self._cache_kwarg: seq.cache,
            "use_cache": True,
            "logits_to_keep": 1,
        }
        if self._peft is not None:
            model = self._peft
            kwargs["adapter_names"] = [seq.adapter.peft_name if seq.adapter else _PEFT_BASE]
        else:
            model = self._base
        logits = model(**kwargs).logits[0, -1].float()
        return self._sample(seq, logits, prefill)

    def _sample(self, seq: _Sequence, raw_logits: torch.Tensor, prefill: bool) -> _StepResult:
        import torch

        logits = raw_logits
        stop = seq.stop
        if seq.sampling.penalized:
            logits = apply_penalties(logits, seq.sampling, seq.prompt, seq.output)
        if len(seq.output) < stop.min_tokens:
            # Below min_tokens no stop token may be produced (vLLM's behaviour).
            banned = set(stop.stop_token_ids)
            if not stop.ignore_eos:
                banned |= self._eos_ids
            banned_ids = [t for t in banned if 0 <= t < logits.shape[-1]]
            if banned_ids:
                logits = logits.clone()
                logits[banned_ids] = -math.inf
        token = sample_token(logits, seq.sampling, seq.generator)
        result = _StepResult(token=token, prefill=prefill)
        if seq.logprobs is not None:
            # The model's own distribution (vLLM's default, raw log probabilities).
            logprobs = torch.log_softmax(raw_logits, dim=-1)
            result.logprob = float(logprobs[token])
            if seq.logprobs:
                values, ids = torch.topk(logprobs, min(seq.logprobs, logprobs.shape[-1]))
                result.top_logprobs = [
                    {"token_id": int(tid), "logprob": float(value), "rank": rank}
                    for rank, (value, tid) in enumerate(zip(values, ids, strict=True), start=1)
                ]
        return result

    def _apply(self, seq: _Sequence, result: _StepResult) -> None:
        """Record one step's token and decide whether the sequence is done."""
        if seq.finished:
            return
        if result.error is not None:
            self._fail(seq, RuntimeError(f"generation failed: {result.error}"))
            return
        assert result.token is not None
        token = result.token
        seq.output.append(token)
        chunk: GenerateChunk = {"token_ids": [token], "index": 0}
        if result.logprob is not None:
            chunk["log_probs"] = [result.logprob]
        if result.top_logprobs is not None:
            chunk["top_logprobs"] = [result.top_logprobs]
        reason = self._finish_reason(seq, token)
        if reason is None:
            seq.queue.put_nowait(chunk)
            return
        chunk["finish_reason"] = reason
        chunk["completion_usage"] = seq.usage()
        seq.finished = True
        seq.cache = None
        seq.queue.put_nowait(chunk)
        self._forget(seq)

    def _finish_reason(self, seq: _Sequence, token: int) -> str | None:
        stop = seq.stop
        generated = len(seq.output)
        if generated >= stop.min_tokens and (
            token in stop.stop_token_ids or (not stop.ignore_eos and token in self._eos_ids)
        ):
            return FinishReason.STOP
        if generated >= stop.max_tokens:
            return FinishReason.LENGTH
        if len(seq.prompt) + generated >= self._context_length:
            return FinishReason.LENGTH
        return None

    # ----- metrics -----------------------------------------------------------------------

    def attach_forward_pass_metrics_sink(self, sink: ForwardPassMetricsSink | None) -> None:
        """Receive one `ForwardPassMetrics` per iteration (and an idle heartbeat)."""
        self._fpm.sink = sink

    def attach_snapshot_publisher(self, publisher: Any) -> None:
        """Publish each rank's KV usage through `publisher.publish(rank, snapshot)`."""
        self._snapshot_publisher = publisher

    def component_metrics_dp_ranks(self) -> list[int]:
        """The data-parallel ranks this engine runs (`--data-parallel-*`)."""
        return [rank.rank for rank in self._ranks]

    def kv_usage(self, dp_rank: int | None = None) -> tuple[int, int]:
        """(used blocks, total blocks) of one rank's KV bookkeeping, or of all ranks."""
        ranks = [r for r in self._ranks if dp_rank is None or r.rank == dp_rank]
        size = self.args.kv_block_size
        used = sum(math.ceil(seq.kv_tokens / size) for r in ranks for seq in r.running)
        return used, self._total_blocks * len(ranks)

    def _emit_iteration_metrics(
        self,
        rank: _Rank,
        batch: list[_Sequence],
        results: list[_StepResult],
        queued: list[_Sequence],
        wall_time: float,
    ) -> None:
        if not self._fpm.attached:
            return
        prefill, decode, waiting = (
            WelfordAccumulator(),
            WelfordAccumulator(),
            WelfordAccumulator(),
        )
        for seq, result in zip(batch, results, strict=True):
            if result.token is None:
                continue
            if result.prefill:
                prefill.add(len(seq.prompt))
            else:
                decode.add(len(seq.prompt) + len(seq.output))
        for seq in queued:
            waiting.add(len(seq.prompt))
        rank.iterations += 1
        self._fpm.iteration(
            dp_rank=rank.rank,
            counter_id=rank.iterations,
            wall_time=wall_time,
            prefill=prefill,
            decode=decode,
            # No prefix cache: a prefill computes its whole prompt.
            prefill_kv_tokens=0,
            queued=waiting,
        )

    def _emit_idle_heartbeat(self, rank: _Rank) -> None:
        if not self._fpm.attached:
            return
        rank.iterations += 1
        self._fpm.heartbeat(dp_rank=rank.rank, counter_id=rank.iterations)

    def _publish_snapshot(self, rank: _Rank) -> None:
        if self._snapshot_publisher is None:
            return
        used, total = self.kv_usage(rank.rank)
        if rank.last_snapshot == (used, total):
            return
        rank.last_snapshot = (used, total)
        snapshot = ComponentSnapshot(
            kv_used_blocks=used,
            kv_total_blocks=total,
            gpu_cache_usage=used / total if total else 0.0,
            dp_rank=rank.rank,
        )
        try:
            result = self._snapshot_publisher.publish(rank.rank, snapshot)
            if inspect.isawaitable(result):
                self._keep(asyncio.ensure_future(result))
        except Exception:
            logger.exception("snapshot publisher failed")

    async def health_check_payload(self) -> dict[str, Any] | None:
        """One greedy token from the BOS token."""
        return worker_args.canary_payload(self.tokenizer)

    # ----- LoRA --------------------------------------------------------------------------

    def adapter_names(self) -> list[str]:
        """Names of the adapters requests may select now."""
        return self._adapters.names()

    def resident_adapter_versions(self) -> int:
        """Adapter versions in memory: the loaded ones plus unloaded or replaced ones that
        running requests still use."""
        return 0 if self._peft is None else len(self._peft.peft_config)

    async def _load_adapter(self, name: str, lora_id: int, path: Path) -> None:
        """Host callback: serve the PEFT adapter in `path` as `name` (replacing a previous one)."""
        if self._base is None:
            raise RuntimeError("the engine is not started")
        self._adapter_counter += 1
        adapter = _Adapter(name=name, lora_id=lora_id, peft_name=f"lora{self._adapter_counter}")
        async with self._model_lock:
            await asyncio.to_thread(self._add_to_peft, adapter.peft_name, path)
        await self._adapters.install(adapter)

    async def _unload_adapter(self, name: str, lora_id: int) -> None:
        """Host callback: stop serving `name`; running requests keep their version."""
        await self._adapters.unload(name)

    async def _delete_adapter(self, adapter: _Adapter) -> None:
        async with self._model_lock:
            if self._peft is not None:
                await asyncio.to_thread(self._remove_from_peft, adapter.peft_name)

    def _add_to_peft(self, peft_name: str, path: Path) -> None:
        from peft import PeftModel

        if self._peft is None:
            self._peft = PeftModel.from_pretrained(
                self._base, str(path), adapter_name=peft_name, is_trainable=False
            ).eval()
            return
        try:
            self._peft.load_adapter(str(path), adapter_name=peft_name, is_trainable=False)
        except Exception:
            # PEFT may have registered the adapter's config before failing: drop the rest.
            if peft_name in self._peft.peft_config:
                self._peft.delete_adapter(peft_name)
            raise

    def _remove_from_peft(self, peft_name: str) -> None:
        if peft_name not in self._peft.peft_config:
            return
        if len(self._peft.peft_config) == 1:
            # PEFT cannot run with zero adapters: take the LoRA layers out instead.
            self._base = self._peft.unload()
            self._peft = None
        else:
            self._peft.delete_adapter(peft_name)


def apply_penalties(
    logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]
) -> torch.Tensor:
    """`logits` with vLLM's penalties and the logit bias applied: presence and frequency
    penalties over the generated tokens, the repetition penalty over prompt and output
    (positive logits divided, negative multiplied), then each bias added."""
    import torch

    logits = logits.clone()
    size = logits.shape[-1]
    if output and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(output, device=logits.device), minlength=size)
        counts = counts[:size].to(logits.dtype)
        logits -= params.frequency_penalty * counts
        logits -= params.presence_penalty * (counts > 0).to(logits.dtype)
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(output)), device=logits.device)
        values = logits[seen]
        penalty = params.repetition_penalty
        logits[seen] = torch.where(values > 0, values / penalty, values * penalty)
    for token, bias in params.logit_bias:
        if 0 <= token < size:
            logits[token] += bias
    return logits


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Pick the next token from 1-D `logits` (greedy, or temperature/top-k/top-p/min-p
    sampling)."""
    import torch

    if params.greedy:
        return int(torch.argmax(logits))
    scores = logits / params.temperature
    if params.min_p > 0:
        probs = torch.softmax(scores, dim=-1)
        scores = scores.masked_fill(probs < params.min_p * probs.max(), -math.inf)
    if 0 < params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        # Drop a token once the mass before it already reaches top_p (the first always stays).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        scores = scores.scatter(0, order[drop], -math.inf)
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def _resolve_dtype(name: str, device: str) -> torch.dtype:
    import torch

    if name == "auto":
        if device.startswith("cuda"):
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def _eos_token_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """EOS ids from the generation config, the model config and the tokenizer."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        values: Iterable[Any] = value if isinstance(value, list | tuple) else [value]
        ids.update(v for v in values if isinstance(v, int))
    return frozenset(ids)


def build_arg_parser() -> argparse.ArgumentParser:
    """The engine's command-line flags."""
    parser = argparse.ArgumentParser(
        prog="transformers-engine",
        description="Serve a local Hugging Face causal-LM checkpoint with transformers, with "
        "PEFT LoRA adapters selected per request by the request's model name.",
    )
    parser.add_argument("--model", required=True, help="local checkpoint directory")
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=8,
        help="requests decoded concurrently; more wait in a queue (default 8)",
    )
    parser.add_argument(
        "--kv-block-size", type=int, default=16, help="tokens per KV block (default 16)"
    )
    parser.add_argument(
        "--context-length",
        type=int,
        default=None,
        help="max prompt + output tokens (default and upper bound: the model's "
        "max_position_embeddings)",
    )
    parser.add_argument(
        "--device", default="auto", help="torch device: auto (cuda when present), cpu, cuda:N"
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=sorted(_DTYPES),
        help="weights dtype (auto: float32 on CPU, bfloat16 or float16 on CUDA)",
    )
    # Each data-parallel rank has its own scheduler, queue and KV budget over the one model.
    worker_args.add_worker_args(parser)
    return parser
