"""The long sweep: 16 prompts with 0, 1 and 2 images of different sizes, repeated images
(encoder and prefix cache hits), chunked prefill and a KV cache small enough to preempt,
for each served family; every output equals transformers' greedy tokens."""

from __future__ import annotations

import pytest
from mm_utils import HFReference, build_tiny_idefics3, build_tiny_llava, make_image

from deepinfer_dp.entrypoints.llm import LLM
from deepinfer_dp.sampling_params import SamplingParams

TOKENS = 12


def sweep_cases() -> list[tuple[str, list]]:
    images = [make_image(70 + i, (32 + 16 * (i % 5), 40 + 12 * (i % 3))) for i in range(6)]
    cases = []
    for i in range(16):
        kind = i % 3
        if kind == 0:
            cases.append((f"USER: text only, number {i}. ASSISTANT:", []))
        elif kind == 1:
            cases.append((f"USER: <image>\nwhat is picture {i}? ASSISTANT:", [images[i % 4]]))
        else:
            cases.append((f"USER: <image> then <image>\ncompare them ({i}). ASSISTANT:",
                          [images[i % 6], images[(i + 1) % 6]]))
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("build", [build_tiny_llava, build_tiny_idefics3], ids=["llava", "idefics3"])
def test_sixteen_prompts_with_preemption_equal_transformers(build, tmp_path_factory):
    model = build(tmp_path_factory.getbasetemp() / f"tiny-{build.__name__}")
    cases = sweep_cases()
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
