"""Top-k logprobs, prompt logprobs, logit_bias and stop_token_ids through the offline engine,
checked against a direct torch computation on the Hugging Face model with the same weights."""

from __future__ import annotations

import msgspec
import pytest
import torch
from model_utils import prompts_of_lengths
from transformers import AutoModelForCausalLM

from deepinfer_dp import LLM, SamplingParams
from deepinfer_dp.cluster import protocol as p
from deepinfer_dp.engine.client import TokenDelta

GREEDY = dict(temperature=0.0, ignore_eos=True)
TOL = 2e-3  # fp32 on both sides; kernels differ in summation order


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    engine = LLM(tiny_model_dir, decode_sequence=False, max_num_batched_tokens=32, block_size=4)
    yield engine
    engine.shutdown()


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of the logits at every position of `ids` [len(ids), vocab]."""
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)


def test_top_logprobs_equal_log_softmax(llm, hf_model):
    prompt = prompts_of_lengths([11])[0]
    outs = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=6, logprobs=5, **GREEDY),
                        use_tqdm=False)[0]
    full = prompt + [o.token_id for o in outs]
    ref = hf_logprobs(hf_model, full)
    for step, out in enumerate(outs):
        row = ref[len(prompt) - 1 + step]
        want = row.topk(5)
        top = out.top_logprobs[0]
        assert list(top) == want.indices.tolist()  # best first
        assert list(top.values()) == pytest.approx(want.values.tolist(), abs=TOL)
        assert out.logprob == pytest.approx(row[out.token_id].item(), abs=TOL)
        assert out.token_id == want.indices[0].item()  # greedy picks the best


def test_rows_asking_fewer_alternatives_get_fewer(llm):
    prompts = prompts_of_lengths([5, 7, 9])
    params = [SamplingParams(max_tokens=3, logprobs=k, **GREEDY) for k in (0, 2, 7)]
    results = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert all(o.top_logprobs is None and o.logprob is not None for o in results[0])
    assert all(len(o.top_logprobs[0]) == 2 for o in results[1])
    assert all(len(o.top_logprobs[0]) == 7 for o in results[2])


@pytest.mark.parametrize("prefix_cached", [False, True])
def test_prompt_logprobs_equal_transformers(llm, hf_model, prefix_cached):
    """Chunked prefill (32-token budget, 4-token blocks) over a 45-token prompt; with
    prefix_cached the same prompt ran before, so its blocks are in the prefix cache, which a
    request asking for prompt logprobs must not read (they would be missing)."""
    prompt = prompts_of_lengths([45])[0]
    if prefix_cached:
        llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)
    params = SamplingParams(max_tokens=2, prompt_logprobs=3, **GREEDY)
    first = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0][0]
    ref = hf_logprobs(hf_model, prompt)
    assert first.prompt_logprobs[0] is None and first.prompt_top_logprobs[0] is None
    assert len(first.prompt_logprobs) == len(prompt)
    want = [ref[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    assert first.prompt_logprobs[1:] == pytest.approx(want, abs=TOL)
    for i in range(1, len(prompt)):
        top = ref[i - 1].topk(3)
        assert list(first.prompt_top_logprobs[i]) == top.indices.tolist()
        assert list(first.prompt_top_logprobs[i].values()) == pytest.approx(top.values.tolist(), abs=TOL)


def test_prompt_logprobs_only_on_the_first_output_and_survive_preemption(tiny_model_dir, hf_model):
    params = SamplingParams(max_tokens=20, prompt_logprobs=0, **GREEDY)
    prompts = prompts_of_lengths([10, 14, 6, 20, 9, 12])
    tight = LLM(tiny_model_dir, decode_sequence=False, block_size=4, num_kv_blocks=20, max_model_len=64)
    results = tight.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert tight.llm_engine.scheduler.stats["num_preemptions"] > 0
    for prompt, outs in zip(prompts, results, strict=True):
        assert all(o.prompt_logprobs is None for o in outs[1:])
        ref = hf_logprobs(hf_model, prompt)
        want = [ref[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
        assert outs[0].prompt_logprobs[1:] == pytest.approx(want, abs=TOL)
        assert outs[0].prompt_top_logprobs is None  # k = 0: the prompt tokens only
    tight.shutdown()


def test_logit_bias_bans_and_forces_tokens(llm):
    prompt = prompts_of_lengths([8])[0]
    free = [o.token_id for o in llm.generate(prompt_token_ids=[prompt],
                                             sampling_params=SamplingParams(max_tokens=5, **GREEDY),
                                             use_tqdm=False)[0]]
    banned = llm.generate(prompt_token_ids=[prompt], use_tqdm=False,
                          sampling_params=SamplingParams(max_tokens=5, logit_bias={free[0]: -100}, **GREEDY))[0]
    assert banned[0].token_id != free[0] and all(o.token_id != free[0] for o in banned)
    forced = llm.generate(prompt_token_ids=[prompt], use_tqdm=False,
                          sampling_params=SamplingParams(max_tokens=4, logit_bias={77: 100}, **GREEDY))[0]
    assert [o.token_id for o in forced] == [77] * 4
    with pytest.raises(ValueError, match="logit_bias"):  # nothing enqueued: a clear error
        llm.generate(prompt_token_ids=[prompt], use_tqdm=False,
                     sampling_params=SamplingParams(max_tokens=2, logit_bias={10**6: 1.0}))


def test_stop_token_ids_end_the_request(llm):
    prompt = prompts_of_lengths([8])[0]
    free = [o.token_id for o in llm.generate(prompt_token_ids=[prompt],
                                             sampling_params=SamplingParams(max_tokens=8, **GREEDY),
                                             use_tqdm=False)[0]]
    outs = llm.generate(prompt_token_ids=[prompt], use_tqdm=False,
                        sampling_params=SamplingParams(max_tokens=8, stop_token_ids=[free[3]], **GREEDY))[0]
    assert [o.token_id for o in outs] == free[: free.index(free[3]) + 1]
    assert outs[-1].finish_reason == "stop"


def test_top_logprobs_cross_the_dp_wire(llm):
    """The DP path: a rank's outputs become TokenDeltas in msgpack and back, alternatives intact."""
    prompt = prompts_of_lengths([6])[0]
    outs = llm.generate(prompt_token_ids=[prompt], use_tqdm=False,
                        sampling_params=SamplingParams(max_tokens=2, logprobs=3, prompt_logprobs=2, **GREEDY))[0]
    msg = p.Deltas(1, [TokenDelta.of(o, 1, want_logprobs=True) for o in outs])
    back = p.router_decoder.decode(msgspec.msgpack.encode(msg))
    assert back.deltas[0].top_logprobs == outs[0].top_logprobs
    assert back.deltas[0].prompt_logprobs == outs[0].prompt_logprobs
    assert back.deltas[0].prompt_top_logprobs == outs[0].prompt_top_logprobs
    assert back.deltas[1].prompt_logprobs is None


def test_sampling_params_cross_the_dp_wire():
    params = SamplingParams(logit_bias={5: -3.5}, prompt_logprobs=2, logprobs=4, seed=2**64 - 1)
    wire = p.rank_decoder.decode(msgspec.msgpack.encode(p.AddRequest("r", [1, 2], p.params_to_wire(params))))
    assert p.params_from_wire(wire.params) == params
