"""The placement policy and the expert map on skewed loads: replicas go to the hottest
experts, the packing raises the balancedness (mean / max token-slots per rank) clearly, every
expert keeps a slot, no rank holds an expert twice, kept experts stay in their slots, and the
map spreads an expert's token-slots evenly over its replicas."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer_dp.eplb.policy import arrange, balancedness, rank_loads, rebalance, replicate
from deepinfer_dp.layers.expert_map import ExpertMap, check_layout, fit_redundant, initial_placement

# 8 experts, 2 hot ones (0 and 2, which the initial placement puts on rank 0)
SKEWED = np.array([4000, 200, 3000, 150, 100, 100, 50, 20], dtype=np.int64)


@pytest.mark.parametrize(("ranks", "redundant"), [(2, 0), (2, 2), (4, 0), (4, 4), (3, 1)])
def test_balancedness_rises_on_a_skewed_load(ranks, redundant):
    start = initial_placement(len(SKEWED), len(SKEWED) + redundant)
    before = balancedness(rank_loads(SKEWED, start, ranks))
    placement = rebalance(SKEWED, start, ranks)
    after = balancedness(rank_loads(SKEWED, placement, ranks))
    assert after > before
    assert sorted(set(placement.tolist())) == list(range(len(SKEWED)))  # every expert has a slot
    slots = len(placement) // ranks
    for r in range(ranks):
        mine = placement[r * slots:(r + 1) * slots].tolist()
        assert len(set(mine)) == len(mine)  # no rank holds an expert twice


def test_redundant_slots_replicate_the_hot_experts_and_balance_two_ranks():
    assert replicate(SKEWED, 10, 2).tolist() == [2, 1, 2, 1, 1, 1, 1, 1]
    start = initial_placement(8, 10)
    placement = rebalance(SKEWED, start, 2)
    # without replicas the two hot experts can only be split: 4000+... vs 3000+...
    assert balancedness(rank_loads(SKEWED, rebalance(SKEWED, initial_placement(8, 8), 2), 2)) < 0.95
    assert balancedness(rank_loads(SKEWED, placement, 2)) > 0.99
    assert balancedness(rank_loads(SKEWED, start, 2)) < 0.75


def test_kept_experts_stay_in_their_slots_and_no_load_changes_nothing():
    current = np.array([0, 1, 2, 3, 4, 5, 6, 7])
    assert arrange([[3, 2, 9, 0], [5, 4, 6, 7]], current).tolist() == [0, 9, 2, 3, 4, 5, 6, 7]
    assert rebalance(np.zeros(8, dtype=np.int64), current, 2).tolist() == current.tolist()


def test_the_policy_is_deterministic():
    load = np.random.default_rng(0).integers(0, 1000, 16)
    start = initial_placement(16, 20)
    assert rebalance(load, start, 4).tolist() == rebalance(load.copy(), start.copy(), 4).tolist()


def test_layouts_that_do_not_divide_are_named():
    assert check_layout(8, 2, 2) == 5
    with pytest.raises(ValueError, match="8 experts \\+ 1 redundant = 9 physical slots .* over 2 expert-parallel "
                                         "ranks .*; 0 would"):
        check_layout(8, 1, 2)
    # a group re-formed at another size takes the nearest count that divides
    assert [fit_redundant(8, 2, n) for n in (1, 2, 3, 4, 5)] == [2, 2, 1, 0, 2]


def test_more_slots_than_experts_on_one_rank_replicate_within_it():
    load = np.array([10, 1, 1, 1])
    placement = rebalance(load, initial_placement(4, 6), 1)
    assert sorted(placement.tolist()) == [0, 0, 0, 1, 2, 3]


def test_the_map_splits_an_expert_over_its_replicas_and_counts():
    m = ExpertMap(initial_placement(4, 6), 4, 2, torch.device("cpu"))  # experts 0 and 1 twice
    ids = torch.tensor([[0, 2], [0, 1], [0, 3], [0, 1]], dtype=torch.int32)
    physical = m.to_physical(ids, counted=True)
    assert torch.equal(torch.tensor(m.phys_to_log)[physical.long()], ids.long())  # same expert
    zeros = physical[ids == 0].tolist()
    assert zeros.count(0) == zeros.count(4) == 2
    counts = m.take_counts()
    assert counts[:4].tolist() == [4, 2, 1, 1]
    owner = torch.arange(6) // 3
    assert counts[4:].tolist() == torch.bincount(owner[physical.reshape(-1).long()], minlength=2).tolist()
    assert m.take_counts().sum() == 0
    m.to_physical(ids, counted=False)
    assert m.counts.sum() == 0
