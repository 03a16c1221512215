"""Structured output and tool calls of the OpenAI API, turned into engine params.

One request asks for at most one of:
  - `response_format`: {"type": "json_object"} or {"type": "json_schema", "json_schema":
    {"name", "schema", "strict"}} (chat and completions);
  - `structured_outputs`: vLLM's extension, json / regex / choice / grammar / json_object;
  - `tools` with `tool_choice` "required" or a named function (chat): the output is JSON
    constrained to the tools' parameter schemas, answered as OpenAI `tool_calls`.
Each becomes a StructuredOutputsParams, checked with the rest of the request by the engine's
validator (structured_output/limits.py: the grammar library reads it, within bounds), so a
schema, regex or grammar it cannot read, or one past a bound, is a 400 naming the request
field (`constraint_field`), before anything is queued.
`tool_choice: "auto"` (the default with tools) leaves the text free: the model decides, and
the server's tool-call parser (`--enable-auto-tool-choice`, Hermes format) reads calls out of
it (tool_calls.py). Without the parser it is a 400.
"""

from __future__ import annotations

from deepinfer_dp.entrypoints.openai import unsupported
from deepinfer_dp.entrypoints.openai.guided import apply_guided
from deepinfer_dp.entrypoints.openai.protocol import ChatCompletionRequest, SamplingFields
from deepinfer_dp.entrypoints.openai.serving_engine import bad_request, refuse_unsupported
from deepinfer_dp.entrypoints.openai.tool_calls import ToolMode
from deepinfer_dp.structured_output import limits
from deepinfer_dp.structured_output.params import StructuredOutputsParams

ANY_OBJECT = {"type": "object"}


def structured_params(req: SamplingFields, tool_parser: str | None = None,
                      ) -> tuple[StructuredOutputsParams | None, ToolMode | None]:
    """The request's constraint (None: free text) and, for tool calls, how to read the answer.
    `tool_parser`: the server's parser for tool_choice "auto" (None: auto is refused)."""
    apply_guided(req)  # vLLM's older guided_* fields become structured_outputs
    asked = [name for name in ("response_format", "structured_outputs") if _asks(req, name)]
    tools = tool_mode(req, tool_parser) if isinstance(req, ChatCompletionRequest) else None
    if tools and tools.kind == "auto":
        if asked:
            raise bad_request(f'{asked[0]} constrains the output, so the model cannot choose to call a tool '
                              f'(tool_choice "auto"); send tool_choice "required", a named function or "none"',
                              "tool_choice")
        return None, tools
    if tools:
        asked.append("tool_choice")
    if len(asked) > 1:
        raise bad_request(f"{' and '.join(asked)} both constrain the output; send one of them", asked[1])
    if not asked:
        return None, None
    if tools:
        return _tools_params(req, tools), tools
    if asked[0] == "response_format":
        return _response_format(req), None
    return _vllm_params(req), None


def constraint_field(req: SamplingFields) -> str | None:
    """The request field a constraint from structured_params came from, for a 400 about it
    (None: the validator's own name, structured_outputs.<kind>, is the field)."""
    if isinstance(req, ChatCompletionRequest) and req.tools and req.tool_choice not in (None, "none", "auto"):
        return "tools"
    return "response_format.json_schema.schema" if _asks(req, "response_format") else None


def _asks(req: SamplingFields, name: str) -> bool:
    value = getattr(req, name)
    return value is not None and not (name == "response_format" and value.type == "text")


def _check(params: StructuredOutputsParams, param: str) -> StructuredOutputsParams:
    try:
        limits.check(params)
    except ValueError as e:
        raise bad_request(f"{param}: {e}", param) from e
    return params


def _response_format(req: SamplingFields) -> StructuredOutputsParams:
    fmt = req.response_format
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None:
        raise bad_request('response_format of type "json_schema" needs a json_schema object',
                          "response_format.json_schema")
    return StructuredOutputsParams(json=fmt.json_schema.schema_ or ANY_OBJECT)


def _vllm_params(req: SamplingFields) -> StructuredOutputsParams:
    so = req.structured_outputs
    refuse_unsupported(so, unsupported.STRUCTURED_OUTPUTS, "structured_outputs.")
    try:
        return StructuredOutputsParams(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                                       json_object=so.json_object, disable_any_whitespace=so.disable_any_whitespace,
                                       whitespace_pattern=so.whitespace_pattern,
                                       json_object_max_depth=so.json_object_max_depth)
    except ValueError as e:
        raise bad_request(str(e), "structured_outputs") from e


def tool_mode(req: ChatCompletionRequest, tool_parser: str | None = None) -> ToolMode | None:
    """How the answer holds tool calls; None when it is text (no tools, or tool_choice "none")."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    if choice == "none":
        return None
    names = [t.function.name for t in req.tools]
    if len(set(names)) != len(names):
        raise bad_request("tools: function names must be unique", "tools")
    if choice is None or choice == "auto":
        if tool_parser is None:
            raise bad_request('`tool_choice` "auto" (the default with tools: the model chooses whether to call one) '
                              'is not supported by this server as started: it needs a tool-call parser (start it '
                              'with --enable-auto-tool-choice); or send tool_choice "required" or {"type": "function", '
                              '"function": {"name": ...}}', "tool_choice", "unsupported_parameter")
        return ToolMode("auto")
    if choice == "required":
        return ToolMode("required")
    if choice.function.name not in names:
        raise bad_request(f"tool_choice names function {choice.function.name!r}, which is not in tools",
                          "tool_choice.function.name")
    return ToolMode("named", choice.function.name)


def _tools_params(req: ChatCompletionRequest, mode: ToolMode) -> StructuredOutputsParams:
    for i, tool in enumerate(req.tools):  # each schema on its own, so a 400 names the tool
        _check(StructuredOutputsParams(json=tool.function.parameters or ANY_OBJECT),
               f"tools.{i}.function.parameters")
    if mode.kind == "named":
        tool = next(t for t in req.tools if t.function.name == mode.name)
        return StructuredOutputsParams(json=tool.function.parameters or ANY_OBJECT)
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                               "parameters": t.function.parameters or ANY_OBJECT},
              "required": ["name", "parameters"], "additionalProperties": False} for t in req.tools]
    # at most one call per tool (one with parallel_tool_calls false), so that a weak model
    # cannot repeat calls until max_tokens
    array = {"type": "array", "minItems": 1, "items": {"anyOf": calls},
             "maxItems": 1 if req.parallel_tool_calls is False else len(req.tools)}
    return StructuredOutputsParams(json=array)


def tools_for_template(req: ChatCompletionRequest) -> list[dict] | None:
    """The tools as the chat template takes them (OpenAI's shape), so the model sees them."""
    if not req.tools or req.tool_choice == "none":
        return None
    return [t.model_dump(exclude_none=True) for t in req.tools]

