"""What a KV cache resident from start-up (`utils/cpu_malloc.py` `resident_zeros`) does to a
fresh engine's first rounds, against one whose pages the OS faults in as blocks are first
written (np.zeros, as the runner allocated before). Two engines in one process, each warmed
with a one-token request as `benchmarks/peers/run.py` warms them, then rounds of the same
prompts alternating which engine goes first; also the seconds each allocation took. Greedy,
EOS ignored, 128 new tokens; models as in decode_step_profile.py.

    python benchmarks/kv_resident.py [--model smollm2-bf16|smollm2] [--batch 64] [--rounds 4]
"""

from __future__ import annotations

import argparse
import time
from contextlib import contextmanager

import numpy as np
from decode_step_profile import _engine_and_prompts

import deepinfer_dp.models.llama as llama
from deepinfer_dp import SamplingParams


@contextmanager
def allocation(resident: bool, spent: dict[str, float], name: str):
    """While the engine is built: the cache through resident_zeros or plain np.zeros, timed."""
    keep = llama.resident_zeros

    def allocate(shape, dtype):
        start = time.perf_counter()
        out = keep(shape, dtype) if resident else np.zeros(shape, dtype=dtype)
        spent[name] = time.perf_counter() - start
        return out

    llama.resident_zeros = allocate
    try:
        yield
    finally:
        llama.resident_zeros = keep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("smollm2-bf16", "smollm2"), default="smollm2-bf16")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    spent: dict[str, float] = {}
    engines = {}
    for name, resident in (("resident", True), ("lazy", False)):
        with allocation(resident, spent, name):
            engines[name], prompts = _engine_and_prompts(args.model, args.batch)
        engines[name].generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=1),
                               use_tqdm=False)
    print(f"cache allocation: resident {spent['resident']:.2f} s, lazy {spent['lazy']:.2f} s")
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    for r in range(args.rounds):
        rate = {}
        for name in ("resident", "lazy") if r % 2 == 0 else ("lazy", "resident"):
            start = time.perf_counter()
            engines[name].generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
            rate[name] = args.batch * 128 / (time.perf_counter() - start)
        print(f"round {r + 1}: resident {rate['resident']:.1f} tok/s, lazy {rate['lazy']:.1f} tok/s, "
              f"resident / lazy {rate['resident'] / rate['lazy']:.3f}", flush=True)


if __name__ == "__main__":
    main()
