"""A KV cache too small for a request: refused at start-up or at admission, or (in the bare
scheduler) finished with "length" when the sequence fills the whole cache -- never a
request that ends without a final output (issue: `--num-kv-blocks 3 --block-size 16`, a
20-token prompt and max_tokens 30 hung the server and failed offline)."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import types

import httpx
import pytest
from fake_model import FakeModel, add, make_scheduler
from model_utils import prompts_of_lengths
from server_utils import MODEL_NAME, served

from deepinfer_dp import LLM, SamplingParams

PROMPT = prompts_of_lengths([20])[0]
GREEDY = dict(temperature=0.0, ignore_eos=True)
SMALL = dict(num_kv_blocks=3, block_size=16)  # 2 usable blocks: 32 tokens


def _drive(sched, model, zos: bool) -> dict[str, list]:
    """Every output of every request, in order (the worker's protocol, ZOS or not)."""
    outputs: dict[str, list] = {}
    prev = None
    for _ in range(1000):
        if not (sched.has_unfinished_seqs() or prev):
            return outputs
        out = sched.schedule()
        sampled = model.forward(out, prev[1] if prev else None)
        batches = ([prev] if prev else []) + [(out, sampled)]
        prev = batches.pop() if zos and not out.is_prompt and not out.is_empty() else None
        for b in batches:
            for o in sched.process_outputs(*b):
                outputs.setdefault(o.request_id, []).append(o.clone())
    raise AssertionError("the scheduler did not drain")


@pytest.mark.parametrize("zos", [False, True])
@pytest.mark.parametrize("lengths", [[20], [10, 10]])  # the issue's request; two that compete for 2 blocks
def test_bare_scheduler_finishes_a_sequence_that_fills_the_cache(zos, lengths):
    sched = make_scheduler(num_blocks=3, block_size=16, max_model_len=2048)
    assert sched.max_seq_len == 33  # 32 cached positions plus the last sampled token
    for i, n in enumerate(lengths):
        add(sched, f"r{i}", [(i + j) % 50 for j in range(n)], max_tokens=30)
    outputs = _drive(sched, FakeModel(3, 16, 50), zos)
    for i, n in enumerate(lengths):
        outs = outputs[f"r{i}"]
        assert [o.finished for o in outs] == [False] * (32 - n) + [True]  # exactly one final output, last
        assert outs[-1].finish_reason == "length" and outs[-1].output_len == 33 - n
    assert (sched.stats["num_preemptions"] > 0) == (len(lengths) > 1)
    assert sched.num_free_blocks == sched.num_usable_blocks == 2


def test_bare_scheduler_prompt_sizes_at_the_cache_edge():
    sched = make_scheduler(num_blocks=3, block_size=16, max_model_len=2048)
    add(sched, "fits", list(range(32)), max_tokens=5)  # fills the cache; its one token needs no slot
    with pytest.raises(ValueError, match="whole KV cache holds 32 .*2 KV cache blocks of 16"):
        add(sched, "too-long", list(range(33)))
    outputs = _drive(sched, FakeModel(3, 16, 50), zos=True)
    assert [(o.finished, o.finish_reason) for o in outputs["fits"]] == [(True, "length")]


def test_llm_refuses_a_cache_smaller_than_the_context(tiny_model_dir):
    with pytest.raises(ValueError) as err:
        LLM(str(tiny_model_dir), **SMALL)
    msg = str(err.value)
    for part in ("holds 32 tokens (2 blocks of 16 from num_kv_blocks=3", "max_model_len is 512",
                 "--max-model-len (max_model_len, at most 32)", "--kv-cache-memory-gb", "--num-kv-blocks 33"):
        assert part in msg, msg
    with pytest.raises(ValueError, match=r"holds 112 tokens .*from kv_cache_memory_gb=0.0001.*max_model_len is 512"):
        LLM(str(tiny_model_dir), kv_cache_memory_gb=1e-4, block_size=16)  # 12 KiB a block here


def test_llm_refuses_a_cache_larger_than_the_available_memory(tiny_model_dir, monkeypatch):
    # The CPU cache is made resident at allocation: past what the machine has, the OOM killer
    # would end the process, so start-up refuses it by name instead.
    import psutil

    def available(amount):
        return lambda: types.SimpleNamespace(available=amount)

    monkeypatch.setattr(psutil, "virtual_memory", available(2**20))  # 1 MiB
    with pytest.raises(ValueError) as err:
        LLM(str(tiny_model_dir), num_kv_blocks=600, block_size=16)
    msg = str(err.value)
    for part in ("(600 blocks from num_kv_blocks=600)", "0.00 GiB of memory available", "--kv-cache-memory-gb",
                 "--num-kv-blocks"):
        assert part in msg, msg
    monkeypatch.setattr(psutil, "virtual_memory", available(2**40))  # enough: not refused
    llm = LLM(str(tiny_model_dir), num_kv_blocks=600, block_size=16)
    try:
        outs = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=2),
                            use_tqdm=False)
        assert len(outs) == 1 and isinstance(outs[0], str)  # the text of its 2 tokens
    finally:
        llm.shutdown()


