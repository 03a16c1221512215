"""A prompt's images through the model's own Hugging Face processor: the expanded prompt
ids, and per image its placeholder positions, its model inputs and its content key.

What differs between the families (which tensors belong to which image, how many placeholder
tokens an image takes) is a small table here; the preprocessing itself is the processor's.
Runs on the image worker's threads (multimodal/image_worker.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from deepinfer_dp.multimodal.media import MediaError
from deepinfer_dp.multimodal.mrope import MRopePositions, rope_index

# Placeholder ids as the C++ scheduler sees them start here, above the vocabulary: one value
# per image token, drawn from the image's content key, so that the prefix cache's block
# hashes (chained over token ids) tell two images apart. PSEUDO_ID_SPAN values per slot.
PSEUDO_ID_SPAN = 1 << 30


@dataclass
class ImageItem:
    """One image of a prompt, ready for the vision encoder."""

    key: str  # content hash of the pixels and the processor settings (encoder + prefix cache)
    positions: np.ndarray  # int64: prompt positions of its placeholder tokens, ascending
    inputs: dict[str, torch.Tensor]  # the encoder's inputs for this image alone

    @property
    def num_tokens(self) -> int:
        return len(self.positions)


@dataclass
class ProcessedPrompt:
    prompt_token_ids: list[int]  # as the processor expanded them (placeholder ids included)
    items: list[ImageItem]
    mrope: MRopePositions | None = None  # M-RoPE models' (Qwen2-VL) prompt positions, with images

    def scheduler_token_ids(self, vocab_size: int) -> list[int]:
        """The ids the scheduler gets: each placeholder replaced by its image's pseudo id."""
        ids = np.asarray(self.prompt_token_ids, dtype=np.int64)
        for item in self.items:
            ids[item.positions] = pseudo_ids(item.key, item.num_tokens, vocab_size)
        return ids.tolist()


