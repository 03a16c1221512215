"""The engine against Hugging Face transformers on the default model (greedy, token-identical;
the tiny families are tests/models/test_families.py) and the contracts of its step loop
(docs/architecture.md): ZOS deferral, flush, pooled outputs, bad input, preemption."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
from model_utils import hf_greedy, prompts_of_lengths, token_ids

from deepinfer_dp import _C, LLM, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _smollm2_check(num_topics: int, max_tokens: int) -> None:
    llm = LLM(decode_sequence=False, max_num_batched_tokens=48)
    tok = llm.get_tokenizer()
    topics = ["the sea", "a robot", "data parallel serving", "paged attention", "tea", "mountains",
              "a lighthouse keeper", "prime numbers"][:num_topics]
    texts = [f"Tell me about {t}." for t in topics] + [
        f"Write a long and detailed paragraph number {i} about {t}, covering its history, its uses, "
        f"and why people care about it so much in the modern world." for i, t in enumerate(topics)]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                       tokenize=False) for t in texts]
    ids = [tok(p, add_special_tokens=False).input_ids for p in prompts]
    assert max(len(i) for i in ids) > 48  # some prompts are prefilled in chunks
    params = SamplingParams(max_tokens=max_tokens, **GREEDY)
    ours = token_ids(llm.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False))
    assert ours == hf_greedy(llm.llm_engine.model_dir, ids, max_tokens)


def test_smollm2_matches_transformers_quick():
    _smollm2_check(num_topics=2, max_tokens=24)


@pytest.mark.slow
def test_smollm2_matches_transformers_16_prompts_64_tokens():
    _smollm2_check(num_topics=8, max_tokens=64)


def test_batch_invariance(tiny_model_dir):
    llm = LLM(tiny_model_dir, decode_sequence=False)
    params = SamplingParams(max_tokens=16, **GREEDY)
    target = prompts_of_lengths([21])[0]
    alone = token_ids(llm.generate(prompt_token_ids=[target], sampling_params=params, use_tqdm=False))[0]
    batch = prompts_of_lengths(list(range(5, 36)), offset=50) + [target]
    together = token_ids(llm.generate(prompt_token_ids=batch, sampling_params=params, use_tqdm=False))
    assert together[-1] == alone


@pytest.mark.parametrize("zos", [True, False])
def test_every_request_gets_exactly_max_tokens(tiny_model_dir, zos):
    llm = LLM(tiny_model_dir, decode_sequence=False, zos=zos)
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in (1, 2, 7, 19)]
    results = llm.generate(prompt_token_ids=prompts_of_lengths([4, 8, 15, 16]), sampling_params=params,
                           use_tqdm=False)
    assert [len(r) for r in results] == [1, 2, 7, 19]
    for r in results:
        assert [o.finished for o in r] == [False] * (len(r) - 1) + [True]
        assert r[-1].finish_reason == "length"
        assert [o.output_len for o in r] == list(range(1, len(r) + 1))


def _drive(engine, steps: int) -> list[list[tuple[str, int]]]:
    return [[(o.request_id, o.output_len) for o in engine.step()] for _ in range(steps)]


def test_zos_decode_step_returns_previous_tokens_and_flush_returns_last(tiny_model_dir):
    llm = LLM(tiny_model_dir, zos=True)
    engine = llm.llm_engine
    rid = engine.add_request(prompt_token_ids=[5, 6, 7], sampling_params=SamplingParams(max_tokens=10, **GREEDY))
    per_step = _drive(engine, 4)
    assert per_step[0] == [(rid, 1)]  # prefill: its own token at once
    assert per_step[1] == []  # first decode step: deferred, nothing yet
    assert per_step[2] == [(rid, 2)]  # the previous step's token
    assert per_step[3] == [(rid, 3)]
    assert [(o.request_id, o.output_len) for o in engine.flush_inflight_reqs()] == [(rid, 4)]
    assert engine.flush_inflight_reqs() == []  # drained exactly once
    engine.abort_request(rid)


def _gated_forward(engine, gate: threading.Event, done: list, fail: bool = False):
    """Wraps the runner's forward so decode steps wait for `gate` (or raise)."""
    inner = engine.worker.runner.forward

    def forward(inp):
        if not inp.attn_metadata.is_prefill:
            gate.wait(timeout=30)
            if fail:
                raise RuntimeError("forward failed on purpose")
        out = inner(inp)
        done.append(True)
        return out
    engine.worker.runner.forward = forward


