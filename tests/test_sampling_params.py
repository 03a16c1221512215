import pytest

from deepinfer_dp.sampling_params import INT32_MAX, InvalidRequest, SamplingParams


def checked(**kwargs) -> SamplingParams:
    params = SamplingParams(**kwargs)
    params.verify()
    return params


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, -1, 0.0)
    assert p.seed is None
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (
        0.0,
        0.0,
        1.0,
    )
    assert (p.max_tokens, p.min_tokens, p.n) == (16, 0, 1)
    assert p.stop == [] and p.stop_token_ids == []
    assert p.ignore_eos is False and p.logprobs is None
    assert p.include_stop_str_in_output is False and p.skip_special_tokens is True
    assert not p.is_greedy and not p.needs_history


@pytest.mark.parametrize(
    ("stop", "expected"),
    [(None, []), ("###", ["###"]), (["a", "b"], ["a", "b"]), (("x",), ["x"])],
)
def test_stop_is_normalized_to_list(stop, expected):
    assert SamplingParams(stop=stop).stop == expected


def test_stop_token_ids_normalized_and_copied():
    ids = [3, 4]
    p = SamplingParams(stop_token_ids=ids)
    ids.append(5)
    assert p.stop_token_ids == [3, 4]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", "hot"),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", -0.5),
        ("top_k", -2),
        ("top_k", 1.5),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("seed", 1.0),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("frequency_penalty", 3.0),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", 2.5),
        ("max_tokens", 0),
        ("max_tokens", -5),
        ("max_tokens", 2.0),
        ("min_tokens", -1),
        ("stop", ["ok", ""]),
        ("stop", [1]),
        ("stop_token_ids", [1, -2]),
        ("stop_token_ids", ["x"]),
        ("logprobs", -1),
        ("n", 0),
        ("n", True),
    ],
)
def test_bad_value_names_field(field, value):
    with pytest.raises(InvalidRequest, match=field) as e:
        checked(**{field: value})
    assert e.value.param == field


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match=r"min_tokens.*max_tokens"):
        checked(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4
    assert SamplingParams(max_tokens=None, min_tokens=100).max_tokens is None


def test_error_message_states_range():
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 0\.0"):
        checked(top_p=0.0)


@pytest.mark.parametrize("top_k", [-1, 0, 1, 50])
def test_top_k_off_values_and_positive_are_valid(top_k):
    assert checked(top_k=top_k).top_k == top_k


def test_edges_are_valid():
    checked(
        temperature=0.0,
        top_p=1.0,
        min_p=1.0,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        repetition_penalty=2.0,
        logprobs=0,
        seed=-3,
    )


def test_is_greedy():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=1e-7).is_greedy
    assert not SamplingParams(temperature=0.01).is_greedy


@pytest.mark.parametrize(
    "kwargs",
    [
        {"presence_penalty": 0.5},
        {"frequency_penalty": -0.5},
        {"repetition_penalty": 1.2},
    ],
)
def test_needs_history(kwargs):
    assert SamplingParams(**kwargs).needs_history


def test_clone_is_deep_and_equal():
    p = SamplingParams(temperature=0.5, stop=["a"], stop_token_ids=[7], seed=3)
    q = p.clone()
    assert q == p and q is not p
    q.stop.append("b")
    q.stop_token_ids.append(8)
    assert p.stop == ["a"] and p.stop_token_ids == [7]


def test_construction_checks_nothing_verify_does():
    """Validation happens once, where a request enters an engine (InputProcessor.process):
    a SamplingParams may be built and changed freely before that."""
    params = SamplingParams(temperature=-1.0, stop=5)
    params.temperature = 0.5
    with pytest.raises(InvalidRequest) as e:
        params.verify()
    assert e.value.param == "stop"


@pytest.mark.parametrize("field", ["top_k", "max_tokens", "min_tokens", "n", "logprobs", "prompt_logprobs", "seed"])
@pytest.mark.parametrize("value", [INT32_MAX + 1, 2**63, 2**64, 2**70, 10**5000, -(2**63) - 1],
                         ids=["2**31", "2**63", "2**64", "2**70", "10**5000", "-2**63-1"])
def test_integers_past_their_bound_name_the_field(field, value):
    """Every integer field has an upper bound (what C++ or the wire carries), and a message
    that can show any integer (str() of 5,000 digits raises in Python)."""
    if field == "seed" and -(2**63) <= value < 2**64:
        return  # a 64-bit seed
    with pytest.raises(InvalidRequest) as e:
        checked(**{field: value})
    assert e.value.param == field and len(str(e.value)) < 300


@pytest.mark.parametrize("field", ["top_k", "max_tokens", "min_tokens", "n"])
def test_int32_max_is_accepted(field):
    checked(**{field: INT32_MAX}, **({"max_tokens": None} if field == "min_tokens" else {}))


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), 10**400], ids=["inf", "-inf", "10**400"])
def test_numbers_must_be_finite(value):
    with pytest.raises(InvalidRequest) as e:
        checked(temperature=value)
    assert e.value.param == "temperature"
