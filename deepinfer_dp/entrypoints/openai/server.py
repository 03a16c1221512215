"""The OpenAI-compatible HTTP API over any EngineClient (one local engine, or the DP router).

build_app() wires the routes; the work of each endpoint is in serving_completion.py and
serving_chat.py, and every error leaves as OpenAI's JSON error shape with its status.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from deepinfer_dp.engine.client import EngineClient, EngineError
from deepinfer_dp.entrypoints.openai import serving_chat, serving_completion
from deepinfer_dp.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    random_id,
)
from deepinfer_dp.entrypoints.openai.serving_engine import OpenAIError, ServingContext, run_choices
from deepinfer_dp.metrics import ServerMetrics


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


def _engine_error(e: EngineError) -> OpenAIError:
    if e.status_code == 400:
        return OpenAIError(400, str(e))
    if e.status_code == 503:
        return OpenAIError(503, str(e), "service_unavailable_error")
    return OpenAIError(e.status_code, str(e), "server_error")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if any(err.get("type") == "json_invalid" for err in errors):
        return "Malformed JSON body: " + "; ".join(str(err.get("ctx", {}).get("error", err["msg"]))
                                                   for err in errors), None
    first = errors[0]
    if tuple(first.get("loc", ())) == ("body",):
        return "The request body must be a JSON object (send it with Content-Type: application/json)", None
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = loc[0] if loc else None
    return "; ".join(f"{'.'.join(str(x) for x in e['loc'] if x != 'body') or 'body'}: {e['msg']}"
                     for e in errors[:5]), param


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
        message, param = _validation_message(exc)  # OpenAI answers 400 where FastAPI would say 422
        metrics.finished(None, "rejected")
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error")


def _api_key_check(api_key: str | None):
    async def check(request: Request) -> None:
        if api_key is None:
            return
        if request.headers.get("authorization", "") != f"Bearer {api_key}":
            raise OpenAIError(401, "Incorrect API key provided. Pass it as 'Authorization: Bearer <key>'.",
                              code="invalid_api_key")
    return check


async def _sse_guard(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """A failure after the stream started cannot change the status: send it as an event."""
    try:
        async for chunk in chunks:
            yield chunk
    except (EngineError, OpenAIError) as e:
        err = _engine_error(e) if isinstance(e, EngineError) else e
        body = ErrorResponse(error=ErrorInfo(message=err.message, type=err.type, code=err.code))
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
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled():
        return Response(status_code=499)  # nobody reads it: the client is gone
    return task.result()


async def _disconnected(request: Request) -> None:
    # The body was already read, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(client: EngineClient, served_model_name: str | None = None,
              api_key: str | None = None) -> FastAPI:
    model_name = served_model_name or client.model_name
    metrics = ServerMetrics(client, model_name)
    ctx = ServingContext(client, model_name, metrics)
    app = FastAPI(title="deepinfer-dp", docs_url=None, redoc_url=None)
    app.state.ctx = ctx
    _install_error_handlers(app, metrics)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_api_key_check(api_key))])

    def check_model(name: str) -> None:
        if name != model_name:
            raise OpenAIError(404, f"The model `{name}` does not exist. This server serves `{model_name}`.",
                              param="model", code="model_not_found")

    async def serve(req, module, request: Request):
        check_model(req.model)
        prompts, params, stops = await module.prepare(ctx, req)
        events = run_choices(ctx, random_id("req"), prompts, params, req.n, stops)
        if not req.stream:
            return await _unless_disconnected(module.complete(ctx, req, events, prompts), request)
        chunks = module.stream(ctx, req, await _primed(events), prompts)
        return StreamingResponse(_sse_guard(chunks), media_type="text/event-stream")

    @v1.post("/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await serve(req, serving_completion, request)

    @v1.post("/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return await serve(req, serving_chat, request)

    @v1.get("/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, max_model_len=client.max_model_len)])

    # Plain `def`: FastAPI runs these in its thread pool, so a router that asks the ranks
    # for their stats never blocks the event loop that streams tokens.
    @app.get("/health")
    def health() -> JSONResponse:
        ranks = client.health()
        up = sum(1 for r in ranks if r.get("up"))
        status = "ok" if up == len(ranks) else "degraded" if up else "down"
        return JSONResponse({"status": status, "ranks": ranks}, status_code=200 if up else 503)

    @app.get("/metrics")
    def prometheus_metrics() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    app.include_router(v1)
    return app