def test_llm_refuses_what_cannot_fit_and_finishes_what_can(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), decode_sequence=False, max_model_len=32, **SMALL)
    try:
        with pytest.raises(ValueError, match=r"prompt 0: request '\d+': the prompt has 20 tokens and max_tokens is "
                                             r"30, 50 in all, but the context length \(max_model_len\) is 32"):
            llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(max_tokens=30, **GREEDY),
                         use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()
        for max_tokens in (12, None):  # None: as many as fit
            params = SamplingParams(max_tokens=max_tokens, **GREEDY)
            # Three at once: the cache holds one of them, so they take turns (preemption).
            results = llm.generate(prompt_token_ids=[PROMPT] * 3, sampling_params=params, use_tqdm=False)
            for outs in results:
                assert [o.finished for o in outs] == [False] * 11 + [True] and outs[-1].finish_reason == "length"
        engine = llm.llm_engine
        assert engine.scheduler.num_free_blocks == engine.scheduler.num_usable_blocks == 2
    finally:
        llm.shutdown()


def test_serve_with_the_issues_flags_exits_with_the_reason(tiny_model_dir):
    cmd = [sys.executable, "-m", "deepinfer_dp.entrypoints.cli", "serve", str(tiny_model_dir),
           "--num-kv-blocks", "3", "--block-size", "16", "--port", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "holds 32 tokens" in proc.stderr and "max_model_len is 512" in proc.stderr


def _complete(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT, **body}, timeout=120)


def _stream(url: str, **body) -> tuple[int, list[dict]]:
    with httpx.stream("POST", url + "/v1/completions", timeout=120,
                      json={"model": MODEL_NAME, "prompt": PROMPT, "stream": True, **body}) as r:
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    return r.status_code, [json.loads(x) for x in lines if x != "[DONE]"]


def test_server_with_a_small_cache_answers_every_request(tiny_model_dir):
    with served(str(tiny_model_dir), max_model_len=32, **SMALL) as srv:
        r = _complete(srv.url, max_tokens=30)
        assert r.status_code == 400 and "maximum context length is 32" in r.json()["error"]["message"]
        status, _ = _stream(srv.url, max_tokens=30)
        assert status == 400
        with concurrent.futures.ThreadPoolExecutor(3) as pool:  # more than the cache holds at once
            replies = list(pool.map(lambda _: _complete(srv.url, max_tokens=12, **GREEDY), range(3)))
        for r in replies:
            choice = r.json()["choices"][0]
            assert r.status_code == 200 and choice["finish_reason"] == "length"
            assert r.json()["usage"]["completion_tokens"] == 12
        status, chunks = _stream(srv.url, max_tokens=12, **GREEDY)
        reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert status == 200 and reasons[-1] == "length" and not any(reasons[:-1])
