"""OpenAI request fields this server does not implement: each is refused with a 400 that
names it, unless its value changes nothing (e.g. `tool_choice: "none"`), so no field is ever
silently ignored.

One table per endpoint, one line per field: the predicate says which values are no-ops.
When the server learns a field, delete its line here and give the field a real type in
protocol.py (as response_format, tools and tool_choice have: see structured.py); nothing else
refers to these tables.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

Noop = Callable[[Any], bool]


def _none(v: Any) -> bool:
    return v is None


def _empty(v: Any) -> bool:
    return v is None or v == [] or v == {}


# field -> (values that change nothing, why it is refused)
CHAT: dict[str, tuple[Noop, str]] = {
    "functions": (_empty, "the legacy `functions` are not implemented; use `tools`"),
    "function_call": (lambda v: v is None or v == "none", "the legacy `function_call` is not implemented; use "
                      "`tool_choice`"),
    # Read by structured.py (false: at most one call); only its type is checked here.
    "parallel_tool_calls": (lambda v: v is None or isinstance(v, bool), "must be a boolean"),
    "audio": (_none, "audio output is not implemented"),
    "modalities": (lambda v: v is None or v == ["text"], "only [\"text\"] output is implemented"),
    "prediction": (_none, "predicted outputs are not implemented"),
    "reasoning_effort": (_none, "this model has no reasoning mode"),
    "web_search_options": (_none, "web search is not implemented"),
    "verbosity": (_none, "verbosity control is not implemented"),
    "service_tier": (lambda v: v in (None, "auto", "default"), "only \"auto\" / \"default\" are served"),
    "store": (lambda v: v is None or v is False, "stored completions are not implemented; only false is accepted"),
}

COMPLETION: dict[str, tuple[Noop, str]] = {
    "suffix": (lambda v: v is None or v == "", "insertion (a suffix after the completion) is not implemented"),
    "service_tier": CHAT["service_tier"],
    "store": CHAT["store"],
}

MESSAGE: dict[str, tuple[Noop, str]] = {
    "function_call": (_none, "function calling is not implemented"),
    "audio": (_none, "audio is not implemented"),
    "refusal": (lambda v: v is None or isinstance(v, str), "must be a string"),
}

CONTENT_PART: dict[str, tuple[Noop, str]] = {
    "image_url": (_none, "image input is not implemented; send text parts"),
    "input_audio": (_none, "audio input is not implemented; send text parts"),
    "file": (_none, "file input is not implemented; send text parts"),
}


def unsupported_field(body: BaseModel, table: dict[str, tuple[Noop, str]],
                      prefix: str = "") -> tuple[str, str] | None:
    """(param, message) of the first field of `body` set to a value the server would ignore."""
    for name, (noop, why) in table.items():
        value = getattr(body, name)
        if not noop(value):
            param = f"{prefix}{name}"
            return param, f"`{param}` is not supported by this server: {why} (got {_short(value)})"
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
