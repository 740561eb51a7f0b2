"""`SampleEngine`: synthetic tokens for runtime tests and benchmarks (no model, no torch).

Like upstream's sample engine it answers every request with made-up tokens, here with an
iteration-level scheduler so it behaves like a real engine towards the runtime:

* one scheduler iteration advances every active request by one token, then waits the
  per-token delay (`--token-delay`, env `DYN_SAMPLE_TOKEN_DELAY`; 0 still yields to the
  event loop); each iteration emits `ForwardPassMetrics` per data-parallel rank and a
  `ComponentSnapshot` per rank whose KV usage changed;
* the output is deterministic: lower-case letters and spaces drawn from a generator seeded
  with the prompt's token ids and, for a LoRA adapter, the adapter's name (so an adapter's
  output differs from the base model's);
* `max_tokens` (default `--max-tokens`) ends a request with finish reason "length"; an abort
  or a stopped context ends it with "cancelled";
* LoRA adapters load through `LoRAAdapterHost` (loading records the adapter directory);
  requests pick one by naming it in `model`;
* KV events: each rank keeps its prompts' full blocks in an LRU prefix cache of
  `--total-kv-blocks` and reports blocks stored and evicted (`kv_event_sources`);
* data-parallel ranks `[start, start + size)` (`--data-parallel-size`,
  `--data-parallel-start-rank`); a request's `routing.dp_rank` picks its rank, else ranks are
  used in turn;
* disaggregated serving (`--disaggregation-mode`), as upstream's sample engine: a prefill
  worker stops after one token and hands over `kv_transfer_params` naming the prompt (a
  digest of its tokens and adapter); a decode worker refuses a request without a prefill
  result, or with one made for another prompt, and then generates what an aggregated worker
  would. Health probes run whole on either role.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import math
import os
import random
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynamo.common import backend
from dynamo.common.backend.disagg import (
    prefill_only,
    received_kv_transfer_params,
    require_prefill_result,
    with_prefill_usage,
)
from dynamo.common.backend.health_check import is_probe
from dynamo.common.backend.publisher import KvEventSource, PushSource
from dynamo.common.constants import DisaggregationMode
from dynamo.common.forward_pass_metrics import WelfordAccumulator
from dynamo.common.lora import LoRAManager
from dynamo.engines import worker_args
from dynamo.engines.fpm import ForwardPassEmitter, ForwardPassMetricsSink
from dynamo.engines.lora_host import LoRAHostEngine
from dynamo.engines.sample_kv import PrefixCache
from dynamo.engines.sample_tokenizer import BYTE_OFFSET, SampleTokenizer
from dynamo.runtime.errors import RequestError

TOKEN_DELAY_ENV = "DYN_SAMPLE_TOKEN_DELAY"
_ALPHABET = [BYTE_OFFSET + byte for byte in b"abcdefghijklmnopqrstuvwxyz     "]


@dataclass(frozen=True)
class SampleEngineArgs:
    """The sample engine's settings (one per command-line flag)."""

    model: str = "sample-model"
    served_model_name: str | None = None
    token_delay: float = 0.0
    max_tokens: int = 16
    context_length: int = 4096
    kv_block_size: int = 16
    total_kv_blocks: int = 1024
    max_num_seqs: int = 256
    data_parallel_size: int = 1
    data_parallel_start_rank: int = 0
    max_loras: int = worker_args.DEFAULT_MAX_LORAS
    # Seconds `start` takes, to stand in for loading a model.
    startup_delay: float = 0.0
    disaggregation_mode: str = DisaggregationMode.AGGREGATED.value

    def __post_init__(self) -> None:
        minimums = {
            "max_tokens": 1,
            "context_length": 2,
            "kv_block_size": 1,
            "total_kv_blocks": 1,
            "max_num_seqs": 1,
        }
        worker_args.check_minimums(self, minimums)
        for name in ("token_delay", "startup_delay"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be a finite number >= 0, got {value}")


@dataclass(eq=False)
class _Sequence:
    context: Any
    rng: random.Random
    prompt_tokens: int
    max_tokens: int
    dp_rank: int
    queue: asyncio.Queue[backend.GenerateChunk] = field(default_factory=asyncio.Queue)
    generated: int = 0
    done: bool = False

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.generated,
            "total_tokens": self.prompt_tokens + self.generated,
        }


