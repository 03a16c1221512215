"""A chat template given by the user (`LLM.chat(chat_template=...)`, `serve --chat-template`):
a Jinja file or the template itself, read as vLLM reads it."""

from __future__ import annotations

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
