"""Speculative decoding through the engine: greedy outputs token-identical with it on and
off (K = 1, 3, 5), including stops inside accepted runs, preemption, mixed batches and the
auto-off; the configuration and its errors. The long SmolLM2 version is marked slow."""

from __future__ import annotations

import pytest
from model_utils import token_ids

from deepinfer_dp import LLM, SamplingParams

GREEDY = dict(temperature=0.0)


def ngram(k: int, **kw) -> dict:
    """Drafting on every step (no auto-off of either kind) unless kw says otherwise: these
    tests check what verification does to the outputs, so the drafts must be there."""
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "disable_by_batch_size": None, "disable_by_acceptance": None, **kw}


def run(llm: LLM, prompts: list[list[int]], params) -> list[list[int]]:
    return token_ids(llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False))


def accepted(llm: LLM) -> int:
    return llm.rank_stats()[0]["spec_decode_num_accepted_tokens"]


class OracleProposer:
    """Drafts each request's known greedy continuation (every third run with its last draft
    wrong), so accepted runs are long and stops fall inside them, which the random tiny
    model's own repetitions would rarely arrange."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]]) -> None:
        self.continuations = continuations
        self.calls = 0

    def propose(self, scheduler, k: int) -> int:
        n = 0
        for seq in scheduler.draft_candidates():
            ids = seq.data.get_token_ids()
            full = self.continuations[tuple(ids[: seq.data.get_prompt_len()])]
            drafts = list(full[seq.data.get_output_len(): seq.data.get_output_len() + k])
            self.calls += 1
            if drafts and self.calls % 3 == 0:
                drafts[-1] = (drafts[-1] + 1) % 300
            scheduler.set_drafts(seq, drafts)
            n += bool(drafts)
        return n


def with_oracle(llm: LLM, prompts: list[list[int]], free: list[list[int]]) -> LLM:
    llm.llm_engine.speculator.proposer = OracleProposer({tuple(p): f for p, f in zip(prompts, free, strict=True)})
    return llm


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_identical_on_and_off(tiny_model_dir, off, prompts, k):
    params = SamplingParams(max_tokens=40, ignore_eos=True, **GREEDY)
    on = LLM(tiny_model_dir, decode_sequence=False, speculative_config=ngram(k))
    assert run(on, prompts, params) == run(off, prompts, params)
    assert accepted(on) > 0  # drafts were verified and kept, so the comparison means something
    assert on.rank_stats()[0]["spec_decode_mean_accepted_length"] > 1


def test_stops_inside_accepted_runs_cut_as_without_speculation(tiny_model_dir, off, prompts):
    free = run(off, prompts, SamplingParams(max_tokens=40, ignore_eos=True, **GREEDY))
    on = with_oracle(LLM(tiny_model_dir, decode_sequence=False, speculative_config=ngram(5)), prompts, free)
    params = []
    for i, out in enumerate(free):  # a stop token, an EOS-like stop and max_tokens at varied depths
        kind = i % 3
        if kind == 0:
            params.append(SamplingParams(max_tokens=40, stop_token_ids=[out[12 + i]], ignore_eos=True, **GREEDY))
        elif kind == 1:
            params.append(SamplingParams(max_tokens=7 + 3 * i, ignore_eos=True, **GREEDY))
        else:
            params.append(SamplingParams(max_tokens=40, min_tokens=4, stop_token_ids=[out[3]], ignore_eos=True,
                                         **GREEDY))
    assert run(on, prompts, params) == run(off, prompts, params)
    assert on.rank_stats()[0]["spec_decode_mean_accepted_length"] > 3


def test_stop_string_inside_an_accepted_run(tiny_model_dir, prompts):
    off = LLM(tiny_model_dir)
    tok = off.get_tokenizer()
    texts = [tok.decode(p) for p in prompts]
    free = off.generate(texts, SamplingParams(max_tokens=40, ignore_eos=True, **GREEDY), use_tqdm=False)
    prompt_ids = [tok(t).input_ids for t in texts]
    on = with_oracle(LLM(tiny_model_dir, speculative_config=ngram(5)), prompt_ids,
                     [tok(f, add_special_tokens=False).input_ids for f in free])
    params = [SamplingParams(max_tokens=40, stop=[t[len(t) // 2: len(t) // 2 + 3]], ignore_eos=True, **GREEDY)
              if t[len(t) // 2: len(t) // 2 + 3].strip() else SamplingParams(max_tokens=40, **GREEDY) for t in free]
    assert on.generate(texts, params, use_tqdm=False) == off.generate(texts, params, use_tqdm=False)
    assert accepted(on) > 0


def test_preempted_runs_identical(tiny_model_dir, prompts):
    params = SamplingParams(max_tokens=30, ignore_eos=True, **GREEDY)
    roomy = LLM(tiny_model_dir, decode_sequence=False, block_size=4, num_kv_blocks=256)
    tight = LLM(tiny_model_dir, decode_sequence=False, block_size=4, num_kv_blocks=30, max_model_len=100,
                speculative_config=ngram(3))
    assert run(tight, prompts, params) == run(roomy, prompts, params)
    stats = tight.rank_stats()[0]
    assert stats["num_preemptions"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0


def test_logprobs_identical_and_seeded_sampling_reproducible(tiny_model_dir, off, prompts):
    on = LLM(tiny_model_dir, decode_sequence=False, speculative_config=ngram(3))
    greedy = SamplingParams(max_tokens=24, ignore_eos=True, **GREEDY)
    seeded = SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)
    with_lp = SamplingParams(max_tokens=24, logprobs=2, ignore_eos=True, **GREEDY)
    penalised = SamplingParams(max_tokens=24, repetition_penalty=1.3, ignore_eos=True, **GREEDY)  # never drafts
    params = [greedy, seeded, with_lp, penalised] * 2
    params = params[: len(prompts)]
    got = on.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    want = off.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    not_seeded = [i for i, p in enumerate(params) if p is not seeded]
    assert [token_ids(got)[i] for i in not_seeded] == [token_ids(want)[i] for i in not_seeded]
    lp = [o.logprob for r in got[2::4] for o in r]
    # (batch shapes differ with drafts in it: the same values up to float summation order)
    assert lp == pytest.approx([o.logprob for r in want[2::4] for o in r], abs=1e-4) and None not in lp
    assert [len(o.top_logprobs[0]) for r in got[2::4] for o in r] == [2] * len(lp)
    again = on.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert token_ids(again) == token_ids(got)  # the same seed, the same tokens, with speculation on
    assert accepted(on) > 0


def test_auto_off_above_the_batch_size(tiny_model_dir, prompts):
    params = SamplingParams(max_tokens=16, ignore_eos=True, **GREEDY)
    on = LLM(tiny_model_dir, decode_sequence=False, speculative_config=ngram(3, disable_by_batch_size=2))
    run(on, prompts, params)  # 7 running: never drafts
    assert on.rank_stats()[0]["spec_decode_num_drafts"] == 0
    run(on, prompts[:2], params)
    assert on.rank_stats()[0]["spec_decode_num_drafts"] > 0


@pytest.mark.parametrize("zos", [True, False])
def test_batch_shrinking_across_the_auto_off_threshold(tiny_model_dir, prompts, zos):
    """ZOS-deferred steps above the threshold, speculative ones below it, in one run."""
    params = [SamplingParams(max_tokens=6 + 6 * i, ignore_eos=True, **GREEDY) for i in range(len(prompts))]
    off = LLM(tiny_model_dir, decode_sequence=False, zos=zos)
    on = LLM(tiny_model_dir, decode_sequence=False, zos=zos, speculative_config=ngram(3, disable_by_batch_size=3))
    assert run(on, prompts, params) == run(off, prompts, params)
    stats = on.rank_stats()[0]
    assert 0 < stats["spec_decode_steps"] < stats["generate_step"]
    assert stats["spec_decode_num_drafts"] > 0


def test_placeholder_step_carries_draft_padding(tiny_model_dir):
    on = LLM(tiny_model_dir, speculative_config=ngram(5))
    inp = on.llm_engine.worker.runner.placeholder_input()
    assert inp.input_ids.numel() == 6 and inp.attn_metadata.slot_mapping.tolist() == list(range(6))
    assert on.llm_engine.step() == []  # nothing to do: a placeholder step through the real forward


@pytest.mark.parametrize("bad, match", [
    ({"method": "ngram"}, "num_speculative_tokens: Field required"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "not available yet"),
    ({"method": "mtp", "num_speculative_tokens": 2}, "method 'mtp' needs a DeepSeek-V3 model"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model: method 'draft_model' needs"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "only method 'draft_model' takes a model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "typo"),
])
def test_bad_speculative_config_names_the_key(tiny_model_dir, bad, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny_model_dir, speculative_config=bad)


def test_k_must_fit_a_block(tiny_model_dir):
    with pytest.raises(ValueError, match="block_size"):
        LLM(tiny_model_dir, block_size=4, speculative_config=ngram(4))


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 3, 5])
def test_smollm2_16_prompts_identical_on_and_off(k):
    off = LLM(decode_sequence=False)
    on = LLM(decode_sequence=False, speculative_config=ngram(k, prompt_lookup_min=2, disable_by_batch_size=None))
    tok = off.get_tokenizer()
    topics = ["the sea", "a robot", "paged attention", "tea", "mountains", "a lighthouse", "prime numbers",
              "rivers"]
    texts = [f"Repeat after me twice: {t} is a topic worth a paragraph." for t in topics] + [
        f"Write a short Python function about {t}, then the same function with comments." for t in topics]
    ids = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True) for t in texts]
    ids = [list(i["input_ids"]) if hasattr(i, "keys") else list(i) for i in ids]
    # EOS is live: some requests end inside an accepted run; max_tokens varies
    params = [SamplingParams(max_tokens=24 + 8 * (i % 4), **GREEDY) for i in range(len(ids))]
    assert run(on, ids, params) == run(off, ids, params)
    assert accepted(on) > 0
