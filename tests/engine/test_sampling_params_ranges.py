"""SamplingParams' ranges for the fields that crossed into the engine with issue 10: seeds to
64 bits (what torch's generators and msgspec carry), logprobs and prompt_logprobs up to 20,
logit_bias keys and values."""

import pytest

from deepinfer_dp.sampling_params import MAX_LOGPROBS, SamplingParams


def checked(**kwargs) -> SamplingParams:
    params = SamplingParams(**kwargs)
    params.verify()
    return params


@pytest.mark.parametrize("seed", [-(2**63), 0, 2**63, 2**64 - 1])
def test_seeds_in_64_bits_are_accepted(seed):
    assert checked(seed=seed).seed == seed


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**30])
def test_seeds_past_64_bits_are_refused(seed):
    with pytest.raises(ValueError, match="seed must fit in 64 bits"):
        checked(seed=seed)


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
def test_logprobs_ranges(name):
    assert getattr(checked(**{name: MAX_LOGPROBS}), name) == MAX_LOGPROBS
    for bad in (-1, MAX_LOGPROBS + 1, True, 2.0):
        with pytest.raises(ValueError, match=name):
            checked(**{name: bad})


@pytest.mark.parametrize(("bias", "words"), [({-1: 1.0}, "keys must be token ids"), ({True: 1.0}, "keys"),
                                             ({"5": 1.0}, "keys"), ({5: 101.0}, r"values must be in \[-100, 100\]"),
                                             ({5: float("nan")}, "finite"), ({5: float("-inf")}, "finite"),
                                             ({5: "x"}, "must be a number")])
def test_logit_bias_is_checked(bias, words):
    with pytest.raises(ValueError, match=f"logit_bias {words}" if words.startswith("keys") else words):
        checked(logit_bias=bias)


def test_logit_bias_is_copied_not_shared():
    bias = {5: 1.0}
    params = SamplingParams(logit_bias=bias)
    bias[6] = 2.0
    assert params.logit_bias == {5: 1.0} and params.clone().logit_bias is not params.logit_bias
