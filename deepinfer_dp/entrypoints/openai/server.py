"""The OpenAI-compatible HTTP API over any EngineClient (one local engine, or the DP router).

build_app() wires the routes; the work of each endpoint is in serving_completion.py and
serving_chat.py. Every error leaves as OpenAI's JSON error shape with its status, whatever
raised it (bad input 400, a body too large 413, a full queue 503 with Retry-After, and any
unexpected exception 500), never as plain text.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from deepinfer_dp.engine.client import EngineClient, EngineError
from deepinfer_dp.entrypoints.openai import routes_elastic, routes_utility, serving_chat, serving_completion
from deepinfer_dp.entrypoints.openai.admission import RETRY_AFTER_S, BodyLimit, QueueFull, ServerLimits
from deepinfer_dp.entrypoints.openai.errors import error_response, validation_message
from deepinfer_dp.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    random_id,
)
from deepinfer_dp.entrypoints.openai.request_body import body_of, document_bodies, openapi_body
from deepinfer_dp.entrypoints.openai.serving_engine import OpenAIError, ServingContext, pinned_rank, run_choices
from deepinfer_dp.metrics import ServerMetrics

logger = logging.getLogger(__name__)
CompletionBody = Annotated[CompletionRequest, Depends(body_of(CompletionRequest))]
ChatCompletionBody = Annotated[ChatCompletionRequest, Depends(body_of(ChatCompletionRequest))]


def _engine_error(e: EngineError) -> OpenAIError:
    if e.status_code == 400:
        return OpenAIError(400, str(e), param=e.param)
    if e.status_code == 503:
        return OpenAIError(503, str(e), "service_unavailable_error")
    return OpenAIError(e.status_code, str(e), "server_error")


def _install_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, e: OpenAIError) -> JSONResponse:
        if e.status in (400, 503):
            metrics.finished(None, "rejected" if e.status == 400 else "unavailable")
        return error_response(e.status, e.message, e.type, e.param, e.code)

    @app.exception_handler(EngineError)
    async def engine_error(request: Request, e: EngineError) -> JSONResponse:
        return await openai_error(request, _engine_error(e))

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)  # OpenAI answers 400 where FastAPI would say 422
        metrics.finished(None, "rejected")
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # its headers too: a 405 says which methods the route allows (Allow)
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error", headers=exc.headers)

    @app.exception_handler(QueueFull)
    async def queue_full(_: Request, e: QueueFull) -> JSONResponse:
        metrics.finished(None, "unavailable")
        return error_response(503, str(e), "service_unavailable_error", code="queue_full",
                              headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(Exception)
    async def unexpected(_: Request, e: Exception) -> JSONResponse:
        # (Starlette re-raises it after this answer, so the server logs the traceback)
        return error_response(500, f"internal error: {type(e).__name__}: {e}", "server_error")


def _api_key_check(api_key: str | None):
    expected = f"Bearer {api_key}".encode()

    async def check(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "").encode("latin-1")  # the raw header bytes
        if not hmac.compare_digest(given, expected):  # constant time: no timing oracle on the key
            raise OpenAIError(401, "Incorrect API key provided. Pass it as 'Authorization: Bearer <key>'.",
                              code="invalid_api_key")
    return check


async def _sse_guard(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """A failure after the stream started cannot change the status: send it as an event."""
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as e:
        if isinstance(e, (EngineError, OpenAIError)):
            err = _engine_error(e) if isinstance(e, EngineError) else e
        else:
            logger.exception("unexpected error in a stream")
            err = OpenAIError(500, f"internal error: {type(e).__name__}: {e}", "server_error")
        body = ErrorResponse(error=ErrorInfo(message=err.message, type=err.type, param=err.param, code=err.code))
        yield f"data: {json.dumps(body.model_dump())}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        await chunks.aclose()


async def _primed(events: AsyncIterator) -> AsyncIterator:
    """Waits for the first event before answering, so that errors at admission (bad input,
    no capacity) still get their own HTTP status instead of a 200 stream."""
    try:
        first = await events.__anext__()
    except StopAsyncIteration:
        first = None
    except BaseException:
        await events.aclose()
        raise

    async def rest() -> AsyncIterator:
        try:
            if first is not None:
                yield first
            async for event in events:
                yield event
        finally:
            await events.aclose()
    return rest()


async def _unless_disconnected(work: Awaitable, request: Request):
    """Runs `work` (a whole non-streamed answer) unless the client leaves first: then it is
    cancelled, which closes the generate iterators and aborts the requests on their ranks."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    done: set = set()
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if task not in done:
            task.cancel()
    if task not in done:
        # Wait for the cancellation to finish (it aborts the requests); never read the result of
        # a task that was cancelled, which raises InvalidStateError while the cancel is pending.
        await asyncio.gather(task, return_exceptions=True)
        return Response(status_code=499)  # nobody reads it: the client is gone
    return task.result()


