"""Packed weights moved into memory backed by 2 MB pages.

At a few sequences a decode step streams every weight byte from memory once. In 4 KB pages
that is a TLB miss and a page walk every 4 KB: some 45,000 a step for Gemma 3 270M's 178 MB
lm_head alone. Linux backs anonymous memory with transparent huge pages where the process
asks for them (madvise(MADV_HUGEPAGE); `madvise` is the usual system setting), and the
arrays safetensors reads and the per-layer concatenations are not asked for. So after
loading, every packed matrix is copied into one 2 MB-aligned arena that is. The bytes are
the same, so every product is too.
"""

from __future__ import annotations

import dataclasses
import logging

from torch import nn

from deepinfer_dp.layers.packed import PackedEmbedding, PackedLinear, PackedWeight
from deepinfer_dp.layers.packed_parts import PackedParts
from deepinfer_dp.utils.cpu_malloc import advised_arena

logger = logging.getLogger(__name__)

ALIGN = 64  # each matrix on a cache line, as packed.py allocates them


def move_to_huge_pages(model: nn.Module) -> int:
    """Copies every packed matrix of `model` into one arena advised for transparent huge
    pages and points its modules at the copies (shared matrices stay shared). Returns the
    arena's size in bytes: 0 when there are no packed matrices or the system has no
    madvise, and then nothing moves. (Below 2 MB no page of it is huge; it moves all the
    same, so that every model runs from the same kind of memory.)"""
    holders = [m for m in model.modules() if isinstance(m, (PackedLinear, PackedEmbedding))]
    matrices = _unique_matrices(m.weight_packed for m in holders)
    total = sum(_padded(w.nbytes) for w in matrices)
    arena = advised_arena(total) if total else None
    if arena is None:
        return 0
    moved: dict[int, PackedWeight] = {}
    offset = 0
    for w in matrices:
        view = arena[offset:offset + w.nbytes].reshape(w.data.shape)
        view[...] = w.data
        moved[id(w)] = dataclasses.replace(w, data=view)
        offset += _padded(w.nbytes)
    rebuilt: dict[int, PackedWeight | PackedParts] = {}
    for m in holders:
        w = m.weight_packed
        if id(w) not in rebuilt:
            rebuilt[id(w)] = PackedParts(tuple(moved[id(p)] for p in w.parts)) if isinstance(w, PackedParts) \
                else moved[id(w)]
        m.weight_packed = rebuilt[id(w)]
    logger.info("packed weights: %d matrices, %.1f MB, in memory advised for 2 MB pages", len(matrices),
                total / 1e6)
    return total


def _unique_matrices(weights) -> list[PackedWeight]:
    """The PackedWeights among `weights` (the parts of a PackedParts too), each once."""
    seen: dict[int, PackedWeight] = {}
    for w in weights:
        for p in w.parts if isinstance(w, PackedParts) else (w,):
            seen.setdefault(id(p), p)
    return list(seen.values())


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN
