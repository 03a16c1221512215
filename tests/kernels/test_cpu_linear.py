"""The C++ small-batch linear kernel against torch's matmul, its batch and thread
invariance, its input checks, and the layer that routes small batches to it."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch
from torch import nn

from deepinfer_dp import _C
from deepinfer_dp.layers import linear as L


def case(m: int, n: int, k: int, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    return x, w, b


def kernel(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, threads: int = 1) -> torch.Tensor:
    out = torch.full((x.shape[0], w.shape[0]), float("nan"))
    _C.linear(x.numpy(), w.numpy(), None if b is None else b.numpy(), out.numpy(), threads)
    return out


@pytest.mark.parametrize("m,n,k,bias", [
    (1, 960, 576, False),   # SmolLM2's q/k/v at one sequence (AVX2 path)
    (8, 3072, 576, True),   # gate/up, with a bias (Qwen2 has them on q/k/v)
    (13, 50, 1536, False),  # rows not a multiple of the 4-row tile, columns not of 3
    (64, 7, 64, False),
    (5, 11, 13, True),      # K not a multiple of 8: the portable loop
])
def test_kernel_matches_torch(m, n, k, bias):
    x, w, b = case(m, n, k, bias)
    expected = torch.nn.functional.linear(x, w, b)
    torch.testing.assert_close(kernel(x, w, b), expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("k", [576, 13])
def test_rows_do_not_depend_on_the_batch_or_the_threads(k):
    x, w, b = case(13, 301, k, True)
    whole = kernel(x, w, b, threads=1)
    assert torch.equal(kernel(x, w, b, threads=2), whole)
    assert torch.equal(kernel(x, w, b, threads=7), whole)  # more threads than there are parts
    for i in (0, 6, 12):
        assert torch.equal(kernel(x[i:i + 1].clone(), w, b), whole[i:i + 1])


def test_kernel_from_several_python_threads_at_once():
    # Two callers at once: one gets the pool, the other runs on its own thread; both right.
    x, w, b = case(8, 2000, 576, False)
    expected = kernel(x, w, b)
    results: list[bool] = []

    def work() -> None:
        results.extend(torch.equal(kernel(x, w, b, threads=2), expected) for _ in range(30))

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 90


def test_kernel_refuses_bad_inputs():
    x, w, b = case(4, 6, 8, True)
    out = np.empty((4, 6), dtype=np.float32)
    with pytest.raises(ValueError, match="weight's K"):
        _C.linear(x.numpy(), w[:, :4].contiguous().numpy(), None, out, 1)
    with pytest.raises(ValueError, match="out must be"):
        _C.linear(x.numpy(), w.numpy(), None, np.empty((4, 5), dtype=np.float32), 1)
    with pytest.raises(ValueError, match="bias"):
        _C.linear(x.numpy(), w.numpy(), np.zeros(5, dtype=np.float32), out, 1)
    with pytest.raises(ValueError, match="num_threads"):
        _C.linear(x.numpy(), w.numpy(), None, out, 0)
    with pytest.raises(TypeError):  # float64 is not converted behind the caller's back
        _C.linear(x.double().numpy(), w.numpy(), None, out, 1)
    with pytest.raises(TypeError):  # nor is a strided view copied
        _C.linear(x.numpy(), w.t().numpy(), None, out, 1)


def test_kernel_in_a_forked_child():
    # A child forked after the pool started has no workers; it must build its own, not wait.
    x, w, b = case(8, 4000, 576, False)
    expected = kernel(x, w, b, threads=2)
    pid = os.fork()
    if pid == 0:
        ok = torch.equal(kernel(x, w, b, threads=2), expected)
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("rows", [1, L.KERNEL_MAX_ROWS, L.KERNEL_MAX_ROWS + 1, 200])
def test_cpu_linear_layer_matches_nn_linear(rows):
    torch.manual_seed(0)
    linear = nn.Linear(48, 40, bias=True)
    layer = L.CpuLinear(linear)
    x = torch.randn(rows, 48)
    torch.testing.assert_close(layer(x), linear(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer(x.view(rows, 1, 48)), linear(x).view(rows, 1, 40), atol=1e-5, rtol=1e-5)


def test_replace_linears_keeps_tied_weights_shared():
    emb = nn.Embedding(32, 16)
    model = nn.ModuleDict({"embed": emb, "head": nn.Linear(16, 32, bias=False)})
    model["head"].weight = emb.weight
    assert L.replace_linears(model) == 1
    assert model["head"].weight.data_ptr() == emb.weight.data_ptr()  # no second copy of the table
