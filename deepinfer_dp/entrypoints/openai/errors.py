"""OpenAI's JSON error shape, `{"error": {"message", "type", "param", "code"}}`, and how a
request that fails to parse is described in it: which field (`param`) and what is wrong."""

from __future__ import annotations

import json
import logging
import re

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from deepinfer_dp.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)


class _AsciiJSON(JSONResponse):
    """An error may quote the client's input, lone surrogates included: escape, never fail."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param, code=code))
    if status == 400:  # the operator sees why a client fails, not only the access line
        logger.info("400 Bad Request (param %s): %s", param, message)
    return _AsciiJSON(body.model_dump(), status_code=status, headers=headers)


# Request fields that hold objects: an error inside one names the nested field.
NESTED_OBJECTS = ("stream_options", "response_format", "structured_outputs", "tools", "tool_choice")


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """(message, param) for a body that did not parse into the request model."""
    errors = exc.errors()
    if any(err.get("type") == "json_invalid" for err in errors):
        return "Malformed JSON body: " + "; ".join(str(err.get("ctx", {}).get("error", err["msg"]))
                                                   for err in errors), None
    first = errors[0]
    if tuple(first.get("loc", ())) == ("body",):
        return "The request body must be a JSON object (send it with Content-Type: application/json)", None
    by_field: dict[str, list[dict]] = {}
    for err in errors:
        by_field.setdefault(".".join(field_path(err)), []).append(err)
    return "; ".join(_describe(errs) for errs in list(by_field.values())[:5]), ".".join(field_path(first)) or None


def field_path(err: dict) -> list[str]:
    """The field an error is about: `body` and pydantic's union-branch tags (e.g. `list[int]`)
    dropped; the top-level field, the whole path inside a request object (NESTED_OBJECTS), or
    messages.<i>.<field> for a message (down to the field of a tool call it sends back:
    messages.<i>.tool_calls.<j>.function...)."""
    path: list[str] = []
    for x in err.get("loc", ()):
        if x == "body":
            continue
        if isinstance(x, str) and x[:1].isupper():  # a union's model branch (NamedToolChoice)
            continue
        if isinstance(x, str) and "[" in x:
            if path[-1:] != ["tool_calls"]:
                break
            continue
        path.append(str(x))
    if path[:1] == ["messages"]:
        return path if path[2:3] == ["tool_calls"] else path[:3]
    # an object's field by its own name (stream_options.continuous_usage_stats), not its parent's
    return path if path[:1] and path[0] in NESTED_OBJECTS else path[:1]


def _describe(errs: list[dict]) -> str:
    """One field's errors in a sentence; a union that matched no branch lists the branches."""
    where = ".".join(field_path(errs[0])) or "body"
    first = errs[0]
    if first.get("type") == "extra_forbidden":
        return f"{where}: unknown field; this server does not accept it (see its OpenAPI schema at /openapi.json)"
    specific = [e for e in errs if e.get("type") == "value_error"]
    if specific:
        return f"{where}: {specific[0]['msg'].removeprefix('Value error, ')}"
    branches = [_clean(x) for e in errs for x in e.get("loc", ()) if isinstance(x, str) and "[" in x]
    if len(set(branches)) > 1:
        return f"{where}: must be one of {', '.join(dict.fromkeys(branches))}"
    return f"{where}: {first['msg']}"


def _clean(tag: str) -> str:
    # pydantic names a validated str "function-after[_unicode_text(), str]"
    return re.sub(r"function-after\[[^,]*, (\w+)\]", r"\1", tag)
