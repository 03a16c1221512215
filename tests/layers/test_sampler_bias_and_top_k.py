"""The sampler's logit_bias and top-k logprobs on hand-made logits: the bias moves greedy and
random rows alike, only the rows that asked, and the reported logprobs stay those of the raw
logits (as vLLM reports them)."""

import pytest
import torch

from deepinfer_dp.layers.sampler import Sampler, SamplingBatch
from deepinfer_dp.sampling_params import SamplingParams

CPU = torch.device("cpu")
VOCAB = 32


def run(logits: torch.Tensor, params: list[SamplingParams], gens=None):
    n = len(params)
    batch = SamplingBatch.build(params, gens or [None] * n, None, None, [0] * n, [None] * n, VOCAB, CPU)
    return Sampler()(logits, batch)


def test_bias_bans_the_greedy_token_in_its_row_only():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    best = logits.argmax(dim=-1)
    params = [SamplingParams(temperature=0, logit_bias={int(best[0]): -100.0}),
              SamplingParams(temperature=0),
              SamplingParams(temperature=0, logit_bias={5: 100.0})]
    out = run(logits, params)
    assert out.token_ids[0] != best[0] and out.token_ids[0] == logits[0].topk(2).indices[1]
    assert out.token_ids[1] == best[1]
    assert out.token_ids[2] == 5


def test_bias_applies_to_random_rows():
    logits = torch.zeros(2, VOCAB)
    gens = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    params = [SamplingParams(temperature=1.0, seed=1, logit_bias={7: 100.0}),
              SamplingParams(temperature=1.0, seed=2, logit_bias=dict.fromkeys(range(VOCAB - 1), -100.0))]
    out = run(logits, params, gens)
    assert out.token_ids.tolist() == [7, VOCAB - 1]


def test_top_logprobs_are_the_raw_distribution_and_ignore_the_bias():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0, logprobs=4, logit_bias={0: 50.0}),
              SamplingParams(temperature=0, logprobs=2)]
    out = run(logits, params)
    raw = logits.log_softmax(dim=-1)
    want = raw.topk(4)
    assert torch.equal(out.top_logprob_ids, want.indices)  # the widest request sets k; rows read a prefix
    assert torch.allclose(out.top_logprobs, want.values)
    assert out.token_ids[0] == 0  # the bias chose the token...
    assert out.logprobs[0] == pytest.approx(raw[0, 0].item())  # ...whose raw logprob is reported


def test_bias_on_a_token_outside_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        run(torch.zeros(1, VOCAB), [SamplingParams(temperature=0, logit_bias={VOCAB: 1.0})])
