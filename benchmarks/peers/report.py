"""Prints the peers benchmark: per workload each engine's best tokens/s, the ratios, token
identity against ours, start time and peak RSS, and our share of the machine's ceilings."""

from __future__ import annotations

import statistics

OURS = "deepinfer-dp"


def best_by_engine(rounds: list[list[dict]], workload: str) -> dict[str, dict]:
    """engine -> {"tok_s": best, "all": [every round], "tokens", "cold_start_s", "peak_rss_gb"}."""
    out: dict[str, dict] = {}
    for runs in rounds:
        for run in runs:
            w = run.get("workloads", {}).get(workload)
            if w is None:
                continue
            e = out.setdefault(run["engine"], {"tok_s": 0.0, "all": [], "tokens": w["tokens"],
                                               "cold_start_s": run["cold_start_s"], "peak_rss_gb": 0.0})
            e["all"].append(w["tok_s"])
            e["tok_s"] = max(e["tok_s"], w["tok_s"])
            e["cold_start_s"] = min(e["cold_start_s"], run["cold_start_s"])
            e["peak_rss_gb"] = max(e["peak_rss_gb"], run["peak_rss_gb"])
            if "prefill_s" in w:
                e.setdefault("prefill_s", []).append(w["prefill_s"])
                e.setdefault("decode_tok_s", []).append(w["decode_tok_s"])
    return out


def prefill_decode(engine: str, e: dict, ours: dict | None, prompt_tokens: int) -> str:
    """The prefill pass's best seconds and the best decode tok/s, with ours against this engine's."""
    decodes = [x for x in e["decode_tok_s"] if x is not None]
    prefill, decode = min(e["prefill_s"]), max(decodes, default=None)
    rounds = ", ".join("n/a" if x is None else f"{x:.1f}" for x in e["decode_tok_s"])
    line = (f"  {engine:<17} prefill {prefill:6.1f} s ({prompt_tokens / prefill:6.0f} prompt tok/s; rounds "
            f"{', '.join(f'{x:.1f}' for x in e['prefill_s'])}), decode "
            f"{'n/a' if decode is None else f'{decode:6.1f}'} tok/s (rounds {rounds})")
    if ours is not None and ours is not e and "prefill_s" in ours:
        line += f"; ours vs it: prefill {prefill / min(ours['prefill_s']):.2f}x"
        ours_decode = max((x for x in ours["decode_tok_s"] if x is not None), default=None)
        if decode is not None and ours_decode is not None:
            line += f", decode {ours_decode / decode:.2f}x"
    return line


def identity(ours: list[list[int]], theirs: list[list[int]]) -> str:
    same = sum(a == b for a, b in zip(ours, theirs, strict=True))
    if same == len(ours):
        return f"{same}/{len(ours)} identical"
    first = [next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
             for a, b in zip(ours, theirs, strict=True) if a != b]
    return f"{same}/{len(ours)} identical (others diverge at token {statistics.median(first):.0f}, median)"


def shares(tok_s: float, w: dict, costs: dict, ceilings: dict, bf16: bool = False) -> str:
    """Decode-step estimate; the measured time includes prefill, so these are lower bounds. The
    peak share is of the instruction the products use: for bf16 AMX's tiles where the CPU has
    them, else vdpbf16ps; fp32 FMA for fp32. The bf16 path's KV cache holds bf16, half the
    bytes of model_costs' fp32 positions."""
    batch = len(w["prompts"])
    ctx = statistics.mean(len(p) for p in w["prompts"]) + w["max_tokens"] / 2
    flops = costs["matmul_flops"] + costs["attn_flops_per_position"] * ctx
    kv_bytes = costs["kv_bytes_per_position"] / (2 if bf16 else 1)
    step_bytes = costs["weight_bytes"] + batch * ctx * kv_bytes
    compute = tok_s * flops / (ceilings["matmul_gflops"] * 1e9)
    memory = tok_s / batch * step_bytes / (ceilings["read_gbs"] * 1e9)
    out = f"ours: {compute * 100:.0f}% of the matmul ceiling, {memory * 100:.0f}% of the read ceiling"
    peak_name, peak = product_peak(ceilings, bf16)
    if peak:
        gflops = tok_s * flops / 1e9
        out += f", {gflops / peak * 100:.0f}% of the {peak_name} peak ({gflops:.0f} GFLOP/s)"
    return out


def product_peak(ceilings: dict, bf16: bool) -> tuple[str, float | None]:
    """The peak of the instruction our products use, and its name."""
    if not bf16:
        return "FMA", ceilings.get("fma_gflops")
    if ceilings.get("amx_gflops"):
        return "AMX", ceilings["amx_gflops"]
    return "vdpbf16ps", ceilings.get("bf16_dot_gflops")


def print_report(rounds: list[list[dict]], spec: dict, ceilings: dict, costs: dict, skipped: list[str],
                 ours_name: str = OURS) -> None:
    print(f"machine: fp32 matmul {ceilings['matmul_gflops']:.0f} GFLOP/s, read {ceilings['read_gbs']:.1f} GB/s, "
          f"peaks 512-bit FMA {ceilings.get('fma_gflops', 0):.0f}, vdpbf16ps "
          f"{ceilings.get('bf16_dot_gflops', 0):.0f} and AMX {ceilings.get('amx_gflops', 0):.0f} GFLOP/s "
          f"({ceilings['threads']} threads); model: "
          f"{costs['matmul_flops'] / 1e9:.2f} GFLOP/token in matmuls, {costs['weight_bytes'] / 2**20:.0f} MiB of "
          "weights as stored")
    for name in spec["workloads"]:
        w = spec["workloads"][name]
        engines = best_by_engine(rounds, name)
        print(f"\n{name}: {len(w['prompts'])} prompts x ~{statistics.mean(len(p) for p in w['prompts']):.0f} "
              f"prompt tokens x {w['max_tokens']} new tokens")
        print(f"  {'engine':<17} {'tok/s best':>10}  {'rounds':<22} {'ours vs it':>10}  {'start s':>7} "
              f"{'peak RSS GB':>11}  tokens vs ours")
        ours = engines.get(ours_name)
        for engine, e in engines.items():
            ratio = f"{ours['tok_s'] / e['tok_s']:.2f}x" if ours and engine != ours_name else ""
            same = identity(ours["tokens"], e["tokens"]) if ours and engine != ours_name else ""
            rounds_s = ", ".join(f"{x:.1f}" for x in e["all"])
            print(f"  {engine:<17} {e['tok_s']:>10.1f}  {rounds_s:<22} {ratio:>10}  {e['cold_start_s']:>7.1f} "
                  f"{e['peak_rss_gb']:>11.2f}  {same}")
        for engine, e in engines.items():
            if "prefill_s" in e:
                print(prefill_decode(engine, e, ours, sum(len(p) for p in w["prompts"])))
        if ours:
            print(f"  {shares(ours['tok_s'], w, costs, ceilings, ours_name != OURS)}")
    for s in skipped:
        print(f"skipped: {s}")
    for run in (r for runs in rounds for r in runs if "error" in r):
        print(f"failed: {run['engine']}: {run['error']}")
    print("(numbers from one run; compare engines only within it)")
