"""What speculative decoding costs, as reported: the proposer's drafting time in rank_stats()
(it rises with speculation on, and stays 0 with it off and under the auto-off), and a draft
model's KV cache counted in kv_cache_memory_gb (the target gets fewer blocks so that both
caches fit the budget), on tiny random models."""

from __future__ import annotations

import re

import pytest
from model_utils import prompts_of_lengths, token_ids

from deepinfer_dp import LLM, SamplingParams
from deepinfer_dp.models import kv_cache_bytes_per_block
from deepinfer_dp.spec_decode import speculator
from deepinfer_dp.spec_decode.config import SpeculativeConfig

PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
GB = 2**30


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    base = prompts_of_lengths([6, 11, 17, 23, 8, 13, 9], offset=7)
    return [p + p[:5] + p for p in base]  # repetitive: prompt lookup finds drafts


def run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return token_ids(llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS, use_tqdm=False))


def stats(llm: LLM) -> dict:
    return llm.rank_stats()[0]


def cache_bytes(caches) -> int:
    return sum(t.numel() * t.element_size() for layer in caches for t in layer)


def test_draft_time_zero_without_speculation(tiny_model_dir, prompts):
    off = LLM(tiny_model_dir, decode_sequence=False)
    run(off, prompts)
    assert stats(off)["spec_decode_draft_time_s"] == 0.0 and stats(off)["spec_decode_steps"] == 0


def test_draft_time_rises_only_when_drafting(tiny_model_dir, prompts):
    on = LLM(tiny_model_dir, decode_sequence=False,
             speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                 "prompt_lookup_max": 3, "disable_by_batch_size": 2})
    engine = on.llm_engine
    for p in prompts:
        engine.add_request(prompt_token_ids=p, sampling_params=PARAMS)
    engine.step()  # admits all 7 (7 waiting: the auto-off already in force)
    before = stats(on)
    assert engine.scheduler.num_running == len(prompts) > 2
    for _ in range(5):  # the auto-off in force: no lookup, no time
        engine.step()
    after = stats(on)
    assert after["spec_decode_draft_time_s"] == before["spec_decode_draft_time_s"]
    assert after["spec_decode_steps"] == before["spec_decode_steps"] and after["spec_decode_num_drafts"] == 0
    while engine.has_local_unfinished_requests():
        engine.step()
    engine.flush_inflight_reqs()
    run(on, prompts[:2])
    s = stats(on)
    assert s["spec_decode_num_drafts"] > 0 and s["spec_decode_steps"] > after["spec_decode_steps"]
    assert s["spec_decode_draft_time_s"] > after["spec_decode_draft_time_s"]


def test_the_batch_size_auto_off_counts_waiting_requests(tiny_model_dir, prompts):
    # Two requests, limit 1: while the second waits, the first drafts nothing, even when it
    # runs alone (a batch being admitted); once it waits no more, drafting starts.
    on = LLM(tiny_model_dir, decode_sequence=False,
             speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                 "prompt_lookup_max": 3, "disable_by_batch_size": 1})
    engine = on.llm_engine
    engine.add_request(prompt_token_ids=prompts[0], sampling_params=PARAMS)
    engine.step()
    second = engine.add_request(prompt_token_ids=prompts[1], sampling_params=PARAMS)
    drafting_time = stats(on)["spec_decode_draft_time_s"]  # a lookup on the first step, no candidate yet
    for _ in range(3):
        engine.step()
        assert engine.scheduler.num_running + engine.scheduler.num_waiting == 2
    assert stats(on)["spec_decode_steps"] == 0 and stats(on)["spec_decode_draft_time_s"] == drafting_time
    engine.abort_request(second)
    while engine.has_local_unfinished_requests():
        engine.step()
    engine.flush_inflight_reqs()
    assert stats(on)["spec_decode_steps"] > 0


def test_draft_model_time_counts_drafting(tiny_model_dir, draft_dir, prompts):
    on = LLM(tiny_model_dir, decode_sequence=False, speculative_config={
        "method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3,
        "disable_by_batch_size": None})
    run(on, prompts[:2])
    assert stats(on)["spec_decode_num_drafts"] > 0 and stats(on)["spec_decode_draft_time_s"] > 0


def test_passes_over_the_target_count_as_drafting_time(monkeypatch):
    """A draft network's pass over a target forward (on the device thread) adds its time,
    also when it fails."""
    spec = speculator.Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=2))
    clock = iter([10.0, 10.25, 20.0, 21.0])
    monkeypatch.setattr(speculator.time, "perf_counter", lambda: next(clock))
    seen = []
    spec.timed(seen.append)("step")
    assert seen == ["step"] and spec.draft_time_s == 0.25

    def fails(step):
        raise RuntimeError("draft pass failed")
    with pytest.raises(RuntimeError, match="draft pass failed"):
        spec.timed(fails)("step")
    assert spec.draft_time_s == 1.25


def test_draft_model_cache_fits_the_kv_budget(tiny_model_dir, draft_dir, prompts):
    """The same budget: with a draft model the target has fewer blocks, both caches together
    stay within kv_cache_memory_gb and fill it, and outputs are unchanged."""
    budget_gb = 0.004
    plain = LLM(tiny_model_dir, decode_sequence=False, kv_cache_memory_gb=budget_gb, max_model_len=256)
    spec = LLM(tiny_model_dir, decode_sequence=False, kv_cache_memory_gb=budget_gb, max_model_len=256,
               speculative_config={"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3})
    engine, plain_engine = spec.llm_engine, plain.llm_engine
    target = cache_bytes(engine.worker.runner.kv_caches)
    draft = cache_bytes(engine.speculator.proposer.kv_caches)
    budget = int(budget_gb * GB)
    bs = engine.config.block_size
    per_block = kv_cache_bytes_per_block(engine.hf_config, bs, engine.worker.runner.kv_caches[0][0].dtype)
    draft_per_block = draft // (engine.worker.runner.num_blocks + engine.config.max_num_seqs)
    assert 0 < draft_per_block < per_block
    assert cache_bytes(plain_engine.worker.runner.kv_caches) <= budget
    assert target + draft <= budget < target + draft + per_block + draft_per_block  # fits, and fills it
    assert engine.worker.runner.num_blocks < plain_engine.worker.runner.num_blocks
    assert engine.scheduler.num_usable_blocks == engine.worker.runner.num_blocks - 1
    assert run(spec, prompts) == run(plain, prompts)


def test_too_small_budget_names_one_that_holds_both(tiny_model_dir, draft_dir):
    spec = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match="kv_cache_memory_gb") as e:
        LLM(tiny_model_dir, decode_sequence=False, kv_cache_memory_gb=0.001, max_model_len=512,
            speculative_config=spec)
    suggested = float(re.search(r"--kv-cache-memory-gb ([0-9.]+)", str(e.value)).group(1))
    llm = LLM(tiny_model_dir, decode_sequence=False, kv_cache_memory_gb=suggested, max_model_len=512,
              speculative_config=spec)
    assert (llm.llm_engine.worker.runner.num_blocks - 1) * llm.llm_engine.config.block_size >= 512
