"""Speculative decoding with a draft model on SmolLM2 (slow): greedy outputs token-identical
with it on and off for 16 prompts at K = 1, 3, 5 (EOS live, max_tokens and stop strings
falling inside accepted runs), a preempted run, and SmolLM2 drafting for itself accepts
every draft. The draft for the identity checks is a layer-skip draft: SmolLM2's first 8
layers (benchmarks/layer_skip_draft.py), which is right often but not always."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from model_utils import token_ids

from deepinfer_dp import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from layer_skip_draft import write_layer_skip_draft  # noqa: E402

pytestmark = pytest.mark.slow
GREEDY = dict(temperature=0.0)
TOPICS = ["the sea", "a robot", "paged attention", "tea", "mountains", "a lighthouse", "prime numbers", "rivers"]


def spec(model, k: int) -> dict:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k, "disable_by_batch_size": None,
            "disable_by_acceptance": None}


@pytest.fixture(scope="module")
def layer_skip(tmp_path_factory) -> Path:
    return write_layer_skip_draft(None, tmp_path_factory.getbasetemp() / "smollm2-first8", 8)


@pytest.fixture(scope="module")
def off() -> LLM:
    return LLM(decode_sequence=False)


@pytest.fixture(scope="module")
def prompts(off) -> list[list[int]]:
    tok = off.get_tokenizer()
    texts = [f"Repeat after me twice: {t} is a topic worth a paragraph." for t in TOPICS] + [
        f"Write a short Python function about {t}, then the same function with comments." for t in TOPICS]
    ids = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True) for t in texts]
    return [list(i["input_ids"]) if hasattr(i, "keys") else list(i) for i in ids]


def run(llm: LLM, ids: list[list[int]], params) -> list[list[int]]:
    return token_ids(llm.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False))


@pytest.mark.parametrize("k", [1, 3, 5])
def test_smollm2_layer_skip_draft_identical(off, prompts, layer_skip, k):
    # EOS is live: some requests end inside an accepted run; max_tokens varies
    params = [SamplingParams(max_tokens=24 + 8 * (i % 4), **GREEDY) for i in range(len(prompts))]
    on = LLM(decode_sequence=False, speculative_config=spec(layer_skip, k))
    assert run(on, prompts, params) == run(off, prompts, params)
    s = on.rank_stats()[0]
    assert 0 < s["spec_decode_acceptance_rate"] < 1, s["spec_decode_acceptance_rate"]


def test_smollm2_stop_strings_and_preemption(off, prompts, layer_skip):
    tok = off.get_tokenizer()
    free = off.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=32, **GREEDY),
                        use_tqdm=False)
    texts = [tok.decode([o.token_id for o in r]) for r in free]
    params = [SamplingParams(max_tokens=32, stop=[t[len(t) // 2: len(t) // 2 + 4]], **GREEDY)
              if t[len(t) // 2: len(t) // 2 + 4].strip() else SamplingParams(max_tokens=32, **GREEDY) for t in texts]
    tight = LLM(decode_sequence=False, num_kv_blocks=40, max_model_len=256, speculative_config=spec(layer_skip, 3))
    assert run(tight, prompts, params) == run(off, prompts, params)
    assert tight.rank_stats()[0]["num_preemptions"] > 0


def test_smollm2_drafting_for_itself_accepts_everything(off, prompts):
    from deepinfer_dp.models.default_model import default_model_path

    params = [SamplingParams(max_tokens=24 + 8 * (i % 4), **GREEDY) for i in range(len(prompts))]
    on = LLM(decode_sequence=False, speculative_config=spec(default_model_path(), 3))
    assert run(on, prompts, params) == run(off, prompts, params)
    s = on.rank_stats()[0]
    assert s["spec_decode_num_draft_tokens"] > 100 and s["spec_decode_acceptance_rate"] == 1.0
