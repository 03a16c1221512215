"""A MoE model with physical expert slots: loaded with redundant slots (the replicas filled
from the same checkpoint tensors) it computes the very logits of the plain model (top-2:
the same products summed in the same pairs); a redundant count that does not divide over
the ranks is refused at load, naming the numbers; and a model re-bound to a group of
another size (a survivor alone) reloads its slots for it and still computes the same."""

from __future__ import annotations

import pytest
import torch
from moe_utils import PagedSequences, build_tiny_moe, random_prompts

from deepinfer_dp.eplb.config import EPLBConfig
from deepinfer_dp.models import load_model


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    return build_tiny_moe("mixtral", tmp_path_factory.mktemp("eplb_model") / "mixtral")


def _logits(loaded) -> list[torch.Tensor]:
    prompts = random_prompts(loaded.hf_config.vocab_size, [5, 19], seed=4)
    seqs = PagedSequences(loaded, seed=5)
    out = seqs.step(dict(enumerate(prompts)), is_prefill=True)
    return out + seqs.step({0: [7], 1: [9]}, is_prefill=False)


@pytest.fixture(scope="module")
def plain_logits(mixtral_dir):
    return _logits(load_model(mixtral_dir, torch.float32, "cpu"))


def test_redundant_slots_compute_the_same_logits(mixtral_dir, plain_logits):
    loaded = load_model(mixtral_dir, torch.float32, "cpu", expert_shard=(0, 1, 2))
    experts = loaded.model.moe_blocks[0].experts
    assert experts.num_slots == 10 and experts.local_logical() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]
    assert torch.equal(experts.w13[8], experts.w13[0]) and torch.equal(experts.w2[9], experts.w2[1])
    for ours, ref in zip(_logits(loaded), plain_logits, strict=True):
        assert torch.equal(ours, ref)
    tokens = loaded.model.expert_tokens
    assert tokens.shape == (2, 10) and tokens[:, 8:].sum() > 0  # the replicas took tokens


def test_a_layout_that_does_not_divide_is_refused(mixtral_dir):
    with pytest.raises(ValueError, match=r"num_redundant_experts=1: 8 experts \+ 1 redundant = 9 physical slots"
                                         r" .* over 2 expert-parallel ranks"):
        load_model(mixtral_dir, torch.float32, "cpu", expert_shard=(0, 2, 1))


def test_a_survivor_alone_reloads_its_slots(mixtral_dir, plain_logits):
    loaded = load_model(mixtral_dir, torch.float32, "cpu", expert_shard=(1, 2, 2))  # rank 1's 5 slots
    assert loaded.model.moe_blocks[0].experts.local_logical() == [5, 6, 7, 0, 1]
    loaded.model.bind_ep_group(None, "all_to_all", EPLBConfig(num_redundant_experts=2))
    assert loaded.model.expert_shard == (0, 1, 2) and loaded.model.balancer is None
    for ours, ref in zip(_logits(loaded), plain_logits, strict=True):
        assert torch.equal(ours, ref)
