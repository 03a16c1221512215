"""The Qwen VL processor without video: it expands `<|image_pad|>` as transformers'
Qwen2VLProcessor does and returns the image processor's own pixels; AutoProcessor comes
first; and M-RoPE's prompt positions equal transformers' get_rope_index."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from mm_utils import make_image
from qwen_vl_utils import build_tiny_qwen_vl
from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor

from deepinfer_dp.multimodal.mrope import rope_index, step_positions
from deepinfer_dp.multimodal.qwen_processor import QwenVLProcessor, load_processor

V = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return build_tiny_qwen_vl(tmp_path_factory.getbasetemp() / "tiny-qwen2-vl", "qwen2_vl")


def test_expansion_and_pixels_are_the_hf_processors(qwen_dir):
    processor = load_processor(qwen_dir)
    if importlib.util.find_spec("torchvision") is None:
        assert isinstance(processor, QwenVLProcessor)  # transformers could not build its own
    images = [make_image(1), make_image(2, (120, 40))]
    text = f"look {V} and {V} now"
    batch = processor(text=[text], images=images, return_tensors="pt")
    own = processor.image_processor(images=images, return_tensors="pt")
    assert torch.equal(batch["pixel_values"], own["pixel_values"])
    assert torch.equal(batch["image_grid_thw"], own["image_grid_thw"])
    # transformers' replacement text per image (its processor's method, on ours)
    pads = [Qwen2VLProcessor.replace_image_token(processor, own, i) for i in range(2)]
    expected = text.replace("<|image_pad|>", "\0").replace("\0", pads[0], 1).replace("\0", pads[1], 1)
    assert batch["input_ids"][0].tolist() == processor.tokenizer(expected)["input_ids"]
    image_rows = batch["input_ids"][0] == processor.image_token_id
    assert torch.equal(batch["mm_token_type_ids"][0], image_rows.long())
    with pytest.raises(ValueError, match="number of images"):
        processor(text=[text], images=images[:1])


def test_rope_index_equals_transformers(qwen_dir):
    from transformers import Qwen2VLForConditionalGeneration

    processor = load_processor(qwen_dir)
    model = Qwen2VLForConditionalGeneration.from_pretrained(qwen_dir)
    images = [make_image(3, (30, 90)), make_image(4, (112, 112))]
    batch = processor(text=[f"a {V} b c {V} d e f"], images=images, return_tensors="pt")
    expected, delta = model.model.get_rope_index(batch["input_ids"], batch["mm_token_type_ids"],
                                                 image_grid_thw=batch["image_grid_thw"])
    ids = batch["input_ids"][0].numpy()
    where = np.flatnonzero(ids == processor.image_token_id)
    sizes = (batch["image_grid_thw"].prod(-1) // 4).tolist()
    runs = np.split(where, np.cumsum(sizes)[:-1])
    grids = [tuple(g) for g in batch["image_grid_thw"].tolist()]
    ours = rope_index(len(ids), list(zip(runs, grids, strict=True)), 2)
    assert np.array_equal(ours.table, expected[:, 0].numpy())
    assert ours.delta == int(delta) < 0
    # a step: the prompt's last 3 rows (text after the images: one row each) and another sequence's row
    n = len(ids)
    pos = step_positions(["r", "other"], np.array([0, 3, 4]), np.array([n - 3, n - 2, n - 1, 7]), {"r": ours})
    assert pos.ndim == 1 and pos.tolist() == [*(ours.table[0, -3:]).tolist(), 7]
    decode = step_positions(["r"], np.array([0, 1]), np.array([n + 5]), {"r": ours})
    assert decode.tolist() == [n + 5 + ours.delta]
    image_rows = step_positions(["r"], np.array([0, 2]), where[:2], {"r": ours})
    assert image_rows.shape == (3, 2)
