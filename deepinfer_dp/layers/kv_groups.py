"""How a model's attention layers share the paged KV cache: its KV groups.

Every layer of a model that attends over the whole context (or of one whose every layer
slides) needs the same blocks, so one block table serves all layers: one group. A model that
interleaves sliding-window and full-attention layers (Gemma 3: five local layers to one
global) needs far fewer blocks in its sliding layers, which only read the last `window`
positions. As in vLLM's hybrid allocator, its layers are split into groups of `group_size`
layers, each group one kind (the full layers first); layer j of every group uses cache
tensor j, so a block costs the same memory in every group and all groups draw on one pool.
A sequence holds a block per group for every `block_size` positions (the scheduler's
block_manager.h); the sliding groups give theirs back once they fall out of the window, and
those blocks serve other sequences.

With group_size = the smaller kind's layer count, Gemma 3 270M (3 global, 15 local layers)
gets 1 full and 5 sliding groups of 3 layers; a kind whose layer count is not a multiple of
group_size leaves a few layer slots of its last group unused (vLLM pads alike).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KvGroups:
    num_groups: int  # G: a sequence holds G blocks per block_size positions
    num_full_groups: int  # groups [0, F) keep every block; the others only the window's
    window: int  # the sliding groups' window (0: nothing is freed early)
    group_size: int  # layers per group: the cache tensors the model allocates
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]  # per layer: its cache tensor

    @property
    def grouped(self) -> bool:
        return self.num_groups > 1

    def scheduler_args(self) -> dict[str, int]:
        """The _C.SchedulerConfig fields that carry these groups."""
        return {"sliding_window": self.window, "num_kv_groups": self.num_groups,
                "num_full_kv_groups": self.num_full_groups}


def single_group(windows: list[int]) -> KvGroups:
    """One table for every layer; blocks before the window freed only when every layer slides."""
    n = len(windows)
    window = max(windows) if windows and all(windows) else 0
    return KvGroups(1, 0 if window else 1, window, n, (0,) * n, tuple(range(n)))


def plan_kv_groups(windows: list[int], hybrid: bool = True) -> KvGroups:
    """The groups of a model whose attention layers have these sliding windows (0: full
    attention), in layer order. Hybrid groups when `hybrid` and the model mixes full layers
    with sliding ones of one window; else a single group."""
    full = [i for i, w in enumerate(windows) if not w]
    sliding = [i for i, w in enumerate(windows) if w]
    if not hybrid or not full or not sliding or len({windows[i] for i in sliding}) != 1:
        return single_group(windows)
    size = min(len(full), len(sliding))
    chunks = [kind[i:i + size] for kind in (full, sliding) for i in range(0, len(kind), size)]
    group, slot = [0] * len(windows), [0] * len(windows)
    for g, chunk in enumerate(chunks):
        for j, layer in enumerate(chunk):
            group[layer], slot[layer] = g, j
    num_full = -(-len(full) // size)
    return KvGroups(len(chunks), num_full, windows[sliding[0]], size, tuple(group), tuple(slot))
