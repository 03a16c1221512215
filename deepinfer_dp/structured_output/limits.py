"""Bounds on a structured-output request, checked when the request is validated.

The grammar library builds its lexer lazily: a spec it parses at once can still fail at the
first step of generation, or make every step slow. Measured with SmolLM2's tokenizer
(llguidance 1.9): `a{1000000}` fails its first token with "lexer error: too many expressions
constructed", `a{300000}` the same with a byte-level tokenizer, `a{100000}` costs 54 ms a
step and `a{10000}` 4.5 ms; a `choice` of more than 2000 options fails the first step ("row
has N items; max is 2000"), and building the matcher of 10,000 options took 0.3 s, of
100,000 over 2 minutes. So a request is refused (ValueError naming the field) when:
  - its text is longer than MAX_SPEC_CHARS (the schema as JSON text, the regex, the grammar,
    or all choices together), or it has more than MAX_CHOICES options;
  - a counted repetition (`{n}`, `{n,m}` in a regex or a grammar; a JSON schema's
    minLength/maxLength/minItems/maxItems/minProperties/maxProperties), times the counts of
    the regex groups around it, asks for more than MAX_REPEAT;
  - the grammar library cannot read it (backend.check).
"""

from __future__ import annotations

import json
import re
from typing import Any

from deepinfer_dp.structured_output import backend
from deepinfer_dp.structured_output.params import StructuredOutputsParams

MAX_SPEC_CHARS = 100_000
MAX_CHOICES = 1_000
MAX_REPEAT = 10_000
_COUNT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
_SCHEMA_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")


def check(params: StructuredOutputsParams) -> None:
    """ValueError, its message starting with `structured_outputs.<kind>:`, when `params` is
    past a bound or not a valid schema, regex or grammar."""
    kind = params.kind
    try:
        _check_bounds(params)
    except ValueError as e:
        raise ValueError(f"structured_outputs.{kind}: {e}") from None
    backend.check(params)


def _check_bounds(params: StructuredOutputsParams) -> None:
    kind = params.kind
    if kind == "choice":
        if len(params.choice) > MAX_CHOICES:
            raise ValueError(f"has {len(params.choice)} options; at most {MAX_CHOICES} are allowed")
        _check_size(sum(len(c) for c in params.choice))
    elif kind == "regex":
        _check_size(len(params.regex))
        check_regex_counts(params.regex)
    elif kind == "grammar":
        _check_size(len(params.grammar))
        _check_flat_counts(params.grammar)
    elif kind == "json":
        text = params.json if isinstance(params.json, str) else json.dumps(params.json)
        _check_size(len(text))
        if isinstance(params.json, str):
            try:
                schema = json.loads(text)
            except ValueError:
                return  # not JSON: backend.check says so
        else:
            schema = params.json
        _check_schema_counts(schema)


def _check_size(num_chars: int) -> None:
    if num_chars > MAX_SPEC_CHARS:
        raise ValueError(f"is {num_chars} characters long; at most {MAX_SPEC_CHARS} are allowed")


def _check_count(count: int, what: str) -> None:
    if count > MAX_REPEAT:
        raise ValueError(f"{what} asks for {count if count < 10**30 else 'too many'} repetitions; "
                         f"at most {MAX_REPEAT} are allowed")


def _check_flat_counts(text: str) -> None:
    """Every `{n}` / `{n,m}` in a grammar, one by one."""
    for m in _COUNT.finditer(text):
        for number in filter(None, m.groups()):
            _check_count(int(number[:40]), f"repetition {{{m.group(0)[1:-1]}}}")


def check_regex_counts(regex: str) -> None:
    """Each counted repetition times those of the groups around it must stay <= MAX_REPEAT.
    The walk knows escapes, character classes and groups; anything else is an atom."""
    groups: list[tuple[int, int]] = []  # (open, close) of each group
    quantifiers: list[tuple[int, int]] = []  # (position of the atom or group's open, count)
    stack: list[int] = []
    i, last_atom = 0, 0
    while i < len(regex):
        c = regex[i]
        if c == "\\":
            last_atom, i = i, i + 2
            continue
        if c == "[":
            last_atom, i = i, _class_end(regex, i)
            continue
        if c == "(":
            stack.append(i)
        elif c == ")" and stack:
            last_atom = stack.pop()
            groups.append((last_atom, i))
        elif c == "{" and (m := _COUNT.match(regex, i)):
            count = max(int(n[:40]) for n in m.groups() if n)
            quantifiers.append((last_atom, count))
            i = m.end()
            continue
        else:
            last_atom = i
        i += 1
    counted = {start: count for start, count in quantifiers}
    for start, count in quantifiers:
        total = count
        for g_open, g_close in groups:
            if g_open < start <= g_close:
                total *= counted.get(g_open, 1)
        _check_count(total, "a counted repetition (with the groups around it)")


def _class_end(regex: str, i: int) -> int:
    """The index after the character class that opens at regex[i] ("[")."""
    j = i + 1
    if j < len(regex) and regex[j] == "^":
        j += 1
    if j < len(regex) and regex[j] == "]":
        j += 1
    while j < len(regex) and regex[j] != "]":
        j += 2 if regex[j] == "\\" else 1
    return j + 1


def _check_schema_counts(schema: Any) -> None:
    """minLength, maxItems, ... anywhere in the schema, and the regex of every `pattern`."""
    if isinstance(schema, dict):
        for key, value in schema.items():
            if key in _SCHEMA_COUNTS and isinstance(value, int) and not isinstance(value, bool):
                _check_count(value, key)
            elif key == "pattern" and isinstance(value, str):
                check_regex_counts(value)
            else:
                _check_schema_counts(value)
    elif isinstance(schema, list):
        for item in schema:
            _check_schema_counts(item)