def pseudo_ids(key: str, count: int, vocab_size: int) -> np.ndarray:
    """`count` ids in [vocab_size, vocab_size + PSEUDO_ID_SPAN) drawn from `key` (splitmix64)."""
    seed = np.uint64(int(key[:16], 16))
    with np.errstate(over="ignore"):
        z = seed + np.arange(1, count + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return vocab_size + (z % np.uint64(PSEUDO_ID_SPAN)).astype(np.int64)


class ImagePromptProcessor:
    """Wraps the model's processor (qwen_processor.load_processor: AutoProcessor first) for one family."""

    def __init__(self, processor, image_token_id: int, family: str) -> None:
        self.processor = processor
        self.image_token_id = image_token_id
        self.family = family
        settings = json.dumps(processor.image_processor.to_dict(), sort_keys=True, default=str)
        self._settings_digest = hashlib.sha256(f"{family}\0{settings}".encode()).digest()

    def content_key(self, image: Image.Image) -> str:
        h = hashlib.sha256(self._settings_digest)
        h.update(f"{image.mode}:{image.size[0]}x{image.size[1]}\0".encode())
        h.update(image.tobytes())
        return h.hexdigest()

    def process(self, prompt: str, images: list[Image.Image]) -> ProcessedPrompt:
        """Expands the prompt's placeholders and preprocesses the images. MediaError when the
        processor refuses them (the message says which image when one alone fails)."""
        try:
            batch = self.processor(text=[prompt], images=images or None, return_tensors="pt")
        except Exception as e:  # noqa: BLE001 - the processor raises many kinds; each is the input's fault
            raise MediaError(self._blame(images, e)) from None
        ids = batch["input_ids"][0].tolist()
        placeholders = np.flatnonzero(np.asarray(ids) == self.image_token_id)
        if self.family == "idefics3":
            per_image, counts = _idefics3_split(batch, ids, placeholders, self.processor, len(images))
        else:
            per_image = _split_inputs(self.family, batch, len(images))
            counts = [_num_tokens(self.family, inputs, self.processor) for inputs in per_image]
        if sum(counts) != len(placeholders):
            raise MediaError(f"the prompt has {len(placeholders)} image placeholder tokens but its "
                             f"{len(images)} image(s) need {sum(counts)}: put one image placeholder in the "
                             "prompt per image")
        items, start = [], 0
        for image, inputs, n in zip(images, per_image, counts, strict=True):
            items.append(ImageItem(self.content_key(image), placeholders[start:start + n].astype(np.int64), inputs))
            start += n
        mrope = None
        if self.family == "qwen2_vl" and items:
            grids = [tuple(int(x) for x in item.inputs["image_grid_thw"][0]) for item in items]
            try:
                mrope = rope_index(len(ids), [(item.positions, g) for item, g in zip(items, grids, strict=True)],
                                   self.processor.image_processor.merge_size)
            except ValueError as e:
                raise MediaError(str(e)) from None
        return ProcessedPrompt(ids, items, mrope)

    def _blame(self, images: list[Image.Image], error: Exception) -> str:
        for i, image in enumerate(images):
            try:
                self.processor.image_processor(images=[image], return_tensors="pt")
            except Exception as e:  # noqa: BLE001
                return f"image {i}: the image processor refused it: {type(e).__name__}: {e}"
        return f"the processor refused the prompt and its images: {type(error).__name__}: {error}"


def _split_inputs(family: str, batch, num_images: int) -> list[dict[str, torch.Tensor]]:
    """Per image, its slice of the processor's batched tensors."""
    if num_images == 0:
        return []
    if family == "llava":
        return [{"pixel_values": batch["pixel_values"][i:i + 1]} for i in range(num_images)]
    if family == "qwen2_vl":  # patches of all images in one run, each image's (t, h, w) grid
        grids = batch["image_grid_thw"]
        pixels = batch["pixel_values"].split(grids.prod(-1).tolist())
        return [{"pixel_values": pixels[i], "image_grid_thw": grids[i:i + 1]} for i in range(num_images)]
    raise ValueError(f"no image inputs layout for model family {family!r}")


def _num_tokens(family: str, inputs: dict[str, torch.Tensor], processor) -> int:
    """Placeholder tokens one image takes in the expanded prompt."""
    if family == "llava":
        _, _, height, width = inputs["pixel_values"].shape
        n = (height // processor.patch_size) * (width // processor.patch_size) + processor.num_additional_image_tokens
        return n - 1 if processor.vision_feature_select_strategy == "default" else n
    if family == "qwen2_vl":
        return int(inputs["image_grid_thw"].prod()) // processor.image_processor.merge_size ** 2
    raise ValueError(f"no placeholder count for model family {family!r}")


def _idefics3_split(batch, ids: list[int], placeholders: np.ndarray, processor,
                    num_images: int) -> tuple[list[dict[str, torch.Tensor]], list[int]]:
    """Idefics3 splits an image into tiles plus a global view, whose `<global-img>` tag comes
    last in the image's expansion: an image's placeholders end image_seq_len tokens after its
    tag, and its tiles are that count over image_seq_len, in the order of pixel_values."""
    if num_images == 0:
        return [], []
    tags = np.flatnonzero(np.asarray(ids) == processor.global_image_token_id)
    if len(tags) != num_images:
        raise MediaError(f"the prompt has {len(tags)} expanded images for {num_images} images: put one image "
                         "placeholder in the prompt per image")
    ends = np.searchsorted(placeholders, tags + processor.image_seq_len, side="right")
    counts = np.diff(np.concatenate([[0], ends])).tolist()
    pixels, mask = batch["pixel_values"][0], batch.get("pixel_attention_mask")
    per_image, tile = [], 0
    for n in counts:
        tiles = n // processor.image_seq_len
        inputs = {"pixel_values": pixels[tile:tile + tiles]}
        if mask is not None:
            inputs["pixel_attention_mask"] = mask[0][tile:tile + tiles]
        per_image.append(inputs)
        tile += tiles
    return per_image, counts
