"""Qwen2-VL and Qwen2.5-VL on the engine: greedy tokens equal transformers' with 0, 1 and 2
images of different sizes (M-RoPE positions in prefill, the prompt's delta in decode steps,
which run the C++ decode stack), chunked prefill splitting an image, the prefix cache
sharing a repeated image and never a different one, preemption, the published and
transformers 5 checkpoint layouts, and chat with image_url parts."""

from __future__ import annotations

import base64

import pytest
from mm_utils import HFReference, make_image, png_bytes
from qwen_vl_utils import build_tiny_qwen_vl, to_transformers5_layout

from deepinfer_dp.entrypoints.llm import LLM
from deepinfer_dp.models import llama_cpu_decode
from deepinfer_dp.sampling_params import SamplingParams

TOKENS = 6
CHUNK = 16  # max_num_batched_tokens: prompts of 20-50 tokens are prefilled in 2-4 chunks
GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
V = "<|vision_start|><|image_pad|><|vision_end|>"


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def mm(text: str, images) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": images}}


def tokens(results) -> list[list[int]]:
    return [[t for o in r for t in o.token_ids] for r in results]


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def family(request, tmp_path_factory):
    model = build_tiny_qwen_vl(tmp_path_factory.getbasetemp() / f"tiny-{request.param}", request.param)
    llm = LLM(str(model), max_num_batched_tokens=CHUNK, max_model_len=256, decode_sequence=False)
    yield model, llm, HFReference(model)
    llm.shutdown()


def test_greedy_tokens_equal_transformers_with_0_1_2_images(family, monkeypatch):
    _, llm, hf = family
    calls = []
    original = llama_cpu_decode.LlamaCpuDecode.__call__
    monkeypatch.setattr(llama_cpu_decode.LlamaCpuDecode, "__call__",
                        lambda self, ids, pos, md: calls.append(pos.ndim) or original(self, ids, pos, md))
    a, b, c = make_image(1, (112, 112)), make_image(2, (30, 90)), make_image(3, (120, 40))
    cases = [(chat(f"{V}What is in the picture?"), [a]),
             (chat(f"compare {V} with {V} are they the same?"), [b, c]),
             (chat("no picture, just text."), []),
             (chat(f"{V}and again"), [a])]  # the same image: an encoder cache hit
    ours = tokens(llm.generate([mm(t, imgs) for t, imgs in cases], GREEDY, use_tqdm=False))
    assert ours == [hf.greedy(t, imgs, TOKENS) for t, imgs in cases]
    assert calls and set(calls) == {1}  # decode steps ran the C++ stack, on one position row
    assert llm.rank_stats()[0]["encoder_cache_hits"] > 0


def test_chunked_prefill_splits_the_image_tokens(family):
    _, llm, hf = family
    text = chat(f"Hello there, world! {V}Describe it.")
    image = make_image(4, (112, 84))
    ids = hf.processor(text=[text], images=[image], return_tensors="pt")["input_ids"][0].tolist()
    where = [i for i, t in enumerate(ids) if t == hf.model.config.image_token_id]
    assert where[0] < CHUNK <= where[-1]  # the first chunk ends inside the image
    assert tokens(llm.generate(mm(text, image), GREEDY, use_tqdm=False)) == [hf.greedy(text, [image], TOKENS)]


def test_prefix_cache_shares_same_image_never_different_images(family):
    _, llm, hf = family
    text = chat(f"{V}A caption for this one, please, as short as you can.")
    first, other = make_image(10, (112, 112)), make_image(11, (112, 112))
    expect_first, expect_other = hf.greedy(text, [first], TOKENS), hf.greedy(text, [other], TOKENS)
    llm.llm_engine.reset_prefix_cache()
    assert tokens(llm.generate(mm(text, first), GREEDY, use_tqdm=False)) == [expect_first]
    hits = llm.rank_stats()[0]["prefix_hit_tokens"]
    assert tokens(llm.generate(mm(text, other), GREEDY, use_tqdm=False)) == [expect_other]
    assert llm.rank_stats()[0]["prefix_hit_tokens"] - hits < 16  # not past the image's first block
    hits = llm.rank_stats()[0]["prefix_hit_tokens"]
    assert tokens(llm.generate(mm(text, first), GREEDY, use_tqdm=False)) == [expect_first]
    assert llm.rank_stats()[0]["prefix_hit_tokens"] - hits >= 16  # the image's blocks were reused


def test_chat_with_image_url_parts(family):
    _, llm, hf = family
    image = make_image(30, (84, 56))
    url = "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "Look: "},
                                              {"type": "image_url", "image_url": {"url": url}},
                                              {"type": "text", "text": "what is it?"}]}]
    text = chat(f"Look: {V}what is it?")
    assert tokens(llm.chat(messages, GREEDY, use_tqdm=False)) == [hf.greedy(text, [image], TOKENS)]


def test_preemption_and_transformers5_layout(family, tmp_path):
    """A KV cache too small for the batch (sequences preempted and recomputed: their rows
    past the prompt at position + delta), loaded from transformers 5's tensor names."""
    model, _, hf = family
    renamed = to_transformers5_layout(model, tmp_path / "t5")
    tight = LLM(str(renamed), max_num_batched_tokens=CHUNK, max_model_len=128, num_kv_blocks=10,
                decode_sequence=False)
    try:
        cases = [(chat(f"{V}picture number {i}?"), [make_image(60 + i, (56 + 28 * i, 84))]) for i in range(3)]
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        ours = tokens(tight.generate([mm(t, imgs) for t, imgs in cases], params, use_tqdm=False))
        assert tight.rank_stats()[0]["num_preemptions"] > 0
        assert ours == [hf.greedy(t, imgs, 24) for t, imgs in cases]
    finally:
        tight.shutdown()
