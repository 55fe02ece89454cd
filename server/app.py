"""The OpenAI-compatible HTTP front end (Starlette): chat and text completions and responses, streaming or not.

Requests are validated by server/protocol.py, sent to the engine through the EngineClient, and the
engine's TextDeltas are turned into OpenAI bodies or SSE chunks by server/protocol_output.py (a Responses
request runs as its chat request, server/responses.py). Every error is an OpenAI error body with the
right status; a bad request never disturbs another one.
Backpressure: at most `max_in_flight` requests are served at once, beyond that 429 + Retry-After.
A client that disconnects mid-stream aborts its sequences (their KV blocks are freed within a step).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from flotilla import __version__
from flotilla.actors import grammar
from flotilla.actors.tokenizer import RequestError, render_prompt
from flotilla.sampling_params import SamplingParams
from flotilla.server.engine_client import EngineClient, EngineDeadError, RequestFailed
from flotilla.server.media import MediaPolicy, load_images
from flotilla.server.metrics import CONTENT_TYPE, RequestTimer, ServerMetrics
from flotilla.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ProtocolError,
    chat_image_urls,
    chat_messages,
    chat_tools,
    completion_prompts,
    error_body,
    model_not_found,
    parse_chat_request,
    parse_completion_request,
    parse_detokenize_request,
    parse_tokenize_request,
    reads_model_markup,
    reasoning_parser_for,
    structured_outputs_of,
    to_sampling_params,
    tool_parser_for,
)
from flotilla.server.protocol_logprobs import TokenTexts
from flotilla.server.protocol_output import (
    ChatCompletionBuilder,
    ChatStreamState,
    CompletionBuilder,
    CompletionStreamState,
    new_response_id,
)
from flotilla.server.reasoning_parser import THINK_END, ReasoningParser
from flotilla.server.responses import (
    ResponsesBuilder,
    ResponsesRequest,
    ResponsesStream,
    ResponseState,
    new_responses_id,
    no_stored_responses,
    parse_responses_request,
    responses_error,
    to_chat_request,
)
from flotilla.server.tool_parsers import CallsOutput, HermesToolParser
from flotilla.transport.messages import GenerateRequest, SeqText

log = logging.getLogger(__name__)

JSON = "application/json"
CHECKED_GRAMMARS = 1024
"""Output constraints whose grammars the server remembers as parsed (a repeated schema is not parsed again)."""


@dataclass
class ServerState:
    """What the routes share."""

    client: EngineClient
    model_name: str
    max_model_len: int
    token_texts: TokenTexts | None = None
    api_key: str | None = None
    max_body_bytes: int = 4 * 2**20
    max_in_flight: int = 1024
    metrics: ServerMetrics = field(init=False)
    in_flight: int = 0
    created: int = field(default_factory=lambda: int(time.time()))
    checked_grammars: OrderedDict[tuple, None] = field(default_factory=OrderedDict)
    media: MediaPolicy = field(default_factory=MediaPolicy)
    """Where chat images may come from (data URLs; http(s) from allowed hosts) and how large."""
    takes_images: bool = True
    """Whether the model runs images (a text-only model answers image parts with a 400 naming the part)."""
    tokenizer: Any = None
    """The model's tokenizer, for /tokenize and /detokenize (None: those routes answer 400)."""
    tool_call_parser: type[CallsOutput] = HermesToolParser
    """The model's tool-call format (--tool-call-parser), read from the output under tool_choice auto."""
    reasoning_parser: type[ReasoningParser] | None = None
    """--reasoning-parser; None leaves the reasoning in the content."""
    keep_special_tokens: bool = False
    """The parsers' tags are special tokens of the tokenizer: a chat request whose parsers read them and that leaves
    skip_special_tokens unset runs with it off, or the tags would be gone before the parsers see them."""

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.model_name)


