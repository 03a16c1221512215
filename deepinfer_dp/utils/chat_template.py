"""How a chat is rendered beyond the model's own template: a template given by the user
(`LLM.chat(chat_template=...)`, `serve --chat-template`: a Jinja file or the template itself,
read as vLLM reads it), and how the rendered conversation ends (PromptEnd)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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


@dataclass(frozen=True)
class PromptEnd:
    """How the rendered conversation ends: with the template's generation prompt (a new
    assistant turn opened, the default), with nothing after the last message, or with the last
    message left open (`continue_final_message`: the model continues it, e.g. an assistant
    answer begun by the caller; the answer holds only the continuation)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @classmethod
    def of(cls, add_generation_prompt: bool | None, continue_final_message: bool | None) -> PromptEnd:
        """vLLM's fields: add_generation_prompt unset means true unless continue_final_message;
        ValueError when both are true (an open last message cannot be followed by a new turn)."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        add = not continue_final_message if add_generation_prompt is None else bool(add_generation_prompt)
        return cls(add, bool(continue_final_message))

    def template_kwargs(self) -> dict[str, bool]:
        """The arguments of transformers' apply_chat_template that say it."""
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message}


NEW_TURN = PromptEnd()  # the default end: the template's generation prompt opens the assistant's turn
