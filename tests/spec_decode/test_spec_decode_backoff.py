"""The acceptance back-off (`disable_by_acceptance`, Scheduler::set_draft_backoff): a
request's draft length follows what its verification steps keep, it pauses after several
steps in a row that keep nothing and probes again with one draft, pausing twice as long after
each failed probe; requests that keep few drafts make new requests start without drafting.
In the C++ scheduler directly (the test plays the target), then end to end on tiny models,
where no token changes."""

from __future__ import annotations

import numpy as np
from model_utils import prompts_of_lengths, token_ids

from deepinfer_dp import _C, LLM, SamplingParams

K = 5
WRONG = 99  # the target's token whenever it disagrees with a draft (no draft is ever 99)


def fresh(max_misses: int = 3, pause: int = 4, skip_requests: bool = True) -> _C.Scheduler:
    sched = _C.Scheduler(_C.SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, block_size=16,
                                            num_blocks=256, max_model_len=2048, vocab_size=100))
    sched.set_draft_backoff(max_misses, pause, skip_requests)
    return sched


def start(sched: _C.Scheduler, rid: str = "r", max_tokens: int = 1000) -> _C.Sequence:
    seq = _C.Sequence(rid, [1, 2, 3, 4], _C.SequenceLimits(max_tokens=max_tokens))
    sched.add_sequence(seq)
    sched.process_outputs(sched.schedule(), np.array([5]))
    return seq


def step_all(sched: _C.Scheduler, keep: dict[str, int | None]) -> dict[str, int | None]:
    """One step of every running request. A draft candidate gets draft_limit(seq, K) drafts
    (tokens 10..), of which the target keeps the first keep[request id] (None or absent: all).
    Per request in the batch: how many drafts it got, or None when it was no candidate."""
    candidates = {s.request_id: s for s in sched.draft_candidates()}
    for seq in candidates.values():
        if n := sched.draft_limit(seq, K):
            sched.set_drafts(seq, list(range(10, 10 + n)))
    out = sched.schedule()
    rows, got = [], {}
    for rid, n in zip(out.request_ids, out.num_drafts.tolist(), strict=True):
        kept = n if keep.get(rid) is None else min(keep[rid], n)
        rows += list(range(10, 10 + kept)) + [WRONG] * (n + 1 - kept)
        got[rid] = n if rid in candidates else None
    sched.process_outputs(out, np.array(rows))
    return got


def step(sched: _C.Scheduler, seq: _C.Sequence, keep: int | None = None) -> int | None:
    """step_all with `seq` alone running."""
    return step_all(sched, {seq.request_id: keep})[seq.request_id]


def test_draft_length_follows_what_verification_keeps():
    sched = fresh()
    seq = start(sched)
    assert step(sched, seq, keep=2) == K  # a fresh request drafts all K
    assert step(sched, seq, keep=0) == 3  # one more than the 2 kept
    assert step(sched, seq) == 1  # one more than the 0 kept; kept whole
    assert step(sched, seq, keep=1) == K  # a run kept whole: all K again
    assert sched.draft_limit(seq, K) == 2
    assert sched.draft_limit(seq, 1) == 1  # never more than the proposer's k


def test_draft_limit_leaves_room_for_the_targets_token():
    sched = fresh()
    seq = start(sched, max_tokens=4)  # 1 token so far: 3 more may come, one of them the target's
    assert sched.draft_limit(seq, K) == 2


def test_misses_pause_drafting_then_one_draft_probes_and_failed_probes_double_the_pause():
    sched = fresh(max_misses=3, pause=4)
    seq = start(sched)
    # K, then 1 and 1 drafts, none kept: the third miss pauses the request for 4 tokens.
    assert [step(sched, seq, keep=0) for _ in range(3)] == [K, 1, 1]
    pauses = []
    for _ in range(4):
        plain = 0
        while (n := step(sched, seq, keep=0)) is None:
            plain += 1
        assert n == 1  # a probe: one draft
        pauses.append(plain)
    # each failed probe pauses again at once, twice as long: 4, 8, 16, 32 tokens, the first of
    # them the target's own token from the failed step, the rest plain one-token steps
    assert pauses == [3, 7, 15, 31]
    # a probe that keeps its draft ends the back-off: all K again, and 3 misses before a pause
    while step(sched, seq) is None:
        pass
    assert [step(sched, seq, keep=0) for _ in range(3)] == [K, 1, 1]
    assert step(sched, seq) is None  # paused again, for 4 tokens


def test_a_pause_never_exceeds_eight_times_pause_tokens():
    sched = fresh(max_misses=1, pause=2)
    seq = start(sched)
    pauses = []
    for _ in range(6):
        plain = 0
        while step(sched, seq, keep=0) is None:
            plain += 1
        pauses.append(plain)
    assert pauses == [0, 1, 3, 7, 15, 15]  # pauses of 2, 4, 8, 16, 16 tokens


def test_requests_that_keep_few_drafts_make_new_ones_start_without_drafting():
    sched = fresh(max_misses=1, pause=1000)
    skipped = []
    for i in range(6):  # every request that drafts keeps nothing
        seq = start(sched, rid=f"bad{i}", max_tokens=6)
        drafted = False
        while not seq.is_finished:
            drafted |= step(sched, seq, keep=0) is not None
        skipped.append(not drafted)
    # bad0 fails: 1 request left out; bad2 fails too: the next 3
    assert skipped == [False, True, False, True, True, True]
    assert sched.stats["spec_decode_num_skipped_requests"] == 4


