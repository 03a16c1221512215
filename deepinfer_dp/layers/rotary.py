"""Rotary position embedding (RoPE) in the Hugging Face "rotate_half" layout.

Checkpoints in HF layout rotate the pair (x[i], x[i + d/2]), not adjacent pairs, so that
is what we do. The inverse frequencies are computed exactly as transformers does
(fp32, same formula) so logits match it to float noise.
"""

import math

import torch
from torch import nn

from deepinfer_dp import _C


def rope_parameters(config) -> dict:
    """The RoPE settings of a config, from either transformers 5 (`rope_parameters`)
    or transformers 4 (`rope_theta` + `rope_scaling`) style configs."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if "rope_theta" not in params:
        params.update(getattr(config, "rope_scaling", None) or {})
        params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    # Llama 3.1 "smooth" frequency scaling: long wavelengths are divided by `factor`,
    # short ones kept, and the band in between interpolated.
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def compute_inv_freq(head_dim: int, params: dict) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (fp32) for the supported rope types."""
    base = params["rope_theta"]
    # Explicit CPU: the model may be built under a meta-device context.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (base ** exponents)
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params)
    raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Applies RoPE to flattened q [T, H, D] and k [T, Hkv, D] at given positions [T]."""

    def __init__(self, head_dim: int, max_position: int, params: dict):
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        self.inv_freq = compute_inv_freq(head_dim, params)
        # cos/sin tables are built lazily per (device, dtype): the model may be created on
        # the meta device and materialized later, which would wipe a precomputed buffer.
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        self._step_positions: torch.Tensor | None = None
        self._step_cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def _cos_sin(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (device, dtype)
        if key not in self._tables:
            pos = torch.arange(self.max_position, dtype=torch.float32, device=device)
            freqs = pos[:, None] * self.inv_freq.to(device)[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            # Cast like transformers: compute in fp32, apply in the activation dtype.
            self._tables[key] = (emb.cos().to(dtype), emb.sin().to(dtype))
        return self._tables[key]

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Every layer of a step passes the same positions tensor: look the rows up once.
        if self._step_positions is not positions:
            cos_table, sin_table = self._cos_sin(q.device, q.dtype)
            self._step_cos_sin = (cos_table[positions], sin_table[positions])  # [T, D]
            self._step_positions = positions
        cos, sin = self._step_cos_sin
        if q.device.type == "cpu" and q.dtype == torch.float32:
            # One C++ pass each, in place (q and k are fresh: views of this step's qkv output).
            cos_np, sin_np = cos.numpy(), sin.numpy()
            _C.rotary(_heads_view(q), cos_np, sin_np)
            _C.rotary(_heads_view(k), cos_np, sin_np)
            return q, k
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, D]
        return _apply(q, cos, sin), _apply(k, cos, sin)


def _heads_view(x: torch.Tensor):
    """x [T, H, D] as a NumPy view for the kernel, which wants each row's heads contiguous."""
    if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        raise ValueError(f"rotary: heads of q/k must be contiguous, got strides {x.stride()}")
    return x.numpy()


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
