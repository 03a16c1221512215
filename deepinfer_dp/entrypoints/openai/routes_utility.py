"""vLLM's utility routes, with vLLM's shapes: /v1/models/{id}, /tokenize, /detokenize,
/version, /ping (GET and POST) and FastAPI's own /docs.

They need only what every API server has (the tokenizer, the chat template, the client's
health), so they answer the same at dp 1 and behind the router. As in vLLM, the API key
guards /v1 only: `install` puts /v1/models/{id} under the server's /v1 router, the rest on
the app.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, Response
from pydantic import BaseModel, Field

from deepinfer_dp.entrypoints.openai.chat_template import TemplateError
from deepinfer_dp.entrypoints.openai.openapi import truthful_openapi
from deepinfer_dp.entrypoints.openai.protocol import ChatMessage, ChatTool, ErrorResponse, ModelCard, Text, _Request
from deepinfer_dp.entrypoints.openai.serving_chat import _messages, chat_render
from deepinfer_dp.entrypoints.openai.serving_engine import OpenAIError, ServingContext, bad_request
from deepinfer_dp.version import __version__

_ERRORS: dict[int | str, dict[str, Any]] = {400: {"model": ErrorResponse, "description": "Bad request"},
                                            404: {"model": ErrorResponse, "description": "Unknown model"}}


class TokenizeCompletionRequest(_Request):
    model: Text | None = None
    prompt: Text
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Request):
    model: Text | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool | None = None  # with continue_final_message, as in chat completions
    return_token_strs: bool | None = False
    continue_final_message: bool | None = None
    add_special_tokens: bool = False
    tools: list[ChatTool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Refused unless unset: the server renders the model's own template only.
    chat_template: Any = None
    mm_processor_kwargs: Any = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: Text | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


router = APIRouter()
v1_router = APIRouter()


def install(app: FastAPI, v1: APIRouter) -> None:
    """Adds these routes to `app` (`v1`: the server's /v1 router, not yet included), and makes
    /openapi.json tell the statuses and content types the server really answers."""
    v1.include_router(v1_router)
    app.include_router(router)
    truthful_openapi(app)


def _ctx(request: Request) -> ServingContext:
    return request.app.state.ctx


def _names(request: Request) -> list[str]:
    return request.app.state.model_names


def check_model(names: list[str], name: str | None) -> None:
    """404 in OpenAI's shape when `name` is given and is none of the served `names`."""
    if name is not None and name not in names:
        raise OpenAIError(404, f"The model `{name}` does not exist. This server serves "
                               f"{', '.join(f'`{n}`' for n in names)}.", param="model", code="model_not_found")


@v1_router.get("/models/{model_id:path}", responses=_ERRORS)
async def retrieve_model(model_id: str, request: Request) -> ModelCard:
    ctx = _ctx(request)
    check_model(_names(request), model_id)
    return ModelCard(id=model_id, root=request.app.state.model_root, max_model_len=ctx.client.max_model_len)


@router.post("/tokenize", responses=_ERRORS)
async def tokenize(req: TokenizeChatRequest | TokenizeCompletionRequest, request: Request) -> TokenizeResponse:
    ctx = _ctx(request)
    check_model(_names(request), req.model)
    if isinstance(req, TokenizeCompletionRequest):
        ctx.check_text_length(len(req.prompt), "prompt", "prompt")
        ids = await ctx.off_loop(_encode, ctx.client.tokenizer, req.prompt, req.add_special_tokens)
    else:
        ids = await _chat_ids(ctx, req)
    strs = ctx.client.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=ctx.client.max_model_len, tokens=ids, token_strs=strs)


def _encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)


async def _chat_ids(ctx: ServingContext, req: TokenizeChatRequest) -> list[int]:
    """The prompt ids /v1/chat/completions would run for these messages."""
    for name, default in (("add_special_tokens", False), ("chat_template", None), ("mm_processor_kwargs", None)):
        if getattr(req, name) not in (default, {}):  # an empty mapping asks for nothing either
            raise bad_request(f"`{name}` is not supported by this server: it renders the model's own chat "
                              f"template, as /v1/chat/completions does (got {getattr(req, name)!r})", name,
                              "unsupported_parameter")
    render = chat_render(ctx, req.add_generation_prompt, req.continue_final_message, req.chat_template_kwargs)
    messages = _messages(req)
    ctx.check_text_length(sum(len(m["content"]) for m in messages), "messages", "messages")
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    try:
        return await ctx.off_loop(ctx.chat_tokenizer.prompt_ids, messages, tools, render)
    except TemplateError as e:
        raise bad_request(str(e), e.param) from e


@router.post("/detokenize", responses=_ERRORS)
async def detokenize(req: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    ctx = _ctx(request)
    check_model(_names(request), req.model)
    vocab = ctx.client.input_processor.vocab_size
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"tokens: token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
    return DetokenizeResponse(prompt=await ctx.off_loop(ctx.client.tokenizer.decode, req.tokens))


@router.get("/version")
async def version() -> VersionResponse:
    return VersionResponse(version=__version__)


# Plain `def`: a router client's health asks the ranks; FastAPI runs it in its thread pool.
# One route for both methods, so that a 405 allows both; openapi.py documents each method.
@router.api_route("/ping", methods=["GET", "POST"], include_in_schema=False)
def ping(request: Request) -> Response:
    """vLLM's (SageMaker's) liveness probe: an empty 200 while a rank is up, else 503."""
    up = any(rank.get("up") for rank in _ctx(request).client.health())
    return Response(status_code=200 if up else 503)


@router.get("/docs", include_in_schema=False)
async def docs(request: Request) -> HTMLResponse:
    app = request.app
    return get_swagger_ui_html(openapi_url=app.openapi_url or "/openapi.json", title=f"{app.title} - Swagger UI")
