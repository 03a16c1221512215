"""The long sweep: 16 prompts with 0, 1 and 2 images of different sizes, repeated images
(encoder and prefix cache hits), chunked prefill and a KV cache small enough to preempt,
for each served family; every output equals transformers' greedy tokens."""

from __future__ import annotations

import functools

import pytest
from mm_utils import HFReference, build_tiny_idefics3, build_tiny_llava, make_image
from qwen_vl_utils import build_tiny_qwen_vl

from deepinfer_dp.entrypoints.llm import LLM
from deepinfer_dp.sampling_params import SamplingParams

TOKENS = 12


QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
FAMILIES = {  # builder, prompt format, image placeholder
    "llava": (build_tiny_llava, "USER: {}ASSISTANT:", "<image>"),
    "idefics3": (build_tiny_idefics3, "USER: {}ASSISTANT:", "<image>"),
    "qwen2_vl": (functools.partial(build_tiny_qwen_vl, family="qwen2_vl"),
                 "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n", QWEN_IMAGE),
    "qwen2_5_vl": (functools.partial(build_tiny_qwen_vl, family="qwen2_5_vl"),
                   "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n", QWEN_IMAGE),
}


def sweep_cases(prompt: str = "USER: {}ASSISTANT:", image: str = "<image>") -> list[tuple[str, list]]:
    images = [make_image(70 + i, (32 + 16 * (i % 5), 40 + 12 * (i % 3))) for i in range(6)]
    cases = []
    for i in range(16):
        kind = i % 3
        if kind == 0:
            cases.append((prompt.format(f"text only, number {i}. "), []))
        elif kind == 1:
            cases.append((prompt.format(f"{image}\nwhat is picture {i}? "), [images[i % 4]]))
        else:
            cases.append((prompt.format(f"{image} then {image}\ncompare them ({i}). "),
                          [images[i % 6], images[(i + 1) % 6]]))
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_sixteen_prompts_with_preemption_equal_transformers(family, tmp_path_factory):
    build, prompt, image = FAMILIES[family]
    model = build(tmp_path_factory.getbasetemp() / f"tiny-sweep-{family}")
    cases = sweep_cases(prompt, image)
    hf = HFReference(model)
    expected = [hf.greedy(t, imgs, TOKENS) for t, imgs in cases]
    llm = LLM(str(model), max_num_batched_tokens=32, max_model_len=256, num_kv_blocks=24, decode_sequence=False)
    try:
        params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
        results = llm.generate([{"prompt": t, "multi_modal_data": {"image": imgs}} for t, imgs in cases], params,
                               use_tqdm=False)
        stats = llm.rank_stats()[0]
    finally:
        llm.shutdown()
    assert [[t for o in r for t in o.token_ids] for r in results] == expected
    assert stats["num_preemptions"] > 0 and stats["encoder_cache_hits"] > 0 and stats["prefix_hit_tokens"] > 0