def output_seed(token_ids: list[int], adapter: str | None) -> int:
    """The generator seed for a prompt (and adapter): stable across processes."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update((adapter or "").encode() + b"\0")
    digest.update(b",".join(str(token).encode() for token in token_ids))
    return int.from_bytes(digest.digest(), "big")


class SampleEngine(LoRAHostEngine):
    """Synthetic-token engine (see the module docstring)."""

    def __init__(self, args: SampleEngineArgs, *, lora_manager: LoRAManager | None = None):
        super().__init__(max_loras=args.max_loras, lora_manager=lora_manager)
        self.args = args
        self.tokenizer: SampleTokenizer | None = None
        self.adapter_paths: dict[str, Path] = {}
        self._served_names: set[str] = set()
        self._active: dict[int, _Sequence] = {}
        self._wakeup = asyncio.Event()
        self._scheduler: asyncio.Task[None] | None = None
        self._fpm = ForwardPassEmitter()
        self._snapshot_publisher: Any = None
        self._last_snapshot: dict[int, int] = {}
        self._iterations = 0
        self._next_rank = itertools.cycle(self.component_metrics_dp_ranks())
        self._closed = False
        self.aborted: list[str] = []
        # Prompt blocks kept per rank, reported as KV events once the runtime attaches a
        # publisher (see sample_kv.py).
        self.prefix_caches = {
            rank: PrefixCache(args.kv_block_size, args.total_kv_blocks)
            for rank in self.component_metrics_dp_ranks()
        }

    # ----- lifecycle -------------------------------------------------------------------

    @classmethod
    async def from_args(
        cls, argv: list[str] | None = None
    ) -> tuple[SampleEngine, backend.WorkerConfig]:
        """Parse the flags (`--help` lists them) into an engine and its WorkerConfig."""
        parser = build_arg_parser()
        ns = parser.parse_args(argv)
        args, config = worker_args.engine_settings(parser, ns, SampleEngineArgs)
        return cls(args), config

    async def start(self, worker_id: int) -> backend.EngineConfig:
        """Start the scheduler (after `--startup-delay`, standing in for a model load)."""
        if self.args.startup_delay:
            await asyncio.sleep(self.args.startup_delay)
        self._fpm.worker_id = str(worker_id)
        self.tokenizer = SampleTokenizer()
        self._served_names = {self.args.model, self.args.served_model_name or self.args.model}
        self._scheduler = asyncio.get_running_loop().create_task(
            self._run_scheduler(), name="sample-scheduler"
        )
        args = self.args
        return backend.EngineConfig(
            model=args.model,
            served_model_name=args.served_model_name,
            llm=backend.LlmRegistration(
                context_length=args.context_length,
                kv_cache_block_size=args.kv_block_size,
                total_kv_blocks=args.total_kv_blocks,
                max_num_seqs=args.max_num_seqs,
                data_parallel_size=args.data_parallel_size,
                data_parallel_start_rank=args.data_parallel_start_rank,
            ),
        )

    async def cleanup(self) -> None:
        """Stop the scheduler and end every request as cancelled (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._scheduler is not None:
            self._scheduler.cancel()
            await asyncio.gather(self._scheduler, return_exceptions=True)
            self._scheduler = None
        for seq in list(self._active.values()):
            self._finish(seq, "cancelled")

    async def is_quiescent(self) -> bool | None:
        """Quiescent when no request is running."""
        return not self._active

    # ----- requests --------------------------------------------------------------------

    async def generate(
        self, request: backend.GenerateRequest, context: Any
    ) -> AsyncGenerator[backend.GenerateChunk, None]:
        """Stream synthetic tokens for one request."""
        if self._closed or self._scheduler is None:
            raise RuntimeError("the sample engine is not running (start() it first)")
        token_ids = list(request.get("token_ids") or [])
        adapter = self._adapter_for(request.get("model"))
        mode = DisaggregationMode(self.args.disaggregation_mode)
        prefill_result = None
        if mode is DisaggregationMode.PREFILL and not is_probe(request):
            request = prefill_only(request)
        elif mode is DisaggregationMode.DECODE and not is_probe(request):
            prefill_result = require_prefill_result(request, mode)
            _check_handoff(prefill_result, token_ids, adapter)
        stop = request.get("stop_conditions") or {}
        max_tokens = int(stop.get("max_tokens") or self.args.max_tokens)
        max_tokens = max(0, min(max_tokens, self.args.context_length - len(token_ids)))
        seq = _Sequence(
            context=context,
            rng=random.Random(output_seed(token_ids, adapter)),
            prompt_tokens=len(token_ids),
            max_tokens=max_tokens,
            dp_rank=self._rank_for(request),
        )
        self.prefix_caches[seq.dp_rank].admit(token_ids, adapter)
        key = id(context)
        self._active[key] = seq
        self._wakeup.set()
        try:
            while True:
                chunk = await seq.queue.get()
                if "finish_reason" not in chunk:
                    yield chunk
                    continue
                if mode is DisaggregationMode.PREFILL and not is_probe(request):
                    chunk["disaggregated_params"] = _handoff(token_ids, adapter)
                yield with_prefill_usage(chunk, prefill_result)
                return
        finally:
            seq.done = True
            if self._active.get(key) is seq:
                del self._active[key]

    async def abort(self, context: Any) -> None:
        """End the request at once with finish reason "cancelled" (ids are recorded in
        `aborted`, also for requests that already ended)."""
        self.aborted.append(context.id())
        seq = self._active.get(id(context))
        if seq is not None and not seq.done:
            self._finish(seq, "cancelled")

    def _adapter_for(self, model: str | None) -> str | None:
        if not model or model in self._served_names:
            return None
        if model in self.lora_host.loaded():
            return model
        raise RequestError(
            f"model {model!r} is neither the served model nor a loaded LoRA adapter "
            f"(loaded: {sorted(self.lora_host.loaded())})",
            status=404,
            param="model",
        )

    def _rank_for(self, request: backend.GenerateRequest) -> int:
        args = self.args
        rank = worker_args.forced_rank(
            request,
            args.data_parallel_start_rank,
            args.data_parallel_size,
            "sample engine",
        )
        return rank if rank is not None else next(self._next_rank)

    def _finish(self, seq: _Sequence, reason: str) -> None:
        seq.done = True
        self._active.pop(id(seq.context), None)
        seq.queue.put_nowait(
            {"token_ids": [], "index": 0, "finish_reason": reason, "completion_usage": seq.usage()}
        )

    # ----- scheduler -------------------------------------------------------------------

    async def _run_scheduler(self) -> None:
        was_active = False
        while True:
            if not self._active:
                if was_active:
                    self._emit_idle()
                    was_active = False
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            was_active = True
            started = time.perf_counter()
            batch = list(self._active.values())
            for seq in batch:
                self._step(seq)
            self._iterations += 1
            self._emit_iteration(batch, time.perf_counter() - started)
            self._publish_snapshots()
            await asyncio.sleep(self.args.token_delay)

    def _step(self, seq: _Sequence) -> None:
        if seq.done:
            return
        if seq.context is not None and seq.context.is_stopped():
            self._finish(seq, "cancelled")
            return
        if seq.generated >= seq.max_tokens:
            self._finish(seq, "length")
            return
        token = seq.rng.choice(_ALPHABET)
        seq.generated += 1
        if seq.generated >= seq.max_tokens:
            seq.done = True
            self._active.pop(id(seq.context), None)
            seq.queue.put_nowait(
                {
                    "token_ids": [token],
                    "index": 0,
                    "finish_reason": "length",
                    "completion_usage": seq.usage(),
                }
            )
        else:
            seq.queue.put_nowait({"token_ids": [token], "index": 0})

    # ----- metrics ---------------------------------------------------------------------

    def attach_forward_pass_metrics_sink(self, sink: ForwardPassMetricsSink | None) -> None:
        """Receive one `ForwardPassMetrics` per iteration and rank (and idle heartbeats)."""
        self._fpm.sink = sink

    def attach_snapshot_publisher(self, publisher: Any) -> None:
        """Publish per-rank KV snapshots through `publisher.publish(rank, snapshot)`."""
        self._snapshot_publisher = publisher
        for rank in self.component_metrics_dp_ranks():
            self._last_snapshot[rank] = -1
        self._publish_snapshots()

    async def kv_event_sources(self) -> list[KvEventSource]:
        """One push source per rank: the runtime hands each a KV-events publisher."""
        return [
            PushSource(on_ready=self._attach_kv_publisher(rank), dp_rank=rank)
            for rank in self.component_metrics_dp_ranks()
        ]

    def _attach_kv_publisher(self, rank: int) -> Callable[[Any], None]:
        def attach(publisher: Any) -> None:
            self.prefix_caches[rank].publisher = publisher

        return attach

    def component_metrics_dp_ranks(self) -> list[int]:
        """`[start, start + size)`."""
        start = self.args.data_parallel_start_rank
        return list(range(start, start + self.args.data_parallel_size))

    def _kv_blocks(self, seq: _Sequence) -> int:
        return math.ceil((seq.prompt_tokens + seq.generated) / self.args.kv_block_size)

    def _publish_snapshots(self) -> None:
        publisher = self._snapshot_publisher
        if publisher is None:
            return
        used = dict.fromkeys(self.component_metrics_dp_ranks(), 0)
        for seq in self._active.values():
            used[seq.dp_rank] = used.get(seq.dp_rank, 0) + self._kv_blocks(seq)
        total = self.args.total_kv_blocks
        for rank, blocks in used.items():
            if self._last_snapshot.get(rank) == blocks:
                continue
            self._last_snapshot[rank] = blocks
            snapshot = backend.ComponentSnapshot(
                kv_used_blocks=blocks,
                kv_total_blocks=total,
                gpu_cache_usage=min(1.0, blocks / total),
                dp_rank=rank,
            )
            publisher.publish(rank, snapshot)

    def _emit_iteration(self, batch: list[_Sequence], wall_time: float) -> None:
        if not self._fpm.attached:
            return
        for rank in self.component_metrics_dp_ranks():
            prefill, decode = WelfordAccumulator(), WelfordAccumulator()
            prefill_kv = 0
            for seq in batch:
                if seq.dp_rank != rank:
                    continue
                if seq.generated <= 1:
                    prefill.add(seq.prompt_tokens)
                    prefill_kv += seq.prompt_tokens
                else:
                    decode.add(seq.prompt_tokens + seq.generated)
            if prefill.n == 0 and decode.n == 0:
                continue
            self._fpm.iteration(
                dp_rank=rank,
                counter_id=self._iterations,
                wall_time=wall_time,
                prefill=prefill,
                decode=decode,
                prefill_kv_tokens=prefill_kv,
            )

    def _emit_idle(self) -> None:
        for rank in self.component_metrics_dp_ranks():
            self._fpm.heartbeat(dp_rank=rank, counter_id=self._iterations)

    # ----- health and updates ----------------------------------------------------------

    async def health_check_payload(self) -> dict[str, Any] | None:
        """One `<s>` token, one output token."""
        return worker_args.canary_payload(self.tokenizer)

    async def _load_adapter(self, name: str, lora_id: int, path: Path) -> None:
        del lora_id
        if not (path / "adapter_config.json").is_file():
            raise ValueError(f"{path} has no adapter_config.json")
        self.adapter_paths[name] = path

    async def _unload_adapter(self, name: str, lora_id: int) -> None:
        del lora_id
        self.adapter_paths.pop(name, None)


def _handoff(token_ids: list[int], adapter: str | None) -> dict[str, Any]:
    """What a sample prefill worker hands over: the prompt it prefilled, by digest."""
    return {"kv_transfer_params": {"sample_prompt": f"{output_seed(token_ids, adapter):016x}"}}


def _check_handoff(
    prefill_result: dict[str, Any], token_ids: list[int], adapter: str | None
) -> None:
    """Refuse a prefill result that is missing or made for another prompt or adapter (a router
    that paired the wrong requests)."""
    received = received_kv_transfer_params(prefill_result)
    expected = _handoff(token_ids, adapter)["kv_transfer_params"]
    if received != expected:
        raise RequestError(
            f"prefill_result carries kv_transfer_params {received!r}, not those of this "
            f"prompt and adapter ({expected!r})",
            param="prefill_result",
        )


def build_arg_parser() -> argparse.ArgumentParser:
    """The sample engine's command-line flags."""
    parser = argparse.ArgumentParser(
        prog="sample-engine",
        description="Synthetic-token engine for runtime tests and benchmarks (no model).",
    )
    defaults = SampleEngineArgs()
    parser.add_argument("--model", default=defaults.model, help="model name (nothing is loaded)")
    parser.add_argument(
        "--token-delay",
        type=float,
        # A string default goes through `type`, so a bad env value is a clean usage error.
        default=os.environ.get(TOKEN_DELAY_ENV) or "0",
        help=f"seconds per generated token (default ${TOKEN_DELAY_ENV} or 0)",
    )
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens,
                        help="tokens when a request gives no max_tokens")  # fmt: skip
    parser.add_argument("--context-length", type=int, default=defaults.context_length)
    parser.add_argument("--kv-block-size", type=int, default=defaults.kv_block_size)
    parser.add_argument("--total-kv-blocks", type=int, default=defaults.total_kv_blocks)
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    parser.add_argument(
        "--startup-delay", type=float, default=0.0, help="seconds start() takes (a fake load)"
    )
    worker_args.add_worker_args(parser)
    return parser