def test_only_requests_that_could_draft_are_left_out():
    sched = fresh(max_misses=1, pause=1000)
    bad = start(sched, rid="bad", max_tokens=6)
    while not bad.is_finished:
        step(sched, bad, keep=0)
    # A request that never is a draft candidate (speculation off for it: no proposer asked)
    # does not use up the one request to be left out.
    unseen = start(sched, rid="unseen", max_tokens=6)
    while not unseen.is_finished:
        sched.process_outputs(sched.schedule(), np.array([WRONG]))
    later = start(sched, rid="later", max_tokens=6)
    assert step(sched, later) is None
    assert sched.stats["spec_decode_num_skipped_requests"] == 1


def test_the_request_after_the_left_out_ones_probes_with_one_draft():
    sched = fresh(max_misses=3, pause=2)
    bad = start(sched, rid="bad", max_tokens=10)
    assert [step(sched, bad, keep=0) for _ in range(3)] == [K, 1, 1]  # a fresh engine: all K, 3 misses
    while not bad.is_finished:
        step(sched, bad, keep=0)
    left_out = start(sched, rid="left_out", max_tokens=4)
    while not left_out.is_finished:
        assert step(sched, left_out) is None
    probe = start(sched, rid="probe", max_tokens=40)
    assert step(sched, probe, keep=0) == 1  # one draft, and its first miss pauses it at once,
    plain = 0
    while step(sched, probe, keep=0) is None:
        plain += 1
    assert plain == 3  # as long as a second pause: 4 tokens (the first the target's own)


def test_a_request_that_keeps_its_drafts_ends_the_engine_wide_back_off():
    sched = fresh(max_misses=1, pause=1000)
    good = start(sched, rid="good", max_tokens=40)
    assert step(sched, good) == K
    bad = start(sched, rid="bad", max_tokens=6)
    while not bad.is_finished:
        step_all(sched, {"bad": 0})
    start(sched, rid="left_out", max_tokens=60)
    while not good.is_finished:  # drafting all along, keeping every draft
        got = step_all(sched, {})
        assert got["left_out"] is None and (good.is_finished or got["good"] is not None)
    start(sched, rid="after", max_tokens=20)
    assert step_all(sched, {})["after"] == K  # new requests draft again
    assert sched.stats["spec_decode_num_skipped_requests"] == 1


def test_without_skip_requests_every_request_drafts():
    sched = fresh(max_misses=1, pause=1000, skip_requests=False)
    for i in range(3):
        seq = start(sched, rid=f"bad{i}", max_tokens=6)
        assert step(sched, seq, keep=0) is not None
        while not seq.is_finished:
            step(sched, seq, keep=0)
    assert sched.stats["spec_decode_num_skipped_requests"] == 0


def test_backoff_off_always_drafts_k():
    sched = fresh(max_misses=0)
    seq = start(sched)
    assert [step(sched, seq, keep=0) for _ in range(8)] == [K] * 8


# ---- end to end ---------------------------------------------------------------------------
MAX_TOKENS = 48
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def drafting(model_dir: str, prompts, **spec) -> tuple[list, dict]:
    config = {"num_speculative_tokens": 3, "disable_by_batch_size": None, **spec}
    llm = LLM(model_dir, decode_sequence=False, speculative_config=config)
    try:
        out = token_ids(llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS, use_tqdm=False))
        return out, llm.rank_stats()[0]
    finally:
        llm.shutdown()


def test_rejected_drafts_shrink_and_pause_drafting_and_keep_every_token(tiny_model_dir):
    # Prompt lookup with 1-grams on a random model: drafts are found everywhere, mostly wrong.
    prompts = prompts_of_lengths([9, 14], offset=3)
    ngram = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 1}
    always, stats_always = drafting(tiny_model_dir, prompts, **ngram, disable_by_acceptance=None)
    backoff, stats_backoff = drafting(tiny_model_dir, prompts, **ngram, disable_by_acceptance=1)
    assert backoff == always
    assert stats_always["spec_decode_num_accepted_tokens"] < stats_always["spec_decode_num_drafts"]  # mostly wrong
    # Fixed K drafts on every step against shorter runs and pauses.
    assert 0 < stats_backoff["spec_decode_num_draft_tokens"] < stats_always["spec_decode_num_draft_tokens"] // 2
    assert stats_backoff["spec_decode_num_drafts"] < stats_always["spec_decode_num_drafts"]


def test_accepted_drafts_keep_drafting(tiny_model_dir):
    # The target drafting for itself: every draft accepted, the back-off never triggers.
    prompts = prompts_of_lengths([9, 14], offset=3)
    same = {"method": "draft_model", "model": str(tiny_model_dir)}
    always, stats_always = drafting(tiny_model_dir, prompts, **same, disable_by_acceptance=None)
    backoff, stats_backoff = drafting(tiny_model_dir, prompts, **same, disable_by_acceptance=1)
    assert backoff == always
    assert stats_backoff["spec_decode_num_drafts"] == stats_always["spec_decode_num_drafts"] > 0
    assert stats_backoff["spec_decode_num_accepted_tokens"] == stats_backoff["spec_decode_num_draft_tokens"]
    assert stats_backoff["spec_decode_num_skipped_requests"] == 0
