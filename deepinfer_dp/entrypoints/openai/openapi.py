"""The OpenAPI schema at /openapi.json, made to say what the server does.

FastAPI documents 200 and 422 for every route with a body. This server answers 400 where
FastAPI would say 422 (OpenAI's shape), 401 without the API key on /v1, 404 for a model it
does not serve, 413 for a body over the limit, 503 when it cannot take work; generation
routes stream `text/event-stream` when asked; /metrics is Prometheus text; `model` is one of
the served names. `truthful_openapi` rewrites FastAPI's schema once, on first use, with those.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from deepinfer_dp.entrypoints.openai.protocol import INT64_MAX, INT64_MIN

_ERROR = {"$ref": "#/components/schemas/ErrorResponse"}
_WHY = {400: "Bad request: the message names the field (param)", 401: "Missing or wrong API key",
        404: "Unknown model", 413: "Request body too large", 503: "No capacity (queue full, or no rank up)"}
# route -> the error statuses it answers besides 200 (405 comes with an Allow header anywhere)
_STATUSES: dict[tuple[str, str], tuple[int, ...]] = {
    ("/v1/completions", "post"): (400, 401, 404, 413, 503),
    ("/v1/chat/completions", "post"): (400, 401, 404, 413, 503),
    ("/v1/models", "get"): (401,),
    ("/v1/models/{model_id}", "get"): (401, 404),
    ("/tokenize", "post"): (400, 404, 413),
    ("/detokenize", "post"): (400, 404, 413),
}
_STREAMED = ("/v1/completions", "/v1/chat/completions")
# One server-sent event of a stream (`stream: true`): its data is a chunk as JSON text, an error
# object once the stream has begun, or `[DONE]` last.
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string", "description": "a chunk (JSON), an error (JSON) or [DONE]"}}}


def truthful_openapi(app: FastAPI) -> None:
    """Replaces app.openapi with FastAPI's schema rewritten as above."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _rewrite(generate(), list(getattr(app.state, "model_names", [])))
        return app.openapi_schema

    app.openapi = openapi


def _rewrite(schema: dict[str, Any], names: list[str]) -> dict[str, Any]:
    paths = schema.get("paths", {})
    for path, methods in paths.items():
        for method, op in methods.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            for status in _STATUSES.get((path, method), ()):
                responses[str(status)] = {"description": _WHY[status],
                                          "content": {"application/json": {"schema": _ERROR}}}
            if path in _STREAMED:
                responses["200"].setdefault("content", {})["text/event-stream"] = {"schema": _SSE_EVENT}
    _plain(paths, "/metrics", "text/plain", "Prometheus text exposition")
    paths["/ping"] = {method: {"summary": "Ping", "operationId": f"ping_{method}", "responses": {
        "200": {"description": "A rank is up (empty body)"}, "503": {"description": "No rank is up (empty body)"}}}
        for method in ("get", "post")}
    if "/health" in paths:
        paths["/health"]["get"]["responses"]["503"] = {"description": "No rank is up and stepping",
                                                      "content": {"application/json": {"schema": {"type": "object"}}}}
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    for name in ("CompletionRequest", "ChatCompletionRequest"):  # only the served names are accepted
        if name in components and names:
            components[name]["properties"]["model"] = {"type": "string", "enum": names, "title": "Model"}
    for model in components.values():
        seed = model.get("properties", {}).get("seed")
        if seed is not None:  # 64-bit bounds as integers (a float maximum rounds past 2**63 - 1)
            model["properties"]["seed"] = {"anyOf": [{"type": "integer", "format": "int64", "minimum": INT64_MIN,
                                                      "maximum": INT64_MAX}, {"type": "null"}], "title": "Seed"}
    return schema


def _plain(paths: dict, path: str, media: str, what: str) -> None:
    if path in paths:
        content = {media: {"schema": {"type": "string"}}}
        paths[path]["get"]["responses"]["200"] = {"description": what, "content": content}
