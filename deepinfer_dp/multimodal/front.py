"""Images on a front end that has no engine of its own (the API server or the offline driver
behind the Ray router): the conversation through the processor's chat template, and each
image reference checked for its shape (scheme, allowed folder, encoded size) without fetching
it. The rank that takes the request fetches, decodes and preprocesses its images itself
(image_worker.py), as at dp 1; here nothing is read but the request.
"""

from __future__ import annotations

import io

from PIL import Image
from transformers import AutoProcessor

from deepinfer_dp.multimodal.chat import render_chat_prompt
from deepinfer_dp.multimodal.image_worker import MultiModalPrompt
from deepinfer_dp.multimodal.media import MediaError, MediaLimits, allowed_local_path, file_url_path, url_scheme
from deepinfer_dp.utils.chat_template import DEFAULT_RENDER, ChatRender


class ImageFront:
    """The chat template of a vision model's processor, its media limits and how many images
    a prompt may carry (`image_limit`)."""

    def __init__(self, processor, limits: MediaLimits, image_limit: int) -> None:
        self.processor = processor
        self.limits = limits
        self.image_limit = image_limit

    @classmethod
    def for_model(cls, model_dir: str, limits: MediaLimits, image_limit: int) -> ImageFront:
        return cls(AutoProcessor.from_pretrained(model_dir), limits, image_limit)

    def chat_prompt(self, messages: list[dict], render: ChatRender = DEFAULT_RENDER,
                    chat_template: str | None = None) -> MultiModalPrompt:
        """As ImageRequests.chat_prompt, and every image URL checked (MediaError naming its field)."""
        prompt = render_chat_prompt(self.processor, messages, render, chat_template)
        for url, field in zip(prompt.images, prompt.image_fields or [], strict=True):
            try:
                check_url(url, self.limits)
            except MediaError as e:
                raise MediaError(f"{field}: {e}") from None
        return prompt


def check_url(url: str, limits: MediaLimits) -> None:
    """What can be told of an image URL without fetching it, with the image worker's own
    checks (media.py): a scheme it takes, a data URL within the byte limit, a local file under
    the allowed folder."""
    scheme = url_scheme(url)
    if scheme == "data":
        payload = url.partition(",")[2]
        if len(payload) * 3 // 4 > limits.max_image_bytes:  # base64: 4 characters per 3 bytes
            raise MediaError(f"the data URL holds about {len(payload) * 3 // 4} bytes, more than the limit of "
                             f"{limits.max_image_bytes}")
    elif scheme == "file":
        allowed_local_path(file_url_path(url), limits)


def image_for_wire(image: object, where: str) -> str | bytes:
    """An offline prompt's image as the wire carries it: a URL string as it is, bytes as they
    are, a PIL image as lossless PNG of its RGB pixels (what the image worker would take of
    it), so the rank decodes exactly the pixels it would have had at dp 1."""
    if isinstance(image, str):
        return image
    if isinstance(image, (bytes, bytearray)):
        return bytes(image)
    if isinstance(image, Image.Image):
        buf = io.BytesIO()
        image.convert("RGB").save(buf, format="PNG", compress_level=1)
        return buf.getvalue()
    raise MediaError(f"{where}: an image must be a PIL image, bytes or a URL string, got {type(image).__name__}")
