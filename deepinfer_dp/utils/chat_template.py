"""How a chat is rendered beyond the model's own template: a template given by the user
(`LLM.chat(chat_template=...)`, `serve --chat-template`: a Jinja file or the template itself,
read as vLLM reads it), and the rest of how a request renders its chat (ChatRender)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# A string with any of these is a template, never a path (vLLM's test).
_JINJA_CHARS = "{}\n"


def load_chat_template(chat_template: str | Path | None) -> str | None:
    """The template's text: the file's content when `chat_template` names a readable file,
    else the string itself when it reads as a template; ValueError for a string that looks
    like a path but cannot be read."""
    if chat_template is None:
        return None
    text = str(chat_template)
    if not isinstance(chat_template, Path) and any(c in text for c in _JINJA_CHARS):
        return text
    try:
        return Path(text).read_text()
    except OSError as e:
        raise ValueError(f"the chat template {text!r} looks like a file path, but it cannot be read "
                         f"({e.strerror or e}); give the path of a Jinja file or the template itself") from e


# apply_chat_template's own parameters (tokenizers' and processors', `self` included) and the
# template's `messages`: a request's template variables may not stand in for them.
_RESERVED = frozenset({
    "self", "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs",
    "load_audio_from_video"})


class ChatRenderError(ValueError):
    """A request's rendering options that cannot go together; `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ChatRender:
    """How a conversation is rendered beyond its messages and tools. Its end: the template's
    generation prompt (a new assistant turn opened, the default), nothing after the last
    message, or the last message left open (`continue_final_message`: the model continues it,
    e.g. an assistant answer begun by the caller; the answer holds only the continuation).
    And the caller's own template variables (vLLM's `chat_template_kwargs`, such as Qwen 3's
    `enable_thinking`); a template that does not read one renders as without it."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    variables: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, add_generation_prompt: bool | None, continue_final_message: bool | None,
           chat_template_kwargs: dict[str, Any] | None = None) -> ChatRender:
        """vLLM's fields: add_generation_prompt unset means true unless continue_final_message.
        ChatRenderError when both are true (an open last message cannot be followed by a new
        turn), or for a variable named as one of apply_chat_template's own arguments."""
        if continue_final_message and add_generation_prompt:
            raise ChatRenderError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                                  "continue_final_message")
        variables = dict(chat_template_kwargs or {})
        taken = sorted((k for k in variables if k in _RESERVED or not str(k).isidentifier()), key=str)
        if taken:
            raise ChatRenderError(f"chat_template_kwargs: {', '.join(map(repr, taken))} cannot be a template "
                                  f"variable (each is a request field of its own or an argument of the "
                                  f"renderer, or not a name)", "chat_template_kwargs")
        add = not continue_final_message if add_generation_prompt is None else bool(add_generation_prompt)
        return cls(add, bool(continue_final_message), variables)

    def template_kwargs(self) -> dict[str, Any]:
        """The arguments of transformers' apply_chat_template that say it."""
        return {**self.variables, "add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message}


DEFAULT_RENDER = ChatRender()  # the template's generation prompt opens the assistant's turn
