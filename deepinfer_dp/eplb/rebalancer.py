"""The balancer of one model's MoE layers under expert parallelism, run by every rank in
lockstep from inside the forward pass.

Every rank enters every forward pass together (the MoE collectives need it; an idle rank
runs placeholder steps), so a count of forward passes is a clock all ranks share without a
message. The balancer keeps, per MoE layer, the token-slots this rank routed to each logical
expert and to each rank over the last window_size passes. Every step_interval passes (and at
the passes of force_steps) every rank all-reduces those counts (one collective), measures the
balancedness, and runs the policy (eplb/policy.py) on the same integers, so all ranks arrive
at the same placement.
Then, one layer per forward pass, the experts whose slot changed move over the EP group (one
all-to-all of their weights) and the layer switches maps: every rank at the same pass.
A layer's output does not depend on the placement: every replica holds the same weights.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from deepinfer_dp.distributed.moe_dispatch import EPGroup
from deepinfer_dp.eplb.config import EPLBConfig
from deepinfer_dp.eplb.policy import balancedness, rank_loads, rebalance
from deepinfer_dp.layers.moe import FusedMoE

logger = logging.getLogger(__name__)
LOG_ENTRIES = 256  # placement switches and balancedness readings kept for rank_stats()
# A layer moves only if the new placement's expected balancedness over the window beats the
# current one's by this much: re-packing a nearly balanced layer from scratch would move
# experts back and forth on noise, each move a whole expert's weights.
MIN_GAIN = 0.02


class Rebalancer:
    def __init__(self, config: EPLBConfig, layers: list[FusedMoE], ep: EPGroup, past: Rebalancer | None) -> None:
        self.config, self.layers, self.ep = config, layers, ep
        self.maps = [layer.expert_map for layer in layers]
        if any(m is None for m in self.maps):
            raise ValueError("expert load balancing needs MoE layers built with physical slots")
        width = self.maps[0].num_experts + ep.size
        self.window = torch.zeros(config.window_size, len(layers), width, dtype=torch.int64, device=ep.device)
        self.forwards = 0  # forward passes since the group formed: the same on every rank
        self.moves: list[tuple[int, np.ndarray]] = []  # (layer, placement) still to switch, one a pass
        # counters stay across re-formed groups
        self.rebalances = past.rebalances if past else 0
        self.moved_bytes = past.moved_bytes if past else 0
        self.move_s = past.move_s if past else 0.0
        self.balancedness: list[float] | None = None  # per layer, at the last rebalance
        self.history: list[list] = past.history if past else []  # [pass, overall, per layer]
        self.switches: list[list[int]] = []  # [pass, layer, placement epoch] of this group
        self.force_steps = set(config.force_steps)
        self.forced = False  # a forced step is due

    def begin_step(self) -> None:
        """Called by the model at the start of every forward pass, on every rank."""
        if self.forwards:  # the previous pass's counts become one row of the window
            row = (self.forwards - 1) % self.config.window_size
            for i, m in enumerate(self.maps):
                self.window[row, i] = m.counts
                m.counts.zero_()
        self.forwards += 1
        # a forced step that falls while a rebalance still moves layers starts right after it
        self.forced |= self.forwards in self.force_steps
        if not self.moves and (self.forced or self.forwards % self.config.step_interval == 0):
            self._plan(self.forced)
            self.forced = False
        if self.moves:
            self._move_next_layer()

    def _plan(self, forced: bool) -> None:
        totals = self.window.sum(dim=0).cpu()
        dispatcher = self.layers[0].dispatcher
        dispatcher.collective("expert load all-reduce", None,
                              lambda: dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=self.ep.cpu_group))
        num_experts = self.maps[0].num_experts
        loads, per_rank = totals[:, :num_experts].numpy(), totals[:, num_experts:].numpy()
        self.balancedness = [balancedness(row) for row in per_rank]
        # vLLM's overall figure: the layers' mean loads over their max loads
        overall = float(per_rank.mean(axis=1).sum() / per_rank.max(axis=1).sum()) if per_rank.any() else 1.0
        self.history = (self.history + [[self.forwards, overall, self.balancedness]])[-LOG_ENTRIES:]
        if self.config.log_balancedness:
            logger.info("EPLB at pass %d: balancedness %.3f overall, per layer %s", self.forwards, overall,
                        [round(b, 3) for b in self.balancedness])
        for i, (m, load) in enumerate(zip(self.maps, loads, strict=True)):
            placement = rebalance(load, m.phys_to_log, self.ep.size)
            now = balancedness(rank_loads(load, m.phys_to_log, self.ep.size))
            if (forced and not np.array_equal(placement, m.phys_to_log)) or \
                    balancedness(rank_loads(load, placement, self.ep.size)) >= now + MIN_GAIN:
                self.moves.append((i, placement))

    def _move_next_layer(self) -> None:
        i, placement = self.moves.pop(0)
        layer = self.layers[i]
        start = time.perf_counter()
        self.moved_bytes += move_experts(layer, placement, self.ep)
        layer.expert_map.set(placement)
        self.move_s += time.perf_counter() - start
        self.switches = (self.switches + [[self.forwards, layer.layer_index, self.rebalances + 1]])[-LOG_ENTRIES:]
        if not self.moves:
            self.rebalances += 1

    def stats(self) -> dict:
        return {"eplb_rebalances": self.rebalances, "eplb_passes": self.forwards,
                "eplb_balancedness": self.history[-1][1] if self.history else None,
                "eplb_balancedness_per_layer": self.balancedness,
                "eplb_balancedness_history": self.history,
                "eplb_moved_bytes": self.moved_bytes, "eplb_move_s": self.move_s,
                "eplb_switches": self.switches,
                "eplb_placement": [m.phys_to_log.tolist() for m in self.maps]}


def transfers(old: np.ndarray, new: np.ndarray, num_ranks: int) -> list[tuple[int, int, int, int]]:
    """(source rank, destination rank, source slot, destination slot) of every expert that a
    rank must receive: one it does not hold yet, from its lowest old slot anywhere."""
    slots = len(old) // num_ranks
    moves = []
    for p, e in enumerate(new.tolist()):
        dst = p // slots
        if e not in old[dst * slots:(dst + 1) * slots]:
            src_slot = int(np.flatnonzero(old == e)[0])
            moves.append((src_slot // slots, dst, src_slot, p))
    return moves


def move_experts(layer: FusedMoE, new: np.ndarray, ep: EPGroup) -> int:
    """Gives `layer` the weights of placement `new` (every rank calls it, with the same
    `new`): kept slots copy locally, the others come in one all-to-all over the EP group.
    Returns the bytes this rank sent."""
    old, me = layer.expert_map.phys_to_log, ep.rank
    first, slots = layer.first_expert, layer.num_local_experts
    moves = transfers(old, new, ep.size)
    sends = sorted((m for m in moves if m[0] == me), key=lambda m: (m[1], m[3]))
    recvs = sorted((m for m in moves if m[1] == me), key=lambda m: (m[0], m[3]))
    w13, w2 = layer.w13.detach(), layer.w2.detach()
    split13 = w13[0].numel() * w13.element_size()
    rows = torch.stack([_as_bytes(w13[s - first], w2[s - first]) for _, _, s, _ in sends]) if sends else \
        torch.empty(0, split13 + w2[0].numel() * w2.element_size(), dtype=torch.uint8, device=w13.device)
    got = rows.new_empty(len(recvs), rows.shape[1])
    if moves:  # every rank knows whether any rank moves anything
        send_sizes = [sum(1 for m in sends if m[1] == r) for r in range(ep.size)]
        recv_sizes = [sum(1 for m in recvs if m[0] == r) for r in range(ep.size)]
        dispatcher = layer.dispatcher
        wire_rows = dispatcher.to_wire(rows)
        wire_got = dispatcher.to_wire(got)
        dispatcher.collective("expert weight move", layer.layer_index, lambda: dist.all_to_all_single(
            wire_got, wire_rows, recv_sizes, send_sizes, group=ep.device_group))
        got = dispatcher.from_wire(wire_got)
    received = {m[3]: got[i] for i, m in enumerate(recvs)}
    old_local = old[first:first + slots].tolist()
    new13, new2 = torch.empty_like(w13), torch.empty_like(w2)
    for j, e in enumerate(new[first:first + slots].tolist()):
        if e in old_local:
            k = old_local.index(e)
            new13[j].copy_(w13[k])
            new2[j].copy_(w2[k])
        else:
            row = received[first + j]
            new13[j].copy_(row[:split13].view(w13.dtype).view(w13.shape[1:]))
            new2[j].copy_(row[split13:].view(w2.dtype).view(w2.shape[1:]))
    layer.w13 = nn.Parameter(new13, requires_grad=False)
    layer.w2 = nn.Parameter(new2, requires_grad=False)
    return rows.numel()


def _as_bytes(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.cat([a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)])
