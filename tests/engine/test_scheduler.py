"""Contract tests of the C++ scheduler, block manager and output pool with a fake model."""

from __future__ import annotations

import numpy as np
import pytest
from fake_model import FakeModel, add, make_scheduler, run

from deepinfer_dp import _C


def fresh(**kw):
    sched = make_scheduler(**kw)
    cfg = sched.config
    return sched, FakeModel(cfg.num_blocks, cfg.block_size, cfg.vocab_size)


def test_refill_frees_slot_for_next_job():
    # Three jobs: A, B, C need 2, 4, 1 tokens; two slots; all arrive at once. C must take the
    # slot A frees (continuous batching), not wait for B.
    sched, model = fresh(max_num_seqs=2)
    for rid, n in [("A", 2), ("B", 4), ("C", 1)]:
        add(sched, rid, [1, 2, 3], max_tokens=n)
    res = run(sched, model)
    steps = {rid: s for rid, (s, _) in res["finished"].items()}
    assert steps["A"] == 2
    assert steps["C"] == 3  # prefill A+B, decode A+B, prefill C -- not 5 as with fixed batches
    assert {rid: len(t) for rid, t in res["tokens"].items()} == {"A": 2, "B": 4, "C": 1}
    assert all(reason == "length" for _, reason in res["finished"].values())


@pytest.mark.parametrize("zos", [False, True])
def test_chunked_prefill_splits_long_prompt(zos):
    prompt = [(i * 7) % 50 for i in range(100)]
    sched, model = fresh(max_num_batched_tokens=32)
    add(sched, "long", prompt, max_tokens=5)
    res = run(sched, model, zos=zos)
    assert model.scheduled_tokens[:4] == [32, 32, 32, 4]
    assert model.prompt_steps[:4] == [True] * 4
    ref_sched, ref_model = fresh(max_num_batched_tokens=512)
    add(ref_sched, "long", prompt, max_tokens=5)
    assert res["tokens"] == run(ref_sched, ref_model)["tokens"]


def test_only_last_chunk_samples():
    sched, _ = fresh(max_num_batched_tokens=16)
    add(sched, "r", list(range(40)), max_tokens=2)
    samples = []
    for _ in range(3):
        out = sched.schedule()
        samples.append(out.num_samples)
        sched.process_outputs(out, np.zeros(out.num_samples, dtype=np.int64))
    assert samples == [0, 0, 1]


def _workload(sched):
    for i in range(6):
        add(sched, f"r{i}", [(i * 5 + j) % 50 for j in range(6 + i)], max_tokens=12 + i)


@pytest.mark.parametrize("zos", [False, True])
def test_preemption_under_tiny_cache_gives_same_tokens(zos):
    sched, model = fresh(num_blocks=12, block_size=4)
    _workload(sched)
    start_free = sched.num_free_blocks
    res = run(sched, model, zos=zos)
    assert sched.stats["num_preemptions"] > 0
    ref_sched, ref_model = fresh(num_blocks=256, block_size=4)
    _workload(ref_sched)
    ref = run(ref_sched, ref_model)
    assert ref_sched.stats["num_preemptions"] == 0
    assert res["tokens"] == ref["tokens"]
    assert all(len(res["tokens"][f"r{i}"]) == 12 + i for i in range(6))
    assert sched.num_free_blocks == start_free


def test_zos_driver_matches_plain_driver():
    a_sched, a_model = fresh()
    b_sched, b_model = fresh()
    _workload(a_sched)
    _workload(b_sched)
    assert run(a_sched, a_model, zos=True)["tokens"] == run(b_sched, b_model)["tokens"]


def test_prefix_cache_hit_skips_shared_blocks():
    shared = [(3 * j) % 50 for j in range(32)]
    sched, model = fresh(block_size=16, max_num_batched_tokens=256)
    add(sched, "first", shared + [1, 2, 3], max_tokens=3)
    run(sched, model)
    model.scheduled_tokens.clear()
    add(sched, "second", shared + [4, 5, 6, 7], max_tokens=3)
    res = run(sched, model)
    assert model.scheduled_tokens[0] == 4  # 32 cached tokens skipped
    assert sched.get_sequence("second") is None
    assert sched.stats["prefix_hit_tokens"] == 32
    ref_sched, ref_model = fresh(block_size=16, enable_prefix_caching=False)
    add(ref_sched, "second", shared + [4, 5, 6, 7], max_tokens=3)
    assert res["tokens"] == run(ref_sched, ref_model)["tokens"]


def test_prompts_sharing_a_prefix_in_one_step_compute_it_once():
    shared = [(7 * j) % 50 for j in range(32)]
    sched, model = fresh(block_size=16, max_num_batched_tokens=256)
    add(sched, "a", shared + [1, 2], max_tokens=3)
    add(sched, "lone", [(3 * j + 1) % 50 for j in range(20)], max_tokens=3)
    add(sched, "b", shared + [3, 4, 5], max_tokens=3)
    first = sched.schedule()
    # "b" would recompute the two blocks "a" computes now: it waits one step; "lone" shares
    # nothing and is not held back by it.
    assert [m.request_id for m in first.seq_metadata()] == ["a", "lone"]
    sched.process_outputs(first, model.forward(first, None))
    second = sched.schedule()
    assert [(m.request_id, m.seqlen_q) for m in second.seq_metadata()] == [("b", 3)]
    assert sched.stats["prefix_hit_tokens"] == 32
    got = [t for o in sched.process_outputs(second, model.forward(second, None)) if o.request_id == "b"
           for t in o.token_ids]
    got += run(sched, model)["tokens"]["b"]
    ref_sched, ref_model = fresh(block_size=16, enable_prefix_caching=False)
    add(ref_sched, "b", shared + [3, 4, 5], max_tokens=3)
    assert got == run(ref_sched, ref_model)["tokens"]["b"]


def test_prefix_cache_can_be_switched_off():
    shared = list(range(32))
    sched, model = fresh(block_size=16, enable_prefix_caching=False)
    add(sched, "a", shared + [1], max_tokens=2)
    run(sched, model)
    model.scheduled_tokens.clear()
    add(sched, "b", shared + [2], max_tokens=2)
    run(sched, model)
    assert model.scheduled_tokens[0] == 33
    assert sched.stats["prefix_hit_tokens"] == 0


def test_reset_prefix_cache_forgets_cached_prefixes_but_not_while_blocks_are_held():
    shared = [(5 * j) % 50 for j in range(32)]
    sched, model = fresh(block_size=16, max_num_batched_tokens=256)
    add(sched, "first", shared + [1], max_tokens=3)
    run(sched, model)
    add(sched, "held", [9, 8, 7], max_tokens=3)
    sched.schedule()  # "held" now holds a block
    assert not sched.reset_prefix_cache()
    sched, model = fresh(block_size=16, max_num_batched_tokens=256)
    add(sched, "first", shared + [1], max_tokens=3)
    run(sched, model)
    assert sched.reset_prefix_cache()
    model.scheduled_tokens.clear()
    add(sched, "second", shared + [2], max_tokens=3)
    run(sched, model)
    assert model.scheduled_tokens[0] == 33  # prefilled again
    assert sched.stats["prefix_hit_tokens"] == 0


def test_shared_blocks_stay_alive_while_in_use():
    shared = [(5 * j) % 50 for j in range(32)]
    sched, model = fresh(block_size=16, max_num_batched_tokens=256)
    add(sched, "a", shared + [9], max_tokens=20)
    out = sched.schedule()
    sched.process_outputs(out, model.forward(out, None))
    add(sched, "b", shared + [8], max_tokens=20)
    out = sched.schedule()
    sched.process_outputs(out, model.forward(out, None))
    shared_blocks = sched.get_sequence("a").block_table[:2]
    assert sched.get_sequence("b").block_table[:2] == shared_blocks
    assert [sched.block_ref_count(b) for b in shared_blocks] == [2, 2]
    assert sched.abort("a")
    assert [sched.block_ref_count(b) for b in shared_blocks] == [1, 1]
    # Churn through fresh requests: the held blocks must not be handed out again.
    for i in range(4):
        add(sched, f"x{i}", [(i + j) % 50 for j in range(30)], max_tokens=4)
    res = run(sched, model)
    ref_sched, ref_model = fresh(block_size=16, enable_prefix_caching=False)
    add(ref_sched, "b", shared + [8], max_tokens=20)
    assert res["tokens"]["b"][-19:] == run(ref_sched, ref_model)["tokens"]["b"][1:]


def test_abort_frees_blocks():
    sched, model = fresh()
    start = sched.num_free_blocks
    for i in range(3):
        add(sched, f"r{i}", list(range(1, 20)), max_tokens=50)
    for _ in range(3):
        out = sched.schedule()
        sched.process_outputs(out, model.forward(out, None))
    assert sched.num_free_blocks < start
    assert sched.abort("r1") and not sched.abort("r1") and not sched.abort("nope")
    for rid in ("r0", "r2"):
        sched.abort(rid)
    assert sched.num_free_blocks == start
    assert not sched.has_unfinished_seqs()


