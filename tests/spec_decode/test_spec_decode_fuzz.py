"""Random speculative workloads on the C++ scheduler under a tight KV cache (preemption,
prefix caching, chunked prefill, drafts right and wrong, stop tokens, varied max_tokens).

The test plays the worker with a "model" whose next token is a hash of the whole context it
reads back through the block tables from a shadow KV cache, so a slot written at the wrong
place, a rejected draft's K/V left visible, or a block freed too early changes the tokens.
Every request must end with exactly the tokens of decoding it alone one token at a time,
and every block must be free at the end."""

from __future__ import annotations

import random

import numpy as np
import pytest

from deepinfer_dp import _C

VOCAB = 50
BS = 4


def next_token(context: tuple[int, ...]) -> int:
    return hash(context) % VOCAB


def reference(prompt: list[int], limits: dict, max_seq_len: int) -> list[int]:
    out: list[int] = []
    while True:
        t = next_token(tuple(prompt + out))
        out.append(t)
        n = len(out)
        if n >= limits.get("min_tokens", 0) and t in limits.get("stop_token_ids", []):
            return out
        if n >= limits["max_tokens"] or len(prompt) + n >= max_seq_len:
            return out


def execute(out, kv: dict[int, tuple], seqs: dict[str, _C.Sequence]) -> np.ndarray:
    """Writes the fed tokens' K/V (their full prefix) and samples each row from the context
    it reads back."""
    qsl, lens, pos, ids, slots = (out.query_start_loc, out.seq_lens, out.positions, out.input_ids,
                                  out.slot_mapping)
    sampled = []
    rows = iter(out.sample_indices.tolist())
    for i, rid in enumerate(out.request_ids):
        seq = seqs[rid]
        known = seq.data.get_token_ids()
        q0, q1 = int(qsl[i]), int(qsl[i + 1])
        fed = list(known[: int(pos[q0])]) + ids[q0:q1].tolist()
        assert (ids[q0:q1] >= 0).all()  # no ZOS deferral here: every input is known
        for t in range(q0, q1):
            kv[int(slots[t])] = tuple(fed[: int(pos[t]) + 1])
        table = seq.block_table
        for t in range(q0, q1):  # each fed position reads its context back, causally
            p = int(pos[t])
            read = [kv.get(table[x // BS] * BS + x % BS) for x in range(p + 1)]
            assert read == [tuple(fed[: x + 1]) for x in range(p + 1)], f"{rid} reads a wrong KV at {p}"
        assert int(lens[i]) == int(pos[q1 - 1]) + 1
        if out.num_samples and out.sample_request_ids.count(rid):
            for t in range(q1 - 1 - int(out.num_drafts[i]), q1):
                assert next(rows) == t
                sampled.append(next_token(tuple(fed[: int(pos[t]) + 1])))
    return np.array(sampled, dtype=np.int64)


@pytest.mark.parametrize("seed", range(6))
def test_random_speculative_workloads_decode_as_one_by_one(seed):
    rng = random.Random(seed)
    cfg = dict(max_num_seqs=6, max_num_batched_tokens=rng.choice([8, 24, 64]), block_size=BS,
               num_blocks=rng.choice([14, 24]), max_model_len=40, vocab_size=VOCAB)
    sched = _C.Scheduler(_C.SchedulerConfig(**cfg))
    max_seq_len = sched.max_seq_len
    shared = [rng.randrange(VOCAB) for _ in range(8)]
    seqs, want, got = {}, {}, {}
    for r in range(12):
        prefix = (shared if r % 2 else [])[: rng.randrange(9)]  # some prompts share blocks: prefix cache hits
        prompt = prefix + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 10))]
        limits = dict(max_tokens=rng.randrange(1, 20), min_tokens=rng.choice([0, 0, 3]),
                      stop_token_ids=rng.sample(range(VOCAB), 2))
        limits["min_tokens"] = min(limits["min_tokens"], limits["max_tokens"])
        rid = f"r{r}"
        seqs[rid] = _C.Sequence(rid, prompt, _C.SequenceLimits(**limits))
        sched.add_sequence(seqs[rid])
        want[rid], got[rid] = reference(prompt, limits, max_seq_len), []
    kv: dict[int, tuple] = {}
    for _ in range(2000):
        if not sched.has_unfinished_seqs():
            break
        for seq in sched.draft_candidates():  # the true continuation, sometimes wrong from a point on
            truth = list(seq.data.get_token_ids())
            drafts = []
            for _ in range(rng.randrange(0, 6)):
                t = next_token(tuple(truth))
                drafts.append(t if rng.random() < 0.8 else (t + 1) % VOCAB)
                truth.append(drafts[-1])
            sched.set_drafts(seq, drafts)
        out = sched.schedule()
        for o in sched.process_outputs(out, execute(out, kv, seqs)):
            assert not got[o.request_id] or not got[o.request_id][-1][1], "an output after the finished one"
            got[o.request_id].append((o.token_ids[0], o.finished))
    assert not sched.has_unfinished_seqs()
    for rid in seqs:
        assert [t for t, _ in got[rid]] == want[rid], rid
    assert sched.num_free_blocks == sched.num_usable_blocks
    st = sched.stats
    assert st["spec_decode_num_accepted_tokens"] > 0