class HTTPError(Exception):
    """An error answered before any engine work: status + OpenAI error body (+ headers)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.headers = status, param, code, headers or {}


def _error(status: int, message: str, param: str | None = None, code: str | None = None,
           headers: dict[str, str] | None = None) -> Response:
    return Response(error_body(status, message, param=param, code=code), status_code=status, media_type=JSON,
                    headers=headers)


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HTTPError(413, f"request body is {declared} bytes; the limit is {limit} bytes", code="body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPError(413, f"request body is larger than the limit of {limit} bytes", code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


CLIENT_CLOSED = 499
"""The status recorded (never sent) for a request whose client went away first (nginx's name for it)."""


async def _until_disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the ASGI server's http.disconnect; once the body is read,
    nothing else arrives)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Any) -> Response:
    """The response `work` makes, or, if the client goes away first, its cancellation: cancelling it aborts the
    engine requests (as a stream's disconnect does), so an abandoned request does not run to its end."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        if asyncio.current_task().cancelling():  # we are cancelled ourselves, not only the work
            raise
        log.debug("%s %s: the client went away before the response", request.method, request.url.path)
        return Response(status_code=CLIENT_CLOSED)


class _Merged:
    """The deltas of several engine requests (n choices, several prompts) as one (index, SeqText) stream."""

    def __init__(self, client: EngineClient, subs: list[tuple[int, GenerateRequest]]) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.remaining = len(subs)
        self.tasks = [asyncio.create_task(self._pump(client, i, r)) for i, r in subs]

    async def _pump(self, client: EngineClient, index: int, req: GenerateRequest) -> None:
        try:
            async for delta in client.stream(req):
                self.queue.put_nowait((index, delta))
        except (RequestFailed, EngineDeadError) as e:
            self.queue.put_nowait((index, e))
        finally:
            self.queue.put_nowait((index, None))

    async def __aiter__(self) -> AsyncIterator[tuple[int, SeqText]]:
        while self.remaining:
            index, item = await self.queue.get()
            if item is None:
                self.remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item

    async def aclose(self) -> None:
        """Stop every engine request still running (the client went away or one choice failed)."""
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


class _Usage:
    """Per-request token accounting for metrics; each prompt counts once whatever n is."""

    def __init__(self, n: int, metrics: ServerMetrics) -> None:
        self.n = n
        self.metrics = metrics
        self.prompt: dict[int, int] = {}
        self.cached: dict[int, int] = {}
        self.output = 0
        self.finish_reasons: list[str] = []
        self.queue_time: float | None = None

    def add(self, index: int, d: SeqText) -> None:
        self.output += len(d.token_ids)
        self.metrics.tokens_generated += len(d.token_ids)
        if index // self.n not in self.prompt:  # its prompt's first delta: the prompt is processed
            self.metrics.tokens_prefilled += d.num_prompt_tokens
        self.prompt[index // self.n] = d.num_prompt_tokens
        self.cached[index // self.n] = d.num_cached_tokens
        if d.finish_reason is not None:
            self.finish_reasons.append(d.finish_reason)
        if self.queue_time is None:
            self.queue_time = d.queue_time_s

    def done(self, timer: RequestTimer) -> None:
        timer.done(time.monotonic(), sum(self.prompt.values()), self.output, sum(self.cached.values()),
                   self.finish_reasons, self.queue_time)


def build_app(state: ServerState) -> Starlette:
    """The Starlette app; the EngineClient must already be started (serve.py owns its lifetime)."""

    def authorized(request: Request) -> None:
        if state.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {state.api_key}".encode()):
            raise HTTPError(401, "invalid API key; send it as `Authorization: Bearer <key>`", code="invalid_api_key")

    def admit(request: Request) -> None:
        if not state.client.alive:
            raise engine_down()
        if state.in_flight >= state.max_in_flight:
            raise HTTPError(429, f"the server is at its limit of {state.max_in_flight} requests in flight; retry "
                                 "shortly", code="rate_limit_exceeded", headers={"Retry-After": "1"})

    def check_model(model: str | None) -> None:
        if model is not None and model != state.model_name:
            raise model_not_found(model)

    async def handle(request: Request, endpoint: str, parse: Any, run: Any) -> Response:
        """One generation request: `parse` makes the request of the body, `run` its response."""
        status = 500
        try:
            authorized(request)
            body = await _read_body(request, state.max_body_bytes)
            req = parse(body)
            check_model(req.model)
            admit(request)
            state.in_flight += 1
            state.metrics.in_flight.labels(state.model_name).set(state.in_flight)
            try:
                response = await _unless_disconnected(request, run(req))
            except BaseException:
                state.in_flight -= 1
                raise
            status = response.status_code
            if isinstance(response, StreamingResponse):
                response.background = _Release(state)  # the stream holds its slot until its last byte
            else:
                state.in_flight -= 1
            return response
        except ProtocolError as e:
            status = e.status
            return Response(e.body(), status_code=e.status, media_type=JSON)
        except HTTPError as e:
            status = e.status
            return _error(e.status, str(e), e.param, e.code, e.headers)
        except RequestFailed as e:
            status = e.status
            headers = {"Retry-After": "1"} if e.status == 429 else None
            return _error(e.status, str(e), e.param, e.code, headers)
        except EngineDeadError as e:  # it died under this request
            status = 503
            retry = state.client.retry_after_s
            return _error(503, str(e), code="engine_dead", headers={"Retry-After": str(retry)} if retry else None)
        except ClientDisconnect:  # gone while sending its body: nobody to answer
            status = CLIENT_CLOSED
            log.debug("%s %s: the client went away while sending its body", request.method, request.url.path)
            return Response(status_code=CLIENT_CLOSED)
        finally:
            state.metrics.requests.labels(state.model_name, endpoint, str(status)).inc()
            state.metrics.in_flight.labels(state.model_name).set(state.in_flight)

    def engine_requests(rid: str, sampling: Any, prompts: list[dict[str, Any]]) -> list[tuple[int, GenerateRequest]]:
        subs: list[tuple[int, GenerateRequest]] = []
        n = sampling.n
        for i, p in enumerate(prompts):
            req = GenerateRequest(rid=f"{rid}-{i}", sampling=sampling, arrival_time=time.time(), **p)
            subs.extend((i * n + j, sub) for j, sub in enumerate(state.client.fan_out(req)))
        return subs

    async def checked(req: ChatCompletionRequest | CompletionRequest) -> SamplingParams:
        """The request's SamplingParams, its output constraint's grammar parsed (off the event loop; once per
        distinct constraint) so that a bad one is a 400 naming it."""
        sampling = to_sampling_params(req)
        so = sampling.structured_outputs
        if so is not None and so.key not in state.checked_grammars:
            try:
                await asyncio.to_thread(grammar.check, so)
            except ValueError as e:
                raise ProtocolError(400, str(e), param=structured_outputs_of(req)[1]) from None
            state.checked_grammars[so.key] = None
            if len(state.checked_grammars) > CHECKED_GRAMMARS:
                state.checked_grammars.popitem(last=False)
        return sampling

    async def chat_prompt(req: ChatCompletionRequest) -> dict[str, Any]:
        """The engine's prompt fields of a chat request, its images' bytes loaded (data URLs, allowed hosts)."""
        urls = chat_image_urls(req)
        if urls and not state.takes_images:
            raise ProtocolError(400, f"Invalid '{urls[0][0]}': the model {state.model_name} takes no images (it has "
                                "no vision encoder); send text content parts only.", param=urls[0][0],
                                code="invalid_value")
        return {"messages": chat_messages(req), "tools": chat_tools(req),
                "add_generation_prompt": req.add_generation_prompt is not False, "priority": req.priority or 0,
                "chat_template_kwargs": req.chat_template_kwargs,
                "images": await load_images(urls, state.media) if urls else []}

    async def chat_sampling(req: ChatCompletionRequest, reasoning: type[ReasoningParser] | None) -> SamplingParams:
        """A chat request's SamplingParams: its parsers' markup kept in the text when the tokenizer makes it special
        tokens and the request left skip_special_tokens unset; with reasoning, its grammar starts after it."""
        sampling = await checked(req)
        if state.keep_special_tokens and req.skip_special_tokens is None and reads_model_markup(req, reasoning):
            sampling = msgspec.structs.replace(sampling, skip_special_tokens=False)
        so = sampling.structured_outputs
        if so is not None and reasoning is not None and state.tokenizer is not None:  # (the answer, after the end tag)
            after = state.tokenizer.encode(THINK_END, add_special_tokens=False)
            sampling = msgspec.structs.replace(sampling, structured_outputs=msgspec.structs.replace(so, after=after))
        return sampling

    async def run_chat(req: ChatCompletionRequest) -> Response:
        reasoning = reasoning_parser_for(req, state.reasoning_parser)
        sampling = await chat_sampling(req, reasoning)
        rid = new_response_id(True)
        kw = dict(request_id=rid, model=state.model_name, token_texts=state.token_texts,
                  tool_parser=tool_parser_for(req, state.tool_call_parser), reasoning_parser=reasoning)
        subs = engine_requests(rid, sampling, [await chat_prompt(req)])
        if req.stream:
            return await stream(ChatStreamState(req, **kw), subs, sampling.n)
        return await collect(ChatCompletionBuilder(req, **kw), subs, sampling.n)

    async def run_responses(req: ResponsesRequest) -> Response:
        """A Responses request runs as the chat request that means the same; errors name the Responses' fields."""
        chat = to_chat_request(req)
        try:
            sampling = await chat_sampling(chat, None)
        except ProtocolError as e:
            raise responses_error(e) from None
        rid = new_responses_id()
        response = ResponseState(req, chat, response_id=rid, model=state.model_name,
                                 tool_parser=tool_parser_for(chat, state.tool_call_parser))
        subs = engine_requests(rid, sampling, [await chat_prompt(chat)])
        try:
            if req.stream:
                return await stream(ResponsesStream(response), subs, 1)
            return await collect(ResponsesBuilder(response), subs, 1)
        except RequestFailed as e:
            if e.status != 400:
                raise
            raise responses_error(ProtocolError(400, str(e), param=e.param, code=e.code)) from None

    async def run_completion(req: CompletionRequest) -> Response:
        sampling = await checked(req)
        rid = new_response_id(False)
        given = completion_prompts(req)
        prompts = [{"prompt": p, "priority": req.priority or 0} if isinstance(p, str) else
                   {"prompt_token_ids": np.asarray(p, dtype=np.int32), "priority": req.priority or 0}
                   for p in given]
        echo = None
        if req.echo:  # a token-id prompt echoes as its text (none without a tokenizer)
            decode = state.tokenizer.decode if state.tokenizer is not None else lambda ids: ""
            echo = [p if isinstance(p, str) else await asyncio.to_thread(decode, p) for p in given]
        kw = dict(request_id=rid, model=state.model_name, token_texts=state.token_texts, echo_texts=echo)
        if req.stream:
            return await stream(CompletionStreamState(req, **kw), engine_requests(rid, sampling, prompts), sampling.n)
        return await collect(CompletionBuilder(req, **kw), engine_requests(rid, sampling, prompts), sampling.n)

    async def collect(builder: Any, subs: list[tuple[int, GenerateRequest]], n: int) -> Response:
        merged = _Merged(state.client, subs)
        timer, usage = RequestTimer(state.metrics, time.monotonic()), _Usage(n, state.metrics)
        try:
            async for index, delta in merged:
                timer.delta(time.monotonic())
                usage.add(index, delta)
                builder.on_delta(index, delta)
        finally:
            await merged.aclose()  # a failure of one choice (or a disconnect) stops the others
        usage.done(timer)
        return Response(builder.body(), media_type=JSON)

    async def stream(sse: Any, subs: list[tuple[int, GenerateRequest]], n: int) -> Response:
        merged = _Merged(state.client, subs)
        events = merged.__aiter__()
        timer, usage = RequestTimer(state.metrics, time.monotonic()), _Usage(n, state.metrics)
        try:  # the first delta decides between an HTTP error and a 200 stream (e.g. a prompt that is too long)
            first = await events.__anext__()
        except BaseException:
            await merged.aclose()
            raise

        async def body() -> AsyncIterator[bytes]:
            item: tuple[int, SeqText] | None = first
            try:
                while item is not None:
                    timer.delta(time.monotonic())
                    usage.add(*item)
                    chunk = sse.on_delta(*item)
                    if chunk:
                        yield chunk
                    item = await anext(events, None)
                usage.done(timer)
                yield sse.finish()
            except (RequestFailed, EngineDeadError) as e:
                yield sse.error(getattr(e, "status", 503), str(e))
            finally:
                await merged.aclose()

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def chat_completions(request: Request) -> Response:
        return await handle(request, "/v1/chat/completions", parse_chat_request, run_chat)

    async def completions(request: Request) -> Response:
        return await handle(request, "/v1/completions", parse_completion_request, run_completion)

    async def responses(request: Request) -> Response:
        return await handle(request, "/v1/responses", parse_responses_request, run_responses)

    async def stored_response(request: Request) -> Response:
        async def answer() -> dict[str, Any]:
            raise no_stored_responses(request.path_params["response_id"].split("/")[0])

        return await simple(request, answer)

    async def simple(request: Request, answer: Any) -> Response:
        """A route that needs no engine: the API key checked, ProtocolError / HTTPError as OpenAI error bodies."""
        try:
            authorized(request)
            return JSONResponse(await answer())
        except ProtocolError as e:
            return Response(e.body(), status_code=e.status, media_type=JSON)
        except HTTPError as e:
            return _error(e.status, str(e), e.param, e.code, e.headers)

    def tokenizer() -> Any:
        if state.tokenizer is None:
            raise HTTPError(400, "this server runs without a tokenizer (skip_tokenizer_init)", code="unsupported")
        return state.tokenizer

    async def tokenize(request: Request) -> Response:
        async def answer() -> dict[str, Any]:
            req = parse_tokenize_request(await _read_body(request, state.max_body_bytes))
            check_model(req.model)
            tools = None if not req.tools else [{"type": "function", "function": msgspec.to_builtins(t.function)}
                                                for t in req.tools]
            try:
                ids = await asyncio.to_thread(
                    render_prompt, tokenizer(), prompt=req.prompt, add_special_tokens=req.add_special_tokens,
                    tools=tools, messages=None if req.messages is None else chat_messages(req),
                    add_generation_prompt=req.add_generation_prompt is not False,
                    chat_template_kwargs=req.chat_template_kwargs)
            except RequestError as e:
                raise HTTPError(e.status, str(e), e.param, e.code) from None
            strs = tokenizer().convert_ids_to_tokens(ids) if req.return_token_strs else None
            return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": strs}

        return await simple(request, answer)

    async def detokenize(request: Request) -> Response:
        async def answer() -> dict[str, Any]:
            req = parse_detokenize_request(await _read_body(request, state.max_body_bytes), len(tokenizer()))
            check_model(req.model)
            return {"prompt": await asyncio.to_thread(tokenizer().decode, req.tokens)}

        return await simple(request, answer)

    async def version(request: Request) -> Response:
        async def answer() -> dict[str, Any]:
            return {"version": __version__}

        return await simple(request, answer)

    def model_card() -> dict[str, Any]:
        return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "flotilla",
                "root": state.model_name, "max_model_len": state.max_model_len}

    async def model(request: Request) -> Response:
        async def answer() -> dict[str, Any]:
            check_model(request.path_params["model"])
            return model_card()

        return await simple(request, answer)

    async def models(request: Request) -> Response:
        try:
            authorized(request)
        except HTTPError as e:
            return _error(e.status, str(e), code=e.code)
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def health(request: Request) -> Response:
        if state.client.alive:
            return Response(status_code=200)
        e = engine_down()
        return _error(e.status, str(e), code=e.code, headers=e.headers)

    def engine_down() -> HTTPError:
        """503: the engine is not running; with Retry-After while it is being restarted."""
        retry = state.client.retry_after_s
        if retry is None:
            return HTTPError(503, "the engine is not running", code="engine_dead")
        return HTTPError(503, f"the engine is restarting after a failure; retry in {retry} s",
                         code="engine_restarting", headers={"Retry-After": str(retry)})

    async def metrics(request: Request) -> Response:
        engines = state.client.engine_stats() if hasattr(state.client, "engine_stats") else None
        # one engine's data-parallel ranks (a fleet does not sum its engines' yet)
        loads, coordinator = getattr(state.client, "expert_loads", None), getattr(state.client, "coordinator", None)
        return Response(state.metrics.render(state.client.stats, engines, loads.total() if loads else None,
                                             coordinator.assigned if coordinator else None,
                                             state.client.restart_counts()), media_type=CONTENT_TYPE)

    async def not_found(request: Request, exc: Exception) -> Response:
        return _error(404, f"no route {request.method} {request.url.path}", code="not_found")

    async def method_not_allowed(request: Request, exc: Exception) -> Response:
        return _error(405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed")

    async def server_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        return _error(500, f"internal error: {type(exc).__name__}", code="internal_error")

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/responses/{response_id:path}", stored_response, methods=["GET", "POST", "DELETE"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/version", version, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    return Starlette(routes=routes, exception_handlers={404: not_found, 405: method_not_allowed,
                                                        500: server_error})


class _Release:
    """Starlette background task: a streaming response gives its in-flight slot back when it ends."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def __call__(self) -> None:
        self.state.in_flight -= 1
        self.state.metrics.in_flight.labels(self.state.model_name).set(self.state.in_flight)
