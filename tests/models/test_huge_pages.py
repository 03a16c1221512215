"""Packed weights moved into one arena advised for 2 MB pages (models/huge_pages.py): every
packed module reads from it afterwards, shared matrices stay shared, and each product and
lookup gives the same floats as before the move."""

from __future__ import annotations

import numpy as np
import torch
from kquant_ref import quantize
from torch import nn

from deepinfer_dp.layers.packed import PackedEmbedding, PackedLinear, PackedWeight
from deepinfer_dp.layers.packed_parts import PackedParts, PackedPartsLinear
from deepinfer_dp.models.huge_pages import move_to_huge_pages
from deepinfer_dp.utils.cpu_malloc import HUGE_PAGE, advised_arena, advised_copy

K = 256


def matrix(fmt: str, rows: int, seed: int) -> PackedWeight:
    w = np.random.default_rng(seed).standard_normal((rows, K)).astype(np.float32)
    return PackedWeight(np.ascontiguousarray(quantize(w, fmt)), fmt, K)


def tiny_model() -> nn.Module:
    """A tied embedding and lm_head, a fused matrix of parts in two formats, and a plain one."""
    embed = matrix("q8_0", 300, 0)
    model = nn.Module()
    model.embed = PackedEmbedding(embed)
    model.qkv = PackedPartsLinear(PackedParts((matrix("q4_k", 40, 1), matrix("q6_k", 24, 2))))
    model.down = PackedLinear(matrix("q5_0", 96, 3), torch.randn(96))
    model.lm_head = PackedLinear(embed)
    return model


def outputs(model: nn.Module, x: torch.Tensor, ids: torch.Tensor) -> list[torch.Tensor]:
    return [model.embed(ids), model.qkv(x), model.down(x), model.lm_head(x)]


def test_every_packed_matrix_moves_into_one_arena_with_the_same_results():
    model, x, ids = tiny_model(), torch.randn(5, K), torch.tensor([0, 7, 299, 7])
    before = outputs(model, x, ids)
    old = [m.weight_packed for m in (model.embed, model.qkv, model.down)]
    total = move_to_huge_pages(model)
    assert total > 0, "madvise is missing or refused on this system"
    datas = [model.embed.weight_packed.data, *(p.data for p in model.qkv.weight_packed.parts),
             model.down.weight_packed.data]
    bases = {id(d.base) for d in datas}
    assert len(bases) == 1, "the matrices are not views of one arena"
    start = min(d.ctypes.data for d in datas)
    assert start % HUGE_PAGE == 0 and all(d.ctypes.data % 64 == 0 for d in datas)
    assert sum(d.nbytes for d in datas) <= total
    assert model.lm_head.weight_packed is model.embed.weight_packed, "the tied matrix was copied twice"
    assert isinstance(model.qkv.weight_packed, PackedParts)
    new = [m.weight_packed for m in (model.embed, model.qkv, model.down)]
    for now, was in zip(new, old, strict=True):
        assert now is not was and now.format == was.format and now.rows == was.rows
    for got, want in zip(outputs(model, x, ids), before, strict=True):
        assert torch.equal(got, want)


def test_the_arena_is_aligned_and_advised():
    arena = advised_arena(3 * HUGE_PAGE + 5)
    assert arena is not None and arena.nbytes == 3 * HUGE_PAGE + 5
    assert arena.ctypes.data % HUGE_PAGE == 0


def test_an_advised_copy_holds_the_same_values():
    a = np.random.default_rng(0).standard_normal((300, 7)).astype(np.float32)
    b = advised_copy(a)
    assert b is not a and b.ctypes.data % HUGE_PAGE == 0 and b.dtype == a.dtype and np.array_equal(b, a)


def test_a_model_without_packed_matrices_is_left_alone():
    model = nn.Sequential(nn.Linear(4, 4))
    assert move_to_huge_pages(model) == 0
