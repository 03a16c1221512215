"""Reading tool calls out of a chat answer, streamed or whole.

Three modes, set by `tool_choice` (structured.py decides which):
  - named: the grammar made the whole answer the named function's arguments (a JSON object);
    they stream as argument pieces of call 0 as they are generated;
  - required: the grammar made the answer a JSON array of {"name", "parameters"}; an array
    cannot be split into calls before it closes, so the calls come in one chunk at the end;
  - auto (Hermes): free text in which the model may write
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, as the Qwen2.5 / Qwen3
    and Hermes chat templates teach. Text before the first block streams as content; from the
    first `<tool_call>` on it is held and parsed when the answer ends.
An answer that does not parse (cut by max_tokens, or a malformed block) is given back as
content with its own finish_reason, never dropped. The non-streamed answer is the streamed
one joined, so both give the same calls.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Literal

from deepinfer_dp.entrypoints.openai.protocol import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    random_id,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@dataclass
class ToolMode:
    kind: Literal["named", "required", "auto"]
    name: str | None = None  # the function, for a named tool_choice


@dataclass
class ToolReader:
    """One choice's reader: feed() each new piece of text, finish() once at the end. Each
    returns (content to show, tool-call deltas)."""

    mode: ToolMode
    _held: str = ""  # text not shown yet
    _in_call: bool = False  # auto: a <tool_call> has opened
    _started: bool = False  # named: call 0's header was sent
    _call_id: str = field(default_factory=lambda: random_id("call"))

    def feed(self, text: str) -> tuple[str, list[DeltaToolCall]]:
        if self.mode.kind == "named":
            return "", self._named_piece(text) if text else []
        self._held += text
        if self.mode.kind == "required" or self._in_call:
            return "", []
        at = self._held.find(OPEN)
        if at >= 0:
            content, self._held, self._in_call = self._held[:at], self._held[at:], True
            return content, []
        keep = _partial_open(self._held)  # the start of a tag must not leak out as content
        content, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
        return content, []

    def finish(self, reason: str | None) -> tuple[str, list[DeltaToolCall], str | None]:
        """The rest, and the finish_reason: "tool_calls" when the answer held calls."""
        held, self._held = self._held, ""
        if self.mode.kind == "named":
            return "", [], "tool_calls" if reason == "stop" else reason
        calls = _calls(held, self.mode.kind) if reason == "stop" or self._in_call else None
        if not calls:
            return held, [], reason
        deltas = [DeltaToolCall(index=i, id=random_id("call"), type="function",
                                function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
                  for i, c in enumerate(calls)]
        return "", deltas, "tool_calls"

    def _named_piece(self, text: str) -> list[DeltaToolCall]:
        if self._started:
            return [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=text))]
        self._started = True
        return [DeltaToolCall(index=0, id=self._call_id, type="function",
                              function=DeltaFunctionCall(name=self.mode.name, arguments=text))]


def _partial_open(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of <tool_call>."""
    return next((n for n in range(min(len(OPEN) - 1, len(text)), 0, -1) if text.endswith(OPEN[:n])), 0)


def _calls(text: str, kind: str) -> list[FunctionCall] | None:
    try:
        if kind == "required":
            return [FunctionCall(name=c["name"], arguments=json.dumps(c["parameters"])) for c in json.loads(text)]
        return [_hermes_call(block) for block in _BLOCK.findall(text)] or None
    except (ValueError, KeyError, TypeError):
        return None


def _hermes_call(block: str) -> FunctionCall:
    call = json.loads(block)
    args = call.get("arguments", call.get("parameters", {}))
    if not isinstance(call["name"], str):
        raise TypeError("name")
    return FunctionCall(name=call["name"], arguments=args if isinstance(args, str) else json.dumps(args))


def joined(deltas: list[DeltaToolCall]) -> list[ToolCall]:
    """The streamed deltas of one choice as whole calls (the non-streamed message's)."""
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        if d.index not in calls:
            calls[d.index] = ToolCall(id=d.id, function=FunctionCall(name=d.function.name, arguments=""))
        calls[d.index].function.arguments += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)]
