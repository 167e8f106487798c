"""The FastAPI app: OpenAI's completions, chat completions and models endpoints, health and metrics.

``build_app(llm, ...)`` serves an :class:`~autodeploy.LLM` (or an :class:`~autodeploy.runtime.engine.
Engine`) through one :class:`~autodeploy.serve.engine_loop.EngineLoop`. Handlers validate a request
completely before it is submitted (fields, model name, prompt length against ``max_seq_len``), so an
invalid request gets its 4xx before any stream starts; every error is OpenAI's error JSON.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..runtime.engine import Engine
from ..runtime.sampler import SamplingParams, TokenLogprob
from .engine_loop import EngineLoop, RequestHandle, Token
from .metrics import ServerMetrics
from .protocol import (
    APIError,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    TopLogprob,
    Usage,
    new_id,
    now,
)

#: engine finish reasons -> OpenAI's
_FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort", "aborted": "abort"}
_DISCONNECT_POLL_S = 0.5


class ServerState:
    """What the handlers share: the engine loop, the names, the chat template, the metrics."""

    def __init__(self, engine: Engine, model_name: str, chat_template: str | None, max_waiting: int):
        self.engine, self.model_name, self.chat_template = engine, model_name, chat_template
        self.metrics = ServerMetrics()
        self.loop = EngineLoop(engine, self.metrics, max_waiting)
        self.created = now()

    # -- requests -> engine inputs ------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def encode(self, prompt: str | list[int], param: str) -> list[int]:
        try:
            return self.engine.encode(prompt)
        except ValueError as exc:
            raise APIError(400, str(exc), param=param) from None

    def check(self, ids: list[int], params: SamplingParams, param: str) -> None:
        problem = self.engine.check_request(ids, params)
        if problem:
            raise APIError(400, problem, param=param)

    def token_text(self, token_id: int) -> str:
        tok = self.engine.tokenizer
        return tok.decode([token_id]) if tok is not None else f"token_id:{token_id}"

    def render_chat(self, body: ChatCompletionRequest) -> list[int]:
        tok = self.engine.tokenizer
        if tok is None:
            raise APIError(400, "chat completions need a tokenizer: the model has none; use /v1/completions "
                           "with token ids", param="messages")
        template = self.chat_template or getattr(tok, "chat_template", None)
        if not template:
            raise APIError(400, "the model's tokenizer has no chat template (tokenizer_config.json "
                           "chat_template): start the server with --chat-template FILE", param="messages",
                           code="missing_chat_template")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = tok.apply_chat_template(messages, chat_template=template, add_generation_prompt=True,
                                           tokenize=False)
        except Exception as exc:  # noqa: BLE001  (a template error is the request's or the template's)
            raise APIError(400, f"the chat template failed on these messages: {exc}", param="messages") from None
        return list(tok(text, add_special_tokens=False)["input_ids"])


def sampling_params(body, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None):
    """The engine's :class:`SamplingParams` for an OpenAI request (``body``), or a 400 naming the field."""
    if body.n != 1:
        raise APIError(400, f"n={body.n}: only n=1 is supported", param="n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise APIError(400, f"{name} is not supported (only 0)", param=name)
    params = SamplingParams(
        max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
        top_k=max(body.top_k, 0), top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed,
        stop_token_ids=list(body.stop_token_ids), ignore_eos=body.ignore_eos, stop=body.stop_strings(),
        min_tokens=body.min_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
    problem = params.problem()
    if problem:
        raise APIError(400, problem, param=problem.split(" ", 1)[0])
    return params


# -- logprobs in OpenAI's shapes ------------------------------------------------------------------------
def _completion_logprobs(state: ServerState, token_ids: list[int], entries: list[TokenLogprob | None],
                         offset: int, out: CompletionLogprobs | None = None) -> CompletionLogprobs:
    """Append ``token_ids`` with their ``entries`` (None: no logprob, the prompt's first token) to ``out``."""
    out = out or CompletionLogprobs()
    for token_id, entry in zip(token_ids, entries):
        text = state.token_text(token_id)
        out.tokens.append(text)
        out.text_offset.append(offset)
        out.token_logprobs.append(entry.logprob if entry is not None else None)
        out.top_logprobs.append({state.token_text(t): lp for t, lp in entry.top} if entry is not None else None)
        offset += len(text)
    return out


def _chat_logprobs(state: ServerState, entries: list[TokenLogprob]) -> ChatLogprobs:
    def top(t: int, lp: float) -> TopLogprob:
        text = state.token_text(t)
        return TopLogprob(token=text, logprob=lp, bytes=list(text.encode()))

    return ChatLogprobs(content=[
        ChatTokenLogprob(**top(e.token_id, e.logprob).model_dump(), top_logprobs=[top(t, lp) for t, lp in e.top])
        for e in entries])


# -- waiting for results -------------------------------------------------------------------------------
async def _collect(request: Request, state: ServerState, handles: list[RequestHandle]) -> list[list[Token]]:
    """Every handle's tokens; a client that disconnects cancels its requests (their pages are freed)."""
    gathered = asyncio.ensure_future(asyncio.gather(*(h.collect() for h in handles)))
    try:
        while True:
            done, _ = await asyncio.wait({gathered}, timeout=_DISCONNECT_POLL_S)
            if done:
                return gathered.result()
            if await request.is_disconnected():
                raise APIError(499, "the client disconnected", code="client_disconnected")
    finally:
        if not gathered.done():
            gathered.cancel()
        for h in handles:
            state.loop.abort(h)


def _sse(payload: Any) -> str:
    data = payload.model_dump_json() if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"data: {data}\n\n"


async def _merged(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, Token]]:
    """Tokens of several requests as they come: ``(index, token)``."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, handle: RequestHandle):
        try:
            async for token in handle.events():
                await queue.put((i, token))
        except APIError as exc:
            await queue.put((i, exc))
        await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    try:
        remaining = len(handles)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, APIError):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _stream(state: ServerState, handles: list[RequestHandle], chunks) -> AsyncIterator[str]:
    """SSE lines from ``chunks(index, token)``; an engine error becomes an error event; always [DONE]."""
    try:
        async for i, token in _merged(handles):
            for payload in chunks(i, token):
                yield _sse(payload)
    except APIError as exc:
        yield _sse(exc.body())
    finally:  # the client went away, or the stream ended: cancel what still runs
        for h in handles:
            state.loop.abort(h)
    yield "data: [DONE]\n\n"


# -- endpoints -------------------------------------------------------------------------------------------
async def completions(request: Request, body: CompletionRequest):
    state: ServerState = request.app.state.server
    state.check_model(body.model)
    prompts = body.prompt
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not prompts:
        raise APIError(400, "prompt is empty: it needs at least one token", param="prompt")
    if body.max_tokens == 0 and not body.echo:
        raise APIError(400, "max_tokens must be >= 1 (0 only with echo: score the prompt)", param="max_tokens")
    scoring_only = body.max_tokens == 0  # echo the prompt's logprobs, generate nothing: run one token, drop it
    params = sampling_params(body, 1 if scoring_only else body.max_tokens, body.logprobs,
                             body.logprobs if body.echo and body.logprobs is not None else None)
    encoded = [state.encode(p, "prompt") for p in prompts]
    for ids in encoded:
        state.check(ids, params, "prompt")
    prompt_texts = [p if isinstance(p, str) else (state.engine.tokenizer.decode(p) if state.engine.tokenizer
                                                  else "") for p in prompts]
    handles = [state.loop.submit(ids, params) for ids in encoded]
    rid, created = new_id("cmpl"), now()

    def echo_choice(i: int) -> CompletionChoice:
        logprobs = None
        if body.logprobs is not None:
            req = handles[i].request
            logprobs = _completion_logprobs(state, req.prompt_token_ids, req.prompt_logprobs or [], 0)
        return CompletionChoice(index=i, text=prompt_texts[i], logprobs=logprobs)

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        counts = [0] * len(handles)
        offsets = [0] * len(handles)
        echoed = [False] * len(handles)
        finished = [False] * len(handles)

        def chunks(i: int, token: Token):
            out = []
            if body.echo and not echoed[i]:
                echoed[i] = True
                choice = echo_choice(i)
                offsets[i] = len(choice.text)
                out.append(CompletionResponse(id=rid, created=created, model=state.model_name, choices=[choice]))
            counts[i] += 1
            finish = _FINISH_REASONS.get(token.finish_reason) if token.finish_reason else None
            if scoring_only:
                text, logprobs = "", None
            else:
                text = token.text
                logprobs = (_completion_logprobs(state, [token.token_id], [token.logprob], offsets[i])
                            if token.logprob else None)
                offsets[i] += len(text)
            if text or logprobs or finish or state.engine.tokenizer is None:  # no text: a chunk per token
                out.append(CompletionResponse(id=rid, created=created, model=state.model_name, choices=[
                    CompletionChoice(index=i, text=text, logprobs=logprobs, finish_reason=finish)]))
            finished[i] = finished[i] or finish is not None
            if include_usage and finish and all(finished):
                out.append(CompletionResponse(id=rid, created=created, model=state.model_name, choices=[],
                                              usage=_usage(encoded, [0 if scoring_only else c for c in counts])))
            return out

        return StreamingResponse(_stream(state, handles, chunks), media_type="text/event-stream")

    results = await _collect(request, state, handles)
    choices = []
    for i, (handle, tokens) in enumerate(zip(handles, results)):
        req = handle.request
        text = "" if scoring_only else req.output_text
        logprobs = None
        if body.echo:
            choice = echo_choice(i)
            text, logprobs = choice.text + text, choice.logprobs
        if body.logprobs is not None and not scoring_only:
            logprobs = _completion_logprobs(state, [t.token_id for t in tokens], [t.logprob for t in tokens],
                                            len(prompt_texts[i]) if body.echo else 0, logprobs)
        choices.append(CompletionChoice(index=i, text=text, logprobs=logprobs,
                                        finish_reason=_FINISH_REASONS.get(req.finish_reason, req.finish_reason)))
    counts = [0 if scoring_only else len(t) for t in results]
    return CompletionResponse(id=rid, created=created, model=state.model_name, choices=choices,
                              usage=_usage(encoded, counts))


def _usage(encoded: list[list[int]], counts: list[int]) -> Usage:
    prompt = sum(len(ids) for ids in encoded)
    return Usage(prompt_tokens=prompt, completion_tokens=sum(counts), total_tokens=prompt + sum(counts))


async def chat_completions(request: Request, body: ChatCompletionRequest):
    state: ServerState = request.app.state.server
    state.check_model(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = sampling_params(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None)
    ids = state.render_chat(body)
    state.check(ids, params, "messages")
    handle = state.loop.submit(ids, params)
    rid, created, name = new_id("chatcmpl"), now(), state.model_name

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        count = [0]

        def chunks(_: int, token: Token):
            out = []
            if count[0] == 0:
                out.append(ChatCompletionChunk(id=rid, created=created, model=name, choices=[
                    ChatChunkChoice(index=0, delta=ChatDelta(role="assistant", content=""))]))
            count[0] += 1
            finish = _FINISH_REASONS.get(token.finish_reason) if token.finish_reason else None
            logprobs = _chat_logprobs(state, [token.logprob]) if token.logprob else None
            if token.text or logprobs or finish:
                out.append(ChatCompletionChunk(id=rid, created=created, model=name, choices=[
                    ChatChunkChoice(index=0, delta=ChatDelta(content=token.text or None), logprobs=logprobs,
                                    finish_reason=finish)]))
            if include_usage and finish:
                out.append(ChatCompletionChunk(id=rid, created=created, model=name, choices=[],
                                               usage=_usage([ids], count)))
            return out

        return StreamingResponse(_stream(state, [handle], chunks), media_type="text/event-stream")

    (tokens,) = await _collect(request, state, [handle])
    req = handle.request
    logprobs = _chat_logprobs(state, [t.logprob for t in tokens]) if body.logprobs else None
    return ChatCompletionResponse(id=rid, created=created, model=name, usage=_usage([ids], [len(tokens)]), choices=[
        ChatChoice(index=0, message=ChatResponseMessage(content=req.output_text), logprobs=logprobs,
                   finish_reason=_FINISH_REASONS.get(req.finish_reason, req.finish_reason))])


async def list_models(request: Request) -> ModelList:
    state: ServerState = request.app.state.server
    return ModelList(data=[ModelCard(id=state.model_name, created=state.created,
                                     max_model_len=state.engine.max_seq_len)])


async def health(request: Request):
    if not request.app.state.server.loop.ready:
        raise APIError(503, "the engine is not ready", code="not_ready", type="service_unavailable")
    return {"status": "ok"}


async def metrics(request: Request) -> Response:
    return Response(request.app.state.server.metrics.render(), media_type="text/plain; version=0.0.4")


# -- errors ---------------------------------------------------------------------------------------------
def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return _api_error(_, APIError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}"))
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # a union (prompt, content) reports each alternative: name the field, not the alternative
    param = ".".join(p for p in loc if not any(c in p for c in "[]()")) or None
    message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
                        for e in errors[:3])
    return _api_error(_, APIError(400, message, param=param))


def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    return _api_error(_, APIError(exc.status_code, str(exc.detail)))


def build_app(llm, served_model_name: str = "autodeploy", chat_template: str | None = None,
              max_waiting: int = 256) -> FastAPI:
    """The server's app over ``llm`` (an :class:`~autodeploy.LLM` or an :class:`Engine`). The engine thread
    starts with the app's lifespan and stops with it (what is left is cancelled)."""
    engine = llm if isinstance(llm, Engine) else llm.engine
    state = ServerState(engine, served_model_name, chat_template, max_waiting)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop.start()
        try:
            yield
        finally:
            state.loop.stop()

    app = FastAPI(title="autodeploy", lifespan=lifespan)
    app.state.server = state
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_api_route("/v1/completions", completions, methods=["POST"], response_model=None)
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"], response_model=None)
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    return app
