"""A reference model of the C++ scheduler's contract, driven through the binding; the fuzz in
test_scheduler_fuzz.py runs random operations on it and checks the contract after each.

The harness plays the worker: it executes every batch as soon as it is scheduled (writing a
shadow KV cache and "sampling" a token from the context it reads back), and post-processes
it at once, or one step later for a ZOS decode step, exactly as Worker.execute_model_step
does. It keeps each request's true history, including tokens sampled but not yet processed,
and checks:

- every block's ref count equals the number of live sequences holding it; block 0 stays
  pinned; the free count is the number of unheld blocks (free + used = usable);
- a batch writes no slot twice and never into a block another sequence also holds; its
  positions, slots, inputs (in-flight ones from the previous step's samples) and sample
  rows agree with the sequences;
- the context each sequence reads (every slot through its block table) holds exactly its own
  history: the shadow cache keys each slot by the prefix that was written there; with a
  sliding window (`sliding_window` in the config) that is each step's window, and the blocks
  before it, freed, show as a leading run of block 0 in the table; with KV groups
  (`num_kv_groups`, the table interleaving one block per group) each group's blocks are
  checked so, the full groups (`num_full_kv_groups`) reading and keeping everything;
- every request ends with exactly one finished output, last, with the reason the stop rules
  give (stop / length / abort) and the right token count; and after a drain every block is
  free again;
- a pooled output raises once released, and its clone keeps the values.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from deepinfer_dp import _C
from deepinfer_dp.sampling_params import DEFAULT_MAX_TOKENS

REASONS = {_C.SequenceStatus.FINISHED_STOPPED: "stop", _C.SequenceStatus.FINISHED_LENGTH: "length",
           _C.SequenceStatus.FINISHED_ABORTED: "abort"}


@dataclass
class Request:
    seq: _C.Sequence
    prompt: list[int]
    limits: dict
    tokens: list[int] = field(default_factory=list)  # processed outputs: the C++ history past the prompt
    inflight: list[int] = field(default_factory=list)  # sampled, not processed yet
    final: object | None = None  # clone of its finished output

    def history(self) -> list[int]:
        return self.prompt + self.tokens + self.inflight


class SchedulerHarness:
    def __init__(self, cfg: dict, salt: int = 0) -> None:
        self.cfg = cfg
        self.sched = _C.Scheduler(_C.SchedulerConfig(**cfg))
        self.bs = cfg["block_size"]
        self.num_blocks = cfg["num_blocks"]
        self.groups = cfg.get("num_kv_groups", 1)
        self.full_groups = cfg.get("num_full_kv_groups", 0)
        self.max_seq_len = min(cfg["max_model_len"], (self.num_blocks - 1) // self.groups * self.bs + 1)
        assert self.sched.max_seq_len == self.max_seq_len
        self.vocab = cfg["vocab_size"]
        self.window = cfg.get("sliding_window", 0)
        self.salt = salt
        self.requests: dict[str, Request] = {}
        self.kv: dict[int, int] = {}  # slot -> key of the history prefix whose last position it holds
        self.deferred: tuple | None = None  # (batch, sampled) of a ZOS decode step
        self.last_sampled = np.empty(0, dtype=np.int64)  # the previous batch's samples
        self.last_outputs: list = []  # pooled outputs valid until the next release
        self.kept: list[tuple] = []  # (pooled, clone, expected fields)
        self.next_id = 0
        self.ops = 0
        self.steps = 0

    # ---- operations ----------------------------------------------------------------------
    def add(self, prompt: list[int], **limits) -> str | None:
        self.ops += 1
        rid = f"r{self.next_id}"
        self.next_id += 1
        limits = {"max_tokens": DEFAULT_MAX_TOKENS, **limits}  # the C++ side has no default
        seq = _C.Sequence(rid, prompt, _C.SequenceLimits(**limits))
        fits = len(prompt) < self.max_seq_len
        try:
            self.sched.add_sequence(seq)
        except ValueError as e:
            assert not fits, f"refused a prompt of {len(prompt)} tokens under max_seq_len {self.max_seq_len}: {e}"
            return None
        assert fits, f"admitted a prompt of {len(prompt)} tokens under max_seq_len {self.max_seq_len}"
        self.requests[rid] = Request(seq, list(prompt), limits)
        return rid

    def step(self, zos: bool) -> None:
        """One engine step: schedule, execute, post-process the deferred step, then this one
        now, or later when ZOS defers a decode step."""
        self.ops += 1
        self.steps += 1
        had_work = self.sched.has_unfinished_seqs()
        out = self.sched.schedule()  # releases the pool
        self._check_released()
        assert not (out.is_empty() and had_work and self.deferred is None), \
            "the scheduler stalled: work waits, nothing is in flight, and the batch is empty"
        sampled = self._execute(out)
        prev, self.deferred = self.deferred, None
        if prev is not None:
            self._process(*prev)
        if out.is_prompt or out.is_empty() or not zos:
            self._process(out, sampled)
        else:
            self.deferred = (out, sampled)

    def flush(self) -> None:
        self.ops += 1
        prev, self.deferred = self.deferred, None
        if prev is not None:
            self._process(*prev)

    def release(self) -> None:
        self.ops += 1
        self.sched.release_outputs()
        self._check_released()

    def clone_one(self, index: int) -> None:
        self.ops += 1
        if self.last_outputs:
            o = self.last_outputs[index % len(self.last_outputs)]
            self.kept.append((o, o.clone(), _fields(o)))
            assert _fields(self.kept[-1][1]) == _fields(o)

    def finish(self, rid: str, status) -> None:
        """abort() or finish_request(): the request's final output comes back at once."""
        self.ops += 1
        req = self.requests.get(rid)
        live = req is not None and req.final is None
        got = self.sched.abort(rid) if status == _C.SequenceStatus.FINISHED_ABORTED \
            else self.sched.finish_request(rid, status)
        assert (got is not None) == live, f"{rid}: live={live} but finish returned {got}"
        if got is not None:
            assert got.finished and got.finish_reason == REASONS[status] and got.token_ids == []
            assert got.output_len == len(req.tokens) and got.prompt_len == len(req.prompt)
            req.final = got.clone()
            self.last_outputs.append(got)

    def live_ids(self) -> list[str]:
        return [rid for rid, r in self.requests.items() if r.final is None]

    def drain(self, zos: bool) -> None:
        """Steps until every request has finished; then every block must be free again."""
        work = sum(len(r.prompt) + r.limits["max_tokens"] for r in self.requests.values())
        bound = 20 * work + 50
        for _ in range(bound):
            if not (self.sched.has_unfinished_seqs() or self.deferred is not None):
                break
            self.step(zos)
            self.check_invariants()
        else:
            raise AssertionError(f"not drained after {bound} steps: {self.live_ids()} unfinished")
        self.flush()
        self.check_invariants()
        assert not self.live_ids()
        assert self.sched.num_free_blocks == self.sched.num_usable_blocks == self.num_blocks - 1

    # ---- one batch -----------------------------------------------------------------------
    def _execute(self, out) -> np.ndarray:
        """Checks the batch against the sequences, writes the shadow KV, reads every context
        back and samples; returns the sampled tokens by sample row."""
        qsl, lens = out.query_start_loc, out.seq_lens
        assert not any(a.flags.writeable for a in (qsl, lens, out.slot_mapping, out.block_tables))
        assert len(qsl) == out.num_seqs + 1 and qsl[0] == 0 and qsl[-1] == out.num_tokens
        slots = out.slot_mapping.tolist()
        assert len(set(slots)) == len(slots), "a slot is written twice in one batch"
        assert out.has_inflight_inputs == bool((out.input_ids < 0).any())
        sample_rids, sampled = out.sample_request_ids, []
        for i, rid in enumerate(out.request_ids):
            req = self.requests[rid]
            assert req.final is None, f"{rid} is scheduled after it finished"
            q0, q1, length = int(qsl[i]), int(qsl[i + 1]), int(lens[i])
            hist = req.history()
            assert 1 <= q1 - q0 <= length <= len(hist), f"{rid}: query [{q0}, {q1}) context {length}"
            table = req.seq.block_table
            row = out.block_tables[i].tolist()
            assert row[:len(table)] == table and not any(row[len(table):])
            assert len(table) % self.groups == 0 and len(table) // self.groups * self.bs >= length
            keys = _prefix_keys(hist[:length])
            first_query = length - (q1 - q0)
            for g in range(self.groups):
                blocks = table[g::self.groups]
                for t, p in zip(range(q0, q1), range(first_query, length), strict=True):
                    self._write(out, t, p, blocks, hist, keys[p], g)
                # a sliding group reads from its window's first position on, a full group all
                window = self.window if g >= self.full_groups else 0
                for p in range(max(0, first_query + 1 - window) if window else 0, length):
                    slot = blocks[p // self.bs] * self.bs + p % self.bs
                    assert self.kv.get(slot) == keys[p], f"{rid} group {g} reads a wrong KV at {p} (slot {slot})"
            if length == len(hist):  # all known tokens computed: it samples
                r = len(sampled)
                assert sample_rids[r] == rid and out.sample_indices[r] == q1 - 1
                sampled.append(self._next_token(keys[-1], length))
                req.inflight.append(sampled[-1])
        assert len(sampled) == out.num_samples == len(sample_rids)
        self.last_sampled = np.array(sampled, dtype=np.int64)
        return self.last_sampled

    def _write(self, out, t: int, p: int, table: list[int], hist: list[int], key: int, group: int) -> None:
        block = table[p // self.bs]
        slot = block * self.bs + p % self.bs
        assert out.positions[t] == p and out.slot_mapping[t * self.groups + group] == slot
        assert block != 0 and self.sched.block_ref_count(block) == 1, f"write into shared block {block}"
        if out.input_ids[t] >= 0:
            assert out.input_ids[t] == hist[p] and out.input_from_prev[t] == -1
        else:  # the token sampled by the previous step, still in flight
            assert self.last_sampled[out.input_from_prev[t]] == hist[p]
        self.kv[slot] = key

    def _next_token(self, key: int, length: int) -> int:
        return (key * 31 + length + self.salt) % self.vocab

    def _process(self, out, sampled: np.ndarray) -> None:
        outputs = list(self.sched.process_outputs(out, sampled))
        live = []
        for rid in out.sample_request_ids:  # every sampled token leaves the in-flight list
            req = self.requests[rid]
            token = req.inflight.pop(0)
            if req.final is None:
                live.append((rid, token))
        assert [o.request_id for o in outputs] == [rid for rid, _ in live]
        for o, (rid, token) in zip(outputs, live, strict=True):
            req = self.requests[rid]
            req.tokens.append(token)
            assert o.token_ids == [token] and o.output_len == len(req.tokens) and o.prompt_len == len(req.prompt)
            reason = self._reason(req, token)
            assert o.finished == (reason is not None) and o.finish_reason == reason, \
                f"{rid}: got {o.finish_reason}, want {reason}"
            if reason is not None:
                req.final = o.clone()
        self.last_outputs.extend(outputs)

    def _reason(self, req: Request, token: int) -> str | None:
        """The stop rules: a stop token once min_tokens are out, else a length limit."""
        lim, n = req.limits, len(req.tokens)
        eos = lim.get("eos_token_id", -1)
        stop = (not lim.get("ignore_eos", False) and token == eos) or token in lim.get("stop_token_ids", [])
        if n >= lim.get("min_tokens", 0) and stop:
            return "stop"
        if n >= lim["max_tokens"] or len(req.prompt) + n >= self.max_seq_len:
            return "length"
        return None

    def _check_released(self) -> None:
        for pooled, clone, expected in self.kept:
            assert not pooled.is_valid and _fields(clone) == expected
            try:
                _ = pooled.request_id
            except _C.ReleasedOutputError:
                pass
            else:
                raise AssertionError("a released pooled output still reads")
        self.kept.clear()
        self.last_outputs = []

    # ---- after every operation -----------------------------------------------------------
    def check_invariants(self) -> None:
        sched, holders, live = self.sched, Counter(), 0
        for rid, r in self.requests.items():
            table = r.seq.block_table
            if r.final is not None:
                assert table == [] and r.seq.is_finished and sched.get_sequence(rid) is None
                assert r.seq.finish_reason == r.final.finish_reason
                continue
            live += 1
            held = [b for b in table if b != 0]
            for g in range(self.groups):  # only a sliding group's window frees, and only leading blocks
                blocks = table[g::self.groups]
                freed = sum(1 for b in blocks if b == 0)
                assert 0 not in blocks[freed:]
                assert freed == 0 or (self.window > 0 and g >= self.full_groups)
            assert not r.seq.is_finished and len(set(held)) == len(held)
            assert r.seq.data.get_token_ids() == r.prompt + r.tokens and r.seq.num_pending == len(r.inflight)
            holders.update(held)
        assert sched.block_ref_count(0) == 1, "block 0 must stay pinned"
        refs = [sched.block_ref_count(b) for b in range(1, self.num_blocks)]
        for b, rc in enumerate(refs, start=1):
            assert rc == holders[b], f"block {b}: ref count {rc}, held by {holders[b]} sequences"
        free = refs.count(0)
        assert sched.num_free_blocks == free and free + (len(refs) - free) == sched.num_usable_blocks
        assert sched.num_waiting + sched.num_running == live and sched.has_unfinished_seqs() == (live > 0)


def _prefix_keys(tokens: list[int]) -> list[int]:
    """keys[p] identifies tokens[:p + 1] (a chained hash, as the KV at p depends on all of it)."""
    keys, h = [], 0
    for t in tokens:
        h = hash((h, t))
        keys.append(h)
    return keys


def _fields(o) -> tuple:
    return (o.request_id, tuple(o.token_ids), o.finished, o.finish_reason, o.output_len)
