"""Rotary position embedding (RoPE) in the Hugging Face "rotate_half" layout.

Checkpoints in HF layout rotate the pair (x[i], x[i + d/2]), not adjacent pairs, so that
is what we do. The inverse frequencies are computed exactly as transformers does
(fp32, same formula) so logits match it to float noise.
"""

import math

import torch
from torch import nn

from deepinfer_dp import _C
from deepinfer_dp.layers import cpu_threads


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
    if rope_type in ("default", "mrope"):  # "mrope": Qwen2-VL's name for default frequencies
        return inv_freq
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params)
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, params)
    raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, linear, llama3, yarn)")


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(dim: int, params: dict) -> torch.Tensor:
    # YaRN (DeepSeek-V2/V3 long context): interpolated frequencies below the correction
    # range, extrapolated above it, a linear ramp between -- transformers' formula.
    base, factor = params["rope_theta"], params["factor"]
    old_len = params["original_max_position_embeddings"]
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    ramp = (torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / ((high - low) or 0.001)
    ramp = torch.clamp(ramp, 0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def attention_factor(params: dict) -> float:
    """The factor YaRN multiplies cos/sin by (1 for the other rope types); DeepSeek's
    checkpoints give mscale == mscale_all_dim, which makes it 1 and moves the whole
    correction into the softmax scale (yarn_softmax_scale)."""
    if params["rope_type"] != "yarn":
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor, mscale, mscale_all = params["factor"], params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
    return _yarn_mscale(factor)


def yarn_softmax_scale(params: dict, scale: float) -> float:
    """DeepSeek's softmax scale under YaRN: head_dim ** -0.5 times mscale(mscale_all_dim) squared."""
    if params["rope_type"] != "default" and params.get("mscale_all_dim"):
        scale *= _yarn_mscale(params["factor"], params["mscale_all_dim"]) ** 2
    return scale


class RotaryEmbedding(nn.Module):
    """Applies RoPE to flattened q [T, H, D] and k [T, Hkv, D] at given positions [T]."""

    def __init__(self, head_dim: int, max_position: int, params: dict):
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        self.inv_freq = compute_inv_freq(head_dim, params)
        self.attention_factor = attention_factor(params)
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
            cos, sin = emb.cos(), emb.sin()
            if self.attention_factor != 1.0:
                cos, sin = cos * self.attention_factor, sin * self.attention_factor
            # Cast like transformers: compute in fp32, apply in the activation dtype.
            self._tables[key] = (cos.to(dtype), sin.to(dtype))
        return self._tables[key]

    def rows(self, positions: torch.Tensor, device: torch.device,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, D] of the rows at `positions` [T]."""
        cos_table, sin_table = self._cos_sin(device, dtype)
        return cos_table[positions], sin_table[positions]

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Every layer of a step passes the same positions tensor: look the rows up once.
        if self._step_positions is not positions:
            self._step_cos_sin = self.rows(positions, q.device, q.dtype)
            self._step_positions = positions
        cos, sin = self._step_cos_sin
        if q.device.type == "cpu" and q.dtype == torch.float32:
            # One C++ pass each, in place (q and k are fresh: views of this step's qkv output).
            cos_np, sin_np, threads = cos.numpy(), sin.numpy(), cpu_threads.kernel_threads()
            # (the kernel refuses by name q or k whose heads are not contiguous in a row)
            _C.rotary(q.numpy(), cos_np, sin_np, threads)
            _C.rotary(k.numpy(), cos_np, sin_np, threads)
            return q, k
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, D]
        return _apply(q, cos, sin), _apply(k, cos, sin)


class MRotaryEmbedding(RotaryEmbedding):
    """M-RoPE (Qwen2-VL): positions [3, T] (temporal, height, width); frequency j takes its
    position from the row of its `mrope_section` (transformers' recomposition), so a row's
    cos/sin are gathered from the one-position tables. Positions [T] are plain RoPE."""

    def __init__(self, head_dim: int, max_position: int, params: dict):
        super().__init__(head_dim, max_position, params)
        section = [int(s) for s in params["mrope_section"]]
        if sum(section) != head_dim // 2:
            raise ValueError(f"mrope_section {section} must add up to head_dim / 2 = {head_dim // 2}")
        # explicit CPU: the model may be built under a meta-device context
        half = torch.repeat_interleave(torch.arange(len(section), device="cpu") % 3,
                                       torch.tensor(section, device="cpu"))
        self._row_of = torch.cat((half, half))  # [D]: which position row frequency j reads

    def rows(self, positions: torch.Tensor, device: torch.device,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().rows(positions, device, dtype)
        cos_table, sin_table = self._cos_sin(device, dtype)
        per_freq = positions[self._row_of.to(positions.device)].T  # [T, D]
        cols = torch.arange(self.head_dim, device=positions.device)
        return cos_table[per_freq, cols].contiguous(), sin_table[per_freq, cols].contiguous()


def make_rotary(head_dim: int, max_position: int, params: dict) -> RotaryEmbedding:
    """The RoPE of a config's parameters: M-RoPE when they carry an `mrope_section`."""
    if params.get("mrope_section"):
        return MRotaryEmbedding(head_dim, max_position, params)
    return RotaryEmbedding(head_dim, max_position, params)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
