"""Bad arguments at the pybind11 boundary raise Python exceptions instead of crashing the
process: block ids, empty prompts, sequence and batch ownership, kernel shapes; and the
batch arrays handed to Python are read-only."""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer_dp import _C

F32 = np.float32


def scheduler(**kw) -> _C.Scheduler:
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=64, block_size=4, num_blocks=16, max_model_len=64,
               vocab_size=50)
    return _C.Scheduler(_C.SchedulerConfig(**{**cfg, **kw}))


def add(s: _C.Scheduler, rid: str, prompt: list[int], **limits) -> _C.Sequence:
    seq = _C.Sequence(rid, prompt, _C.SequenceLimits(**{"max_tokens": 16, **limits}))
    s.add_sequence(seq)
    return seq


@pytest.mark.parametrize("block", [-3, -1, 16, 100_000, 2**31 - 1])
def test_block_ref_count_out_of_range(block):
    s = scheduler()
    with pytest.raises(IndexError, match="outside"):
        s.block_ref_count(block)
    assert s.block_ref_count(0) == 1 and s.block_ref_count(15) == 0


def test_empty_sequence_is_refused_where_it_is_made():
    with pytest.raises(ValueError, match="'x': the prompt is empty"):
        _C.Sequence("x", [], _C.SequenceLimits(max_tokens=1))
    assert _C.Sequence("y", [7], _C.SequenceLimits(max_tokens=1)).data.get_last_token_id() == 7


def test_max_tokens_has_no_default_in_cpp():
    """SamplingParams owns the default; the binding takes max_tokens always, and a sequence
    whose max_tokens was never set (0) is refused when added."""
    with pytest.raises(TypeError):
        _C.SequenceLimits()
    with pytest.raises(TypeError):
        _C.Sequence("x", [1])
    limits = _C.SequenceLimits(max_tokens=1)
    limits.max_tokens = 0
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        scheduler().add_sequence(_C.Sequence("x", [1], limits))


def test_a_sequence_belongs_to_one_scheduler():
    a, b = scheduler(), scheduler()
    seq = add(a, "r", [1, 2, 3])
    with pytest.raises(ValueError, match="already added"):
        b.add_sequence(seq)
    with pytest.raises(ValueError, match="already added"):
        a.add_sequence(seq)
    with pytest.raises(ValueError, match="None"):
        a.add_sequence(None)
    assert not b.has_unfinished_seqs() and a.num_waiting == 1


def test_limits_of_an_added_sequence_cannot_be_changed():
    seq = add(scheduler(), "r", [1, 2], max_tokens=5)
    seq.limits.max_tokens = 0  # a copy
    assert seq.limits.max_tokens == 5


@pytest.mark.parametrize("changes, match", [
    ({"block_size": 0}, "positive"), ({"num_blocks": 1}, "num_blocks"), ({"num_blocks": -5}, "num_blocks"),
    ({"vocab_size": 0}, "positive"), ({"max_model_len": 1}, "max_model_len"),
    ({"num_blocks": 1 << 20, "block_size": 1 << 12}, "positions"),
])
def test_bad_scheduler_config(changes, match):
    with pytest.raises(ValueError, match=match):
        scheduler(**changes)


def test_batch_of_another_scheduler_is_refused():
    a, b = scheduler(), scheduler(num_blocks=4)
    add(a, "r", list(range(1, 12)))
    add(b, "r", [1])
    out = a.schedule()
    b.schedule()
    with pytest.raises(ValueError, match="another scheduler"):
        b.process_outputs(out, np.array([1]))
    del a  # a batch outliving its scheduler is still not the other one's
    with pytest.raises(ValueError, match="another scheduler"):
        b.process_outputs(out, np.array([1]))
    assert b.get_sequence("r").num_pending == 1


def test_batch_processed_once_in_order():
    s = scheduler()
    seq = add(s, "r", [1, 2, 3], max_tokens=10)
    first = s.schedule()
    s.process_outputs(first, np.array([5]))
    with pytest.raises(ValueError, match="already processed"):
        s.process_outputs(first, np.array([5]))
    assert seq.num_pending == 0 and seq.data.get_output_token_ids() == [5]
    second, third = s.schedule(), s.schedule()  # ZOS: the host schedules before it processes
    with pytest.raises(ValueError, match="before step 2 was processed"):
        s.process_outputs(third, np.array([6]))
    assert [o.token_id for o in s.process_outputs(second, np.array([6]))] == [6]
    assert [o.token_id for o in s.process_outputs(third, np.array([7]))] == [7]
    assert seq.data.get_output_token_ids() == [5, 6, 7] and seq.num_pending == 0


def test_batches_of_a_lost_step_are_discarded_only_once_nothing_waits_for_them():
    """A forward that failed (a MoE collective lost its peer) never returns its tokens: once
    every request is aborted, its batches are skipped and the scheduler serves on."""
    s = scheduler()
    add(s, "r", [1, 2, 3], max_tokens=10)
    s.process_outputs(s.schedule(), np.array([5]))
    lost = s.schedule()
    with pytest.raises(RuntimeError, match=r"1 unfinished sequence\(s\) still wait"):
        s.discard_unprocessed()
    assert s.abort("r") is not None
    s.release_outputs()
    s.discard_unprocessed()
    with pytest.raises(ValueError, match="already processed"):
        s.process_outputs(lost, np.array([6]))
    assert s.num_free_blocks == s.num_usable_blocks and not s.has_unfinished_seqs()
    add(s, "next", [4, 5], max_tokens=2)
    assert [o.token_id for o in s.process_outputs(s.schedule(), np.array([7]))] == [7]


