"""A re-formed expert-parallel group's experts: moved over the group, read from the checkpoint
only where no member holds them.

When the group changes (a scale up or down, a rank lost for good, a restarted rank back),
every member joins the new group at once (LLMEngine.join_dp_group -> bind_ep_group) and holds
from then on the initial placement of its new shard: group rank r of `size` holds the slots
expert_range(r, size, slots), slot p holding logical expert p mod num_experts. Each member
gathers what every member holds now (one all-gather: its experts per layer, in the current
placement, EPLB moves included) and all compute the same plan: per layer and wanted slot, a
copy of an expert the rank holds already, or the expert received from the lowest member that
holds it (one all-to-all of the weights' bytes per layer over the EP group, as the load
balancer's moves, eplb/rebalancer.py), or, when no member holds it (a leaving or lost rank
held the only copy), read from the checkpoint. So a rank lost under load balancing with a
replica of each of its experts elsewhere costs no read at all.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from deepinfer_dp.layers.moe import FusedMoE, expert_range
from deepinfer_dp.models.weights import iterate_weights

# <prefix>.experts.<e>.<projection>.weight, in either family's names (as models/moe_models.py)
EXPERT_NAME = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")


@dataclass
class RegroupStats:
    """What one change of the group cost this rank (per layer and expert: one expert's weights)."""

    kept: int = 0  # experts it held already (copied locally)
    received: int = 0  # experts that came over the group
    loaded: int = 0  # experts read from the checkpoint
    sent_bytes: int = 0
    received_bytes: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def wanted_experts(num_experts: int, num_slots: int, rank: int, size: int) -> list[int]:
    """The logical expert of each slot group rank `rank` of `size` holds in the initial placement."""
    return [p % num_experts for p in range(*expert_range(rank, size, num_slots))]


def regroup_experts(model: Any, ep: Any, shard: tuple[int, ...], dispatcher: Any) -> RegroupStats:
    """Gives `model`'s MoE layers the experts of `shard` (the new group's rank and size, and the
    redundant slots under load balancing). `ep`: the new EP group (None or one rank: alone);
    `dispatcher`: the new group's (its collective() turns a lost peer into MoECollectiveError).
    A collective call when the group has peers: every member makes it."""
    start = time.perf_counter()
    layers: list[FusedMoE] = [b.experts for b in model.moe_blocks]
    mine = [layer.local_logical() for layer in layers]
    size, me = (ep.size, ep.rank) if ep is not None and ep.size > 1 else (1, 0)
    held = [mine]
    if size > 1:
        held = [None] * size
        dispatcher.collective("expert holdings all-gather", None,
                              lambda: dist.all_gather_object(held, mine, group=ep.cpu_group))
    num_experts = layers[0].num_experts if layers else 0
    slots = num_experts + (shard[2] if len(shard) == 3 else 0)
    wanted = [wanted_experts(num_experts, slots, r, size) for r in range(size)]
    stats = RegroupStats()
    changed = shard != model.expert_shard or any(
        layer.expert_map is not None and not layer.expert_map.is_initial() for layer in layers)
    missing: set[tuple[str, int]] = set()
    for i, layer in enumerate(layers):
        old13, old2 = layer.w13.detach(), layer.w2.detach()
        if changed:
            layer.reshard(shard)
        got = _exchange(layer, i, held, wanted, me, old13, old2, dispatcher, ep, stats)
        if not changed:
            continue
        for j, e in enumerate(wanted[me]):
            if e in held[me][i]:
                k = held[me][i].index(e)
                _put(layer, j, old13[k], old2[k])
                stats.kept += 1
            elif e in got:
                _put(layer, j, *got[e])
                stats.received += 1
            else:
                missing.add((f"model.layers.{layer.layer_index}.mlp", e))
    if changed:
        model.expert_shard = shard
        model.after_reshard()
    if missing:
        stats.loaded = _load(model, missing)
    stats.seconds = time.perf_counter() - start
    return stats


def _source(e: int, i: int, held: list) -> int | None:
    """The lowest member holding expert `e` in layer `i`, or None."""
    return next((s for s, h in enumerate(held) if e in h[i]), None)


def _exchange(layer: FusedMoE, i: int, held: list, wanted: list, me: int, old13: torch.Tensor,
              old2: torch.Tensor, dispatcher: Any, ep: Any, stats: RegroupStats) -> dict[int, tuple]:
    """Layer `i`'s experts that members need from another member, in one all-to-all; the ones
    this rank received, by expert: (w13, w2). Every member plans the same moves."""
    moves = sorted({(s, d, e) for d, want in enumerate(wanted) for e in want
                    if e not in held[d][i] and (s := _source(e, i, held)) is not None})
    if not moves:
        return {}
    sends = [(d, e) for s, d, e in moves if s == me]
    recvs = [(s, e) for s, d, e in moves if d == me]
    split13 = old13[0].numel() * old13.element_size()
    width = split13 + old2[0].numel() * old2.element_size()
    rows = torch.stack([_as_bytes(old13[held[me][i].index(e)], old2[held[me][i].index(e)]) for _, e in sends]) \
        if sends else torch.empty(0, width, dtype=torch.uint8, device=old13.device)
    got = rows.new_empty(len(recvs), width)
    send_sizes = [sum(1 for d, _ in sends if d == r) for r in range(len(held))]
    recv_sizes = [sum(1 for s, _ in recvs if s == r) for r in range(len(held))]
    wire_rows, wire_got = dispatcher.to_wire(rows), dispatcher.to_wire(got)
    dispatcher.collective("expert regroup move", layer.layer_index, lambda: dist.all_to_all_single(
        wire_got, wire_rows, recv_sizes, send_sizes, group=ep.device_group))
    got = dispatcher.from_wire(wire_got)
    stats.sent_bytes += rows.numel()
    stats.received_bytes += got.numel()
    shape13, shape2 = old13.shape[1:], old2.shape[1:]
    return {e: (got[k, :split13].view(old13.dtype).view(shape13), got[k, split13:].view(old2.dtype).view(shape2))
            for k, (_, e) in enumerate(recvs)}


def _put(layer: FusedMoE, j: int, w13: torch.Tensor, w2: torch.Tensor) -> None:
    with torch.no_grad():
        layer.w13[j].copy_(w13)
        layer.w2[j].copy_(w2)


def _load(model: Any, missing: set[tuple[str, int]]) -> int:
    """Reads the `missing` (block prefix, expert) weights from the checkpoint; how many experts."""
    if model.source_dir is None:
        raise RuntimeError("the re-formed group needs experts no member holds, and the model has no "
                           "checkpoint directory (source_dir) to read them from")

    def wanted(name: str) -> bool:
        match = EXPERT_NAME.match(name.replace(".block_sparse_moe.", ".mlp."))
        return match is not None and (match.group(1), int(match.group(2))) in missing

    done: set[tuple[str, int, int]] = set()
    for name, tensor in iterate_weights(Path(model.source_dir), wanted):
        name = name.replace(".block_sparse_moe.", ".mlp.")
        model.load_expert(name, EXPERT_NAME.match(name), tensor, done)
    lacking = sorted(m for m in missing if any((*m, piece) not in done for piece in range(3)))
    if lacking:
        raise ValueError(f"checkpoint {model.source_dir} is missing the weights of expert(s) {lacking[:8]}")
    return len(missing)


def _as_bytes(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.cat([a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)])