async def _disconnected(request: Request) -> None:
    # The body was already read, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _judged(rank: dict, stall_timeout_s: float) -> dict:
    """One rank of /health with its state: down, stalled (it has work and finished no step
    within `stall_timeout_s`: frozen, or one step that long) or ok."""
    age = rank.get("step_age_s")
    if not rank.get("up"):
        return {**rank, "state": "down"}
    if age is not None and age > stall_timeout_s:
        return {**rank, "state": "stalled", "reason": f"DP rank {rank.get('dp_rank')} has work and finished no "
                                                      f"step for {age:.1f}s (limit {stall_timeout_s:g}s)"}
    return {**rank, "state": "ok"}


def build_app(client: EngineClient, served_model_name: str | list[str] | None = None,
              api_key: str | None = None, limits: ServerLimits | None = None,
              model_root: str | None = None, scaler: routes_elastic.Scaler | None = None) -> FastAPI:
    """The app serving `client` under `served_model_name` (one name or several; the first is
    the one answers carry); `model_root`, the model argument, is each /v1/models card's root;
    `scaler` (the DP deployment, with --enable-elastic-ep) serves the elastic EP routes."""
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
    names = names or [client.model_name]
    model_name = names[0]  # the name answers carry, as vLLM's first served name
    metrics = ServerMetrics(client, model_name)
    limits = limits or ServerLimits()
    ctx = ServingContext(client, model_name, metrics, limits)
    app = FastAPI(title="deepinfer-dp", docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, max_bytes=limits.max_request_body_bytes)
    app.state.ctx = ctx
    app.state.model_names = names
    app.state.model_root = model_root
    _install_error_handlers(app, metrics)
    document_bodies(app, [CompletionRequest, ChatCompletionRequest])
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_api_key_check(api_key))])

    def check_model(name: str) -> None:
        routes_utility.check_model(names, name)

    async def serve(req, module, request: Request):
        check_model(req.model)
        dp_rank = pinned_rank(req.data_parallel_rank, request.headers.get("x-data-parallel-rank"), client)
        prompts, params, stops = await module.prepare(ctx, req)
        events = run_choices(ctx, random_id("req"), prompts, params, req.n, stops, dp_rank)
        if not req.stream:
            return await _unless_disconnected(module.complete(ctx, req, events, prompts), request)
        chunks = module.stream(ctx, req, await _primed(events), prompts)
        return StreamingResponse(_sse_guard(chunks), media_type="text/event-stream")

    # The bodies are parsed by the routes' own dependency, off the event loop past a size.
    @v1.post("/completions", openapi_extra=openapi_body(CompletionRequest))
    async def completions(req: CompletionBody, request: Request):
        return await serve(req, serving_completion, request)

    @v1.post("/chat/completions", openapi_extra=openapi_body(ChatCompletionRequest))
    async def chat_completions(req: ChatCompletionBody, request: Request):
        return await serve(req, serving_chat, request)

    @v1.get("/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, root=model_root, max_model_len=client.max_model_len)
                               for name in names])

    # Plain `def`: FastAPI runs these in its thread pool, so a router that asks the ranks
    # for their stats never blocks the event loop that streams tokens.
    @app.get("/health")
    def health() -> JSONResponse:
        ranks = [_judged(r, limits.stall_timeout_s) for r in client.health()]
        states = [r["state"] for r in ranks]
        status = ("down" if "ok" not in states and "stalled" not in states else "stalled" if "stalled" in states
                  else "degraded" if "down" in states else "ok")
        return JSONResponse({"status": status, "ranks": ranks}, status_code=200 if "ok" in states else 503)

    @app.get("/metrics")
    def prometheus_metrics() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    routes_elastic.install(app, scaler)  # /scale_elastic_ep, /is_scaling_elastic_ep
    routes_utility.install(app, v1)  # /v1/models/{id}, /tokenize, /version, /ping, /docs...
    app.include_router(v1)
    return app
