"""The per-step encoder budget on the engine (tiny LLaVA: 16 image tokens per image): with a
budget of one image per step, prompts with several images are prefilled in chunks that end
before the image that does not fit; the vision encoder never makes more than the budget in a
step, and greedy tokens equal transformers' and the unbudgeted run's."""

from __future__ import annotations

import pytest
from mm_utils import HFReference, build_tiny_idefics3, build_tiny_llava, make_image

from deepinfer_dp.entrypoints.llm import LLM
from deepinfer_dp.sampling_params import SamplingParams

TOKENS = 4
GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
OPTIONS = dict(max_num_batched_tokens=256, max_model_len=256, decode_sequence=False)


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return build_tiny_llava(tmp_path_factory.getbasetemp() / "tiny-llava")


def cases(seed: int) -> list[tuple[str, list]]:
    """Four prompts with 3, 2, 0 and 1 images, none of them seen before (each is encoded)."""
    img = [make_image(seed + i, (40 + 6 * i, 56)) for i in range(6)]
    return [("USER: <image> then <image> and <image>\nwhich one? ASSISTANT:", img[0:3]),
            ("USER: <image> or <image>\nsame? ASSISTANT:", img[3:5]),
            ("USER: no image here ASSISTANT:", []),
            ("USER: <image>\nwhat is it? ASSISTANT:", img[5:6])]


def generate(model_dir, seed: int, **options) -> tuple[list[list[int]], dict]:
    llm = LLM(str(model_dir), **OPTIONS, **options)
    try:
        out = llm.generate([{"prompt": t, "multi_modal_data": {"image": i}} for t, i in cases(seed)], GREEDY,
                           use_tqdm=False)
        return [[t for o in r for t in o.token_ids] for r in out], llm.rank_stats()[0]
    finally:
        llm.shutdown()


def test_budget_of_one_image_per_step_keeps_the_tokens(llava_dir):
    free, free_stats = generate(llava_dir, 200)
    assert free_stats["encoder_tokens_max_step"] > 16  # unbudgeted, one step encodes several images
    ours, stats = generate(llava_dir, 200, max_num_encoder_input_tokens=16)
    assert ours == free
    hf = HFReference(llava_dir)
    assert ours == [hf.greedy(t, i, TOKENS) for t, i in cases(200)]
    assert stats["encoder_tokens_max_step"] <= 16
    assert stats["encoder_tokens"] == 6 * 16 and stats["encoder_budget_cuts"] > 0


def test_a_budget_smaller_than_one_image_still_encodes_one_per_step(llava_dir):
    free, _ = generate(llava_dir, 300)
    ours, stats = generate(llava_dir, 300, max_num_encoder_input_tokens=4)
    assert ours == free
    assert stats["encoder_tokens_max_step"] == 16  # one image per step, whole


def test_tiled_images_whose_placeholders_are_not_one_run(tmp_path_factory):
    """Idefics3: an image's tiles are separated by row/column tags; the chunk still ends
    before the first placeholder of the image that does not fit."""
    model = build_tiny_idefics3(tmp_path_factory.getbasetemp() / "tiny-idefics3")
    images = [make_image(400, (100, 60)), make_image(401, (30, 90)), make_image(402, (120, 40))]
    text = "USER: <image> and <image> and <image>\nthe same? ASSISTANT:"
    hf = HFReference(model)
    llm = LLM(str(model), max_num_batched_tokens=512, max_model_len=512, decode_sequence=False,
              max_num_encoder_input_tokens=1)  # one image per step, whatever its size
    try:
        out = llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)
        stats = llm.rank_stats()[0]
    finally:
        llm.shutdown()
    assert [[t for o in r for t in o.token_ids] for r in out] == [hf.greedy(text, images, TOKENS)]
    assert stats["encoder_budget_cuts"] >= 2 and stats["encoder_tokens_max_step"] < stats["encoder_tokens"]
