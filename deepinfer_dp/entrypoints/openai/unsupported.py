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


def _false(v: Any) -> bool:
    return v is None or v is False


def _any_bool(v: Any) -> bool:
    return v is None or isinstance(v, bool)


def _any_int(v: Any) -> bool:
    return v is None or (isinstance(v, int) and not isinstance(v, bool))


def _any_number(v: Any) -> bool:
    return _any_int(v) or isinstance(v, float)


def _any_text(v: Any) -> bool:
    return v is None or isinstance(v, str)


# vLLM's extensions on both endpoints (vllm/entrypoints/openai/{completion,chat_completion}/
# protocol.py); the "accepted and ignored" ones change nothing about the answer, as in vLLM.
VLLM: dict[str, tuple[Noop, str]] = {
    "use_beam_search": (_false, "beam search is not implemented"),
    "length_penalty": (_any_number, "must be a number (it only acts with beam search, as in vLLM)"),
    "watermarking": (_false, "watermarking is not implemented"),
    "spaces_between_special_tokens": (lambda v: v is None or v is True, "only true (the default) is implemented"),
    "truncate_prompt_tokens": (_none, "prompt truncation is not implemented: send a prompt that fits"),
    "truncation_side": (_none, "prompt truncation is not implemented: send a prompt that fits"),
    "allowed_token_ids": (_none, "allowed_token_ids is not implemented; use logit_bias or structured_outputs"),
    "prompt_logprobs": (_none, "prompt_logprobs is not implemented as a field; /v1/completions returns them "
                        "with echo: true and logprobs"),
    "logprob_token_ids": (_none, "logprobs of chosen token ids are not implemented"),
    "bad_words": (_empty, "bad_words is not implemented; use logit_bias"),
    "priority": (lambda v: v is None or v == 0, "priority scheduling is not implemented; only 0 is accepted"),
    "request_id": (_any_text, "must be a string (accepted and ignored: the server names its requests)"),
    "session_id": (_any_text, "must be a string (accepted and ignored)"),
    "return_tokens_as_token_ids": (_false, "token ids in place of token strings are not implemented"),
    "return_token_ids": (_false, "returning token ids is not implemented; use /tokenize"),
    "routed_experts_prompt_start": (lambda v: v is None or v == 0, "routed-expert data is not returned"),
    "return_token_offsets": (_any_bool, "must be a boolean (vLLM ignores it outside /render)"),
    "return_mm_kwargs": (_any_bool, "must be a boolean (vLLM ignores it outside /render)"),
    "cache_salt": (_none, "salting the prefix cache per tenant is not implemented"),
    "kv_transfer_params": (_empty, "disaggregated serving is not implemented"),
    "ec_transfer_params": (_empty, "disaggregated serving is not implemented"),
    "vllm_xargs": (_empty, "vLLM's custom-extension arguments are not implemented"),
    "repetition_detection": (_none, "repetition detection is not implemented"),
    "thinking_token_budget": (lambda v: v is None or v == -1, "this model has no reasoning mode"),
    "stream_interval": (lambda v: v is None or (_any_int(v) and v >= 1),
                        "must be an integer >= 1 (accepted and ignored: every step's tokens are sent)"),
}

VLLM_CHAT: dict[str, tuple[Noop, str]] = {
    "include_reasoning": (_any_bool, "must be a boolean (accepted and ignored: no reasoning parser)"),
    "add_special_tokens": (_false, "only false (the default: the chat template adds them) is implemented"),
    "documents": (_empty, "documents for the chat template are not implemented"),
    "chat_template": (_none, "a request's own chat template is not served (the server's is --chat-template)"),
    "media_io_kwargs": (_empty, "media input is not implemented"),
    "mm_processor_kwargs": (_empty, "multimodal input is not implemented"),
    "return_prompt_text": (_false, "returning the rendered prompt is not implemented; use /tokenize"),
}

STRUCTURED_OUTPUTS: dict[str, tuple[Noop, str]] = {
    "disable_additional_properties": (_false, "is not implemented; say additionalProperties: false in the schema"),
    "structural_tag": (_none, "structural tags are not implemented"),
}

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
    **VLLM,
    **VLLM_CHAT,
}

COMPLETION: dict[str, tuple[Noop, str]] = {
    "suffix": (lambda v: v is None or v == "", "insertion (a suffix after the completion) is not implemented"),
    "service_tier": CHAT["service_tier"],
    "store": CHAT["store"],
    **VLLM,
    "add_special_tokens": (lambda v: v is None or v is True, "only true (the default) is implemented"),
    "prompt_embeds": (_none, "prompt embeddings are not implemented"),
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
