"""Time per decode step of the C++ scheduler against a pure-Python one with the same policy.

One step = schedule() + the array hand-off the worker does (NumPy views of input ids,
positions, slot mapping, block tables, lengths) + process_outputs() of the sampled ids.

    python benchmarks/scheduler_overhead.py [--seqs 256 1024] [--steps 200]
"""

from __future__ import annotations

import argparse
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from deepinfer_dp import _C

BLOCK = 16
PROMPT = 32


@dataclass
class PySeq:
    rid: str
    tokens: list[int]
    prompt_len: int
    max_tokens: int
    eos: int
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    finished: bool = False


@dataclass
class PyOutput:
    request_id: str
    token_id: int
    finished: bool
    prompt_len: int
    output_len: int


class PyScheduler:
    """The reference: FCFS prefill-or-decode, paged blocks from a free list, stop rules."""

    def __init__(self, num_blocks: int, max_num_seqs: int, budget: int) -> None:
        self.free = deque(range(1, num_blocks))
        self.waiting: deque[PySeq] = deque()
        self.running: list[PySeq] = []
        self.max_num_seqs, self.budget = max_num_seqs, budget

    def add(self, seq: PySeq) -> None:
        self.waiting.append(seq)

    def _grow(self, seq: PySeq, upto: int) -> bool:
        need = -(-upto // BLOCK) - len(seq.blocks)
        if need > len(self.free):
            return False
        seq.blocks.extend(self.free.popleft() for _ in range(need))
        return True

    def schedule(self) -> dict:
        self.running = [s for s in self.running if not s.finished]
        batch, chunks, budget = [], [], self.budget
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            n = min(len(seq.tokens), budget)
            if not self._grow(seq, n):
                break
            self.running.append(self.waiting.popleft())
            batch.append(seq), chunks.append(n)
            budget -= n
        is_prompt = bool(batch)
        if not is_prompt:
            for seq in self.running:
                if not self._grow(seq, seq.num_computed + 1):
                    raise RuntimeError("benchmark sized to avoid preemption")
                batch.append(seq), chunks.append(1)
        ids, pos, slots, qsl, lens, samples = [], [], [], [0], [], []
        max_blocks = max(len(s.blocks) for s in batch)
        tables = np.zeros((len(batch), max_blocks), dtype=np.int32)
        for i, (seq, n) in enumerate(zip(batch, chunks, strict=True)):
            for p in range(seq.num_computed, seq.num_computed + n):
                ids.append(seq.tokens[p])
                pos.append(p)
                slots.append(seq.blocks[p // BLOCK] * BLOCK + p % BLOCK)
            seq.num_computed += n
            qsl.append(qsl[-1] + n)
            lens.append(seq.num_computed)
            samples.append(len(ids) - 1)
            tables[i, : len(seq.blocks)] = seq.blocks
        return {"seqs": batch, "is_prompt": is_prompt, "input_ids": np.array(ids), "positions": np.array(pos),
                "slot_mapping": np.array(slots), "query_start_loc": np.array(qsl, dtype=np.int32),
                "seq_lens": np.array(lens, dtype=np.int32), "block_tables": tables,
                "sample_indices": np.array(samples)}

    def process_outputs(self, out: dict, tokens: np.ndarray) -> list[PyOutput]:
        results = []
        for seq, tok in zip(out["seqs"], tokens.tolist(), strict=True):
            seq.tokens.append(tok)
            out_len = len(seq.tokens) - seq.prompt_len
            seq.finished = tok == seq.eos or out_len >= seq.max_tokens
            if seq.finished:
                self.free.extend(seq.blocks)
            results.append(PyOutput(seq.rid, tok, seq.finished, seq.prompt_len, out_len))
        return results


def hand_off(out) -> int:
    """What the worker touches per step: the arrays (zero-copy views for the C++ scheduler)."""
    get = out.__getitem__ if isinstance(out, dict) else out.__getattribute__
    arrays = [get(k) for k in ("input_ids", "positions", "slot_mapping", "query_start_loc",
                               "seq_lens", "block_tables", "sample_indices")]
    return sum(a.shape[0] for a in arrays)


def prompt_of(i: int) -> list[int]:
    return [(i * 131 + j) % 32000 for j in range(PROMPT)]


def timed_decode(sched, num_seqs: int, steps: int, num_samples) -> float:
    """Runs the untimed prefill step, then times `steps` decode steps."""
    out = sched.schedule()
    sched.process_outputs(out, np.full(num_samples(out), 7, dtype=np.int64))
    tokens = np.full(num_seqs, 7, dtype=np.int64)
    t0 = time.perf_counter()
    for _ in range(steps):
        out = sched.schedule()
        hand_off(out)
        outputs = sched.process_outputs(out, tokens)
        assert len(outputs) == num_seqs
    return (time.perf_counter() - t0) / steps


def run_cpp(num_seqs: int, steps: int) -> float:
    num_blocks = num_seqs * (-(-(PROMPT + steps + 8) // BLOCK)) + 1
    sched = _C.Scheduler(_C.SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=num_seqs * PROMPT,
                                            block_size=BLOCK, num_blocks=num_blocks, max_model_len=4096,
                                            vocab_size=32000, enable_prefix_caching=True))
    for i in range(num_seqs):
        sched.add_sequence(_C.Sequence(str(i), prompt_of(i), _C.SequenceLimits(max_tokens=10**6, eos_token_id=2)))
    return timed_decode(sched, num_seqs, steps, lambda out: out.num_samples)


def run_python(num_seqs: int, steps: int) -> float:
    num_blocks = num_seqs * (-(-(PROMPT + steps + 8) // BLOCK)) + 1
    sched = PyScheduler(num_blocks, num_seqs, num_seqs * PROMPT)
    for i in range(num_seqs):
        sched.add(PySeq(str(i), prompt_of(i), PROMPT, 10**6, 2))
    return timed_decode(sched, num_seqs, steps, lambda out: len(out["seqs"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    print(f"{'running seqs':>12} {'C++ us/step':>12} {'Python us/step':>15} {'speedup':>8}")
    for n in args.seqs:
        cpp = min(run_cpp(n, args.steps) for _ in range(3))
        py = min(run_python(n, args.steps) for _ in range(3))
        print(f"{n:>12} {cpp * 1e6:>12.1f} {py * 1e6:>15.1f} {py / cpp:>7.1f}x")


if __name__ == "__main__":
    main()
