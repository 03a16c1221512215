"""A reference quantizer for GGUF's K-quant formats (Q2_K-Q6_K), which the `gguf` package
can dequantize but not write: plain min/max scales per sub-block (not llama.cpp's error
search), laid out byte for byte as ggml's block_q2_K ... block_q6_K, so
`gguf.quants.dequantize` reads them back. Q5_0/Q5_1 (and the rest) go through gguf's own
quantizer."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType, quants

GGUF_TYPES = {"q4_0": GGMLQuantizationType.Q4_0, "q4_1": GGMLQuantizationType.Q4_1,
              "q5_0": GGMLQuantizationType.Q5_0, "q5_1": GGMLQuantizationType.Q5_1,
              "q8_0": GGMLQuantizationType.Q8_0, "q2_k": GGMLQuantizationType.Q2_K,
              "q3_k": GGMLQuantizationType.Q3_K, "q4_k": GGMLQuantizationType.Q4_K,
              "q5_k": GGMLQuantizationType.Q5_K, "q6_k": GGMLQuantizationType.Q6_K}
K_QUANTS = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k")


def quantize(w: np.ndarray, fmt: str) -> np.ndarray:
    """w [rows, cols] fp32 as uint8 [rows, bytes per row] in `fmt`."""
    if fmt not in K_QUANTS:
        return quants.quantize(w, GGUF_TYPES[fmt])
    rows, cols = w.shape
    if cols % 256:
        raise ValueError(f"{fmt} needs columns in multiples of 256, got {cols}")
    blocks = w.astype(np.float32).reshape(-1, 256)
    writers = {"q2_k": _q2_k, "q3_k": _q3_k, "q6_k": _q6_k, "q4_k": lambda b: _q45_k(b, bits=4),
               "q5_k": lambda b: _q45_k(b, bits=5)}
    packed = writers[fmt](blocks)
    return packed.reshape(rows, -1)


def dequantize(data: np.ndarray, fmt: str) -> np.ndarray:
    return np.asarray(quants.dequantize(data, GGUF_TYPES[fmt]), dtype=np.float32)


def _half(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x rounded to fp16: (its bytes [n, 2], its value as fp32 [n])."""
    h = x.astype(np.float16)
    return h.reshape(-1, 1).view(np.uint8), h.astype(np.float32)


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1), 0)


def _q45_k(blocks: np.ndarray, bits: int) -> np.ndarray:
    n, top = blocks.shape[0], (1 << bits) - 1
    sub = blocks.reshape(n, 8, 32)
    low = np.minimum(sub.min(-1), 0)  # values are d * sc * q - dmin * m with q, m >= 0
    scale, mins = (sub.max(-1) - low) / top, -low
    d_bytes, d = _half(scale.max(-1) / 63)
    m_bytes, dmin = _half(mins.max(-1) / 63)
    sc = np.clip(np.rint(_ratio(scale, d[:, None])), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(_ratio(mins, dmin[:, None])), 0, 63).astype(np.uint8)
    dl, ml = (d[:, None] * sc)[..., None], (dmin[:, None] * m)[..., None]
    q = np.clip(np.rint(_ratio(sub + ml, np.broadcast_to(dl, sub.shape))), 0, top).astype(np.uint8)
    scales = np.concatenate([sc[:, :4] | (sc[:, 4:] >> 4) << 6, m[:, :4] | (m[:, 4:] >> 4) << 6,
                             (sc[:, 4:] & 0xF) | (m[:, 4:] & 0xF) << 4], axis=1)
    pairs = (q & 0xF).reshape(n, 4, 2, 32)
    qs = (pairs[:, :, 0] | pairs[:, :, 1] << 4).reshape(n, 128)
    parts = [d_bytes, m_bytes, scales]
    if bits == 5:  # bit s of high byte l: the fifth bit of value l of sub-block s
        parts.append(np.bitwise_or.reduce((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None], axis=1))
    return np.concatenate([*parts, qs], axis=1).astype(np.uint8)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    sub = blocks.reshape(n, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d_bytes, d = _half(scale.max(-1) / 127)
    sc = np.clip(np.rint(_ratio(scale, d[:, None])), -128, 127).astype(np.int8)
    step = np.broadcast_to((d[:, None] * sc)[..., None], sub.shape)
    q = (np.clip(np.rint(_ratio(sub, step)), -32, 31) + 32).astype(np.uint8).reshape(n, 2, 4, 32)
    # value 128h + 32c + l: nibble c // 2 of low byte 64h + 32(c % 2) + l, bits 2c of high byte 32h + l
    ql = ((q[:, :, :2] & 0xF) | (q[:, :, 2:] & 0xF) << 4).reshape(n, 128)
    qh = np.bitwise_or.reduce((q >> 4) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None], axis=2)
    return np.concatenate([ql, qh.reshape(n, 64), sc.view(np.uint8), d_bytes], axis=1).astype(np.uint8)


def _q2_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    sub = blocks.reshape(n, 16, 16)
    low = np.minimum(sub.min(-1), 0)
    scale, mins = (sub.max(-1) - low) / 3, -low
    d_bytes, d = _half(scale.max(-1) / 15)
    m_bytes, dmin = _half(mins.max(-1) / 15)
    sc = np.clip(np.rint(_ratio(scale, d[:, None])), 0, 15).astype(np.uint8)
    m = np.clip(np.rint(_ratio(mins, dmin[:, None])), 0, 15).astype(np.uint8)
    dl, ml = (d[:, None] * sc)[..., None], (dmin[:, None] * m)[..., None]
    q = np.clip(np.rint(_ratio(sub + ml, np.broadcast_to(dl, sub.shape))), 0, 3).astype(np.uint8)
    # value 128h + 32t + l: bits 2t of quant byte 32h + l
    qs = np.bitwise_or.reduce(q.reshape(n, 2, 4, 32) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None], axis=2)
    return np.concatenate([sc | m << 4, qs.reshape(n, 64), d_bytes, m_bytes], axis=1).astype(np.uint8)


def _q3_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    sub = blocks.reshape(n, 16, 16)
    scale = np.abs(sub).max(-1) / 4
    d_bytes, d = _half(scale.max(-1) / 31)
    sc = np.clip(np.rint(_ratio(scale, d[:, None])), 0, 31).astype(np.int16)
    step = np.broadcast_to((d[:, None] * sc)[..., None], sub.shape)
    u = (np.clip(np.rint(_ratio(sub, step)), -4, 3) + 4).astype(np.uint8).reshape(n, 8, 32)  # q + 4
    # value 32j + l: bits 2(j % 4) of quant byte 32(j // 4) + l, and bit j of byte l (set: q >= 0)
    qs = np.bitwise_or.reduce((u & 3).reshape(n, 2, 4, 32) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None],
                              axis=2)
    hmask = np.bitwise_or.reduce((u >> 2) << np.arange(8, dtype=np.uint8)[None, :, None], axis=1)
    s6 = (sc + 32).astype(np.uint8)  # scale i: low nibble in byte i % 8 (high half for i >= 8),
    low = s6[:, :8] & 0xF | (s6[:, 8:] & 0xF) << 4  # its top two bits at 2(i // 4) of byte 8 + i % 4
    high = np.bitwise_or.reduce((s6 >> 4).reshape(n, 4, 4) << (2 * np.arange(4, dtype=np.uint8))[None, :, None], axis=1)
    return np.concatenate([hmask, qs.reshape(n, 64), low, high, d_bytes], axis=1).astype(np.uint8)
