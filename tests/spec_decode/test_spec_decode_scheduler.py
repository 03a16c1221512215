"""Speculative decoding in the C++ scheduler (csrc/engine/scheduler_spec.cpp): drafts in a
decode batch, acceptance per token with the stop rules, rollback of rejected slots, the
prefix cache seeing accepted tokens only, the guards at the binding, the counters."""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer_dp import _C


def fresh(**kw) -> _C.Scheduler:
    cfg = dict(max_num_seqs=8, max_num_batched_tokens=64, block_size=4, num_blocks=32, max_model_len=64,
               vocab_size=100)
    cfg.update(kw)
    return _C.Scheduler(_C.SchedulerConfig(**cfg))


def decoding(sched: _C.Scheduler, prompt: list[int], first: int, **limits) -> _C.Sequence:
    """A request prefilled and given its first token: decode-ready, nothing in flight."""
    seq = _C.Sequence("r", prompt, _C.SequenceLimits(**{"max_tokens": 16, **limits}))
    sched.add_sequence(seq)
    out = sched.schedule()
    assert out.is_prompt
    sched.process_outputs(out, np.array([first]))
    return seq


def test_ngram_propose_takes_the_latest_longest_match():
    assert _C.ngram_propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 2, 3], k=2, min_n=1, max_n=3) == [7, 8]
    assert _C.ngram_propose([1, 2, 3, 4, 1, 2], k=5, min_n=2, max_n=2) == [3, 4, 1, 2]
    assert _C.ngram_propose([1, 2, 3], k=3, min_n=1, max_n=3) == []
    with pytest.raises(ValueError):
        _C.ngram_propose([1, 2], k=0, min_n=1, max_n=2)


def test_drafts_are_fed_after_the_last_token_with_one_sample_row_each():
    sched = fresh()
    seq = decoding(sched, [10, 11, 12, 13, 14], first=20)
    assert [s.request_id for s in sched.draft_candidates()] == ["r"]
    sched.set_drafts(seq, [21, 22, 23])
    out = sched.schedule()
    assert not out.is_prompt
    assert out.input_ids.tolist() == [20, 21, 22, 23]
    assert out.positions.tolist() == [5, 6, 7, 8]
    assert out.num_drafts.tolist() == [3]
    assert out.sample_indices.tolist() == [0, 1, 2, 3]
    assert out.sample_request_ids == ["r"] * 4
    assert out.seq_lens.tolist() == [9]
    assert len(seq.block_table) == 3  # KV slots for all 1 + K positions
    assert seq.draft_token_ids == []  # drafts are for one step


def test_accepts_the_matching_prefix_plus_the_targets_token_and_rolls_back():
    sched = fresh()
    seq = decoding(sched, [10, 11, 12, 13, 14], first=20)
    sched.set_drafts(seq, [21, 22, 23, 24, 25, 26])
    out = sched.schedule()
    # the target agrees with drafts 21 and 22, then says 40 instead of 23
    outs = sched.process_outputs(out, np.array([21, 22, 40, 24, 25, 26, 27]))
    assert [o.token_ids for o in outs] == [[21], [22], [40]]
    assert [o.output_len for o in outs] == [2, 3, 4]
    assert seq.data.get_token_ids() == [10, 11, 12, 13, 14, 20, 21, 22, 40]
    assert seq.num_computed == seq.num_processed == 8  # the new token is fed next step
    assert len(seq.block_table) == 3  # the block of rejected slots only went back
    st = sched.stats
    assert (st["spec_decode_num_drafts"], st["spec_decode_num_draft_tokens"],
            st["spec_decode_num_accepted_tokens"]) == (1, 6, 2)
    assert st["spec_decode_num_accepted_tokens_per_pos"] == [1, 1, 0, 0, 0, 0]
    nxt = sched.schedule()
    assert nxt.input_ids.tolist() == [40] and nxt.positions.tolist() == [8]


def test_all_accepted_gives_k_plus_one_tokens():
    sched = fresh()
    seq = decoding(sched, [1, 2, 3], first=4)
    sched.set_drafts(seq, [5, 6])
    outs = sched.process_outputs(sched.schedule(), np.array([5, 6, 7]))
    assert [o.token_ids[0] for o in outs] == [5, 6, 7]
    assert seq.num_computed == 6  # 7 tokens, the last fed next step


