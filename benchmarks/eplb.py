"""Expert load balancing: the realistic-shape random MoE of moe_ep.py (Qwen3-MoE-like, 64
experts, top-8) with its router skewed onto the first --hot experts (all on rank 0 at start:
half of them share a direction u in their router rows, half -u, so every token's top-8 takes
half of them),
served offline on DP=2 with expert parallelism without EPLB, with EPLB, and with EPLB plus
redundant experts, side by side in one run.

Workload: N prompts (default 16) of moe_ep.py's chat prompts, greedy, exactly --max-tokens new
tokens each, all submitted at once, one torch thread per rank; a warm-up run of the same
workload first (the balancer has rebalanced by the timed run; it keeps rebalancing every
--step-interval passes during it). Each side runs in its own subprocess, the sides alternate
over --rounds rounds and every round counts. Prints tokens/s and each rank's MoE collective
time (waiting for the slowest rank included) and share of compute, as ranges over the rounds,
the balancedness readings, and the bytes and time of one rebalance.

    python benchmarks/eplb.py [--prompts 16] [--max-tokens 64] [--rounds 1] [--layers 2]
        [--hidden 512] [--moe-intermediate 256] [--hot 8] [--skew 3] [--redundant 4] [--step-interval 48]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from harness import ONE_THREAD_NO_RAY_AUTH, emit, run_child, self_command  # noqa: E402
from moe_ep import moe_config  # noqa: E402
from offline_throughput import chat_prompts  # noqa: E402

SIDES = ("ep", "ep+eplb", "ep+eplb+redundant")


def skewed_model_dir(args) -> Path:
    """The random-weight checkpoint with the hot experts' router rows scaled, written once."""
    key = f"{args.hidden}-{args.moe_intermediate}-{args.layers}-{args.hot}-{args.skew}"
    root = Path(os.environ.get("DEEPINFER_DP_CACHE") or Path.home() / ".cache" / "deepinfer_dp")
    path = root / f"eplb-bench-{hashlib.sha1(key.encode()).hexdigest()[:8]}"
    if (path / "config.json").is_file():
        return path
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from deepinfer_dp.models import convert_gguf, default_model_path

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(moe_config(args), dtype=torch.float32)
    with torch.no_grad():  # half the hot rows get +u, half -u: every token favours one half
        for layer in model.model.layers:
            rows = layer.mlp.gate.weight
            u = torch.randn(rows.shape[1])
            u *= args.skew * rows.norm(dim=1).mean() / u.norm()
            rows[:args.hot // 2] += u
            rows[args.hot // 2:args.hot] -= u
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(convert_gguf(default_model_path())).save_pretrained(tmp)
    tmp.rename(path)
    return path


def run_side(name: str, path: str, args) -> dict:
    from deepinfer_dp import LLM, SamplingParams

    eplb = {}
    if name != "ep":
        redundant = args.redundant if name.endswith("redundant") else 0
        eplb = {"enable_eplb": True, "eplb_config": {"window_size": args.step_interval,
                                                     "step_interval": args.step_interval,
                                                     "num_redundant_experts": redundant}}
    llm = LLM(path, decode_sequence=False, dp_size=2, torch_threads=1, kv_cache_memory_gb=0.5,
              enable_expert_parallel=True, dp_options={"collective_timeout_s": 300}, **eplb)
    ids = chat_prompts(llm.get_tokenizer(), args.prompts)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False)  # warm-up (and rebalances)
    before = llm.rank_stats()
    t = time.perf_counter()
    results = llm.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    after = llm.rank_stats()
    llm.shutdown()
    ranks = [{"collective_s": a["moe_collective_s"] - b["moe_collective_s"],
              "busy_s": a["device_busy_s"] - b["device_busy_s"],
              "slots": sum(map(sum, a["moe_expert_tokens"])) - sum(map(sum, b["moe_expert_tokens"])),
              **{k: a.get(k) for k in ("eplb_rebalances", "eplb_moved_bytes", "eplb_move_s",
                                       "eplb_balancedness_history")}}
             for a, b in zip(after, before, strict=True)]
    tokens = sum(len(o.token_ids) for outs in results for o in outs)
    return {"name": name, "tok_per_s": tokens / elapsed, "seconds": elapsed, "ranks": ranks,
            "token_ids": [o.token_ids for outs in results for o in outs]}


def every_round(rounds: int, sides: list[str], run) -> dict[str, list[dict]]:
    """Every side once per round, the sides one after the other (interleaved, so that a load
    change on the machine hits every side); each side's runs, by side."""
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for _ in range(rounds):
        for side in sides:
            runs[side].append(run(side))
    return runs


def _span(values: list[float], fmt: str) -> str:
    return format(min(values), fmt) if min(values) == max(values) else f"{min(values):{fmt}}-{max(values):{fmt}}"


def report(runs: dict[str, list[dict]], args) -> None:
    print(f"workload: {args.prompts} prompts x {args.max_tokens} new tokens, greedy, DP=2 with EP, one torch "
          f"thread per rank; {args.layers} MoE layers, hidden {args.hidden}, 64 experts of {args.moe_intermediate}, "
          f"top-8, router rows of experts 0-{args.hot - 1} +-{args.skew}u; EPLB window = interval = "
          f"{args.step_interval} passes, redundant {args.redundant}; {args.rounds} interleaved rounds, ranges "
          f"over the rounds (load average at start {os.getloadavg()[0]:.1f})")
    same = len({str(r["token_ids"]) for side in runs.values() for r in side}) == 1
    print(f"greedy tokens identical across sides and rounds: {same}")
    for name, side in runs.items():
        print(f"{name:20s} {_span([r['tok_per_s'] for r in side], '.1f')} tok/s")
        for i in range(len(side[0]["ranks"])):
            ranks = [r["ranks"][i] for r in side]
            shares = [100 * r["collective_s"] / r["busy_s"] if r["busy_s"] else 0.0 for r in ranks]
            print(f"    rank {i}: token-slots computed {_span([r['slots'] for r in ranks], 'd')}, MoE collectives "
                  f"{_span([r['collective_s'] for r in ranks], '.2f')} s = {_span(shares, '.1f')}% of compute")
        s = side[-1]
        r0 = s["ranks"][0]
        if r0["eplb_rebalances"]:
            done = r0["eplb_rebalances"]
            moved = sum(r["eplb_moved_bytes"] for r in s["ranks"])
            print(f"    balancedness readings: {[round(h[1], 3) for h in r0['eplb_balancedness_history']]}")
            print(f"    {done} rebalances since start: {moved / done / 2**20:.1f} MiB sent per rebalance (both "
                  f"ranks), {1000 * r0['eplb_move_s'] / done:.1f} ms moving per rebalance on rank 0")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--moe-intermediate", type=int, default=256)
    ap.add_argument("--hot", type=int, default=8, help="experts the router favours (all on rank 0 at start)")
    ap.add_argument("--skew", type=float, default=3.0, help="the shared direction's norm over a router row's")
    ap.add_argument("--redundant", type=int, default=4)
    ap.add_argument("--step-interval", type=int, default=48)
    ap.add_argument("--sides", nargs="*", default=list(SIDES), choices=list(SIDES))
    ap.add_argument("--side", default=None, help=argparse.SUPPRESS)  # child process
    ap.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side is not None:
        emit(run_side(args.side, args.model_dir, args))
        return
    path = skewed_model_dir(args)
    passed = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
              if k not in ("sides", "side", "model_dir", "rounds")]

    def run(name: str) -> dict:
        return run_child(self_command(__file__, "--side", name, "--model-dir", str(path), *passed), name,
                         ONE_THREAD_NO_RAY_AUTH)

    report(every_round(args.rounds, args.sides, run), args)


if __name__ == "__main__":
    main()
