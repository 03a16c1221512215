"""`_C.LlamaDecodeStack` (csrc/kernels/llama_decode.h) checks what it is handed: weights at
add_layer, caches at set_caches, and every step's slots, block ids and shapes before it
writes into the cache, each with a ValueError naming what was wrong (KV groups and RoPE tables
included). And `_C.silu_mul` and `_C.gelu_tanh_mul`, the activations it shares with the module
path, against torch's within a few ulp.
(That the stack computes what the modules compute is tests/models/test_llama_cpu_decode.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer_dp import _C

H, HEADS, KV, D, INTER, BLOCKS, BS = 16, 4, 2, 4, 24, 8, 4


def f32(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32) * 0.1


def stack_with_one_layer():
    stack = _C.LlamaDecodeStack(H, HEADS, KV, D, INTER, 1e-5, np.ones(H, np.float32), 1e-5)
    qkv = (f32((HEADS + 2 * KV) * D, H), "f32", None)
    stack.add_layer(qkv, (f32(H, HEADS * D), "f32", None), (f32(2 * INTER, H), "f32", None),
                    (f32(H, INTER), "f32", None), np.ones(H, np.float32), np.ones(H, np.float32), 0.5)
    return stack


def caches():
    return [np.zeros((BLOCKS, BS, KV, D), np.float32)], [np.zeros((BLOCKS, BS, KV, D), np.float32)]


def step(slot=5, block=1, length=6):
    return dict(embeddings=f32(1, H, seed=1), cos=np.ones((1, D), np.float32), sin=np.zeros((1, D), np.float32),
                slots=np.array([slot], np.int64), block_tables=np.array([[0, block]], np.int32),
                context_lens=np.array([length], np.int32), query_rows=None, threads=1)


def test_a_step_writes_its_kv_and_returns_hidden_states():
    stack = stack_with_one_layer()
    k, v = caches()
    stack.set_caches(k, v)
    out = stack.run(**step())
    assert out.shape == (1, H) and np.isfinite(out).all()
    assert np.abs(k[0][1, 1]).sum() > 0 and np.abs(v[0][1, 1]).sum() > 0  # slot 5 = block 1, offset 1
    assert np.abs(k[0]).sum() == np.abs(k[0][1, 1]).sum()  # nothing else written


@pytest.mark.parametrize("bad, message", [
    (dict(slot=BLOCKS * BS), "slot 32 outside the cache"),
    (dict(slot=-1), "slot -1 outside the cache"),
    (dict(block=BLOCKS), "block id outside the cache"),
    (dict(length=3 * BS), "context length out of range"),
])
def test_bad_step_indices_raise_before_anything_is_written(bad, message):
    stack = stack_with_one_layer()
    k, v = caches()
    stack.set_caches(k, v)
    with pytest.raises(ValueError, match=message):
        stack.run(**step(**bad))
    assert not k[0].any() and not v[0].any()


def test_misuse_names_what_was_wrong():
    stack = stack_with_one_layer()
    with pytest.raises(ValueError, match="caches are not set"):
        stack.run(**step())
    with pytest.raises(ValueError, match="one K and V cache per layer"):
        stack.set_caches([], [])
    with pytest.raises(ValueError, match=r"qkv: weight must be \[32, 16\]"):
        stack.add_layer((f32(H, H), "f32", None), (f32(H, HEADS * D), "f32", None), (f32(2 * INTER, H), "f32", None),
                        (f32(H, INTER), "f32", None), np.ones(H, np.float32), np.ones(H, np.float32), 0.5)
    with pytest.raises(ValueError, match="unknown format 'iq4_xs'"):
        stack.add_layer((np.zeros((32, 8), np.uint8), "iq4_xs", None), (f32(H, HEADS * D), "f32", None),
                        (f32(2 * INTER, H), "f32", None), (f32(H, INTER), "f32", None), np.ones(H, np.float32),
                        np.ones(H, np.float32), 0.5)
    k, v = caches()
    stack.set_caches(k, v)
    with pytest.raises(ValueError, match="embeddings must be"):
        stack.run(**{**step(), "embeddings": f32(1, H + 1)})
    with pytest.raises(ValueError, match="unknown activation 'relu'"):
        _C.LlamaDecodeStack(H, HEADS, KV, D, INTER, 1e-5, np.ones(H, np.float32), 1e-5, "relu")
    with pytest.raises(ValueError, match=r"q_norm must be \[4\]"):
        stack.add_layer(*layer_args(), q_norm=np.ones(H, np.float32), k_norm=np.ones(D, np.float32))


def layer_args():
    return ((f32((HEADS + 2 * KV) * D, H), "f32", None), (f32(H, HEADS * D), "f32", None),
            (f32(2 * INTER, H), "f32", None), (f32(H, INTER), "f32", None), np.ones(H, np.float32),
            np.ones(H, np.float32), 0.5)


def test_kv_groups_and_rope_tables_are_checked_per_step():
    """Two layers in two KV groups with two RoPE tables: a step needs a slot per token and
    group, tables interleaving both groups, and cos/sin per table; each layer writes its
    group's slot (both share one cache pair here)."""
    stack = _C.LlamaDecodeStack(H, HEADS, KV, D, INTER, 1e-5, np.ones(H, np.float32), 1e-5, "gelu_tanh")
    stack.add_layer(*layer_args(), rope=0, group=0)
    stack.add_layer(*layer_args(), q_norm=np.ones(D, np.float32), k_norm=np.ones(D, np.float32), rope=1, group=1)
    assert stack.num_groups == 2
    k, v = caches()
    stack.set_caches(k * 2, v * 2)
    good = {**step(), "cos": np.ones((2, 1, D), np.float32), "sin": np.zeros((2, 1, D), np.float32),
            "slots": np.array([5, 9], np.int64), "block_tables": np.array([[0, 0, 1, 2]], np.int32)}
    with pytest.raises(ValueError, match=r"cos must be \[2 RoPE tables, T, head_dim\]"):
        stack.run(**{**good, "cos": np.ones((1, D), np.float32)})
    with pytest.raises(ValueError, match=r"slots need one entry per token and KV group \(2\)"):
        stack.run(**{**good, "slots": np.array([5], np.int64)})
    with pytest.raises(ValueError, match=r"block_tables must be \[rows, blocks \* KV groups \(2\)\]"):
        stack.run(**{**good, "block_tables": np.array([[0, 1, 2]], np.int32)})
    with pytest.raises(ValueError, match="block id outside the cache"):
        stack.run(**{**good, "block_tables": np.array([[0, 0, 1, BLOCKS]], np.int32)})
    assert not k[0].any()
    out = stack.run(**good)
    assert np.isfinite(out).all()
    written = [(b, o) for b in range(BLOCKS) for o in range(BS) if k[0][b, o].any()]
    assert written == [(1, 1), (2, 1)]  # slot 5 (group 0) and slot 9 (group 1)


