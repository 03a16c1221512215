"""Output tensors larger than glibc's mmap threshold, handed out again once nothing holds them.

glibc serves a block of more than 32 MB (the most `cpu_malloc.keep_freed_memory` can raise its
threshold to) with a fresh mmap and unmaps it when it is freed, so every such tensor is
page-faulted in zeroed pages at first touch. A decode step of a large vocabulary allocates
one: Gemma 3's logits at 64 rows are 64 x 262,144 floats (64 MiB), and faulting them in cost
20-26 ms of a 120 ms lm_head. Here each thread keeps a few such blocks and reuses one when no
tensor (or view of one) refers to it any more: a tensor made by torch.from_numpy holds its
array until the tensor's storage is freed, so the array's reference count says whether one
is alive.
"""

from __future__ import annotations

import sys
import threading

import numpy as np
import torch

from deepinfer_dp.utils.cpu_malloc import MMAP_THRESHOLD_MAX

KEEP_BLOCKS = 2  # a step's logits and a draft model's in the same step (speculative decoding)

_local = threading.local()  # DP ranks may share a process: a pool per thread


def empty(rows: int, cols: int) -> torch.Tensor:
    """An uninitialised fp32 [rows, cols] tensor, from a reused block when it is large."""
    floats = rows * cols
    if floats * 4 <= MMAP_THRESHOLD_MAX:
        return torch.empty(rows, cols)
    blocks: list[np.ndarray] = _local.__dict__.setdefault("blocks", [])
    for i in range(len(blocks)):
        # Held by the list and getrefcount's argument only: nothing uses it.
        if blocks[i].size >= floats and sys.getrefcount(blocks[i]) == 2:
            return torch.from_numpy(blocks[i][:floats].reshape(rows, cols))
    block = np.empty(floats, np.float32)
    if len(blocks) < KEEP_BLOCKS:
        blocks.append(block)
    else:  # replace a smaller block nothing uses, if there is one
        for i in range(len(blocks)):
            if sys.getrefcount(blocks[i]) == 2:
                blocks[i] = block
                break
    return torch.from_numpy(block.reshape(rows, cols))


def kept_blocks() -> int:
    """How many blocks this thread keeps (for tests)."""
    return len(_local.__dict__.get("blocks", []))
