"""M-RoPE positions (Qwen2-VL, Qwen2.5-VL): three position rows, temporal, height and width.

A text token has the same position in all three rows; an image's tokens take their grid
coordinates, offset by where the image starts; the text after an image resumes past the
larger side of its grid. A prompt's table is transformers' `get_rope_index` (images only);
every token after the prompt (generated, or recomputed after preemption) sits at its
position plus the prompt's `delta`, equal in all three rows, which is plain RoPE: so a
decode step takes the usual one-row positions, and the C++ decode path with them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np


@dataclass
class MRopePositions:
    table: np.ndarray  # int64 [3, prompt tokens]
    delta: int  # a token at position p >= the prompt's length sits at p + delta in every row


def rope_index(num_tokens: int, images: list[tuple[np.ndarray, tuple[int, int, int]]],
               spatial_merge_size: int) -> MRopePositions:
    """The prompt's table from each image's placeholder positions (one consecutive run, in
    prompt order) and its (t, h, w) patch grid, as transformers' get_rope_index computes it."""
    table = np.empty((3, num_tokens), dtype=np.int64)
    current, text_start = 0, 0
    for positions, (t, h, w) in images:
        start, n = int(positions[0]), len(positions)
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        if n != t * gh * gw or int(positions[-1]) != start + n - 1:
            raise ValueError(f"an image with grid {(t, h, w)} needs {t * gh * gw} consecutive placeholder "
                             f"tokens; the prompt has {n} at {start}..{int(positions[-1])}")
        table[:, text_start:start] = current + np.arange(start - text_start)
        current += start - text_start
        grid = np.stack(np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")).reshape(3, -1)
        table[:, start:start + n] = grid + current
        current += max(h, w) // spatial_merge_size
        text_start = start + n
    table[:, text_start:] = current + np.arange(num_tokens - text_start)
    return MRopePositions(table, int(table.max()) + 1 - num_tokens if num_tokens else 0)


def step_positions(request_ids: list[str], query_start_loc: np.ndarray, positions: np.ndarray,
                   prompts: Mapping[str, MRopePositions]) -> np.ndarray | None:
    """A step's positions for an M-RoPE model: [T] where every row has its three positions
    equal, else [3, T]; None when no scheduled sequence has a table (positions as scheduled)."""
    out = None
    for i, rid in enumerate(request_ids):
        m = prompts.get(rid)
        if m is None:
            continue
        if out is None:
            out = np.broadcast_to(np.asarray(positions, dtype=np.int64), (3, len(positions))).copy()
        lo, hi = int(query_start_loc[i]), int(query_start_loc[i + 1])
        p = np.asarray(positions[lo:hi], dtype=np.int64)
        n = m.table.shape[1]
        out[:, lo:hi] = np.where(p < n, m.table[:, np.minimum(p, n - 1)], p + m.delta)
    if out is None:
        return None
    if (out[0] == out[1]).all() and (out[0] == out[2]).all():
        return out[0]
    return out