@pytest.mark.parametrize("limits, expect, reason", [
    (dict(eos_token_id=6), [5, 6], "stop"),                       # EOS inside the accepted run
    (dict(stop_token_ids=[5]), [5], "stop"),
    (dict(eos_token_id=6, min_tokens=4), [5, 6, 7, 8], None),      # min_tokens holds EOS back
    (dict(max_tokens=3), [5, 6], "length"),                       # drafts clipped to max_tokens
])
def test_a_stop_inside_an_accepted_run_cuts_exactly_there(limits, expect, reason):
    sched = fresh()
    seq = decoding(sched, [1, 2, 3], first=4, **limits)
    sched.set_drafts(seq, [5, 6, 7])
    out = sched.schedule()
    k = out.num_drafts.tolist()[0]
    outs = sched.process_outputs(out, np.array([5, 6, 7, 8][: k + 1]))
    assert [o.token_ids[0] for o in outs] == expect
    assert [o.finished for o in outs] == [False] * (len(expect) - 1) + [reason is not None]
    if reason:
        assert outs[-1].finish_reason == reason
        assert seq.is_finished and sched.num_free_blocks == sched.num_usable_blocks


def test_drafts_clipped_to_the_context():
    sched = fresh(max_model_len=8)
    seq = decoding(sched, [1, 2, 3, 4, 5], first=6, max_tokens=3)
    sched.set_drafts(seq, [7, 8, 9])
    out = sched.schedule()
    assert out.num_drafts.tolist() == [1]  # 6 tokens now; at most 8, so one draft + the target's token


def test_prefix_cache_keys_only_accepted_tokens():
    sched = fresh()
    seq = decoding(sched, [1, 2, 3, 4, 5, 6], first=7)
    sched.set_drafts(seq, [8, 50, 51])
    sched.process_outputs(sched.schedule(), np.array([8, 9, 52, 53]))  # 8 accepted, 9 is the target's
    assert seq.data.get_token_ids() == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    # a new prompt equal to the accepted history finds its two full blocks cached...
    hit = _C.Sequence("hit", [1, 2, 3, 4, 5, 6, 7, 8, 1], _C.SequenceLimits(max_tokens=16))
    sched.add_sequence(hit)
    sched.schedule()
    assert hit.num_cached_tokens == 8
    # ...and one following the rejected drafts does not get their block
    miss = _C.Sequence("miss", [1, 2, 3, 4, 5, 6, 7, 8, 50, 51, 0, 0, 1], _C.SequenceLimits(max_tokens=16))
    sched.add_sequence(miss)
    sched.schedule()
    assert miss.num_cached_tokens == 8


def test_drafts_make_room_before_preempting():
    sched = fresh(num_blocks=4, max_model_len=12)  # 3 usable blocks of 4
    seq = decoding(sched, [1, 2, 3, 4, 5, 6, 7], first=8)
    other = _C.Sequence("o", [9, 9, 9], _C.SequenceLimits(max_tokens=16))
    sched.add_sequence(other)
    sched.process_outputs(sched.schedule(), np.array([9]))
    sched.set_drafts(seq, [10, 11, 12, 13])  # would need a fourth block
    out = sched.schedule()
    assert out.num_drafts.tolist() == [0, 0]
    assert sched.stats["num_preemptions"] == 0


def test_set_drafts_guards():
    sched = fresh()
    seq = decoding(sched, [1, 2, 3], first=4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        sched.set_drafts(seq, [5, 100])
    with pytest.raises(ValueError, match="more than 64"):
        sched.set_drafts(seq, [5] * 65)
    waiting = _C.Sequence("w", [1, 2], _C.SequenceLimits(max_tokens=16))
    with pytest.raises(ValueError, match="not a live sequence"):
        sched.set_drafts(waiting, [5])
    sched.add_sequence(waiting)
    with pytest.raises(ValueError, match="not decode-ready"):
        sched.set_drafts(waiting, [5])
    no = decoding(fresh(), [1, 2, 3], first=4, allow_drafts=False)
    assert no.limits.allow_drafts is False


def test_sequences_that_refuse_drafts_are_no_candidates():
    sched = fresh()
    decoding(sched, [1, 2, 3, 1, 2], first=3, allow_drafts=False)
    assert sched.draft_candidates() == []
    assert sched.propose_ngram(3, 1, 2) == 0
    assert sched.schedule().num_drafts.tolist() == [0]


def test_propose_ngram_sets_drafts_from_history():
    sched = fresh()
    seq = decoding(sched, [1, 2, 3, 4, 1, 2], first=3)
    assert sched.propose_ngram(2, 1, 3) == 1
    assert seq.draft_token_ids == [4, 1]
    with pytest.raises(ValueError):
        sched.propose_ngram(0, 1, 3)
