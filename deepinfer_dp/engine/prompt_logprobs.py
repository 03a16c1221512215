"""Prompt logprobs (vLLM's SamplingParams.prompt_logprobs): the log-probability of every prompt
token given the tokens before it, plus the k most likely alternatives at each position.

A prefill step computes them for the prompt positions it feeds: before the forward, the
engine names those token rows in a PromptLogprobsSpec (build_spec); ModelRunner.forward fills
the spec's result (worker/prompt_logprobs.py); post-processing copies it into the request's
PromptLogprobs (absorb). The first output of the request carries the whole array
(RequestOutput.prompt_logprobs).

Invariants: logits at position p predict prompt token p + 1, so positions 0 .. prompt_len - 2
are needed and the last prompt position is the ordinary first sample. A request asking for
prompt logprobs never reads the prefix cache (the scheduler recomputes a cached prefix, as
vLLM does), because a cache hit skips exactly the positions whose logits are needed. Chunked
prefill fills the array chunk by chunk; a preempted request recomputes its prompt and the
positions already filled are not taken again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from deepinfer_dp.worker.prompt_logprobs import PromptLogprobsSpec


@dataclass
class PromptLogprobs:
    """One request's prompt logprobs as they are computed."""

    targets: np.ndarray  # int64 [P - 1]: prompt tokens 1 .. P - 1
    k: int
    logprobs: np.ndarray = field(init=False)
    top_ids: np.ndarray = field(init=False)
    top_logprobs: np.ndarray = field(init=False)
    filled: int = 0  # positions 0 .. filled - 1 are done
    delivered: bool = False

    def __post_init__(self) -> None:
        n = len(self.targets)
        self.logprobs = np.zeros(n, dtype=np.float32)
        self.top_ids = np.zeros((n, self.k), dtype=np.int64)
        self.top_logprobs = np.zeros((n, self.k), dtype=np.float32)

    @classmethod
    def for_prompt(cls, prompt_token_ids: list[int], k: int) -> PromptLogprobs:
        return cls(np.asarray(prompt_token_ids[1:], dtype=np.int64), k)

    @property
    def complete(self) -> bool:
        return self.filled >= len(self.targets)


def build_spec(sched_out, states: dict[str, PromptLogprobs], device: torch.device) -> PromptLogprobsSpec | None:
    """The rows of a prefill step whose logits the requests in `states` still need."""
    qsl, positions = sched_out.query_start_loc, sched_out.positions
    rows: list[np.ndarray] = []
    segments: list[tuple[str, int, int]] = []
    for i, rid in enumerate(sched_out.request_ids):
        state = states.get(rid)
        if state is None or state.complete:
            continue
        first_row, start = int(qsl[i]), int(positions[qsl[i]])
        lo, hi = max(start, state.filled), min(start + int(qsl[i + 1]) - first_row, len(state.targets))
        if lo < hi:
            rows.append(np.arange(first_row + lo - start, first_row + hi - start, dtype=np.int64))
            segments.append((rid, lo, hi - lo))
    if not segments:
        return None
    targets = np.concatenate([states[rid].targets[lo: lo + n] for rid, lo, n in segments])
    k = max(states[rid].k for rid, _, _ in segments)
    return PromptLogprobsSpec(torch.from_numpy(np.concatenate(rows)).to(device),
                              torch.from_numpy(targets).to(device), k, segments)


def absorb(spec: PromptLogprobsSpec, states: dict[str, PromptLogprobs]) -> None:
    """Copies a computed spec into the requests' arrays."""
    res, row = spec.result, 0
    for rid, lo, n in spec.segments:
        state = states.get(rid)
        if state is not None:  # (gone: aborted meanwhile)
            state.logprobs[lo: lo + n] = res.logprobs[row: row + n]
            state.top_ids[lo: lo + n] = res.top_ids[row: row + n, : state.k]
            state.top_logprobs[lo: lo + n] = res.top_logprobs[row: row + n, : state.k]
            state.filled = max(state.filled, lo + n)
        row += n
