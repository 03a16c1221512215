"""Expert load balancing between two real processes over Gloo, on two MoE layers of 8
experts (top-2) plus 2 redundant slots, with a router skewed onto experts 2 and 3 (both on
rank 0 at first): every few passes both ranks all-reduce the window's loads, agree on a new
placement and move the experts layer by layer. Every pass's output is bit-identical to the
local computation of all experts before, across and after the moves; both ranks switched
each layer at the same pass; the balancedness the balancer measured rose clearly. With
force_steps the rebalances start at exactly the passes given (one due during a move waits for
it), still bit-identical."""

from __future__ import annotations

import pytest
import torch
from test_moe_dispatch import _join, _run

from deepinfer_dp.eplb.config import EPLBConfig

EXPERTS, REDUNDANT, TOP_K, HIDDEN, INTER, LAYERS, PASSES = 8, 2, 2, 32, 24, 2, 14
TOKENS = (9, 5)  # per pass on rank 0, rank 1
CONFIG = EPLBConfig(window_size=4, step_interval=4, num_redundant_experts=REDUNDANT)


def _weights(layer: int):
    gen = torch.Generator().manual_seed(layer)
    return (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) * 0.1,
            torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) * 0.1)


def _tokens(rank: int, step: int):
    """Skewed routing: experts 2 and 3 take most token-slots."""
    from deepinfer_dp.layers.moe import select_experts

    gen = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(TOKENS[rank], HIDDEN, generator=gen)
    logits = torch.randn(TOKENS[rank], EXPERTS, generator=gen)
    logits[:, 2:4] += 3.0
    return x, *select_experts(logits, TOP_K, renormalize=True)


def _layer(index: int, shard: tuple[int, ...]):
    from deepinfer_dp.layers.moe import FusedMoE

    layer = FusedMoE(EXPERTS, TOP_K, HIDDEN, INTER, layer_index=index, shard=shard)
    w13, w2 = _weights(index)
    with torch.no_grad():
        for j, e in enumerate(layer.local_logical()):
            layer.w13[j].copy_(w13[e])
            layer.w2[j].copy_(w2[e])
    return layer


def _worker(rank: int, port: int, backend: str, config: EPLBConfig, out) -> None:
    from deepinfer_dp.distributed.moe_dispatch import make_dispatcher
    from deepinfer_dp.eplb.rebalancer import Rebalancer

    torch.set_num_threads(1)
    ep = _join(rank, port, 30)
    layers = [_layer(i, (rank, 2, REDUNDANT)) for i in range(LAYERS)]
    dispatcher = make_dispatcher(backend, ep, EXPERTS)
    for layer in layers:
        layer.dispatcher = dispatcher
    balancer = Rebalancer(config, layers, ep, None)
    outputs = []
    with torch.inference_mode():
        for step in range(PASSES):
            balancer.begin_step()
            x, ids, weights = _tokens(rank, step)
            dispatcher.begin_step(x.shape[0])
            outputs.append([layer(x, ids, weights, True).numpy() for layer in layers])
    out.put((rank, outputs, balancer.stats(), [layer.expert_tokens.tolist() for layer in layers]))


@pytest.fixture(scope="module", params=["all_to_all", "allgather_reducescatter"])
def balanced(request) -> tuple[str, dict]:
    got = _run(_worker, request.param, CONFIG)
    return request.param, got


def test_forced_steps_rebalance_there_and_a_forced_step_during_a_move_waits_for_it():
    """Forced at 2 (layer 0 switches at 2, layer 1 at 3), at 3 (still moving: it plans at 4)
    and at 9; step_interval never comes."""
    config = EPLBConfig(window_size=4, step_interval=1000, num_redundant_experts=REDUNDANT, force_steps=[2, 3, 9])
    got = _run(_worker, "all_to_all", config)
    stats0, stats1 = got[0][1], got[1][1]
    assert stats0["eplb_switches"] == stats1["eplb_switches"]
    assert stats0["eplb_switches"][:2] == [[2, 0, 1], [3, 1, 1]]
    assert [h[0] for h in stats0["eplb_balancedness_history"]] == [2, 4, 9]
    assert all(p in (2, 3, 4, 5, 9, 10) for p, _, _ in stats0["eplb_switches"])
    _assert_bit_identical_to_all_experts_local(got)


def _assert_bit_identical_to_all_experts_local(got: dict) -> None:
    full = [_layer(i, (0, 1)) for i in range(LAYERS)]
    for rank in (0, 1):
        for step, outputs in enumerate(got[rank][0]):
            x, ids, weights = _tokens(rank, step)
            with torch.inference_mode():
                for layer, result in zip(full, outputs, strict=True):
                    assert torch.equal(torch.from_numpy(result), layer.compute(x, ids, weights, False)), (rank, step)


def test_outputs_are_bit_identical_to_all_experts_local(balanced):
    _, got = balanced
    _assert_bit_identical_to_all_experts_local(got)


def test_both_ranks_switched_every_layer_at_the_same_pass(balanced):
    _, got = balanced
    stats0, stats1 = got[0][1], got[1][1]
    assert stats0["eplb_switches"] == stats1["eplb_switches"]
    assert [s[:2] for s in stats0["eplb_switches"][:2]] == [[4, 0], [5, 1]]  # one layer a pass
    assert stats0["eplb_rebalances"] == stats1["eplb_rebalances"] >= 1
    assert stats0["eplb_placement"] == stats1["eplb_placement"]
    assert stats0["eplb_moved_bytes"] + stats1["eplb_moved_bytes"] > 0


def test_balancedness_rises_and_each_rank_counts_its_own_slots(balanced):
    _, got = balanced
    history = got[0][1]["eplb_balancedness_history"]
    assert history == got[1][1]["eplb_balancedness_history"]
    before, after = history[0][1], history[-1][1]
    assert before < 0.75 and after > before + 0.15, history
    for rank, (first, end) in ((0, (0, 5)), (1, (5, 10))):
        for row in got[rank][2]:
            assert sum(row[:first]) + sum(row[end:]) == 0 and sum(row[first:end]) > 0
