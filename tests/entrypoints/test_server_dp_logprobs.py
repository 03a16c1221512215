"""Top-k logprobs and prompt logprobs over the DP path (Ray ranks, TokenDeltas through the
router): offline LLM(dp_size=2) outputs and a DP=2 server's answers equal one engine's."""

from __future__ import annotations

import httpx
import pytest
from model_utils import prompts_of_lengths
from server_utils import ENGINE_OPTIONS, MODEL_NAME, served

from deepinfer_dp import LLM, SamplingParams

pytestmark = pytest.mark.slow
PROMPTS = prompts_of_lengths([7, 12, 5, 9])
PARAMS = SamplingParams(temperature=0, ignore_eos=True, max_tokens=4, logprobs=3, prompt_logprobs=2)
TOL = 1e-5


@pytest.fixture(scope="module")
def single(model_dir):
    llm = LLM(model_dir, decode_sequence=False, **ENGINE_OPTIONS)
    yield llm.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS, use_tqdm=False)
    llm.shutdown()


def test_offline_dp_outputs_carry_the_alternatives(model_dir, single, ray_cluster):
    llm = LLM(model_dir, decode_sequence=False, dp_size=2, **ENGINE_OPTIONS)
    try:
        got = llm.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS, use_tqdm=False)
    finally:
        llm.shutdown()
    for outs, want in zip(got, single, strict=True):
        assert [o.token_id for o in outs] == [o.token_id for o in want]
        for o, w in zip(outs, want, strict=True):
            assert list(o.top_logprobs[0]) == list(w.top_logprobs[0])
            assert list(o.top_logprobs[0].values()) == pytest.approx(list(w.top_logprobs[0].values()), abs=TOL)
        assert outs[0].prompt_logprobs[1:] == pytest.approx(want[0].prompt_logprobs[1:], abs=TOL)
        assert [list(d) for d in outs[0].prompt_top_logprobs[1:]] == [list(d) for d in want[0].prompt_top_logprobs[1:]]


def test_dp_server_echo_and_top_logprobs(model_dir, single, ray_cluster):
    with served(model_dir, dp_size=2) as srv:
        for prompt, want in zip(PROMPTS, single, strict=True):
            r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4,
                                                              "temperature": 0, "ignore_eos": True, "logprobs": 3,
                                                              "echo": True})
            lp = r.json()["choices"][0]["logprobs"]
            n = len(prompt)
            assert lp["token_logprobs"][1:n] == pytest.approx(want[0].prompt_logprobs[1:], abs=TOL)
            assert lp["token_logprobs"][n:] == pytest.approx([o.logprob for o in want], abs=TOL)
            tok = srv.client.tokenizer
            for top, o in zip(lp["top_logprobs"][n:], want, strict=True):
                expected = {tok.decode([i]): v for i, v in o.top_logprobs[0].items()}
                expected.setdefault(tok.decode([o.token_id]), o.logprob)
                assert top == pytest.approx(expected, abs=TOL)
