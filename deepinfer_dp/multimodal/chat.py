"""Chat messages with image parts (OpenAI's shape) for a vision model's chat template.

Every `{"type": "image_url", "image_url": {"url": ...}}` part becomes the template's
`{"type": "image"}` part, and its URL is collected, in order, with the field that carried it
("messages.0.content.1.image_url") for error messages. Shared by LLM.chat and the server.
"""

from __future__ import annotations

from deepinfer_dp.multimodal.image_worker import MultiModalPrompt
from deepinfer_dp.multimodal.media import MediaError
from deepinfer_dp.utils.chat_template import DEFAULT_RENDER, ChatRender


def split_chat_images(messages: list[dict]) -> tuple[list[dict], list[str], list[str]]:
    """(messages for the processor's chat template, image URLs, their fields)."""
    out, urls, fields = [], [], []
    for m, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for c, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url":
                field = f"messages.{m}.content.{c}.image_url"
                image_url = part.get("image_url")
                url = image_url.get("url") if isinstance(image_url, dict) else image_url
                if not isinstance(url, str) or not url:
                    raise MediaError(f"{field}: needs a 'url' string")
                urls.append(url)
                fields.append(field)
                parts.append({"type": "image"})
            elif kind == "text":
                parts.append({"type": "text", "text": part.get("text", "")})
            else:
                raise MediaError(f"messages.{m}.content.{c}: unsupported content part type {kind!r} "
                                 "(text and image_url are)")
        out.append({**message, "content": parts})
    return out, urls, fields


def has_image_parts(messages: list[dict]) -> bool:
    return any(isinstance(part, dict) and part.get("type") == "image_url"
               for message in messages if isinstance(message.get("content"), list)
               for part in message["content"])


def render_chat_prompt(processor, messages: list[dict], render: ChatRender = DEFAULT_RENDER,
                       chat_template: str | None = None) -> MultiModalPrompt:
    """A conversation with image_url parts as one prompt: the processor's chat template's (or
    `chat_template`'s) text, placeholders where the images were, and the images' URLs, fetched
    later, with their fields."""
    conv, urls, fields = split_chat_images(messages)
    override = {} if chat_template is None else {"chat_template": chat_template}
    text = processor.apply_chat_template(conv, tokenize=False, **render.template_kwargs(), **override)
    return MultiModalPrompt(text, urls, fields)
