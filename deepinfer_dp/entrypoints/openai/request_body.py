"""Request bodies parsed and validated by the routes themselves, off the event loop past a size.

FastAPI parses a declared body on the event loop: a chat of 40,000 messages (11 MB) held it for
1.8 s, so every other request, `GET /v1/models` included, waited that long. A body over
OFF_LOOP_BYTES is parsed and validated on a worker thread here instead. Python code in the
validation (the models' per-string checks) lets the event loop in between; one C call holding
the GIL does not: json.loads of a 2-million-integer array, or pydantic-core validating it as
one list, is a single such call, which no thread can interrupt (`max_request_body_bytes` bounds
it). Smaller bodies are parsed inline, where a thread hop would cost more than the parse.

The behaviour is FastAPI's own for a body parameter, errors included: JSON only under a JSON
Content-Type (FastAPI's strict content type), a decode error as `json_invalid`, and
validation errors located under "body", so errors.py describes them the same way. The
models stay documented in /openapi.json (`openapi_body` and `document_bodies`).
"""

from __future__ import annotations

import asyncio
import email.message
import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

OFF_LOOP_BYTES = 1 << 20
Model = TypeVar("Model", bound=BaseModel)


def body_of(model: type[Model]) -> Callable[[Request], Awaitable[Model]]:
    """A FastAPI dependency: the request's body as `model`, parsed off the loop past a size."""

    async def parse(request: Request) -> Model:
        body = await request.body()
        content_type = request.headers.get("content-type")
        if len(body) > OFF_LOOP_BYTES:
            return await asyncio.to_thread(validate_body, model, body, content_type)
        return validate_body(model, body, content_type)
    return parse


def validate_body(model: type[Model], body: bytes, content_type: str | None) -> Model:
    """`body` as `model`, or RequestValidationError shaped as FastAPI's."""
    value: Any = None
    if body:
        value = body
        if _is_json(content_type):
            try:
                value = json.loads(body, parse_int=_parse_int)
            except json.JSONDecodeError as e:
                error = {"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error", "input": {},
                         "ctx": {"error": e.msg}}
                raise RequestValidationError([error], body=body) from None
            except UnicodeDecodeError as e:  # not UTF-8 text: a 400 as any malformed JSON, not a 500
                error = {"type": "json_invalid", "loc": ("body", e.start), "msg": "JSON decode error", "input": {},
                         "ctx": {"error": f"the body is not UTF-8 text ({e.reason} at byte {e.start})"}}
                raise RequestValidationError([error], body=body) from None
    try:
        return model.model_validate(value)
    except ValidationError as e:
        errors = [{**err, "loc": ("body", *err["loc"])} for err in e.errors(include_url=False)]
        raise RequestValidationError(errors, body=value) from None


class HugeInteger:
    """A JSON integer of more digits than Python turns into an int (sys.get_int_max_str_digits,
    4300): json.loads would raise a plain ValueError (a 500). As this, the field it was sent in
    refuses it as not an integer (nor a number), and the 400 names that field."""

    def __init__(self, digits: int) -> None:
        self.digits = digits

    def __repr__(self) -> str:
        return f"<an integer of {self.digits} digits>"


def _parse_int(text: str) -> int | HugeInteger:
    return int(text) if len(text) <= 4000 else HugeInteger(len(text))


def _is_json(content_type: str | None) -> bool:
    if not content_type:
        return False  # FastAPI's strict content type: no header, no JSON
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def openapi_body(model: type[BaseModel]) -> dict[str, Any]:
    """A route's `openapi_extra`: its JSON body is `model` (see document_bodies)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def document_bodies(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Adds `models` (and the models they use) to the app's OpenAPI components."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                one = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(one.pop("$defs", {}))
                components[model.__name__] = one
        return app.openapi_schema
    app.openapi = openapi
