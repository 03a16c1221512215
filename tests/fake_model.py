"""A fake "model" for scheduler tests: no weights, a deterministic next token.

It keeps its own paged "KV cache" of token ids, written through the scheduler's slot
mapping and read back through its block tables, so a wrong slot, a block freed while in
use or a bad prefix-cache hit changes the tokens it picks.
"""

from __future__ import annotations

import numpy as np

from deepinfer_dp import _C
from deepinfer_dp.sampling_params import DEFAULT_MAX_TOKENS


class FakeModel:
    def __init__(self, num_blocks: int, block_size: int, vocab_size: int) -> None:
        self.cache = np.full(num_blocks * block_size, -1, dtype=np.int64)
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.scheduled_tokens: list[int] = []  # tokens fed per step
        self.prompt_steps: list[bool] = []

    def next_token(self, context: np.ndarray) -> int:
        weights = np.arange(1, len(context) + 1, dtype=np.int64)
        return int((context * weights).sum() * 7 + len(context)) % self.vocab_size

    def forward(self, out: _C.SchedulerOutput, prev_tokens: np.ndarray | None) -> np.ndarray:
        ids = np.array(out.input_ids, dtype=np.int64)
        from_prev = np.asarray(out.input_from_prev)
        if (from_prev >= 0).any():
            ids[from_prev >= 0] = prev_tokens[from_prev[from_prev >= 0]]
        self.cache[np.asarray(out.slot_mapping)] = ids
        self.scheduled_tokens.append(out.num_tokens)
        self.prompt_steps.append(out.is_prompt)
        sampled = []
        sample_set = set(np.asarray(out.sample_indices).tolist())
        qsl, bt, lens = out.query_start_loc, out.block_tables, out.seq_lens
        for i in range(out.num_seqs):
            if int(qsl[i + 1]) - 1 not in sample_set:
                continue
            n = int(lens[i])
            pos = np.arange(n)
            slots = bt[i][pos // self.block_size].astype(np.int64) * self.block_size + pos % self.block_size
            context = self.cache[slots]
            assert (context >= 0).all(), "read an unwritten KV slot"
            sampled.append(self.next_token(context))
        return np.array(sampled, dtype=np.int64)


def make_scheduler(**kw) -> _C.Scheduler:
    cfg = dict(max_num_seqs=8, max_num_batched_tokens=64, block_size=4, num_blocks=128,
               max_model_len=512, vocab_size=50, enable_prefix_caching=True)
    cfg.update(kw)
    return _C.Scheduler(_C.SchedulerConfig(**cfg))


def add(sched: _C.Scheduler, rid: str, prompt: list[int], **limits) -> None:
    limits = {"max_tokens": DEFAULT_MAX_TOKENS, **limits}  # the C++ side has no default
    sched.add_sequence(_C.Sequence(rid, prompt, _C.SequenceLimits(**limits)))


def run(sched: _C.Scheduler, model: FakeModel, zos: bool = False, max_steps: int = 10_000) -> dict:
    """Drive the step loop; returns {request_id: [tokens]} plus per-request finish step and reason.

    With zos=True a decode step's post-processing is deferred to the next step, as the
    worker does: the model reads the in-flight tokens, then the previous step is processed.
    """
    tokens: dict[str, list[int]] = {}
    finished: dict[str, tuple[int, str]] = {}
    prev = None
    step = 0

    def collect(outputs) -> None:
        for o in outputs:
            tokens.setdefault(o.request_id, []).extend(o.token_ids)
            if o.finished:
                finished[o.request_id] = (step, o.finish_reason)

    while sched.has_unfinished_seqs() or prev is not None:
        step += 1
        assert step <= max_steps, "scheduler did not converge"
        out = sched.schedule()
        sampled = model.forward(out, prev[1] if prev else None)
        if prev is not None:
            collect(sched.process_outputs(*prev))
            prev = None
        if zos and not out.is_prompt and not out.is_empty():
            prev = (out, sampled)
        else:
            collect(sched.process_outputs(out, sampled))
    return {"tokens": tokens, "finished": finished, "steps": step}
