"""Where a long prefill's time goes: the wall time of each C++ kernel the model's modules call
(`_C.packed_linear`, `_C.paged_attention`, ...) against the whole generate call, for prompts of
random token ids on the default model (SmolLM2 Q4_1), 1 new token, the default
(batch-invariant) settings or not, 2 GiB of KV cache. Wall time: on a loaded machine the shares hold
better than the seconds.

    python benchmarks/prefill_profile.py [--prompts 1] [--tokens 2000] [--rounds 2]
        [--model DIR --dtype bfloat16]   # e.g. the peers runner's bf16 copy, computing in bf16
        [--no-batch-invariant]           # long prefills in torch's SDPA, timed apart
"""

from __future__ import annotations

import argparse
import collections
import time

import numpy as np

from deepinfer_dp import _C, LLM, SamplingParams
from deepinfer_dp.layers import activation, attention, linear, norm, packed, rotary
from deepinfer_dp.models import default_model_path

SPENT: collections.Counter = collections.Counter()
CALLS: collections.Counter = collections.Counter()


def timed(name: str, f):
    """f, its wall time added to SPENT[name] and its calls to CALLS[name]."""
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            SPENT[name] += time.perf_counter() - t
            CALLS[name] += 1
    return wrapper


class Timed:
    """`_C` with every callable timed into SPENT and CALLS."""

    def __init__(self, module) -> None:
        self._module = module

    def __getattr__(self, name: str):
        f = getattr(self._module, name)
        return timed(name, f) if callable(f) else f


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default=None, help="a model directory (default: the default model)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--no-batch-invariant", action="store_true",
                    help="batch_invariant=False: long prefills take torch's SDPA (timed apart)")
    args = ap.parse_args()
    for module in (packed, attention, linear, norm, rotary, activation):
        module._C = Timed(_C)
    attention._causal_attention = timed("sdpa", attention._causal_attention)
    attention._attention_with_context = timed("sdpa_with_context", attention._attention_with_context)
    llm = LLM(args.model or str(default_model_path()), dtype=args.dtype, kv_cache_memory_gb=2.0,
              enable_prefix_caching=False, batch_invariant=not args.no_batch_invariant)
    params = SamplingParams(max_tokens=1, temperature=0)
    llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=params, use_tqdm=False)
    rng = np.random.default_rng(0)
    for r in range(args.rounds):
        prompts = rng.integers(100, 40000, (args.prompts, args.tokens)).tolist()
        SPENT.clear()
        CALLS.clear()
        t = time.perf_counter()
        llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        wall = time.perf_counter() - t
        print(f"round {r + 1}: {wall:.2f} s for {args.prompts} x {args.tokens} tokens")
        for name, spent in SPENT.most_common():
            print(f"  {name:<18} {spent:7.2f} s {100 * spent / wall:5.1f}%  ({CALLS[name]} calls)")
        print(f"  {'the rest':<18} {wall - sum(SPENT.values()):7.2f} s")


if __name__ == "__main__":
    main()
