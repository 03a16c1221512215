"""The CPU KV cache is resident when it is handed out (utils/cpu_malloc.py resident_zeros): no
page of it is faulted in inside a decode step, it reads as zeros, and it starts on a page
boundary (glibc puts a large block 16 bytes past one, and every K/V row then straddles cache
lines)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from transformers import LlamaConfig

from deepinfer_dp.models import allocate_kv_cache
from deepinfer_dp.utils import cpu_malloc

PAGE = cpu_malloc.PAGE


def resident_share(a: np.ndarray) -> float:
    """The share of a's whole pages that are in memory (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    start = -a.ctypes.data % PAGE
    pages = (a.nbytes - start) // PAGE
    vec = np.zeros(pages, dtype=np.uint8)
    assert libc.mincore(a.ctypes.data + start, pages * PAGE, vec.ctypes.data) == 0, ctypes.get_errno()
    return float(np.mean(vec & 1))


def test_plain_zeros_are_not_resident_yet():
    # What resident_zeros is for: a fresh mapping of this size is faulted in only as it is written.
    assert resident_share(np.zeros(96 << 20, dtype=np.uint8)) < 0.5


@pytest.mark.parametrize("dtype", [np.float32, np.uint16])
def test_resident_zeros_are_resident_and_zero(dtype):
    a = cpu_malloc.resident_zeros((3, 8 << 20), dtype)
    assert a.shape == (3, 8 << 20) and a.dtype == dtype
    assert a.ctypes.data % PAGE == 0
    assert resident_share(a) == 1.0
    assert not a.any()


def test_resident_zeros_of_an_odd_size_start_on_a_page_and_are_zero():
    """A size that is no whole number of pages, from the heap rather than a mapping of its own
    (where a recycled block holds old bytes): still a page boundary, still zeros."""
    junk = np.full(3 << 20, 7, dtype=np.uint8)
    del junk
    a = cpu_malloc.resident_zeros((1000, 3, 7), np.float32)
    assert a.ctypes.data % PAGE == 0 and a.shape == (1000, 3, 7)
    assert not a.any()


def test_without_madvise_the_zeros_are_written(monkeypatch):
    monkeypatch.setattr(cpu_malloc, "_madvise", lambda: None)
    a = cpu_malloc.resident_zeros((64 << 20,), np.uint8)
    assert resident_share(a) == 1.0 and not a.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kv_cache_is_resident(dtype):
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)
    caches = allocate_kv_cache(config, 2048, 16, dtype, torch.device("cpu"))
    assert len(caches) == 3
    for k, v in caches:
        assert k.dtype == dtype and v.dtype == dtype
        for t in (k, v):
            assert t.data_ptr() % 64 == 0
            assert resident_share(t.view(torch.uint8).numpy()) == 1.0
            assert not t.view(torch.uint8).any()
