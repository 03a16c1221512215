"""What a request asks its output to follow: vLLM's StructuredOutputsParams.

Exactly one of `json` (a JSON schema, as a dict or its JSON text), `regex`, `choice` (the
output is one of these strings), `grammar` (EBNF, in the GBNF dialect of llama.cpp that
xgrammar reads) or `json_object=True` (any JSON object) is set. The params are plain data,
checked for shape at construction; whether the schema, regex or grammar itself is valid is
checked by the grammar library (structured_output/backend.py) when the request is admitted.
"""

from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")
# Starts the error of a grammar build that failed on the request's own schema, regex or
# grammar (backend.py writes them so); the front ends answer it as bad input.
BUILD_ERROR_PREFIX = "structured_outputs."


@dataclass
class StructuredOutputsParams:
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # JSON only, the whitespace between tokens (see backend.py): by default bounded (compact
    # or lightly indented); disable_any_whitespace (vLLM's): none at all;
    # whitespace_pattern (vLLM's): a regex of your own, e.g. "[ \\t\\n]*" for unbounded.
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    # json_object only: the deepest nesting of objects and arrays (None: backend's default).
    json_object_max_depth: int | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            self.choice = list(self.choice)
        self.verify()

    def verify(self) -> None:
        """ValueError naming the field when the shape is wrong (not one kind, wrong types)."""
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(set_kinds) or 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (dict or str), got "
                             f"{type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        if self.json_object not in (None, True, False):
            raise ValueError("structured_outputs.json_object must be a boolean")
        if self.whitespace_pattern is not None and (not isinstance(self.whitespace_pattern, str)
                                                    or self.disable_any_whitespace):
            raise ValueError("structured_outputs.whitespace_pattern must be a string, and not sent with "
                             "disable_any_whitespace")
        depth = self.json_object_max_depth
        if depth is not None and (not isinstance(depth, int) or isinstance(depth, bool) or not 1 <= depth <= 64):
            raise ValueError(f"structured_outputs.json_object_max_depth must be an integer in [1, 64], got {depth!r}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """The cache key of the compiled grammar: (kind, canonical text of the spec)."""
        kind = self.kind
        if kind == "json":
            spec: Any = self.json if isinstance(self.json, str) else jsonlib.dumps(self.json, sort_keys=True)
            return (f"json/{self._whitespace()}", spec)
        if kind == "choice":
            return ("choice", jsonlib.dumps(self.choice))
        if kind == "json_object":
            return (f"json_object/{self._whitespace()}", str(self.json_object_max_depth or ""))
        return (kind, getattr(self, kind))

    def _whitespace(self) -> str:
        """The JSON whitespace in the cache key: 1 compact, 0 the default, p:<the regex>."""
        if self.whitespace_pattern is not None:
            return "p:" + self.whitespace_pattern
        return str(int(self.disable_any_whitespace))
