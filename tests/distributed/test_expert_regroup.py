"""A re-formed EP group's experts (models/expert_regroup.py), on two MoE layers of 8 experts.
Between two real processes over Gloo: they held the shards of ranks 0 and 1 of a group of 3
(the third rank gone: it left, or died) and re-form as a group of 2: rank 0 keeps 0 and 1 and
receives 2 and 3 from rank 1; rank 1 keeps 4 and reads 5-7, which only the gone rank held,
from the checkpoint. Under load balancing after a rebalance moved experts, a re-formed group
of the same size gets back to the initial placement with the missing replicas sent by the
peer, nothing read. A survivor left alone reads only what it lacks: nothing when it held a
replica of every expert. Every slot ends with its expert's exact weights."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from test_moe_dispatch import _join, _run

EXPERTS, HIDDEN, INTER, LAYERS = 8, 16, 12, 2
_PROJ = ("gate_proj", "up_proj", "down_proj")


def _weights(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(layer)
    return torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen), torch.randn(EXPERTS, HIDDEN, INTER, generator=gen)


def write_checkpoint(path) -> None:
    from safetensors.torch import save_file

    tensors = {}
    for layer in range(LAYERS):
        w13, w2 = _weights(layer)
        for e in range(EXPERTS):
            pieces = (w13[e, :INTER], w13[e, INTER:], w2[e])
            for proj, t in zip(_PROJ, pieces, strict=True):
                tensors[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"] = t.contiguous()
    save_file(tensors, str(path / "model.safetensors"))


class FakeMoeModel:
    """What regroup_experts needs of MoeForCausalLM, over bare FusedMoE layers."""

    def __init__(self, shard: tuple[int, ...], source_dir: str, placement: list[int] | None = None) -> None:
        from deepinfer_dp.layers.moe import FusedMoE

        self.expert_shard, self.source_dir = shard, source_dir
        self.moe_blocks = []
        for i in range(LAYERS):
            layer = FusedMoE(EXPERTS, 2, HIDDEN, INTER, layer_index=i, shard=shard)
            if placement is not None:  # as a rebalance left it
                layer.expert_map.set(placement)
            w13, w2 = _weights(i)
            with torch.no_grad():
                for j, e in enumerate(layer.local_logical()):
                    layer.w13[j].copy_(w13[e])
                    layer.w2[j].copy_(w2[e])
            self.moe_blocks.append(SimpleNamespace(experts=layer))

    def after_reshard(self) -> None:
        pass

    def get_submodule(self, prefix: str):
        return self.moe_blocks[int(re.search(r"layers\.(\d+)\.", prefix).group(1))]

    def load_expert(self, name: str, match, tensor: torch.Tensor, done: set) -> None:
        from deepinfer_dp.models.moe_models import MoeForCausalLM

        MoeForCausalLM.load_expert(self, name, match, tensor, done)


def _exact(model: FakeMoeModel) -> bool:
    return all(torch.equal(b.experts.w13[j], _weights(i)[0][e]) and torch.equal(b.experts.w2[j], _weights(i)[1][e])
               for i, b in enumerate(model.moe_blocks) for j, e in enumerate(b.experts.local_logical()))


def _worker(rank: int, port: int, old: tuple, new: tuple, placement, source_dir: str, out) -> None:
    from deepinfer_dp.distributed.moe_dispatch import make_dispatcher
    from deepinfer_dp.models.expert_regroup import regroup_experts

    torch.set_num_threads(1)
    ep = _join(rank, port, 30)
    model = FakeMoeModel((rank, *old), source_dir, placement)
    stats = regroup_experts(model, ep, (rank, *new), make_dispatcher("all_to_all", ep, EXPERTS))
    out.put((rank, stats.as_dict(), [b.experts.local_logical() for b in model.moe_blocks], _exact(model),
             model.expert_shard))


MOVED = [2, 3, 0, 1, 4, 5, 6, 7, 2, 3]  # 10 slots (2 redundant): rank 0 {0-4}, rank 1 {5-7, 2, 3}


@pytest.mark.parametrize("old, new, placement, want", [
    # shards of a group of 3 (ranks 0, 1 of it) -> a group of 2 (kept, received, loaded)
    ((3,), (2,), None, {0: (4, 4, 0), 1: (2, 0, 6)}),
    # EPLB moved experts; the re-formed group (same size) starts from the initial placement
    # [0-4 | 5-7, 0, 1]: rank 1 gets 0 and 1 from rank 0
    ((2, 2), (2, 2), MOVED, {0: (10, 0, 0), 1: (6, 4, 0)}),
])
def test_regroup_keeps_moves_and_reads_only_what_no_member_holds(tmp_path, old, new, placement, want):
    write_checkpoint(tmp_path)
    got = _run(_worker, old, new, placement, str(tmp_path))
    for rank in (0, 1):
        stats, held, exact, shard = got[rank]
        assert exact, (rank, held)
        assert shard == (rank, *new)
        assert (stats["kept"], stats["received"], stats["loaded"]) == want[rank], (rank, stats)
    if old == (3,):
        assert got[0][1] == [[0, 1, 2, 3]] * LAYERS and got[1][1] == [[4, 5, 6, 7]] * LAYERS
        assert got[1][0]["sent_bytes"] == got[0][0]["received_bytes"] == 2 * 2 * (3 * HIDDEN * INTER * 4)


@pytest.mark.parametrize("old, new, want", [
    ((2,), (1,), (8, 0, 8)),  # half its experts held, the other half read
    ((2, 8), (1, 8), (32, 0, 0)),  # a replica of every expert held: nothing read
])
def test_a_survivor_alone_reads_only_what_it_lacks(tmp_path, old, new, want):
    from deepinfer_dp.models.expert_regroup import regroup_experts

    write_checkpoint(tmp_path)
    model = FakeMoeModel((0, *old), str(tmp_path))
    stats = regroup_experts(model, None, (0, *new), None)
    assert (stats.kept, stats.received, stats.loaded) == want, stats
    assert _exact(model) and model.expert_shard == (0, *new)
    assert model.moe_blocks[0].experts.local_logical() == list(range(EXPERTS)) * (1 + (len(new) > 1))
