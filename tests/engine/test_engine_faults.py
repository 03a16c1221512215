"""One request cannot break the engine: bad values are refused before anything is queued, and
a failure while post-processing one request finishes that request with an error while the
others on the same engine finish token-identical."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from model_utils import prompts_of_lengths, token_ids

from deepinfer_dp import LLM, SamplingParams
from deepinfer_dp.engine.input_processor import InvalidRequest
from deepinfer_dp.engine.step_loop import StepLoop

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_a_bad_seed_is_refused_before_anything_is_queued(tiny_model_dir):
    engine = LLM(tiny_model_dir).llm_engine
    params = SamplingParams(temperature=0.5)
    params.seed = 2**64  # past what torch.Generator takes; set after construction on purpose
    with pytest.raises(InvalidRequest, match="seed must fit in 64 bits") as info:
        engine.add_request(prompt_token_ids=[5, 6, 7], sampling_params=params, request_id="bad")
    assert info.value.param == "seed"
    assert not engine.has_unfinished_requests() and "bad" not in engine.requests
    engine.add_request(prompt_token_ids=[5, 6, 7], sampling_params=GREEDY)  # and it still serves
    outputs = []
    StepLoop(engine).run(lambda outs: outputs.extend(o.clone() for o in outs))
    assert outputs[-1].finished and outputs[-1].output_len == 6


@pytest.mark.parametrize("zos", [True, False])
def test_a_failure_in_one_requests_post_processing_fails_that_request_only(tiny_model_dir, zos):
    prompts = prompts_of_lengths([5, 9, 13])
    llm = LLM(tiny_model_dir, decode_sequence=False, zos=zos)
    expected = token_ids(llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False))
    engine = llm.llm_engine
    real = engine._check_stop_strings

    def fail_the_9_token_prompt_at_its_third_token(out):
        if out.prompt_len == 9 and out.output_len == 3:
            raise RuntimeError("injected post-processing failure")
        return real(out)

    engine._check_stop_strings = fail_the_9_token_prompt_at_its_third_token
    rids = [engine.add_request(prompt_token_ids=p, sampling_params=GREEDY) for p in prompts]
    outputs: dict[str, list] = {}
    StepLoop(engine).run(lambda outs: [outputs.setdefault(o.request_id, []).append(o.clone()) for o in outs])
    failed = outputs[rids[1]][-1]
    assert failed.finished and failed.finish_reason == "error" and "injected" in failed.error
    assert [[t for o in outputs[r] for t in o.token_ids] for r in (rids[0], rids[2])] == [expected[0], expected[2]]
    assert engine.stats()["requests_failed"] == 1
    assert engine.scheduler.num_free_blocks == engine.scheduler.num_usable_blocks  # its blocks were freed
    # Offline, the failure is named after its prompt; the engine serves the next call.
    with pytest.raises(RuntimeError, match=r"prompt 1: request \d+ failed: RuntimeError: injected"):
        llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    engine._check_stop_strings = real
    assert token_ids(llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)) == expected


def test_a_lost_step_reports_every_request_the_engine_held_even_one_it_had_finished(tiny_model_dir):
    """drop_lost_step (a MoE step failed with its peer) returns every request the engine held:
    also one whose finish was applied while the failing step's outputs never left the rank,
    which the scheduler no longer has. Left out, its stream would wait forever."""
    llm = LLM(tiny_model_dir, decode_sequence=False)
    engine = llm.llm_engine
    short = engine.add_request(prompt_token_ids=[5, 6, 7], sampling_params=GREEDY)
    long = engine.add_request(prompt_token_ids=[8, 9, 10, 11], sampling_params=SamplingParams(
        temperature=0.0, max_tokens=40, ignore_eos=True))
    while not any(o.request_id == short and o.finished for o in engine.step()):
        pass  # the short one's finish is applied; say its output never left the rank
    assert short in engine.requests and engine.scheduler.get_sequence(short) is None
    model = engine.worker.runner.model
    model.dispatcher = SimpleNamespace(broken="peer rank(s) [1] died")
    try:
        lost, cause = engine.drop_lost_step()
    finally:
        del model.dispatcher
    assert sorted(lost) == sorted([short, long]) and cause == "peer rank(s) [1] died"
    assert not engine.requests and not engine.has_unfinished_requests()
    assert engine.scheduler.num_free_blocks == engine.scheduler.num_usable_blocks
    expected = token_ids(LLM(tiny_model_dir, decode_sequence=False).generate(
        prompt_token_ids=[[5, 6, 7]], sampling_params=GREEDY, use_tqdm=False))
    assert token_ids(llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=GREEDY, use_tqdm=False)) == expected
