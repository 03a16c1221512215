"""The MoE layer on its own: routing as transformers' routers do it, the layer equal to
transformers' sparse MoE block, batch-invariant at decode sizes (bit-identical), its torch
path equal to its kernel path, and its expert-load counters."""

from __future__ import annotations

import pytest
import torch
from moe_utils import build_tiny_moe, load_oracle

from deepinfer_dp.layers import moe
from deepinfer_dp.layers.linear import replace_linears
from deepinfer_dp.layers.moe import expert_range, select_experts
from deepinfer_dp.models import load_model


@pytest.fixture(scope="module")
def layers(tmp_path_factory):
    """kind -> (our first MoE block with the CPU linear kernel, transformers' block)."""
    root = tmp_path_factory.mktemp("moe_layer")
    out = {}
    for kind in ("mixtral", "qwen2-moe"):
        path = build_tiny_moe(kind, root / kind)
        ours = load_model(str(path), torch.float32, "cpu").model
        replace_linears(ours)
        out[kind] = (ours.moe_blocks[0], load_oracle(path).model.layers[0].mlp)
    return out


def test_select_experts_is_softmax_top_k_renormalized():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.5], [3.0, 0.0, 0.0, 2.9]])
    ids, weights = select_experts(logits, 2, renormalize=False)
    probs = torch.softmax(logits, dim=-1)
    assert ids.tolist() == [[1, 3], [0, 3]] and ids.dtype == torch.int32
    assert torch.allclose(weights, probs.gather(1, ids.long()))
    _, normed = select_experts(logits, 2, renormalize=True)
    assert torch.allclose(normed.sum(-1), torch.ones(2))


def test_expert_ranges_cover_every_expert_once():
    for size in (1, 2, 3, 5):
        ranges = [expert_range(r, size, 64) for r in range(size)]
        assert ranges[0][0] == 0 and ranges[-1][1] == 64
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    with pytest.raises(ValueError, match="needs at least 4 experts"):
        expert_range(0, 4, 2)


@pytest.mark.parametrize("kind", ["mixtral", "qwen2-moe"])
def test_layer_matches_transformers_block(layers, kind):
    ours, theirs = layers[kind]
    x = torch.randn(1, 50, 64, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ref = theirs(x).reshape(50, 64)
        got = ours(x[0])
    assert (got - ref).abs().max().item() < 1e-5


def test_routed_experts_are_batch_invariant_at_decode_sizes(layers):
    ours, _ = layers["mixtral"]
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        full = ours(x)
        for rows in ([5], [5, 9], list(range(0, 64, 2)), list(range(33))):
            assert torch.equal(ours(x[rows]), full[rows])


def test_torch_path_equals_kernel_path(layers, monkeypatch):
    ours, _ = layers["qwen2-moe"]
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        kernel = ours(x)
        monkeypatch.setattr(moe, "CPU_KERNEL", False)
        plain = ours(x)
    assert (kernel - plain).abs().max().item() < 1e-5


def test_expert_counters_count_real_token_slots(layers):
    ours, _ = layers["mixtral"]
    experts = ours.experts
    before = experts.expert_tokens.copy()
    x = torch.randn(10, 64, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        ids, _ = select_experts(ours.gate(x), ours.top_k, ours.renormalize)
        ours(x)
        assert (experts.expert_tokens - before).sum() == 10 * ours.top_k
        assert ((experts.expert_tokens - before) == torch.bincount(ids.reshape(-1).long(), minlength=8).numpy()).all()
        ours.counted = False  # the placeholder step's dummy token
        snapshot = experts.expert_tokens.copy()
        ours(x[:1])
        ours.counted = True
    assert (experts.expert_tokens == snapshot).all()
