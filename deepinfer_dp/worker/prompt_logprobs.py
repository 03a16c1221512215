"""The forward's half of prompt logprobs: which rows of a prefill step the engine wants
(PromptLogprobsSpec, handed down with the step) and how ModelRunner.forward fills them in
(compute). The requests' side, what they asked and what they have, is engine/prompt_logprobs.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class PromptLogprobsResult:
    """One step's prompt logprobs, row for row with the spec (host arrays)."""

    logprobs: np.ndarray  # float32 [M]: the target token's logprob
    top_ids: np.ndarray  # int64 [M, k]
    top_logprobs: np.ndarray  # float32 [M, k]


@dataclass
class PromptLogprobsSpec:
    """Which token rows of a prefill step need prompt logprobs; ModelRunner.forward sets `result`."""

    rows: torch.Tensor  # int64 [M]: rows of the step's flat token batch
    targets: torch.Tensor  # int64 [M]: the prompt token that each row's logits predict
    k: int  # most alternatives any of the step's requests asked for
    segments: list[tuple[str, int, int]]  # (request id, first prompt position, count), in row order
    result: PromptLogprobsResult | None = None


def compute(compute_logits, hidden: torch.Tensor, spec: PromptLogprobsSpec, rows_per_slice: int = 256) -> None:
    """Fills spec.result from the step's hidden states. Slices of rows bound the memory: a
    2048-token chunk's full logits would be 2048 x vocab floats at once."""
    lps, ids, vals = [], [], []
    for s in range(0, spec.rows.numel(), rows_per_slice):
        logprobs = compute_logits(hidden[spec.rows[s: s + rows_per_slice]]).float().log_softmax(dim=-1)
        lps.append(logprobs.gather(1, spec.targets[s: s + rows_per_slice].unsqueeze(1)).squeeze(1))
        top = logprobs.topk(spec.k, dim=-1)
        ids.append(top.indices)
        vals.append(top.values)
    spec.result = PromptLogprobsResult(torch.cat(lps).cpu().numpy(), torch.cat(ids).cpu().numpy(),
                                       torch.cat(vals).cpu().numpy())
