"""Speculative decoding with a draft model, on tiny random models (the default run): greedy
outputs token-identical with it on and off (K = 1, 3, 5; stops inside accepted runs;
preemption; prefix caching; ZOS on and off), the target drafting for itself accepts every
draft, sampling is lossless with q != p (chi-square), seeds reproduce, and a draft model of
another tokenizer is refused by name. The SmolLM2 versions are in
test_spec_decode_draft_smollm2.py (slow)."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from model_utils import tiny_config, token_ids, write_tiny_model
from safetensors.torch import load_file, save_file
from test_spec_decode_sampling import NUM, chi_square_p, first_three

from deepinfer_dp import LLM, SamplingParams

GREEDY = dict(temperature=0.0)


def draft(path, k: int, **kw) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k,
            "disable_by_batch_size": None, "disable_by_acceptance": None, **kw}


def perturbed_copy(src: Path, out: Path, scale: float, seed: int = 1) -> Path:
    """The model at `src` with noise on every weight: a different model whose distributions
    overlap the original's (a random model's top tokens would share none with it)."""
    if (out / "config.json").is_file():
        return out
    shutil.copytree(src, out)
    gen = torch.Generator().manual_seed(seed)
    tensors = load_file(out / "model.safetensors")
    save_file({n: t + scale * t.std() * torch.randn(t.shape, generator=gen) for n, t in tensors.items()},
              out / "model.safetensors", metadata={"format": "pt"})
    return out


def run(llm: LLM, prompts: list[list[int]], params) -> list[list[int]]:
    return token_ids(llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False))


def stats(llm: LLM) -> dict:
    return llm.rank_stats()[0]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_identical_with_a_draft_model(tiny_model_dir, draft_dir, off, prompts, k):
    params = SamplingParams(max_tokens=30, ignore_eos=True, **GREEDY)
    on = LLM(tiny_model_dir, decode_sequence=False, speculative_config=draft(draft_dir, k))
    assert run(on, prompts, params) == run(off, prompts, params)
    assert stats(on)["spec_decode_num_drafts"] > 0


@pytest.mark.parametrize("zos", [True, False])
def test_target_drafting_for_itself_accepts_everything(tiny_model_dir, off, prompts, zos):
    """Stops (a stop token, max_tokens, EOS-like) fall inside accepted runs, and every
    draft is accepted: the draft's cache holds exactly the target's K/V."""
    free = run(off, prompts, SamplingParams(max_tokens=30, ignore_eos=True, **GREEDY))
    params = [SamplingParams(max_tokens=30, stop_token_ids=[out[10 + i]], ignore_eos=True, **GREEDY) if i % 2
              else SamplingParams(max_tokens=7 + 3 * i, ignore_eos=True, **GREEDY) for i, out in enumerate(free)]
    on = LLM(tiny_model_dir, decode_sequence=False, zos=zos, speculative_config=draft(tiny_model_dir, 4))
    assert run(on, prompts, params) == run(off, prompts, params)
    s = stats(on)
    assert s["spec_decode_num_draft_tokens"] > 0 and s["spec_decode_acceptance_rate"] == 1.0


@pytest.mark.parametrize("zos", [True, False])
def test_draft_catches_up_over_steps_with_speculation_off(tiny_model_dir, off, prompts, zos):
    """Above the auto-off threshold the draft skips the target's passes (ZOS-deferred or
    not); once the batch shrinks it catches up first, so drafting for itself still keeps
    every draft."""
    params = [SamplingParams(max_tokens=6 + 6 * i, ignore_eos=True, **GREEDY) for i in range(len(prompts))]
    on = LLM(tiny_model_dir, decode_sequence=False, zos=zos,
             speculative_config=draft(tiny_model_dir, 3, disable_by_batch_size=3))
    assert run(on, prompts, params) == run(off, prompts, params)
    s = stats(on)
    assert 0 < s["spec_decode_steps"] < s["generate_step"]
    assert s["spec_decode_num_draft_tokens"] > 0 and s["spec_decode_acceptance_rate"] == 1.0


def test_preempted_and_prefix_cached_runs_identical(tiny_model_dir, draft_dir, prompts):
    params = SamplingParams(max_tokens=30, ignore_eos=True, **GREEDY)
    roomy = LLM(tiny_model_dir, decode_sequence=False, block_size=4, num_kv_blocks=256)
    tight = LLM(tiny_model_dir, decode_sequence=False, block_size=4, num_kv_blocks=30, max_model_len=100,
                speculative_config=draft(tiny_model_dir, 3))
    shared = [p[:12] + q for p, q in zip(prompts, prompts[::-1], strict=True)]  # common prefixes, cached
    for batch in (prompts, shared, shared):
        assert run(tight, batch, params) == run(roomy, batch, params)
    s = stats(tight)
    assert s["num_preemptions"] > 0 and s["spec_decode_acceptance_rate"] == 1.0
    other = LLM(tiny_model_dir, decode_sequence=False, block_size=4, num_kv_blocks=30, max_model_len=100,
                speculative_config=draft(draft_dir, 3))
    assert run(other, prompts, params) == run(roomy, prompts, params)


def test_sampling_with_a_draft_distribution_is_lossless(tiny_model_dir, tmp_path_factory):
    engine = dict(decode_sequence=False, max_num_seqs=256)
    near = perturbed_copy(tiny_model_dir, tmp_path_factory.getbasetemp() / "tiny-perturbed", 0.05)
    on = LLM(tiny_model_dir, speculative_config=draft(near, 2), **engine)
    off = LLM(tiny_model_dir, **engine)
    with_spec, without = first_three(on, 0), first_three(off, 10**6)
    s = stats(on)
    # drafts from a different model are kept often but not always: both branches are exercised
    assert 0.2 < s["spec_decode_acceptance_rate"] < 0.9, s["spec_decode_acceptance_rate"]
    assert chi_square_p(with_spec, without) > 1e-3, (with_spec.most_common(5), without.most_common(5))
    biased = Counter(with_spec)  # the test can see a bias of this size
    biased[with_spec.most_common(1)[0][0]] += NUM // 4
    assert chi_square_p(biased, without) < 1e-3


def test_seeded_sampling_reproducible_with_a_draft_model(tiny_model_dir, draft_dir, prompts):
    on = LLM(tiny_model_dir, decode_sequence=False, speculative_config=draft(draft_dir, 3))
    params = [SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=100 + i, ignore_eos=True)
              for i in range(len(prompts))]
    first = run(on, prompts, params)
    assert run(on, prompts, params) == first
    assert stats(on)["spec_decode_num_accepted_tokens"] > 0
    assert len({tuple(t) for t in first}) == len(first)


def test_a_draft_model_of_another_tokenizer_is_refused(tiny_model_dir, tmp_path):
    def bigger(vocab_size):
        return tiny_config("llama-gqa", vocab_size + 8)
    other = write_tiny_model(bigger, tmp_path / "other-vocab")
    with pytest.raises(ValueError, match="speculative_config.model.*vocabulary"):
        LLM(tiny_model_dir, speculative_config=draft(other, 2))
    with pytest.raises(ValueError, match="model: method 'draft_model' needs"):
        LLM(tiny_model_dir, speculative_config={"method": "draft_model", "num_speculative_tokens": 2})