def test_zos_decode_step_returns_while_its_forward_runs(tiny_model_dir):
    # On CPU the host is free during a deferred step's forward (for the DP vote, scheduling).
    engine = LLM(tiny_model_dir, zos=True).llm_engine
    rid = engine.add_request(prompt_token_ids=[5, 6, 7], sampling_params=SamplingParams(max_tokens=4, **GREEDY))
    engine.step()  # prefill
    gate, done = threading.Event(), []
    _gated_forward(engine, gate, done)
    assert engine.step() == []
    assert done == []  # returned with its forward still waiting at the gate
    gate.set()
    assert [(o.request_id, o.output_len) for o in engine.flush_inflight_reqs()] == [(rid, 2)]


def test_error_in_a_deferred_forward_is_raised_not_lost(tiny_model_dir):
    engine = LLM(tiny_model_dir, zos=True).llm_engine
    engine.add_request(prompt_token_ids=[5, 6, 7], sampling_params=SamplingParams(max_tokens=4, **GREEDY))
    engine.step()
    gate, done = threading.Event(), []
    gate.set()
    _gated_forward(engine, gate, done, fail=True)
    engine.step()  # the failure is in flight
    with pytest.raises(RuntimeError, match="on purpose"):
        engine.flush_inflight_reqs()


def test_zos_off_each_step_returns_its_own_tokens(tiny_model_dir):
    llm = LLM(tiny_model_dir, zos=False)
    engine = llm.llm_engine
    rid = engine.add_request(prompt_token_ids=[5, 6, 7], sampling_params=SamplingParams(max_tokens=10, **GREEDY))
    assert _drive(engine, 4) == [[(rid, 1)], [(rid, 2)], [(rid, 3)], [(rid, 4)]]
    assert engine.flush_inflight_reqs() == []
    engine.abort_request(rid)


def test_zos_on_and_off_give_the_same_tokens(tiny_model_dir):
    params = SamplingParams(max_tokens=9, **GREEDY)
    prompts = prompts_of_lengths([3, 30, 12])
    a = LLM(tiny_model_dir, decode_sequence=False, zos=True).generate(
        prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    b = LLM(tiny_model_dir, decode_sequence=False, zos=False).generate(
        prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert token_ids(a) == token_ids(b)


def test_pooled_output_read_after_next_step_raises(tiny_model_dir):
    engine = LLM(tiny_model_dir, zos=False).llm_engine
    engine.add_request(prompt_token_ids=[5, 6], sampling_params=SamplingParams(max_tokens=5, **GREEDY))
    raw = engine.step()[0]
    kept = raw.clone()
    engine.step()
    with pytest.raises(_C.ReleasedOutputError, match="clone"):
        _ = raw.token_id
    assert kept.output_len == 1


def test_out_of_vocab_prompt_raises_and_loses_nothing(tiny_model_dir):
    llm = LLM(tiny_model_dir, decode_sequence=False)
    vocab = llm.llm_engine.vocab_size
    params = SamplingParams(max_tokens=3, **GREEDY)
    with pytest.raises(ValueError, match=rf"prompt 1: .*token id {vocab} .*outside the vocabulary"):
        llm.generate(prompt_token_ids=[[5, 6], [7, vocab], [8]], sampling_params=params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.scheduler.num_free_blocks == llm.llm_engine.scheduler.num_usable_blocks
    results = llm.generate(prompt_token_ids=[[5, 6], [8]], sampling_params=params, use_tqdm=False)
    assert [len(r) for r in results] == [3, 3]


@pytest.mark.parametrize("prompt, match", [([], "empty"), ([5 + i % 300 for i in range(600)], "context length")])
def test_bad_prompts_name_the_problem(tiny_model_dir, prompt, match):
    llm = LLM(tiny_model_dir, max_model_len=512)
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt_token_ids=[prompt], use_tqdm=False)


def test_preemption_under_tiny_cache_gives_same_tokens(tiny_model_dir):
    params = SamplingParams(max_tokens=24, **GREEDY)
    prompts = prompts_of_lengths([10, 14, 6, 20, 9, 12])
    roomy = LLM(tiny_model_dir, decode_sequence=False, block_size=4, num_kv_blocks=256)
    # 19 usable blocks of 4 hold 76 tokens: max_model_len must fit in them (start-up check).
    tight = LLM(tiny_model_dir, decode_sequence=False, block_size=4, num_kv_blocks=20, max_model_len=64)
    expected = token_ids(roomy.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False))
    got = token_ids(tight.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False))
    assert tight.llm_engine.scheduler.stats["num_preemptions"] > 0
    assert got == expected