def test_scheduling_ahead_never_feeds_a_token_from_an_older_step():
    s = scheduler()
    seq = add(s, "r", [1, 2, 3], max_tokens=10)
    s.process_outputs(s.schedule(), np.array([5]))
    batches = [s.schedule() for _ in range(3)]  # nothing processed meanwhile
    assert [b.num_seqs for b in batches] == [1, 1, 0]  # the third waits: its input is two steps old
    assert batches[1].has_inflight_inputs and seq.num_pending == 2
    for b, token in zip(batches, [6, 7], strict=False):
        s.process_outputs(b, np.array([token]))
    s.process_outputs(batches[2], np.empty(0, dtype=np.int64))
    assert seq.data.get_output_token_ids() == [5, 6, 7]


@pytest.mark.parametrize("token", [-1, 50, 2**40])
def test_sampled_token_outside_the_vocabulary_changes_nothing(token):
    s = scheduler()
    seq = add(s, "r", [1, 2, 3])
    out = s.schedule()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        s.process_outputs(out, np.array([token]))
    assert seq.num_pending == 1 and seq.data.get_len() == 3
    s.process_outputs(out, np.array([4]))  # the same batch, now right
    with pytest.raises(ValueError, match="sampled tokens for 1 sample rows"):
        s.process_outputs(s.schedule(), np.array([1, 2]))


def test_batch_arrays_are_read_only():
    s = scheduler()
    add(s, "r", [1, 2, 3, 4, 5])
    out = s.schedule()
    names = ["seq_ids", "input_ids", "input_from_prev", "positions", "slot_mapping", "query_start_loc",
             "seq_lens", "block_tables", "sample_indices"]
    for name in names:
        arr = getattr(out, name)
        assert not arr.flags.writeable, name
        with pytest.raises(ValueError, match="read-only"):
            arr[...] = 0
        with pytest.raises(ValueError, match="WRITEABLE"):
            arr.setflags(write=True)
    assert list(out.seq_lens) == [5]
    assert s.process_outputs(out, np.array([9]))[0].output_len == 1


def test_final_output_of_abort_has_no_token_and_reads_safely():
    s = scheduler()
    add(s, "r", [1, 2, 3])
    s.process_outputs(s.schedule(), np.array([8]))
    final = s.abort("r")
    assert final.finished and final.finish_reason == "abort" and final.token_ids == [] and final.token_id is None
    assert final.output_len == 1 and "token_id=None" in repr(final)
    assert s.abort("r") is None and s.finish_request("nope", _C.SequenceStatus.FINISHED_STOPPED) is None
    with pytest.raises(ValueError, match="finished"):
        s.finish_request("r", _C.SequenceStatus.RUNNING)
    with pytest.raises(ValueError, match="finished"):
        final.clone_finished(_C.SequenceStatus.WAITING)
    s.release_outputs()
    with pytest.raises(_C.ReleasedOutputError):
        _ = final.token_id


def test_step_outputs_index_out_of_range():
    s = scheduler()
    add(s, "r", [1, 2, 3])
    outputs = s.process_outputs(s.schedule(), np.array([8]))
    assert outputs[-1].token_id == 8
    for i in (1, -2, 2**40):
        with pytest.raises(IndexError):
            outputs[i]


def paged_args(num_blocks=4, block_size=4, kv_heads=1, head_dim=8, heads=2, max_blocks=2, queries=1):
    q = np.zeros((queries, heads, head_dim), dtype=F32)
    cache = np.zeros((num_blocks, block_size, kv_heads, head_dim), dtype=F32)
    tables = np.ones((queries, max_blocks), dtype=np.int32)
    return q, cache, cache.copy(), tables, np.ones(queries, dtype=np.int32), np.zeros_like(q)


@pytest.mark.parametrize("dims", [{"block_size": 0}, {"num_blocks": 0}, {"kv_heads": 0}, {"head_dim": 0},
                                  {"heads": 0}, {"max_blocks": 0}])
def test_paged_attention_zero_sized_dims(dims):
    with pytest.raises(ValueError, match="paged_attention: .*non-zero"):
        _C.paged_attention(*paged_args(**dims), 1.0)


def test_paged_attention_edges():
    _C.paged_attention(*paged_args(queries=0), 1.0)  # no queries: nothing to do
    q, k, v, tables, lens, out = paged_args(max_blocks=1 << 20, block_size=32)
    with pytest.raises(ValueError, match="context length above"):
        _C.paged_attention(q, k, v, tables, np.array([(1 << 24) + 1], dtype=np.int32), out, 1.0)
    with pytest.raises(ValueError, match="query row outside"):
        _C.paged_attention(*paged_args(), 1.0, 1, np.array([-1], dtype=np.int32))
    with pytest.raises(ValueError, match="query_rows needs one entry"):
        _C.paged_attention(*paged_args(), 1.0, 1, np.zeros(2, dtype=np.int32))


def test_fused_ops_and_linear_zero_sized_dims():
    with pytest.raises(ValueError, match="rms_norm: the hidden size"):
        _C.rms_norm(np.zeros((2, 0), F32), None, np.zeros(0, F32), 1e-6, np.zeros((2, 0), F32))
    with pytest.raises(ValueError, match="rotary: heads and D"):
        _C.rotary(np.zeros((2, 0, 8), F32), np.zeros((2, 8), F32), np.zeros((2, 8), F32))
    with pytest.raises(ValueError, match="rotary: heads and D"):
        _C.rotary(np.zeros((2, 3, 0), F32), np.zeros((2, 0), F32), np.zeros((2, 0), F32))
    for k, n in ((0, 4), (4, 0)):
        with pytest.raises(ValueError, match="linear: K and N"):
            _C.linear(np.zeros((2, k), F32), np.zeros((n, k), F32), None, np.zeros((2, n), F32), 1)
    assert _C.argmax(np.zeros((0, 5), F32)).shape == (0,)