def test_pooled_output_raises_after_release_and_clone_survives():
    sched, model = fresh()
    add(sched, "r", [1, 2, 3], max_tokens=4)
    out = sched.schedule()
    outputs = sched.process_outputs(out, model.forward(out, None))
    raw = outputs[0]
    kept = raw.clone()
    token = raw.token_id
    assert raw.is_pooled and not kept.is_pooled
    sched.schedule()  # the next step releases the pool
    with pytest.raises(_C.ReleasedOutputError, match="released"):
        _ = raw.token_id
    with pytest.raises(RuntimeError):
        _ = raw.request_id
    assert not raw.is_valid
    assert kept.token_id == token and kept.request_id == "r" and kept.is_valid


def test_stop_rules():
    sched, _ = fresh()
    add(sched, "eos", [1, 2], max_tokens=10, eos_token_id=7)
    add(sched, "stopid", [1, 2], max_tokens=10, stop_token_ids=[7])
    add(sched, "ignore", [1, 2], max_tokens=3, eos_token_id=7, ignore_eos=True)
    add(sched, "min", [1, 2], max_tokens=10, min_tokens=2, eos_token_id=7)
    seen: dict[str, list] = {}
    while sched.has_unfinished_seqs():
        out = sched.schedule()
        for o in sched.process_outputs(out, np.full(out.num_samples, 7, dtype=np.int64)):
            seen.setdefault(o.request_id, []).append((o.token_id, o.finish_reason))
    assert seen["eos"] == [(7, "stop")]
    assert seen["stopid"] == [(7, "stop")]
    assert seen["ignore"][-1] == (7, "length") and len(seen["ignore"]) == 3
    assert seen["min"] == [(7, None), (7, "stop")]


@pytest.mark.parametrize(
    "prompt, limits, match",
    [
        ([], {}, "prompt is empty"),
        ([1, 50], {}, "token id 50 at position 1 is outside the vocabulary"),
        ([1, -3], {}, "token id -3"),
        (list(range(40)) * 13, {}, "context length"),
        ([1, 2], {"max_tokens": 0}, "max_tokens must be at least 1"),
        ([1, 2], {"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ],
)
def test_bad_input_is_refused(prompt, limits, match):
    sched, _ = fresh()
    with pytest.raises(ValueError, match=match) as err:
        add(sched, "req-7", prompt, **limits)
    assert "req-7" in str(err.value)
    assert not sched.has_unfinished_seqs()


def test_prompt_larger_than_whole_cache_is_refused():
    sched, _ = fresh(num_blocks=5, block_size=4)
    with pytest.raises(ValueError, match="KV cache blocks"):
        add(sched, "big", list(range(20)))


def test_duplicate_request_id_is_refused():
    sched, _ = fresh()
    add(sched, "dup", [1])
    with pytest.raises(ValueError, match="already"):
        add(sched, "dup", [2])


def test_block_zero_is_never_handed_out():
    sched, model = fresh(num_blocks=12, block_size=4)
    _workload(sched)
    while sched.has_unfinished_seqs():
        out = sched.schedule()
        if out.num_seqs:
            assert (np.asarray(out.slot_mapping) >= 4).all()
        sched.process_outputs(out, model.forward(out, None))


def test_arrays_and_metadata_agree():
    sched, _ = fresh(block_size=4)
    add(sched, "a", list(range(1, 10)), max_tokens=3)
    add(sched, "b", list(range(1, 4)), max_tokens=3)
    out = sched.schedule()
    assert out.is_prompt and out.num_tokens == 12 and out.num_seqs == 2
    assert list(out.query_start_loc) == [0, 9, 12]
    assert list(out.seq_lens) == [9, 3]
    assert list(out.sample_indices) == [8, 11]
    assert out.block_tables.shape == (2, 3)
    md = out.seq_metadata()
    assert [m.request_id for m in md] == ["a", "b"]
    assert [m.seqlen_q for m in md] == [9, 3] and all(m.do_sample for m in md)
    assert md[0].block_table == list(out.block_tables[0])
    seq = sched.get_sequence("a")
    assert seq.data.get_prompt_len() == 9 and seq.num_computed == 9 and seq.num_pending == 1
    sched.process_outputs(out, np.array([5, 6]))
    assert seq.data.get_len() == 10 and seq.data.get_output_len() == 1 and seq.data.get_last_token_id() == 5
    assert seq.num_processed == 9 and seq.status == _C.SequenceStatus.RUNNING
