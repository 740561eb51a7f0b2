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
from dynamo.common.backend.dp_rank import forced_dp_rank, validate_global_dp_rank
from dynamo.common.backend.health_check import bos_token_id_or, build_health_check_payload
from dynamo.common.forward_pass_metrics import WelfordAccumulator
from dynamo.common.lora import LoRAManager
from dynamo.engines.fpm import ForwardPassEmitter, ForwardPassMetricsSink
from dynamo.engines.lora_host import LoRAHostEngine
from dynamo.engines.worker_args import (
    DEFAULT_MAX_LORAS,
    add_worker_args,
    check_minimums,
    settings_from,
    worker_config,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# PEFT's reserved adapter name for "no adapter" in per-call `adapter_names`.
_PEFT_BASE = "__base__"


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
    max_loras: int = DEFAULT_MAX_LORAS
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
            "max_loras": 0,
            "context_length": 2,
            "data_parallel_size": 1,
            "data_parallel_start_rank": 0,
        }
        check_minimums(self, minimums)
        if self.dtype not in _DTYPES:
            raise ValueError(
                f"dtype (--dtype) must be one of {sorted(_DTYPES)}, got {self.dtype!r}"
            )


_DTYPES = {"auto", "float32", "float16", "bfloat16"}


@dataclass(frozen=True)
class SamplingParams:
    """Decoding settings from `sampling_options` (temperature 0 means greedy).

    Other sampling options (penalties, min_p, ...) are not applied; `n` > 1 and beam
    search are refused rather than silently answered with one greedy choice.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        """Whether the most likely token is always taken."""
        return self.temperature < 1e-5 or self.top_k == 1

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> SamplingParams:
        """Parse and check `sampling_options`; None values mean the defaults."""
        temperature = _number(options, "temperature", 1.0)
        top_p = _number(options, "top_p", 1.0)
        top_k = int(_number(options, "top_k", 0))
        seed = options.get("seed")
        if (options.get("n") or 1) != 1 or (options.get("best_of") or 1) != 1:
            raise ValueError("sampling_options.n and best_of must be 1: one choice per request")
        if options.get("use_beam_search"):
            raise ValueError("sampling_options.use_beam_search is not supported by this engine")
        if temperature < 0:
            raise ValueError(f"sampling_options.temperature must be >= 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"sampling_options.top_p must be in (0, 1], got {top_p}")
        if top_k < -1:
            raise ValueError(f"sampling_options.top_k must be -1, 0 or positive, got {top_k}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"sampling_options.seed must be an integer, got {seed!r}")
        # -1 and 0 both mean "no top-k", as in vLLM and OpenAI-style APIs.
        return cls(temperature, top_p, max(top_k, 0), seed)


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
            raise ValueError(f"stop_conditions.max_tokens must be >= 1, got {max_tokens}")
        min_tokens = 0 if conditions.get("min_tokens") is None else _int(conditions, "min_tokens")
        if min_tokens < 0:
            raise ValueError(f"stop_conditions.min_tokens must be >= 0, got {min_tokens}")
        stop_ids: set[int] = set()
        for key in ("stop_token_ids", "stop_token_ids_hidden"):
            values = conditions.get(key) or []
            if not isinstance(values, list) or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in values
            ):
                raise ValueError(f"stop_conditions.{key} must be a list of token ids")
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
        raise ValueError(f"sampling_options.{key} must be a number, got {value!r}")
    return float(value)


def _int(conditions: dict[str, Any], key: str) -> int:
    value = conditions[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"stop_conditions.{key} must be an integer, got {value!r}")
    return value


@dataclass
class _Adapter:
    """One adapter version inside the `PeftModel`, and how many requests still use it."""

    name: str
    lora_id: int
    peft_name: str
    users: int = 0
    retired: bool = False


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
    want_logprobs: bool
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
        self._adapters: dict[str, _Adapter] = {}
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
        args = settings_from(parser, ns, TransformersEngineArgs)
        return cls(args), worker_config(ns)

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
            raise ValueError("token_ids must be a non-empty list of token ids")
        if not all(isinstance(t, int) and 0 <= t < self._vocab_size for t in prompt):
            raise ValueError(f"token_ids must be integers in [0, {self._vocab_size})")
        if len(prompt) >= self._context_length:
            raise ValueError(
                f"the prompt has {len(prompt)} tokens; the context length is "
                f"{self._context_length}, so at most {self._context_length - 1} fit"
            )
        sampling = SamplingParams.from_options(request.get("sampling_options") or {})
        stop = StopParams.from_conditions(
            request.get("stop_conditions") or {}, self._context_length - len(prompt)
        )
        output_options = request.get("output_options") or {}
        adapter = self._adapter_for(request.get("model"))
        rank = self._rank_for(request)
        generator = torch.Generator(device=self._device)
        if sampling.seed is None:
            generator.seed()
        else:
            generator.manual_seed(sampling.seed)
        if adapter is not None:
            adapter.users += 1
        return _Sequence(
            prompt=list(prompt),
            sampling=sampling,
            stop=stop,
            adapter=adapter,
            rank=rank,
            context=context,
            generator=generator,
            want_logprobs=output_options.get("logprobs") is not None,
        )

    def _rank_for(self, request: GenerateRequest) -> _Rank:
        """The router's forced rank when it is ours, else the least-loaded rank."""
        first, size = self.args.data_parallel_start_rank, self.args.data_parallel_size
        forced = validate_global_dp_rank(forced_dp_rank(request), first, size, "transformers")
        if forced is not None:
            return self._ranks[forced - first]
        return min(self._ranks, key=_Rank.load)

    def _adapter_for(self, model: str | None) -> _Adapter | None:
        if not model or model in self._served_names:
            return None
        adapter = self._adapters.get(model)
        if adapter is None:
            raise ValueError(
                f"model {model!r} is neither the served model "
                f"{self.args.served_model_name or self.args.model!r} nor a loaded LoRA adapter "
                f"(loaded: {sorted(self._adapters)})"
            )
        return adapter

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
        adapter = seq.adapter
        seq.adapter = None
        if adapter is not None:
            adapter.users -= 1
            if adapter.retired and adapter.users == 0:
                # Freed outside the caller: deleting takes the model lock.
                self._keep(asyncio.ensure_future(self._delete_adapter(adapter)))

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
        token, logprob = self._sample(seq, logits)
        return _StepResult(token=token, logprob=logprob, prefill=prefill)

    def _sample(self, seq: _Sequence, logits: torch.Tensor) -> tuple[int, float | None]:
        import torch

        stop = seq.stop
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
        logprob = None
        if seq.want_logprobs:
            logprob = float(torch.log_softmax(logits, dim=-1)[token])
        return token, logprob

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
        return build_health_check_payload(bos_token_id_or(self.tokenizer))

    # ----- LoRA --------------------------------------------------------------------------

    def adapter_names(self) -> list[str]:
        """Names of the adapters requests may select now."""
        return sorted(self._adapters)

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
        previous = self._adapters.get(name)
        self._adapters[name] = adapter
        if previous is not None:
            await self._retire(previous)

    async def _unload_adapter(self, name: str, lora_id: int) -> None:
        """Host callback: stop serving `name`; running requests keep their version."""
        adapter = self._adapters.pop(name, None)
        if adapter is not None:
            await self._retire(adapter)

    async def _retire(self, adapter: _Adapter) -> None:
        adapter.retired = True
        if adapter.users == 0:
            await self._delete_adapter(adapter)

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


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Pick the next token from 1-D `logits` (greedy, or temperature/top-k/top-p sampling)."""
    import torch

    if params.greedy:
        return int(torch.argmax(logits))
    scores = logits / params.temperature
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
    add_worker_args(parser)
    return parser
