"""How many threads each part of a small CPU forward pass gets.

Between the matrix products, a decode step runs dozens of small elementwise ops per layer
(norms, rotary, residual adds, silu). At decode sizes they are too small to pay for an
OpenMP fork and join across threads, while the matrix products and the attention kernel
gain from every core. Measured on SmolLM2 with 2 cores, interleaved in one process: a
64-sequence decode step took 212-270 ms with the small ops on one thread against 245-293 ms
with everything on two; at 8 sequences it made no difference. So for steps of at most
NARROW_MAX_TOKENS tokens the runner drops torch to one thread, and the linear layers and
the attention kernel ask `wide_threads()` for the full count.

The bound is the packed kernels' row limit, not a decode size: after each parallel torch op
OpenMP's workers spin for a while, and on 2 cores a spinning worker takes a core from the
kernels' own thread pool. A 205-token prefill of SmolLM2 (packed weights) spent 0.66 s in its
linear layers with torch on two threads and 0.34 s with torch on one (SDPA, now on one
thread, went from 47 to 59 ms); the steps above it run their products in torch's GEMMs.

A batch-invariant step (EngineConfig.batch_invariant) is narrowed whatever its size: its
products and attention all run in the C++ kernels, whose floats for a row do not depend on
the rows around it, and torch only adds and copies.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

NARROW_MAX_TOKENS = 512  # packed.KERNEL_MAX_ROWS (packed imports this module)

_state = threading.local()


def wide_threads() -> int:
    """Threads for a matrix product or attention kernel in the step in flight; 0 outside a
    narrow step (then torch's own count applies)."""
    return getattr(_state, "wide", 0)


def batch_invariant() -> bool:
    """True inside a step whose every row must get the same floats whatever else the step
    holds: the layers then take the C++ kernels at any row count and query length."""
    return getattr(_state, "invariant", False)


def kernel_threads() -> int:
    """Threads for a C++ kernel call now: the step's when narrowed, else torch's count."""
    return wide_threads() or torch.get_num_threads()


@contextmanager
def narrow_step(threads: int, num_tokens: int, invariant: bool = False) -> Iterator[None]:
    """Runs the body with torch on one thread and wide_threads() == threads, when the step
    is small enough (or batch-invariant) and there is more than one thread to share; else
    leaves things be. batch_invariant() is `invariant` inside."""
    before = batch_invariant()
    _state.invariant = invariant
    try:
        with _narrowed(threads, num_tokens <= NARROW_MAX_TOKENS or invariant):
            yield
    finally:
        _state.invariant = before


@contextmanager
def _narrowed(threads: int, small: bool) -> Iterator[None]:
    if threads <= 1 or not small:
        yield
        return
    torch.set_num_threads(1)
    _state.wide = threads
    try:
        yield
    finally:
        _state.wide = 0
        torch.set_num_threads(threads)


@contextmanager
def wide() -> Iterator[None]:
    """Inside a narrow step, the body runs on all threads."""
    threads = wide_threads()
    if not threads:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(1)
