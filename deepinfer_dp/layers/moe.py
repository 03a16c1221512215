"""The routed experts of one mixture-of-experts layer: top-k routing, this rank's experts,
and the weighted combine.

Routing is transformers': softmax over the router logits in fp32, the top k, renormalized
when the family asks (Mixtral always, Qwen-MoE/OLMoE with norm_topk_prob). A token's output
is the sum over its k slots, in slot order, of weight x expert(token), each expert a SwiGLU
(gate/up, SiLU, down) -- the order of transformers' grouped MoE forward, so logits match it
to float noise. No token is ever dropped (no capacity factor).

The experts live in two tensors per layer, w13 [E, 2I, H] (gate rows, then up rows) and
w2 [E, H, I]. Under expert parallelism (EP) a rank holds only the contiguous range of
experts expert_range() gives it (with load balancing: its physical slots, see
layers/expert_map.py), and a dispatcher (distributed/moe_dispatch.py) moves each
token to the ranks that own its experts and sums their results back; without EP the layer
computes everything locally. On CPU in fp32 the experts run in the C++ kernel `_C.moe_experts`
(tokens sorted by expert, one grouped product per expert, SiLU fused, combine in slot order;
batch-invariant); elsewhere in torch, in the same order.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from deepinfer_dp import _C
from deepinfer_dp.layers import cpu_threads
from deepinfer_dp.layers.expert_map import ExpertMap, check_layout, initial_placement

# The C++ experts kernel on CPU (fp32); False selects the torch path everywhere.
CPU_KERNEL = True


def expert_range(rank: int, size: int, num_experts: int) -> tuple[int, int]:
    """[first, end) of the experts rank `rank` of `size` owns: contiguous, sizes differing by
    at most one."""
    if not 0 <= rank < size:
        raise ValueError(f"expert-parallel rank {rank} outside [0, {size})")
    if size > num_experts:
        raise ValueError(f"expert parallelism over {size} ranks needs at least {size} experts, "
                         f"the model has {num_experts}")
    return rank * num_experts // size, (rank + 1) * num_experts // size


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids int32 [T, k], weights fp32 [T, k]) of each token, best first."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return ids.to(torch.int32), weights


class MoEDispatcher(Protocol):
    """Moves a layer's tokens to the ranks owning their experts and combines the results
    (distributed/moe_dispatch.py)."""

    def begin_step(self, num_tokens: int) -> None: ...

    def dispatch_combine(self, layer: FusedMoE, x: torch.Tensor, ids: torch.Tensor,
                         weights: torch.Tensor, counted: bool) -> torch.Tensor: ...


class FusedMoE(nn.Module):
    """The routed experts of layer `layer_index` that this rank owns, and their forward.

    `shard` is (rank, size), or (rank, size, redundant) with load balancing: the layer then
    has num_experts + redundant physical slots, an equal share on each rank, and an
    ExpertMap from the router's logical experts to them (layers/expert_map.py). Without it a
    slot is its logical expert. first_expert/end_expert are this rank's slot range."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 layer_index: int, shard: tuple[int, ...] = (0, 1)) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.layer_index = layer_index
        self._set_shard(shard)
        local = self.end_expert - self.first_expert
        self.w13 = nn.Parameter(torch.empty(local, 2 * intermediate_size, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(local, hidden_size, intermediate_size), requires_grad=False)
        self.dispatcher: MoEDispatcher | None = None
        # Token-slots this rank's slots computed for real tokens (placeholder tokens are not
        # counted), by global slot id; the model owns the array, this is its row.
        self.expert_tokens = np.zeros(self.num_slots, dtype=np.int64)

    def _set_shard(self, shard: tuple[int, ...]) -> None:
        rank, size, *redundant = shard
        self.expert_map: ExpertMap | None = None
        self.num_slots = self.num_experts + (redundant[0] if redundant else 0)
        if redundant:
            check_layout(self.num_experts, redundant[0], size)
            self.expert_map = ExpertMap(initial_placement(self.num_experts, self.num_slots), self.num_experts,
                                        size, torch.device("cpu"))
        self.rank = rank
        self.first_expert, self.end_expert = expert_range(rank, size, self.num_slots)
        owners = [r for r in range(size) for _ in range(*expert_range(r, size, self.num_slots))]
        self._owner = torch.tensor(owners, dtype=torch.int64, device="cpu")  # not the meta device of a build

    @property
    def num_local_experts(self) -> int:
        return self.end_expert - self.first_expert

    def local_logical(self) -> list[int]:
        """The logical expert each of this rank's slots holds, in slot order."""
        if self.expert_map is None:
            return list(range(self.first_expert, self.end_expert))
        return self.expert_map.local_logical(self.rank)

    def slot_owner(self, device: torch.device) -> torch.Tensor:
        """int64 [num_slots]: the rank holding each physical slot, on `device`."""
        if self._owner.device != device:
            self._owner = self._owner.to(device)
        return self._owner

    def place_on(self, device: torch.device) -> None:
        """Moves the expert map's tables to `device` (where the router's ids are)."""
        if self.expert_map is not None and self.expert_map.device != device:
            self.expert_map = ExpertMap(self.expert_map.phys_to_log, self.num_experts, self.expert_map.num_ranks,
                                        device)

    def reshard(self, shard: tuple[int, ...]) -> None:
        """Holds the experts of `shard` from now on (the initial placement under load
        balancing): fresh uninitialized tensors (the caller loads them), the old ones freed."""
        device = self.w13.device
        self._set_shard(shard)
        self.place_on(device)
        like = self.w13
        self.w13 = nn.Parameter(like.new_empty(self.num_local_experts, *like.shape[1:]), requires_grad=False)
        self.w2 = nn.Parameter(like.new_empty(self.num_local_experts, *self.w2.shape[1:]), requires_grad=False)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, counted: bool = True) -> torch.Tensor:
        """x [T, H], ids/weights [T, k] from select_experts -> [T, H]. `counted`: the tokens
        are real (not the placeholder step's dummy), so they count in expert_tokens."""
        if self.expert_map is not None:
            self.place_on(ids.device)
            ids = self.expert_map.to_physical(ids, counted)
        if self.dispatcher is not None:
            return self.dispatcher.dispatch_combine(self, x, ids, weights, counted)
        return self.compute(x, ids, weights, counted)

    def compute(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                counted: bool | torch.Tensor = True) -> torch.Tensor:
        """This rank's experts' share of each token: the slots of other ranks' experts add
        nothing. `counted` may be a bool [T] mask of the rows to count (tokens from peers)."""
        local = ids - self.first_expert
        if self.first_expert > 0 or self.end_expert < self.num_slots:
            local = torch.where((local >= 0) & (local < self.num_local_experts), local, -1)
        self._count(local, counted)
        if x.shape[0] == 0:  # no token of any rank routed here (NumPy gives empty rows no strides)
            return x.new_zeros(0, self.hidden_size)
        if _use_cpu_kernel(x, self.w13):
            out = torch.empty(x.shape[0], self.hidden_size)
            rows = x if x.stride(-1) == 1 else x.contiguous()  # rows may be strided (a received buffer)
            _C.moe_experts(rows.numpy(), local.numpy(), weights.numpy(), self.w13.detach().numpy(),
                           self.w2.detach().numpy(), out.numpy(), cpu_threads.kernel_threads())
            return out
        return experts_torch(x, local, weights, self.w13, self.w2)

    def _count(self, local: torch.Tensor, counted: bool | torch.Tensor) -> None:
        if counted is False:
            return
        rows = local if counted is True else local[counted.to(local.device)]
        rows = rows[rows >= 0]
        if rows.numel():
            hits = torch.bincount(rows.long(), minlength=self.num_local_experts).cpu().numpy()
            self.expert_tokens[self.first_expert:self.end_expert] += hits


def _use_cpu_kernel(x: torch.Tensor, w13: torch.Tensor) -> bool:
    return CPU_KERNEL and x.device.type == "cpu" and x.dtype == torch.float32 and w13.dtype == torch.float32


def experts_torch(x: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                  w2: torch.Tensor) -> torch.Tensor:
    """The experts in plain torch (CUDA, other dtypes, and the kernel's reference): each
    expert's (token, slot) pairs as one matrix product, then the weighted sum over slots in
    slot order. local_ids -1 marks a slot another rank computes."""
    num_tokens, top_k = local_ids.shape
    flat = local_ids.reshape(-1).long()
    per_slot = torch.zeros(num_tokens * top_k, x.shape[1], dtype=x.dtype, device=x.device)
    flat_weights = weights.reshape(-1).to(x.dtype)
    for e in torch.unique(flat[flat >= 0]).tolist():
        pairs = (flat == e).nonzero().squeeze(1)
        gate, up = F.linear(x[pairs // top_k], w13[e]).chunk(2, dim=-1)
        per_slot[pairs] = F.linear(F.silu(gate) * up, w2[e]) * flat_weights[pairs, None]
    return per_slot.view(num_tokens, top_k, -1).sum(dim=1)
