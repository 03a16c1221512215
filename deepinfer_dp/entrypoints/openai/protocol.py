"""Request and response bodies of the OpenAI HTTP API, as pydantic models.

Requests are parsed strictly: a field of the wrong JSON type is an error (no `true` becomes a
token id, no `"yes"` a bool), an unknown field is an error naming it, and every string must be
valid Unicode text (a lone surrogate is refused here, not deep in the tokenizer). OpenAI's
fields that the server does not implement are declared as `Any` so that unsupported.py can
refuse them with a message that names them. A few vLLM extensions are accepted (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, skip_special_tokens, stop_token_ids,
include_stop_str_in_output, structured_outputs). Structured output (response_format,
structured_outputs, tools) is turned into engine params by structured.py.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from deepinfer_dp.sampling_params import DEFAULT_MAX_TOKENS

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _unicode_text(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"holds a lone surrogate (\\u{ord(value[e.start]):04x}) at index {e.start}, which is "
                         f"not valid Unicode text") from None
    return value


Text = Annotated[str, AfterValidator(_unicode_text)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, the usage so far in every chunk


# ---- structured output and tools ----------------------------------------------------------
class JsonSchemaFormat(_Request):
    name: Text
    description: Text | None = None
    schema_: dict[Text, Any] | None = Field(None, alias="schema")  # (`schema` would shadow pydantic's)
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Request):
    """vLLM's `structured_outputs` extension: exactly one of these."""

    json_: dict[Text, Any] | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: Text | None = None  # a regex for the whitespace between JSON tokens
    json_object_max_depth: int | None = None  # ours: json_object's nesting bound (default in backend.py)
    disable_fallback: bool = False  # accepted and ignored: there is one grammar library, no fallback
    # Refused unless unset (unsupported.py): they would change the output and are not implemented.
    disable_additional_properties: Any = None
    structural_tag: Any = None


class FunctionDefinition(_Request):
    name: Text
    description: Text | None = None
    parameters: dict[Text, Any] | None = None
    strict: bool | None = None


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Request):
    name: Text


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: FunctionName


class SamplingFields(_Request):
    """The fields shared by both endpoints."""

    model: Text
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)  # OpenAI's and vLLM's range
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[Text, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # Accepted and ignored: they change nothing about the answer by definition.
    user: Text | None = None
    metadata: dict[Text, Text] | None = None
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = None
    service_tier: Any = None  # refused unless "auto" / "default" (unsupported.py)
    store: Any = None  # refused unless false
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # vLLM's older structured-output fields: aliases of structured_outputs (guided.py)
    guided_json: dict[Text, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    guided_whitespace_pattern: Text | None = None
    guided_decoding_backend: Text | None = None  # accepted and ignored: one grammar library here
    # vLLM's own request fields: accepted where the value changes nothing, else refused with
    # why (unsupported.VLLM); the table in docs/serving.md says what happens to each.
    use_beam_search: Any = None
    length_penalty: Any = None
    watermarking: Any = None
    spaces_between_special_tokens: Any = None
    truncate_prompt_tokens: Any = None
    truncation_side: Any = None
    allowed_token_ids: Any = None
    prompt_logprobs: Any = None
    logprob_token_ids: Any = None
    bad_words: Any = None
    priority: Any = None
    request_id: Any = None
    session_id: Any = None
    return_tokens_as_token_ids: Any = None
    return_token_ids: Any = None
    routed_experts_prompt_start: Any = None
    return_token_offsets: Any = None
    return_mm_kwargs: Any = None
    cache_salt: Any = None
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None
    vllm_xargs: Any = None
    repetition_detection: Any = None
    thinking_token_budget: Any = None
    stream_interval: Any = None
    data_parallel_rank: int | None = None  # vLLM's: pin the request to this DP rank (one this endpoint serves)

    def continuous_usage(self) -> bool:
        """vLLM's `stream_options.continuous_usage_stats`: with include_usage, every chunk
        carries the usage so far (the last one, without choices, the total as without it)."""
        so = self.stream_options
        return bool(so and so.include_usage and so.continuous_usage_stats)


class CompletionRequest(SamplingFields):
    prompt: Text | list[Text] | list[int] | list[list[int]]
    max_tokens: int | None = DEFAULT_MAX_TOKENS  # unsent: the model's default, if it has one
    logprobs: int | None = None
    echo: bool = False
    suffix: Any = None  # refused (unsupported.py)
    best_of: int | None = None  # refused above n
    add_special_tokens: Any = None  # vLLM's; true (the default) only
    prompt_embeds: Any = None  # vLLM's; refused


class ContentPart(_Request):
    type: Text
    text: Text | None = None
    image_url: Any = None  # refused with its type
    input_audio: Any = None
    file: Any = None


class FunctionCallIn(_Request):
    name: Text
    arguments: Text  # JSON text, as OpenAI sends it


class ToolCallIn(_Request):
    id: Text | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    # What an assistant turn of OpenAI's answer holds; a client may send such a turn back.
    refusal: Any = None
    tool_calls: list[ToolCallIn] | None = None  # an earlier answer's calls, sent back
    tool_call_id: Text | None = None  # a tool result: the call it answers
    function_call: Any = None
    audio: Any = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # vLLM's: how the chat is rendered (ChatRender.of), and the last message's text put before
    # the answer when it is the assistant's (echo: with continue_final_message, the whole message)
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False
    # OpenAI fields this server does not implement (refused in unsupported.py unless no-ops)
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    verbosity: Any = None
    # vLLM's chat fields (unsupported.VLLM_CHAT): accepted at their defaults, else refused
    include_reasoning: Any = None
    add_special_tokens: Any = None
    documents: Any = None
    chat_template: Any = None
    media_io_kwargs: Any = None
    mm_processor_kwargs: Any = None
    return_prompt_text: Any = None


# ---- responses ---------------------------------------------------------------------------
class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)  # None: the first prompt token (echo)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str = Field(default_factory=lambda: random_id("call"))
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "deepinfer-dp"
    root: str | None = None  # the model argument the served names stand for, as vLLM's card says
    parent: str | None = None  # a LoRA adapter's base model in vLLM; never set here
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
