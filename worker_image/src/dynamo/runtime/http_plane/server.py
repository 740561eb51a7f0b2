"""The request plane: the worker's own HTTP server (`DYN_HTTP_HOST:DYN_HTTP_PORT`).

Routes:
* `POST /v1/generate`: token level. A `GenerateRequest` JSON in, the engine's
  `GenerateChunk`s out as newline-delimited JSON (`application/x-ndjson`). Raw engines get the
  body as is and stream their response objects the same way.
* `POST /v1/completions`, `POST /v1/chat/completions`: OpenAI-compatible, streamed as SSE
  with `"stream": true`, using the engine's `tokenizer` (and its chat template).
* `GET /v1/models`: the base model and the loaded adapters.

Streamed output is written through `dynamo.runtime.http_plane.coalesce`: the engine runs in a
task of its own and chunks that come out close together share one write.

`model` picks the base model or an adapter. The token budget is enforced before the engine
sees a request. A client that disconnects cancels its handler, which kills the request's
context and so aborts it in the engine. While the worker drains, new requests get 503 with
`Retry-After`. The transport is kept apart from the serving logic: both request planes are
given the same `dynamo.runtime.serving.Serving` (engine, models, metrics, tracker, budget).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine
from typing import Any

import msgspec
from aiohttp import web

from dynamo.runtime.context import Context
from dynamo.runtime.errors import RequestError
from dynamo.runtime.http_plane import openai
from dynamo.runtime.http_plane.coalesce import FLUSH_INTERVAL_SECS, OutputBuffer, write_coalesced
from dynamo.runtime.http_plane.detokenize import IncrementalDetokenizer, StopStringFilter
from dynamo.runtime.inflight import InflightRequest
from dynamo.runtime.serving import Serving
from dynamo.runtime.tokenizer import Tokenizer

RETRY_AFTER_SECS = "1"
_json = msgspec.json.Encoder()
_SSE_DONE = b"data: [DONE]\n\n"

Handler = Callable[[web.Request, Any, Context, InflightRequest], Awaitable[web.StreamResponse]]


def _sse(event: dict[str, Any]) -> bytes:
    return b"data: " + _json.encode(event) + b"\n\n"


class RequestPlane:
    """Serves one engine's requests over HTTP (see the module docstring)."""

    def __init__(self, serving: Serving, *, flush_interval: float = FLUSH_INTERVAL_SECS) -> None:
        """`flush_interval`: the least time between two writes of one streamed response
        while chunks keep coming (see `dynamo.runtime.http_plane.coalesce`)."""
        self.serving = serving
        self._metrics = serving.metrics
        self._flush_interval = flush_interval
        self._runner: web.AppRunner | None = None

    # ----- server ------------------------------------------------------------------------

    def app(self) -> web.Application:
        """The aiohttp application with the request-plane routes."""
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/v1/generate", self._route(self._generate))
        app.router.add_post("/v1/completions", self._route(self._completions))
        app.router.add_post("/v1/chat/completions", self._route(self._chat))
        app.router.add_get("/v1/models", self._list_models)
        return app

    async def start(self, host: str, port: int) -> int:
        """Listen on `host:port` (0 = ephemeral); return the bound port."""
        # handler_cancellation: a client disconnect cancels its handler, so the engine
        # learns about it at once instead of at the next write.
        self._runner = web.AppRunner(
            self.app(), handler_cancellation=True, access_log=None, shutdown_timeout=1.0
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        return _bound_port(self._runner)

    async def stop(self) -> None:
        """Close the listener and any remaining connections (idempotent)."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    # ----- common handling ---------------------------------------------------------------

    def _route(self, handler: Handler) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def serve(request: web.Request) -> web.StreamResponse:
            return await self._serve(request, handler)

        return serve

    async def _serve(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        serving = self.serving
        if not serving.tracker.accepting:
            self._metrics.count_error("unavailable")
            return self._unavailable()
        metrics = self._metrics
        context = Context(request.headers.get("x-request-id"))
        with serving.admitted(context) as record:
            try:
                raw_body = await request.read()
                metrics.request_bytes.inc(len(raw_body))
                try:
                    body = msgspec.json.decode(raw_body) if raw_body else None
                except msgspec.DecodeError as exc:
                    raise RequestError(f"request body is not valid JSON: {exc}") from None
                serving.streamer.watch(context)
                return await handler(request, body, context, record)
            except RequestError as exc:
                serving.failed(record, "not_found" if exc.status == 404 else "invalid_argument")
                return self._json(openai.request_error_body(exc), exc.status)
            except asyncio.CancelledError:
                if record.forced:
                    raise
                context.kill("client")
                serving.cancelled(record)
                raise
            except Exception as exc:
                return self._json({"error": self._stream_error(exc, record)}, 500)

    def _json(self, body: Any, status: int = 200) -> web.Response:
        data = _json.encode(body)
        self._metrics.response_bytes.inc(len(data))
        return web.Response(body=data, status=status, content_type="application/json")

    def _unavailable(self) -> web.Response:
        body = openai.error_body(
            "the worker is shutting down and accepts no new requests; retry on another worker",
            503,
        )
        response = self._json(body, 503)
        response.headers["Retry-After"] = RETRY_AFTER_SECS
        return response

    def _tokenizer(self) -> Tokenizer:
        tokenizer = getattr(self.serving.engine, "tokenizer", None)
        if tokenizer is None or self.serving.raw:
            raise RequestError(
                "this engine serves no text routes (it exposes no tokenizer); use /v1/generate",
                status=404,
            )
        return tokenizer

    def _engine_request(
        self,
        record: InflightRequest,
        token_ids: list[int],
        body: dict[str, Any],
        parsed: openai.TextRequest,
    ) -> dict[str, Any]:
        """The engine request, checked against what the engine publishes."""
        serving = self.serving
        adapter = serving.resolve_model(record, body.get("model"))
        conditions = dict(parsed.stop_conditions)
        max_tokens = serving.check_budget(record, len(token_ids), conditions.get("max_tokens"))
        if max_tokens is not None:
            conditions["max_tokens"] = max_tokens
        request: dict[str, Any] = {
            "token_ids": token_ids,
            "model": adapter or serving.models.base,
            "sampling_options": parsed.sampling_options,
            "stop_conditions": conditions,
        }
        if parsed.output_options:
            request["output_options"] = parsed.output_options
        if adapter is not None:
            request["routing"] = {"lora_name": adapter}
        serving.limits.check_request(request, prompt_param="messages" if parsed.chat else "prompt")
        return request

    # ----- /v1/models --------------------------------------------------------------------

    async def _list_models(self, request: web.Request) -> web.Response:
        del request
        return self._json(self.serving.models.listing())

    # ----- /v1/generate ------------------------------------------------------------------

    async def _generate(
        self, request: web.Request, body: Any, context: Context, record: InflightRequest
    ) -> web.StreamResponse:
        if not isinstance(body, dict):
            raise RequestError("request body must be a JSON object (a GenerateRequest)")
        engine_request = dict(body)
        if not self.serving.raw:
            token_ids = body.get("token_ids")
            if not isinstance(token_ids, list) or not all(
                isinstance(token, int) and not isinstance(token, bool) for token in token_ids
            ):
                raise RequestError("'token_ids' must be an array of integers", param="token_ids")
            engine_request = self.serving.token_request(record, body, token_ids, body.get("model"))
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        buffer = OutputBuffer()
        produce = self._produce_ndjson(engine_request, context, record, buffer)
        return await self._write_stream(response, buffer, produce, record)

    async def _produce_ndjson(
        self,
        engine_request: dict[str, Any],
        context: Context,
        record: InflightRequest,
        buffer: OutputBuffer,
    ) -> bool:
        """Encode the engine's chunks as NDJSON lines into `buffer`; False after an error
        (which becomes the last line)."""
        encode_into = _json.encode_into
        chunks = self.serving.streamer.stream(engine_request, context, record, raw=self.serving.raw)
        try:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    data = buffer.data
                    encode_into(chunk, data, -1)
                    data += b"\n"
                    full = buffer.added()
                    if full is not None:
                        await full
            return True
        except Exception as exc:
            data = buffer.data
            encode_into({"error": self._stream_error(exc, record)}, data, -1)
            data += b"\n"
            buffer.added()
            return False

    async def _write_stream(
        self,
        response: web.StreamResponse,
        buffer: OutputBuffer,
        produce: Coroutine[Any, Any, bool],
        record: InflightRequest,
    ) -> web.StreamResponse:
        sent = 0

        def count(size: int) -> None:
            nonlocal sent
            sent += size

        try:
            if await write_coalesced(
                response, buffer, produce, record, count, flush_interval=self._flush_interval
            ):
                self.serving.succeeded()
        finally:
            self._metrics.response_bytes.inc(sent)
        return response

    # ----- /v1/completions and /v1/chat/completions --------------------------------------

    async def _completions(
        self, request: web.Request, body: Any, context: Context, record: InflightRequest
    ) -> web.StreamResponse:
        if not isinstance(body, dict):
            raise RequestError("request body must be a JSON object")
        tokenizer = self._tokenizer()
        parsed = openai.parse_text_request(body, self.serving.limits, chat=False)
        prompt = openai.completion_prompt(body)
        if isinstance(prompt, str):
            try:
                token_ids = tokenizer.encode(prompt)
            except Exception as exc:
                raise RequestError(f"cannot tokenize the prompt: {exc}", param="prompt") from None
        else:
            token_ids = prompt
        return await self._text_response(
            request, body, parsed, context, record, tokenizer, token_ids
        )

    async def _chat(
        self, request: web.Request, body: Any, context: Context, record: InflightRequest
    ) -> web.StreamResponse:
        if not isinstance(body, dict):
            raise RequestError("request body must be a JSON object")
        tokenizer = self._tokenizer()
        parsed = openai.parse_text_request(body, self.serving.limits, chat=True)
        messages = openai.chat_messages(body)
        try:
            prompt = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            token_ids = tokenizer.encode(prompt, add_special_tokens=False)
        except Exception as exc:
            raise RequestError(
                f"cannot apply the model's chat template: {exc}", param="messages"
            ) from None
        return await self._text_response(
            request, body, parsed, context, record, tokenizer, token_ids
        )

    async def _text_response(
        self,
        request: web.Request,
        body: dict[str, Any],
        parsed: openai.TextRequest,
        context: Context,
        record: InflightRequest,
        tokenizer: Tokenizer,
        token_ids: list[int],
    ) -> web.StreamResponse:
        chat = parsed.chat
        engine_request = self._engine_request(record, token_ids, body, parsed)
        model = body.get("model") or self.serving.models.base
        events = self._text_events(engine_request, context, record, tokenizer, parsed)
        response_id = openai.new_id("chatcmpl" if chat else "cmpl")
        created = openai.now()
        if parsed.stream:
            return await self._stream_text(
                request,
                record,
                events,
                response_id,
                created,
                model,
                chat=chat,
                include_usage=parsed.include_usage,
            )
        text_parts: list[str] = []
        finish: str | None = None
        async for text, reason in events:
            text_parts.append(text)
            finish = reason or finish
        usage = openai.usage(len(token_ids), events_usage(events))
        self.serving.succeeded()
        answer = openai.text_response(
            response_id,
            created,
            model,
            "".join(text_parts),
            finish,
            usage,
            events.logprobs_block(),
            chat=chat,
        )
        return self._json(answer)

    async def _stream_text(
        self,
        request: web.Request,
        record: InflightRequest,
        events: TextEvents,
        response_id: str,
        created: int,
        model: str,
        *,
        chat: bool,
        include_usage: bool,
    ) -> web.StreamResponse:
        texts = events.__aiter__()
        try:
            # The first event before the headers: a request the engine refuses (its own
            # last check) is still a 400, not an error event in a 200 stream.
            first = await anext(texts, None)
        except BaseException:
            await texts.aclose()
            raise
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        buffer = OutputBuffer()
        head = (response_id, created, model)
        if chat:
            role = {"role": "assistant", "content": ""}
            buffer.data += _sse(openai.chat_chunk(*head, role, None))
        usage_chunk = None
        if include_usage:
            usage_chunk = functools.partial(openai.usage_chunk, *head, chat=chat)
        encode_into: Callable[[bytearray, str, str | None], None]
        if events.top_logprobs is None:
            encode_into = openai.ChunkTemplate(*head, chat=chat).encode_into
        else:
            # With log probabilities each event carries its tokens' own: no template.
            def encode_into(data: bytearray, text: str, reason: str | None) -> None:
                logprobs = events.logprobs_block()
                _json.encode_into(
                    openai.text_chunk(*head, text, reason, logprobs, chat=chat), data, -1
                )

        produce = self._produce_sse(first, texts, events, encode_into, buffer, usage_chunk, record)
        return await self._write_stream(response, buffer, produce, record)

    async def _produce_sse(
        self,
        first: tuple[str, str | None] | None,
        texts: AsyncGenerator[tuple[str, str | None], None],
        events: TextEvents,
        encode_into: Callable[[bytearray, str, str | None], None],
        buffer: OutputBuffer,
        usage_chunk: Callable[..., dict[str, Any]] | None,
        record: InflightRequest,
    ) -> bool:
        """Encode the text events (`first`, then the rest of `texts`) as SSE into `buffer`,
        then the usage event (if asked for) and `[DONE]`; False after an error (which
        becomes an `error` event)."""
        try:
            async with contextlib.aclosing(texts):
                event = first
                while event is not None:
                    text, reason = event
                    data = buffer.data
                    data += b"data: "
                    encode_into(data, text, reason)
                    data += b"\n\n"
                    full = buffer.added()
                    if full is not None:
                        await full
                    event = await anext(texts, None)
            if usage_chunk is not None:
                usage = openai.usage(events.prompt_tokens, events_usage(events))
                buffer.data += _sse(usage_chunk(usage_block=usage))
            buffer.data += _SSE_DONE
            buffer.added()
            return True
        except Exception as exc:
            buffer.data += b"event: error\n" + _sse({"error": self._stream_error(exc, record)})
            buffer.added()
            return False

    def _text_events(
        self,
        engine_request: dict[str, Any],
        context: Context,
        record: InflightRequest,
        tokenizer: Tokenizer,
        parsed: openai.TextRequest,
    ) -> TextEvents:
        chunks = self.serving.streamer.stream(engine_request, context, record, raw=False)
        return TextEvents(
            chunks,
            context,
            tokenizer,
            parsed.stops,
            len(engine_request["token_ids"]),
            top_logprobs=parsed.top_logprobs,
            chat=parsed.chat,
        )

    def _stream_error(self, exc: Exception, record: InflightRequest) -> dict[str, Any]:
        if isinstance(exc, RequestError):
            self.serving.failed(record, "invalid_argument")
            return openai.request_error_body(exc)["error"]
        # Our own fault (or the engine's): logged with the request id, which the client
        # gets too, to find the log line.
        self.serving.engine_failed(exc, record)
        request_id = record.context.id()
        return openai.error_body(f"engine error: {exc} (request id {request_id})", 500)["error"]


class TextEvents:
    """Engine chunks as `(text delta, OpenAI finish reason or None)` pairs, with stop
    strings applied; counts completion tokens as it goes."""

    def __init__(
        self,
        chunks: AsyncGenerator[dict[str, Any], None],
        context: Context,
        tokenizer: Tokenizer,
        stops: list[str],
        prompt_tokens: int,
        *,
        top_logprobs: int | None = None,
        chat: bool = False,
    ) -> None:
        """`top_logprobs`: alternatives per token when log probabilities were asked for."""
        self._chunks = chunks
        self._context = context
        self._tokenizer = tokenizer
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._stops = StopStringFilter(stops)
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.engine_usage: dict[str, Any] | None = None
        self.top_logprobs = top_logprobs
        self._chat = chat
        # Log probabilities of the tokens not yet handed out (`logprobs_block`).
        self._logprobs: list[openai.TokenLogprob] = []
        self._text_offset = 0

    def logprobs_block(self) -> dict[str, Any] | None:
        """The OpenAI `logprobs` of the tokens seen since the last call (None when they
        were not asked for)."""
        if self.top_logprobs is None:
            return None
        entries, self._logprobs = self._logprobs, []
        if self._chat:
            return openai.chat_logprobs(entries)
        block = openai.completion_logprobs(entries, self._text_offset)
        self._text_offset += sum(len(entry.token) for entry in entries)
        return block

    def _collect_logprobs(self, chunk: dict[str, Any], token_ids: Any) -> None:
        chosen = chunk.get("log_probs") or []
        tops = chunk.get("top_logprobs") or []
        decode = self._tokenizer.decode
        count = self.top_logprobs or 0
        for index, token in enumerate(token_ids):
            logprob = chosen[index] if index < len(chosen) else None
            if logprob is None:
                raise RuntimeError("the engine returned no log probability for a token")
            alternatives = tops[index] if index < len(tops) else []
            best = sorted(alternatives, key=lambda alt: -float(alt["logprob"]))[:count]
            self._logprobs.append(
                openai.TokenLogprob(
                    token=decode([token], skip_special_tokens=False),
                    logprob=float(logprob),
                    top=[
                        (decode([int(alt["token_id"])], skip_special_tokens=False), alt["logprob"])
                        for alt in best
                    ],
                )
            )

    def __aiter__(self) -> AsyncGenerator[tuple[str, str | None], None]:
        return self._events()

    async def _events(self) -> AsyncGenerator[tuple[str, str | None], None]:
        stops = self._stops
        detokenizer = self._detokenizer
        try:
            async for chunk in self._chunks:
                token_ids = chunk.get("token_ids") or ()
                self.completion_tokens += len(token_ids)
                if self.top_logprobs is not None and token_ids:
                    self._collect_logprobs(chunk, token_ids)
                text = stops.feed(detokenizer.add(token_ids)) if token_ids else ""
                if stops.stopped:
                    # A stop string ended the output: stop the engine (it is aborted).
                    self._context.stop_generating("stop")
                    yield text, "stop"
                    return
                reason = chunk.get("finish_reason")
                if reason is not None:
                    self.engine_usage = chunk.get("completion_usage")
                    text += stops.feed(detokenizer.flush())
                    text += stops.flush()
                    yield text, openai.openai_finish_reason(reason)
                    return
                if text:
                    yield text, None
        finally:
            await self._chunks.aclose()


def events_usage(events: TextEvents) -> int:
    """Completion tokens: the engine's count when it reported one, else the tokens seen."""
    usage = events.engine_usage
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        return int(usage["completion_tokens"])
    return events.completion_tokens


def _bound_port(runner: web.AppRunner) -> int:
    for address in runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            return int(address[1])
    raise RuntimeError("the request plane is not listening on a TCP port")