def test_stop_string_cuts_text_and_finishes(tiny_model_dir):
    llm = LLM(tiny_model_dir)
    free = llm.generate(["The quick brown"], SamplingParams(max_tokens=24, **GREEDY), use_tqdm=False)[0]
    stop = free[len(free) // 2: len(free) // 2 + 3]
    assert stop.strip()
    cut = llm.generate(["The quick brown"], SamplingParams(max_tokens=24, stop=[stop], **GREEDY), use_tqdm=False)[0]
    assert cut == free[: free.index(stop)]
    llm.decode_sequence = False
    outs = llm.generate(["The quick brown"], SamplingParams(max_tokens=24, stop=[stop], **GREEDY), use_tqdm=False)[0]
    assert outs[-1].finish_reason == "stop" and len(outs) < 24


def test_logprobs_and_seeded_sampling(tiny_model_dir):
    llm = LLM(tiny_model_dir, decode_sequence=False)
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=123, logprobs=0, ignore_eos=True)
    a = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=seeded, use_tqdm=False)[0]
    mixed = [SamplingParams(max_tokens=8, temperature=0.7, seed=i, ignore_eos=True) for i in range(5)] + [seeded]
    b = llm.generate(prompt_token_ids=prompts_of_lengths([4, 5, 6, 7, 8]) + [[5, 6, 7]],
                     sampling_params=mixed, use_tqdm=False)[-1]
    assert [o.token_id for o in a] == [o.token_id for o in b]
    assert all(o.logprob is not None and o.logprob <= 0.0 for o in a)


def test_n_returns_several_different_reproducible_completions(tiny_model_dir):
    llm = LLM(tiny_model_dir, decode_sequence=False)
    params = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=1, ignore_eos=True)
    (samples,) = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=params, use_tqdm=False)
    got = token_ids(samples)
    assert len(got) == 3 and len({tuple(t) for t in got}) > 1  # the samples differ from each other
    # ...because sample i is seeded seed + i: each equals a single request with that seed
    singles = [SamplingParams(max_tokens=8, temperature=1.0, seed=1 + i, ignore_eos=True) for i in range(3)]
    alone = llm.generate(prompt_token_ids=[[5, 6, 7]] * 3, sampling_params=singles, use_tqdm=False)
    assert got == token_ids(alone)
    texts = LLM(tiny_model_dir).generate(["hello"], SamplingParams(n=3, max_tokens=5, seed=1), use_tqdm=False)
    assert len(texts) == 1 and len(texts[0]) == 3 and all(isinstance(t, str) for t in texts[0])


def test_chat_applies_template(tiny_model_dir):
    llm = LLM(tiny_model_dir, decode_sequence=False)
    params = SamplingParams(max_tokens=3, **GREEDY)
    res = llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False)
    tok = llm.get_tokenizer()
    templated = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                        tokenize=False)
    ids = tok(templated, add_special_tokens=False).input_ids
    assert len(ids) > len(tok("hi").input_ids)  # the template adds the role markers
    assert res[0][0].prompt_len == len(ids)  # the engine saw the templated prompt, not the bare text
    assert token_ids(res) == token_ids(llm.generate(prompt_token_ids=[ids], sampling_params=params, use_tqdm=False))


def test_abort_frees_blocks(tiny_model_dir):
    engine = LLM(tiny_model_dir).llm_engine
    start = engine.scheduler.num_free_blocks
    rids = [engine.add_request(prompt_token_ids=list(range(5, 40)),
                               sampling_params=SamplingParams(max_tokens=50, **GREEDY)) for _ in range(3)]
    for _ in range(3):
        engine.step()
    assert engine.scheduler.num_free_blocks < start
    assert engine.abort_request(rids) == rids
    engine.flush_inflight_reqs()
    assert engine.scheduler.num_free_blocks == start
    assert not engine.has_unfinished_requests()


def test_cli_generate_runs(tiny_model_dir):
    res = subprocess.run([sys.executable, "-m", "deepinfer_dp.entrypoints.cli", "generate", "--model",
                          str(tiny_model_dir), "--prompt", "hello", "--max-tokens", "4", "--no-progress"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip()
    bad = subprocess.run([sys.executable, "-m", "deepinfer_dp.entrypoints.cli", "generate", "--model",
                          "/nonexistent/model", "--prompt", "x"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "does not exist" in bad.stderr