@pytest.mark.parametrize("rows, inter", [(1, 1536), (3, 13), (5, 64)])
def test_silu_mul_is_torch_silu_times_up_within_a_few_ulp(rows, inter):
    gate_up = torch.from_numpy(f32(rows, 2 * inter, seed=rows) * 80)  # reaches e^x's clamped range
    out = torch.empty(rows, inter)
    _C.silu_mul(gate_up.numpy(), out.numpy())
    gate, up = gate_up.split(inter, dim=-1)
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up, rtol=4e-7, atol=1e-30)
    row = torch.empty(1, inter)  # a row's values do not depend on the rows around it
    _C.silu_mul(gate_up[-1:].contiguous().numpy(), row.numpy())
    assert torch.equal(row[0], out[-1])
    with pytest.raises(ValueError, match=r"silu_mul: gate_up must be \[T, 2I\]"):
        _C.silu_mul(gate_up.numpy(), torch.empty(rows, inter + 1).numpy())


@pytest.mark.parametrize("act", ["silu_mul", "gelu_tanh_mul"])
def test_activation_bits_do_not_depend_on_where_an_element_falls(act):
    """31 = 16 + 8 + 7: the 16-lane, 8-lane and scalar code each take part of the row; every
    element must equal the same element computed alone (inter = 1: scalar code only)."""
    values = torch.from_numpy(f32(2, 31, seed=7) * 30)
    values[0, :6] = torch.tensor([0.0, -0.0, 1e-30, 88.5, -88.5, 1e-3])
    row = torch.empty(1, 31)
    getattr(_C, act)(values.reshape(1, 62).contiguous().numpy(), row.numpy())
    alone = torch.empty(31, 1)
    getattr(_C, act)(values.t().contiguous().numpy(), alone.numpy())
    assert torch.equal(row[0], alone[:, 0])


@pytest.mark.parametrize("rows, inter", [(1, 1536), (3, 13), (5, 64)])
def test_gelu_tanh_mul_is_torch_tanh_gelu_times_up(rows, inter):
    """Against float64 (x * sigmoid(2 * inner), the same function without 1 + tanh's loss of
    bits where tanh nears -1) within what rounding the float32 argument costs, and against
    torch's float32 tanh GELU; a row's values do not depend on its neighbours."""
    gate_up = torch.from_numpy(f32(rows, 2 * inter, seed=rows) * 40)  # reaches e^x's clamped range
    gate_up[0, :4] = torch.tensor([0.0, -0.0, 1e-30, -1e-30])
    out = torch.empty(rows, inter)
    _C.gelu_tanh_mul(gate_up.numpy(), out.numpy())
    gate, up = gate_up.split(inter, dim=-1)
    x = gate.double()
    exact = x * torch.sigmoid(2 * 0.7978845608028654 * (x + 0.044715 * x ** 3)) * up.double()
    torch.testing.assert_close(out.double(), exact, rtol=2e-5, atol=1e-30)
    torch.testing.assert_close(out, torch.nn.functional.gelu(gate, approximate="tanh") * up, rtol=1e-5, atol=1e-5)
    row = torch.empty(1, inter)
    _C.gelu_tanh_mul(gate_up[-1:].contiguous().numpy(), row.numpy())
    assert torch.equal(row[0], out[-1])
    with pytest.raises(ValueError, match=r"gelu_tanh_mul: gate_up must be \[T, 2I\]"):
        _C.gelu_tanh_mul(gate_up.numpy(), torch.empty(rows, inter + 1).numpy())
