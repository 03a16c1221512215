"""Idefics3 / SmolVLM on the engine: images split into tiles plus a global view by the
model's processor (so an image's placeholders are not one run), greedy tokens equal
transformers' with 0, 1 and 2 images of different sizes, chunked prefill, and the prefix
cache telling two images apart."""

from __future__ import annotations

import pytest
from mm_utils import HFReference, build_tiny_idefics3, make_image

from deepinfer_dp.entrypoints.llm import LLM
from deepinfer_dp.sampling_params import SamplingParams

TOKENS = 6
GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_and_reference(tmp_path_factory):
    model = build_tiny_idefics3(tmp_path_factory.getbasetemp() / "tiny-idefics3")
    llm = LLM(str(model), max_num_batched_tokens=24, max_model_len=512, decode_sequence=False)
    yield llm, HFReference(model)
    llm.shutdown()


def tokens(results) -> list[list[int]]:
    return [[t for o in r for t in o.token_ids] for r in results]


def test_tiled_images_give_transformers_tokens(model_and_reference):
    llm, hf = model_and_reference
    images = [make_image(1), make_image(2, (30, 90)), make_image(3, (120, 40))]
    cases = [("USER: <image>\nWhat is it? ASSISTANT:", images[:1]),
             ("USER: <image> and <image>\nthe same? ASSISTANT:", images[1:]),
             ("USER: text only ASSISTANT:", [])]
    tiles = hf.processor(text=[cases[1][0]], images=[images[1:]], return_tensors="pt")["pixel_values"].shape[1]
    assert tiles > 2  # at least one image was split into tiles
    ours = tokens(llm.generate([{"prompt": t, "multi_modal_data": {"image": i}} for t, i in cases], GREEDY,
                               use_tqdm=False))
    assert ours == [hf.greedy(t, i, TOKENS) for t, i in cases]


def test_same_placeholders_different_images_never_share_blocks(model_and_reference):
    llm, hf = model_and_reference
    text = "USER: <image>\nOne short caption, please. ASSISTANT:"
    first, other = make_image(10, (100, 60)), make_image(11, (100, 60))
    for image in (first, other, first):
        out = tokens(llm.generate({"prompt": text, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False))
        assert out == [hf.greedy(text, [image], TOKENS)]
