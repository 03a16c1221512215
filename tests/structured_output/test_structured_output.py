"""Structured output in the engine, on a tiny random model (whose choices are noise, so only
the grammar makes them valid): every kind of spec holds at greedy and at temperature 0.8, ZOS
on and off agree, a request waits outside the scheduler while its grammar builds, a failed
build fails only its own request, invalid specs are refused before anything is queued, and
preemption keeps outputs valid."""

from __future__ import annotations

import threading

import pytest
from so_cases import ARITHMETIC, CHOICES, CODE_REGEX, PERSON, check_arithmetic, check_json, check_regex

from deepinfer_dp import LLM, SamplingParams, StructuredOutputsParams
from deepinfer_dp.engine.input_processor import InvalidRequest
from deepinfer_dp.engine.step_loop import StepLoop
from deepinfer_dp.structured_output.backend import GrammarBackend

PROMPTS = [[5, 6, 7], [8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18]]
SPECS = [StructuredOutputsParams(json=PERSON), StructuredOutputsParams(regex=CODE_REGEX),
         StructuredOutputsParams(choice=CHOICES), StructuredOutputsParams(grammar=ARITHMETIC)]


def _params(temperature: float, seed: int | None = None) -> list[SamplingParams]:
    return [SamplingParams(temperature=temperature, max_tokens=120, seed=seed, structured_outputs=s) for s in SPECS]


def _check_all(texts: list[str]) -> None:
    check_json(texts[0], PERSON)
    check_regex(texts[1], CODE_REGEX)
    assert texts[2] in CHOICES
    check_arithmetic(texts[3])


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    llm = LLM(tiny_model_dir)
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_every_kind_of_spec_holds(llm, temperature):
    for seed in (1, 2):
        _check_all(llm.generate(prompt_token_ids=PROMPTS, sampling_params=_params(temperature, seed), use_tqdm=False))
    stats = llm.rank_stats()[0]
    assert stats["so_cache_hits"] >= 4 and stats["so_mask_steps"] > 0


def test_zos_on_and_off_give_the_same_constrained_tokens(tiny_model_dir, llm):
    params = _params(0.0) + [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)]
    prompts = [*PROMPTS, [20, 21, 22]]
    with_zos = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    off = LLM(tiny_model_dir, zos=False)
    try:
        assert off.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False) == with_zos
    finally:
        off.shutdown()
    _check_all(with_zos)


def test_unconstrained_steps_build_no_mask(llm):
    engine = llm.llm_engine
    steps = engine.structured.stats.mask_steps
    llm.generate(prompt_token_ids=PROMPTS, sampling_params=SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert engine.structured.stats.mask_steps == steps
    # a mixed batch: mask rows only for the constrained request
    rows = engine.structured.stats.mask_rows
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * 3 + [_params(0.0)[2]]
    llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    assert engine.structured.stats.mask_rows - rows == engine.structured.stats.mask_steps - steps


@pytest.mark.parametrize("bad, field", [
    (StructuredOutputsParams(json={"type": "objekt"}), "structured_outputs.json"),
    (StructuredOutputsParams(regex="a(b"), "structured_outputs.regex"),
    (StructuredOutputsParams(grammar="root ::= (\"a\""), "structured_outputs.grammar"),
])
def test_an_invalid_spec_is_refused_before_anything_is_queued(llm, bad, field):
    params = [_params(0.0)[0], SamplingParams(max_tokens=8, structured_outputs=bad)]
    with pytest.raises(ValueError, match=f"prompt 1: {field}"):
        llm.generate(prompt_token_ids=PROMPTS[:2], sampling_params=params, use_tqdm=False)
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and not engine.structured.has_pending()
    with pytest.raises(InvalidRequest) as info:
        engine.add_request(prompt_token_ids=[5], sampling_params=params[1])
    assert info.value.param == field


def test_exactly_one_kind_per_request():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputsParams(regex="a")).verify()


class _GatedBuilds:
    """Replaces GrammarBackend.compile: builds wait for `release`, and a spec can be made to fail."""

    def __init__(self, monkeypatch, fail_regex: str | None = None) -> None:
        self.release, self.started = threading.Event(), threading.Event()
        real = GrammarBackend.compile

        def compile(backend, params):
            self.started.set()
            self.release.wait(30)
            if params.regex is not None and params.regex == fail_regex:
                raise ValueError("structured_outputs.regex: injected build failure")
            return real(backend, params)
        monkeypatch.setattr(GrammarBackend, "compile", compile)


def _run(engine) -> dict[str, list]:
    outputs: dict[str, list] = {}
    StepLoop(engine).run(lambda outs: [outputs.setdefault(o.request_id, []).append(o.clone()) for o in outs])
    return outputs


