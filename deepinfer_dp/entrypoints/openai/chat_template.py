"""Chat messages -> prompt token ids through the model's chat template, with special-token
strings inside message content kept as plain text.

Tokenizing a rendered template parses every special-token string in it as a control token,
including one a user typed: `<|im_start|>system` in user content would open a new system
turn. So when some content holds a special-token string (rare), the template is rendered
with a placeholder for each content, its own text is tokenized as usual (control tokens
parsed) and each content is tokenized on its own with special tokens split into plain text.
Content without such strings takes the ordinary path, token for token what LLM.chat gives.
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer

from deepinfer_dp.utils.chat_template import DEFAULT_RENDER, ChatRender


class TemplateError(ValueError):
    """The messages cannot be turned into a prompt (the template refused them, or the
    content cannot be kept as text under this template); `param`: the request field at fault."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


class ChatTokenizer:
    def __init__(self, tokenizer: Any, special_tokens_as_text: bool = True, chat_template: str | None = None) -> None:
        """`chat_template`: the server's own (--chat-template), used instead of the model's."""
        self.tokenizer = tokenizer
        self.template = chat_template if chat_template is not None else tokenizer.chat_template
        self.special = [t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special]
        self.as_text = special_tokens_as_text
        self._plain: Tokenizer | None = None  # a copy that never parses special tokens
        if special_tokens_as_text and getattr(tokenizer, "is_fast", False):
            self._plain = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
            self._plain.encode_special_tokens = True

    def prompt_ids(self, messages: list[dict[str, str]], tools: list[dict] | None = None,
                   render: ChatRender = DEFAULT_RENDER) -> list[int]:
        """`tools` (OpenAI's function definitions) go to the template, which may show them;
        `render`: how the conversation ends and the template variables (the caller checks
        those first, check_variables)."""
        if self.template is None:
            raise TemplateError("this model has no chat template: start the server with --chat-template "
                                "(a Jinja file or the template itself), or use /v1/completions")
        if not self.as_text or not any(s in m["content"] for m in messages for s in self.special):
            return _as_ids(self._render(messages, True, tools, render))
        if self._plain is None:
            raise TemplateError("message content holds a special-token string, which this (slow) tokenizer "
                                "cannot keep as plain text")
        return self._split_ids(messages, tools, render)

    def check_variables(self, render: ChatRender) -> None:
        """TemplateError for a template variable holding a special-token string: rendered into
        the prompt, it would be parsed as a control token, which content is not either (where
        the server keeps them as text; with that off, neither is refused)."""
        if self.as_text and any(s in text for text in _strings(render.variables) for s in self.special):
            raise TemplateError("chat_template_kwargs: a value holds a special-token string, which the template "
                                "would place as a control token; remove it", "chat_template_kwargs")

    def _render(self, messages: list[dict[str, str]], tokenize: bool, tools: list[dict] | None, render: ChatRender):
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=tokenize, tools=tools,
                                                      chat_template=self.template, **render.template_kwargs())
        except Exception as e:  # the template's own checks (e.g. roles it does not know) are user errors
            raise TemplateError(f"the chat template rejected the messages: {e}") from e

    def _split_ids(self, messages: list[dict[str, str]], tools: list[dict] | None, render: ChatRender) -> list[int]:
        # Private-use characters: no template rewrites them, and no content is likely to hold them.
        marks = [f"\ue000{i}\ue001" for i in range(len(messages))]
        rendered = self._render([{**m, "content": k} for m, k in zip(messages, marks, strict=True)], False, tools,
                                render)
        ids: list[int] = []
        pos = 0
        for message, mark in zip(messages, marks, strict=True):
            at = rendered.find(mark, pos)
            if at < 0 or rendered.count(mark) != 1:
                raise TemplateError("message content holds a special-token string, and this model's chat "
                                    "template does not place each content exactly once, so it cannot be kept "
                                    "as plain text; remove the special-token string")
            ids += self._template_ids(rendered[pos:at]) + self._plain.encode(message["content"],
                                                                             add_special_tokens=False).ids
            pos = at + len(mark)
        return ids + self._template_ids(rendered[pos:])

    def _template_ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids) if text else []


def _strings(value: Any) -> list[str]:
    """Every string inside a JSON value (keys of objects included)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in _strings(k) + _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def _as_ids(encoded) -> list[int]:
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True), older a list
    return list(encoded["input_ids"]) if hasattr(encoded, "keys") else list(encoded)
