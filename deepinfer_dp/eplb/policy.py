"""The placement policy: which logical expert each physical slot holds, given each expert's
load (token-slots over the window), so that every rank computes about the same number of
token-slots. DeepSeek's EPLB idea in two greedy passes, written here from the idea:

1. replicate: each redundant slot goes, one at a time, to the expert with the highest load
   per replica (its tokens are split evenly among its replicas), at most one replica a rank
   while there are fewer slots per rank than experts;
2. pack: the replicas, heaviest first, each to the rank with the lowest load so far that
   has a free slot and does not hold that expert yet (greedy bin packing, equal slot counts).

DeepSeek's hierarchical variant first packs expert groups onto nodes so that tokens rarely
cross nodes; on one node there is nothing to gain from it, so only the global one is here.

Every rank runs this on the same all-reduced integer loads and gets the same placement: the
arithmetic is exact (loads compared as cross products of integers) and ties go to the lowest
index, so the ranks agree without exchanging the result.
"""

from __future__ import annotations

import numpy as np


def replicate(load: np.ndarray, num_slots: int, num_ranks: int) -> np.ndarray:
    """Replicas per logical expert (>= 1 each, summing to num_slots; at most num_ranks while
    the slots allow, so that no rank needs to hold an expert twice)."""
    replicas = np.ones(len(load), dtype=np.int64)
    for _ in range(num_slots - len(load)):
        cap = num_ranks if (replicas < num_ranks).any() else num_slots
        best = -1
        for e in range(len(load)):  # the highest load per replica: load[e]/replicas[e], exactly
            if replicas[e] < cap and (best < 0 or load[e] * replicas[best] > load[best] * replicas[e]):
                best = e
        replicas[best] += 1
    return replicas


def pack(load: np.ndarray, replicas: np.ndarray, num_ranks: int) -> list[list[int]]:
    """The logical experts each rank holds (slots per rank each), replicas heaviest first."""
    slots = int(replicas.sum()) // num_ranks
    # a replica's load is load/replicas; scale by the replicas' common multiple to stay in integers
    scale = int(np.lcm.reduce(replicas))
    items = sorted(((int(load[e]) * (scale // int(replicas[e])), e) for e in range(len(load))
                    for _ in range(int(replicas[e]))), key=lambda item: (-item[0], item[1]))
    held: list[list[int]] = [[] for _ in range(num_ranks)]
    total = [0] * num_ranks
    for weight, e in items:
        free = [r for r in range(num_ranks) if len(held[r]) < slots]
        fresh = [r for r in free if e not in held[r]] or free
        rank = min(fresh, key=lambda r: (total[r], r))
        held[rank].append(e)
        total[rank] += weight
    return held


def arrange(held: list[list[int]], current: np.ndarray) -> np.ndarray:
    """The new slot -> logical expert array: each rank's experts in its slots, an expert that
    is already in one of that rank's slots kept there (its weights need not move)."""
    slots = len(current) // len(held)
    placement = np.full(len(current), -1, dtype=np.int64)
    for rank, experts in enumerate(held):
        todo = list(experts)
        mine = range(rank * slots, (rank + 1) * slots)
        for p in mine:
            if int(current[p]) in todo:
                todo.remove(int(current[p]))
                placement[p] = current[p]
        for p in mine:
            if placement[p] < 0:
                placement[p] = todo.pop(0)
    return placement


def rebalance(load: np.ndarray, current: np.ndarray, num_ranks: int) -> np.ndarray:
    """The placement (slot -> logical expert) for `load` (int, per logical expert), moving as
    few experts as the packing allows away from `current`; `current` itself when no load."""
    if not load.any():
        return current.copy()
    replicas = replicate(load, len(current), num_ranks)
    return arrange(pack(load, replicas, num_ranks), current)


def rank_loads(load: np.ndarray, placement: np.ndarray, num_ranks: int) -> np.ndarray:
    """The expected token-slots each rank computes: an expert's load split evenly over its
    replicas."""
    replicas = np.bincount(placement, minlength=len(load))
    per_slot = load[placement] / replicas[placement]
    return per_slot.reshape(num_ranks, -1).sum(axis=1)


def balancedness(per_rank: np.ndarray) -> float:
    """vLLM's measure: mean over max of the tokens per rank (1.0 is perfect; 1.0 with no load)."""
    top = float(np.max(per_rank)) if len(per_rank) else 0.0
    return float(np.mean(per_rank)) / top if top > 0 else 1.0
