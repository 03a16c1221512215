"""glibc malloc settings for CPU inference.

By default glibc hands blocks over 128 KB to mmap and gives the top of the heap back to the
OS once 128 KB of it is free. A forward pass allocates and frees megabyte-sized activations
op after op, so every op then page-faults fresh zeroed pages in: measured on a 665-token
prefill of SmolLM2, elementwise ops ran 5-7x slower and the whole step 1.5x slower. The
usual fix is LD_PRELOAD=tcmalloc; mallopt does the same for the sizes that matter without
a preload, from inside the process.

Memory read whole at every step (the packed weights) is better in 2 MB pages: `advised_arena`.
Memory written a little at every step (the KV cache) is better resident from the start:
`resident_zeros`.
"""

from __future__ import annotations

import ctypes

import numpy as np

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc refuses larger values on 64-bit
_MADV_HUGEPAGE = 14  # linux/mman.h
_MADV_POPULATE_WRITE = 23  # linux/mman.h, Linux 5.14+
PAGE = 4096
HUGE_PAGE = 2 << 20


def keep_freed_memory() -> bool:
    """Serve blocks up to 32 MB from the heap and keep freed memory for reuse (peak RSS is
    unchanged: it is memory the process already used). False where libc has no mallopt."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) and mallopt(_M_TRIM_THRESHOLD, 1 << 30)
                and mallopt(_M_TOP_PAD, 64 << 20))


def release_freed_memory() -> bool:
    """Hands the heap's free pages back to the OS (after loading, whose temporaries glibc would
    otherwise keep resident). False where libc has no malloc_trim."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    return bool(trim(0))


def _madvise():
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


def resident_zeros(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Zeros starting on a page boundary whose every page is resident on return. np.zeros alone
    maps zero pages that the OS fills in as each is first written: under a KV cache that is a
    page fault inside a decode step whenever a block is first used (zeroing 2 MB on one thread
    while the other waits at the end of the split). MADV_POPULATE_WRITE faults them all in now
    without writing; where the kernel lacks it (before 5.14), the zeros are written.

    The page boundary: glibc puts a large block 16 bytes past one, and the kernels' 64-byte K/V
    rows would then straddle cache lines, two lines read for every row (docs/cpu_engine.md)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.zeros(nbytes + PAGE, dtype=np.uint8)  # calloc: untouched zero pages
    start = -raw.ctypes.data % PAGE
    a = raw[start:start + nbytes].view(dtype).reshape(shape)
    length = nbytes // PAGE * PAGE
    madvise = _madvise()
    if length <= 0 or madvise is None or madvise(a.ctypes.data, length, _MADV_POPULATE_WRITE) != 0:
        a.reshape(-1).view(np.uint8)[:] = 0
    return a


def advised_arena(nbytes: int) -> np.ndarray | None:
    """uint8 [nbytes] starting on a 2 MB boundary and advised for transparent huge pages before
    any page of it is touched (memory streamed at every step: one TLB entry a 2 MB page, not
    a 4 KB one). None where libc has no madvise or the kernel refuses (no THP support)."""
    madvise = _madvise()
    if madvise is None:
        return None
    raw = np.empty(nbytes + HUGE_PAGE, dtype=np.uint8)
    start = -raw.ctypes.data % HUGE_PAGE
    arena = raw[start:start + nbytes]
    length = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    if madvise(arena.ctypes.data, min(length, raw.nbytes - start), _MADV_HUGEPAGE) != 0:
        return None
    return arena


def advised_copy(a: np.ndarray) -> np.ndarray:
    """`a` copied into an arena of its own (advised_arena); `a` itself where there is none."""
    arena = advised_arena(a.nbytes)
    if arena is None:
        return a
    out = arena.view(a.dtype).reshape(a.shape)
    out[...] = a
    return out
