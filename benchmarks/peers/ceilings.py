"""The machine's ceilings (fp32 matmul GFLOP/s, memory read GB/s, the multiply-add peaks; all on
all cores) and the default model's cost per token, so that throughputs can be read as shares of
what the machine can do."""

from __future__ import annotations

import os
import time
from pathlib import Path


def machine_ceilings(reps: int = 5) -> dict:
    import torch

    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b)
        best = min(best, (time.perf_counter() - t) / 4)
    gflops = 2 * 2048**3 / best / 1e9
    return {"matmul_gflops": gflops, "read_gbs": read_gbs(threads, reps), "threads": torch.get_num_threads(),
            "fma_gflops": dot_peak(False, threads), "bf16_dot_gflops": dot_peak(True, threads),
            "amx_gflops": amx_peak(threads)}


def dot_peak(bf16: bool, threads: int, reps: int = 3) -> float:
    """GFLOP/s of `threads` cores' multiply-add units together, from `_C.dot_peak_gflops`'s loop of
    register chains run on every core at once (512-bit fp32 FMA, or vdpbf16ps with bf16), each
    core's rate over its own CPU time, the best of `reps`; 0 where the CPU lacks the instruction."""
    from deepinfer_dp import _C

    return _on_every_core(lambda: _C.dot_peak_gflops(bf16), threads, reps)


def amx_peak(threads: int, reps: int = 3) -> float:
    """The same for AMX's tile products (`_C.amx_peak_gflops`), where our bf16 products run on a
    CPU with AMX-BF16; 0 without it."""
    from deepinfer_dp import _C

    return _on_every_core(_C.amx_peak_gflops, threads, reps)


def _on_every_core(loop, threads: int, reps: int) -> float:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(threads) as pool:  # the loops release the GIL
        return max(sum(pool.map(lambda _: loop(), range(threads))) for _ in range(reps))


def read_gbs(threads: int, reps: int = 5) -> float:
    """GB/s that `threads` torch threads read: the best sum over 512 MB, far beyond the caches."""
    import torch

    torch.set_num_threads(threads)
    big = torch.ones(128 << 20)
    big.sum()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        big.sum()
        best = min(best, time.perf_counter() - t)
    return big.numel() * 4 / best / 1e9


def model_costs(hf_dir: str) -> dict:
    """Per token: matmul FLOPs, attention FLOPs per context position; per step: bytes of
    weights as stored packed (norms aside), and fp32 KV bytes per cached position."""
    from safetensors import safe_open
    from transformers import AutoConfig

    from deepinfer_dp.models.default_model import PACKED_FILE

    c = AutoConfig.from_pretrained(hf_dir)
    head = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * head, c.num_key_value_heads * head
    per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    matmul_params = c.num_hidden_layers * per_layer + c.vocab_size * c.hidden_size
    weight_bytes = 0
    packed = Path(hf_dir) / PACKED_FILE
    if packed.is_file():
        with safe_open(packed, framework="np") as f:
            for name in f.keys():
                rows, row_bytes = f.get_slice(name).get_shape()
                weight_bytes += rows * row_bytes
    return {"matmul_flops": 2 * matmul_params,
            "attn_flops_per_position": 4 * c.num_attention_heads * head * c.num_hidden_layers,
            "weight_bytes": weight_bytes or (2 if str(c.torch_dtype).endswith("bfloat16") else 4) * matmul_params,
            "kv_bytes_per_position": 2 * c.num_hidden_layers * kv * 4}
