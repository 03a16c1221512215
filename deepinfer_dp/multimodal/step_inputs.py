"""Which rows of a step are image tokens, and their embeddings spliced into the step's.

The engine plans (`plan_step`): for every scheduled sequence with images, the rows of this
step's flattened tokens whose positions are placeholders, and which embedding row of which
image each takes, so a prefill chunk that splits an image gets exactly its part. The model
runner splices (`splice`), inside the step: the vision encoder runs for an image the first
time one of its rows is computed (EncoderCache), and the rows overwrite the text embeddings.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from deepinfer_dp.multimodal.encoder_cache import EncoderCache
from deepinfer_dp.multimodal.processing import ImageItem


@dataclass
class ImageSlice:
    batch_rows: np.ndarray  # int64: rows of the step's flattened tokens
    item: ImageItem
    item_rows: np.ndarray  # int64: rows of the image's embeddings, one per batch row
    request_id: str = ""


@dataclass
class MultiModalStep:
    """What the model runner needs to build one step's input embeddings."""

    slices: list[ImageSlice]
    cache: EncoderCache
    mrope_positions: np.ndarray | None = None  # M-RoPE models: [T] or [3, T] (multimodal/mrope.py)

    def embeddings(self, model, input_ids: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """The step's input embeddings; None when it has no image row (the ids are looked up as usual)."""
        if not self.slices:
            return None
        self.cache.start_step()
        return splice(model.embed_input_ids, model.encode_image, input_ids, vocab_size, self.slices, self.cache)

    def positions(self, scheduled: torch.Tensor) -> torch.Tensor:
        """The positions the model computes RoPE at: the scheduled ones unless M-RoPE's."""
        if self.mrope_positions is None:
            return scheduled
        return torch.from_numpy(self.mrope_positions).to(scheduled.device)


def plan_step(request_ids: list[str], query_start_loc: np.ndarray, positions: np.ndarray,
              items: Mapping[str, list[ImageItem]]) -> list[ImageSlice]:
    """The image rows of one step; [] when no scheduled sequence computes an image token."""
    slices = []
    for i, rid in enumerate(request_ids):
        its = items.get(rid)
        if not its:
            continue
        lo, hi = int(query_start_loc[i]), int(query_start_loc[i + 1])
        first, last = int(positions[lo]), int(positions[hi - 1])  # a sequence's rows are consecutive
        for item in its:
            begin, end = np.searchsorted(item.positions, [first, last + 1])
            if begin < end:
                item_rows = np.arange(begin, end, dtype=np.int64)
                slices.append(ImageSlice(lo + item.positions[begin:end] - first, item, item_rows, rid))
    return slices


def splice(embed: Callable[[torch.Tensor], torch.Tensor], encode: Callable[[dict], torch.Tensor],
           input_ids: torch.Tensor, vocab_size: int, slices: list[ImageSlice], cache: EncoderCache) -> torch.Tensor:
    """The step's input embeddings: the text embedding of every row, image rows overwritten.
    (Image rows carry pseudo ids above the vocabulary; they are clamped before the lookup
    and their embedding is replaced.)"""
    embeds = embed(input_ids.clamp(max=vocab_size - 1))
    for s in slices:
        image = cache.get(s.item.key, lambda item=s.item: encode(item.inputs))
        rows = torch.from_numpy(s.batch_rows).to(embeds.device)
        embeds[rows] = image[torch.from_numpy(s.item_rows).to(image.device)].to(embeds.dtype)
    return embeds