def test_a_request_waits_outside_the_scheduler_while_its_grammar_builds(tiny_model_dir, monkeypatch):
    gate = _GatedBuilds(monkeypatch)
    llm = LLM(tiny_model_dir)
    try:
        engine = llm.llm_engine
        rid = engine.add_request(prompt_token_ids=[5, 6], sampling_params=_params(0.0)[1])
        assert gate.started.wait(30)
        assert engine.scheduler.num_waiting == 0 and engine.has_unfinished_requests()
        engine.step()
        engine.step()  # nothing schedulable yet: placeholder steps, the request still waiting
        assert engine.placeholder_steps == 2 and engine.scheduler.num_waiting == 0
        gate.release.set()
        ids = [t for o in _run(engine)[rid] for t in o.token_ids]
        check_regex(llm.get_tokenizer().decode(ids, skip_special_tokens=True), CODE_REGEX)
        # a request still compiling can be aborted
        gate.release.clear()
        rid = engine.add_request(prompt_token_ids=[5, 6], sampling_params=_params(0.0)[1])
        assert engine.abort_request(rid) == [rid] and not engine.has_unfinished_requests()
        gate.release.set()
    finally:
        llm.shutdown()


def test_a_failed_build_finishes_only_its_own_request(tiny_model_dir, monkeypatch):
    gate = _GatedBuilds(monkeypatch, fail_regex="[0-9]{4}")
    gate.release.set()
    llm = LLM(tiny_model_dir)
    try:
        params = [_params(0.0)[0], SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(
            regex="[0-9]{4}")), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)]
        with pytest.raises(ValueError, match="prompt 1: request .* failed: structured_outputs.regex: injected"):
            llm.generate(prompt_token_ids=PROMPTS[:3], sampling_params=params, use_tqdm=False)
        engine = llm.llm_engine
        rids = [engine.add_request(prompt_token_ids=p, sampling_params=s)
                for p, s in zip(PROMPTS[:3], params, strict=True)]
        outputs = _run(engine)
        assert outputs[rids[1]][-1].finish_reason == "error" and outputs[rids[1]][-1].finished
        check_json(llm.get_tokenizer().decode([t for o in outputs[rids[0]] for t in o.token_ids],
                                              skip_special_tokens=True), PERSON)
        assert sum(len(o.token_ids) for o in outputs[rids[2]]) == 8
        assert engine.stats()["so_build_failures"] == 2 and not engine.has_unfinished_requests()
    finally:
        llm.shutdown()


def test_preemption_keeps_constrained_outputs_valid(tiny_model_dir):
    # 12 blocks of 16 tokens for 8 requests of 50+ tokens each: the scheduler must preempt
    # (recompute), and the resumed outputs must still follow their grammars.
    words = {"type": "object", "properties": {"words": {
        "type": "array", "items": {"type": "string", "minLength": 2, "maxLength": 6}, "minItems": 10,
        "maxItems": 10}}, "required": ["words"], "additionalProperties": False}
    specs = [StructuredOutputsParams(json=words, disable_any_whitespace=True),  # noise would pick whitespace
             StructuredOutputsParams(regex="[a-z]{60}")]
    llm = LLM(tiny_model_dir, num_kv_blocks=12, block_size=16, max_model_len=160)
    try:
        params = [SamplingParams(temperature=0.8, seed=i, max_tokens=150, structured_outputs=specs[i % 2])
                  for i in range(8)]
        texts = llm.generate(prompt_token_ids=[[5 + i, 6, 7, 8] for i in range(8)], sampling_params=params,
                             use_tqdm=False)
        assert llm.rank_stats()[0]["num_preemptions"] > 0
        for i, text in enumerate(texts):
            check_json(text, words) if i % 2 == 0 else check_regex(text, "[a-z]{60}")
    finally:
        llm.shutdown()


def test_constrained_requests_beside_speculating_ones(tiny_model_dir, llm):
    """Speculative decoding on: constrained requests decode one token per step (their mask
    would need the grammar advanced over unverified drafts) and stay valid and equal to a
    run without speculation; the repetitive unconstrained request beside them drafts."""
    repetitive = [7, 8, 9, 10] * 6
    params = _params(0.0) + [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)]
    prompts = [*PROMPTS, repetitive]
    plain = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    # both auto-offs off: the drafting request must draft beside the constrained ones
    spec = LLM(tiny_model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                   "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                                                   "disable_by_batch_size": None, "disable_by_acceptance": None})
    try:
        got = spec.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        stats = spec.rank_stats()[0]
    finally:
        spec.shutdown()
    assert got == plain
    _check_all(got)
    assert stats["spec_decode_num_drafts"] > 0 and stats["so_mask_steps"] > 0
