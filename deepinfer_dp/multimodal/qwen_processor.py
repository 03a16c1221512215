"""The model's processor: `AutoProcessor` first; for Qwen2-VL and Qwen2.5-VL, when transformers
cannot build theirs, the same processor without video (`QwenVLProcessor`).

transformers builds `Qwen2VLProcessor` (which Qwen2.5-VL uses too) only with its video
processor, and that needs torchvision; without it `AutoProcessor` fails even for images.
`QwenVLProcessor` is the image half of that processor: the family's own image processor
(`AutoImageProcessor`: `Qwen2VLImageProcessorPil` here) and tokenizer, and the prompt
expansion of `Qwen2VLProcessor.replace_image_token`: each `<|image_pad|>` becomes
`image_grid_thw.prod() // merge_size**2` of them, in image order.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from transformers import AutoConfig, AutoImageProcessor, AutoProcessor, AutoTokenizer, BatchFeature

QWEN_VL_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")


def load_processor(model_dir: str | os.PathLike):
    """The processor of the model in `model_dir` (AutoProcessor's, or QwenVLProcessor when
    transformers cannot build a Qwen VL one)."""
    try:
        return AutoProcessor.from_pretrained(model_dir)
    except Exception:
        if AutoConfig.from_pretrained(model_dir).model_type not in QWEN_VL_MODEL_TYPES:
            raise
        return QwenVLProcessor.from_pretrained(model_dir)


class QwenVLProcessor:
    """Qwen2-VL / Qwen2.5-VL's processor for text and images (no video)."""

    def __init__(self, image_processor, tokenizer, chat_template: str | None = None) -> None:
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
        self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> QwenVLProcessor:
        return cls(AutoImageProcessor.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir),
                   _chat_template(Path(model_dir)))

    def __call__(self, text: str | list[str], images=None, return_tensors: str | None = None,
                 **text_kwargs) -> BatchFeature:
        texts = [text] if isinstance(text, str) else list(text)
        image_inputs = {}
        placeholders = sum(t.count(self.image_token) for t in texts)
        if images is not None:
            image_inputs = self.image_processor(images=images, return_tensors="pt")
            grids = image_inputs["image_grid_thw"]
            if placeholders != len(grids):
                raise ValueError(f"The total number of {self.image_token} tokens in the prompts should be the same "
                                 f"as the number of images passed. Found total {placeholders} {self.image_token} "
                                 f"tokens and {len(grids)} images.")
            merge = self.image_processor.merge_size ** 2
            texts = self._expand(texts, [int(g.prod()) // merge for g in grids])
        elif placeholders:
            raise ValueError(f"Found {placeholders} {self.image_token} tokens in the text but no images were passed.")
        text_inputs = self.tokenizer(texts, **text_kwargs)
        types = []
        for ids in text_inputs["input_ids"]:
            ids = np.asarray(ids)
            types.append(np.where(ids == self.image_token_id, 1, np.where(ids == self.video_token_id, 2, 0)).tolist())
        data = {**text_inputs, "mm_token_type_ids": types, **image_inputs}
        return BatchFeature(data, tensor_type=return_tensors)

    def _expand(self, texts: list[str], counts: list[int]) -> list[str]:
        """Each placeholder, in order across the texts, repeated its image's token count."""
        it = iter(counts)
        out = []
        for t in texts:
            pieces = t.split(self.image_token)
            out.append(pieces[0] + "".join(self.image_token * next(it) + p for p in pieces[1:]))
        return out

    def apply_chat_template(self, conversation: list[dict], **kwargs):
        kwargs.setdefault("chat_template", self.chat_template)
        return self.tokenizer.apply_chat_template(conversation, **kwargs)

    def batch_decode(self, *args, **kwargs):
        return self.tokenizer.batch_decode(*args, **kwargs)

    def decode(self, *args, **kwargs):
        return self.tokenizer.decode(*args, **kwargs)


def _chat_template(model_dir: Path) -> str | None:
    """The processor's chat template as saved (transformers 5: chat_template.jinja; the
    published checkpoints: chat_template.json); None: the tokenizer's own."""
    if (model_dir / "chat_template.jinja").is_file():
        return (model_dir / "chat_template.jinja").read_text()
    if (model_dir / "chat_template.json").is_file():
        return json.loads((model_dir / "chat_template.json").read_text()).get("chat_template")
    return None
