"""LLaVA-1.5 on the engine: greedy tokens equal transformers' with 0, 1 and 2 images of
different sizes, chunked prefill splitting an image, prefix caching that tells images
apart, the encoder cache, and a broken image that fails only its own prompt."""

from __future__ import annotations

import base64

import pytest
from mm_utils import HFReference, build_tiny_llava, make_image, png_bytes

from deepinfer_dp.entrypoints.llm import LLM
from deepinfer_dp.sampling_params import SamplingParams

TOKENS = 6
CHUNK = 24  # max_num_batched_tokens: prompts of 40-70 tokens are prefilled in 2-3 chunks
GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return build_tiny_llava(tmp_path_factory.getbasetemp() / "tiny-llava")


@pytest.fixture(scope="module")
def hf(llava_dir):
    return HFReference(llava_dir)


@pytest.fixture(scope="module")
def llm(llava_dir):
    engine = LLM(str(llava_dir), max_num_batched_tokens=CHUNK, max_model_len=256, decode_sequence=False)
    yield engine
    engine.shutdown()


def tokens(results) -> list[list[int]]:
    return [None if r is None else [t for o in r for t in o.token_ids] for r in results]


def mm(text: str, images) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": images}}


def hits(llm) -> int:
    return llm.rank_stats()[0]["prefix_hit_tokens"]


def test_greedy_tokens_equal_transformers_with_0_1_2_images(llm, hf):
    a, b, c = make_image(1), make_image(2, (30, 90)), make_image(3, (120, 40))
    cases = [("USER: <image>\nWhat is in the picture? ASSISTANT:", [a]),
             ("USER: compare <image> with <image>\nAre they the same? ASSISTANT:", [b, c]),
             ("USER: no picture, just text. ASSISTANT:", []),
             ("USER: <image>\nand again ASSISTANT:", [a])]  # the same image: an encoder cache hit
    before = llm.rank_stats()[0]["encoder_cache_hits"]
    ours = tokens(llm.generate([mm(t, imgs) for t, imgs in cases], GREEDY, use_tqdm=False))
    assert ours == [hf.greedy(t, imgs, TOKENS) for t, imgs in cases]
    assert llm.rank_stats()[0]["encoder_cache_hits"] > before


def test_chunked_prefill_splits_the_image_tokens(llm, hf):
    text = "USER: Hello, world! <image>\nDescribe it. ASSISTANT:"
    image = make_image(4, (50, 50))
    ids = hf.processor(text=[text], images=[image], return_tensors="pt")["input_ids"][0].tolist()
    where = [i for i, t in enumerate(ids) if t == hf.model.config.image_token_id]
    assert where[0] < CHUNK <= where[-1]  # the first chunk ends inside the image
    assert tokens(llm.generate(mm(text, image), GREEDY, use_tqdm=False)) == [hf.greedy(text, [image], TOKENS)]
    # pinned in the encoder cache between its two chunks, let go once its last rows were computed
    assert llm.rank_stats()[0]["encoder_cache_pinned"] == 0


def test_prefix_cache_shares_same_image_never_different_images(llm, hf):
    text = "USER: <image>\nA caption for this one, please, as short as you can. ASSISTANT:"
    first, other = make_image(10), make_image(11)
    expect_first, expect_other = hf.greedy(text, [first], TOKENS), hf.greedy(text, [other], TOKENS)
    llm.llm_engine.reset_prefix_cache()
    assert tokens(llm.generate(mm(text, first), GREEDY, use_tqdm=False)) == [expect_first]
    start = hits(llm)
    # the same placeholders with another image: only the text before the image may be reused
    assert tokens(llm.generate(mm(text, other), GREEDY, use_tqdm=False)) == [expect_other]
    image_start = text.index("<image>")  # a few tokens: less than one block
    assert hits(llm) - start <= image_start
    start = hits(llm)
    assert tokens(llm.generate(mm(text, first), GREEDY, use_tqdm=False)) == [expect_first]
    assert hits(llm) - start >= 32  # the image's blocks were reused


def test_a_broken_image_fails_only_its_prompt(llm):
    images = [make_image(20 + i, (40 + 8 * i, 60)) for i in range(8)]
    prompts = [mm(f"USER: picture {i} <image>\nwhat is it? ASSISTANT:", images[i]) for i in range(8)]
    broken = "data:image/png;base64," + base64.b64encode(b"these bytes are not a png").decode()
    prompts[3] = mm("USER: <image> next to <image>\nwhat is it? ASSISTANT:", [images[3], broken])
    with pytest.raises(ValueError, match=r"prompt 3: image 1: .*not an image") as err:
        llm.generate(prompts, GREEDY, use_tqdm=False)
    outputs = tokens(err.value.outputs)
    assert outputs[3] is None
    solo = [None if i == 3 else tokens(llm.generate(prompts[i], GREEDY, use_tqdm=False))[0] for i in range(8)]
    assert outputs == solo
    assert llm.llm_engine.stats()["image_failures"] >= 1


def test_chat_with_image_url_parts(llm, hf):
    image = make_image(30)
    url = "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "Look: "},
                                              {"type": "image_url", "image_url": {"url": url}},
                                              {"type": "text", "text": "what is it?"}]}]
    text = hf.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "Look: "}, {"type": "image"},
                                      {"type": "text", "text": "what is it?"}]}],
        add_generation_prompt=True, tokenize=False)
    assert tokens(llm.chat(messages, GREEDY, use_tqdm=False)) == [hf.greedy(text, [image], TOKENS)]


def test_too_many_images_and_text_model_are_refused(llm, model_dir):
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        llm.generate(mm("<image>" * 5, [make_image(i) for i in range(5)]), GREEDY, use_tqdm=False)
    text_only = LLM(model_dir, max_model_len=128)
    try:
        with pytest.raises(ValueError, match="does not take images"):
            text_only.generate(mm("hello <image>", make_image(1)), GREEDY, use_tqdm=False)
    finally:
        text_only.shutdown()


def test_preempted_image_requests_recompute_to_the_same_tokens(llava_dir, hf):
    """A KV cache too small for the batch: sequences are preempted and recomputed, their
    images' rows coming back from the encoder cache."""
    tight = LLM(str(llava_dir), max_num_batched_tokens=CHUNK, max_model_len=128, num_kv_blocks=10,
                decode_sequence=False)
    try:
        cases = [(f"USER: <image>\npicture number {i}? ASSISTANT:", [make_image(60 + i, (40 + 10 * i, 50))])
                 for i in range(4)]
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        ours = tokens(tight.generate([mm(t, imgs) for t, imgs in cases], params, use_tqdm=False))
        assert tight.rank_stats()[0]["num_preemptions"] > 0
        assert ours == [hf.greedy(t, imgs, 24) for t, imgs in cases]
    finally:
        tight.shutdown()
