"""Routing policies side by side: prefix-cache hit rate, TTFT and throughput of each router
policy at dp 2 (Ray ranks behind the router), on a shared-prefix workload and a uniform one.

Workloads (token ids drawn at random from the vocabulary, seeded, the same for every policy):
  shared:  --requests requests, each one of --systems system prompts of --system-len tokens
           followed by a --user-len-token question of its own;
  uniform: --requests prompts of --system-len + --user-len tokens that share nothing.
Each request is greedy with --max-tokens new tokens (EOS ignored); arrivals are Poisson at
--rate requests/s. The KV cache of each rank (--kv-blocks) holds about half the system
prompts besides its running requests, the regime in which where a prompt goes decides
whether its prefix is cached. TTFT is measured at the router client (no HTTP), from submit
to the first token's delta; it is also given in mean steps of the run (TTFT / the ranks' mean
step time), which a machine slowed down by other work for a whole run changes less.

Each policy runs in a child process of its own (a fresh Ray instance, cold caches), both
workloads one after the other; the policies take turns over --rounds rounds, each round in
another order. The model is a small random Llama built once under /tmp (no download): it
measures scheduling and prefill steps saved, not a real model's compute.

    python benchmarks/routing.py [--rounds 3] [--requests 64] [--rate 8] [--kv-blocks 160]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import ONE_THREAD_NO_RAY_AUTH, emit, in_turn, run_child, self_command  # noqa: E402

POLICIES = ("cache_aware", "prefix_affinity", "least_loaded", "round_robin")
MODEL_DIR = Path("/tmp/deepinfer_dp_bench/routing-llama")


def build_model() -> str:
    """A random 4-layer Llama (hidden 256) with room for 2k positions, written once."""
    sys.path.insert(0, str(HERE.parent / "tests"))
    from model_utils import write_tiny_model
    from transformers import LlamaConfig

    def config(vocab_size: int) -> LlamaConfig:
        return LlamaConfig(vocab_size=vocab_size, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                           rms_norm_eps=1e-5, initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)

    return str(write_tiny_model(config, MODEL_DIR))


def workloads(args: argparse.Namespace, vocab: int) -> dict[str, list[list[int]]]:
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]  # 0-2 are special

    systems = [tokens(args.system_len) for _ in range(args.systems)]
    shared = [rng.choice(systems) + tokens(args.user_len) for _ in range(args.requests)]
    uniform = [tokens(args.system_len + args.user_len) for _ in range(args.requests)]
    return {"shared": shared, "uniform": uniform}


class Timings:
    """Submit, first-token and finish times of each request, filled by the client's thread."""

    def __init__(self, n: int) -> None:
        self.sent = [0.0] * n
        self.first = [0.0] * n
        self.done = [0.0] * n
        self.tokens = [0] * n
        self.rank = [-1] * n
        self.errors: list[str] = []
        self.left = n
        self.all_done = threading.Event()

    def sink(self, i: int) -> Callable[[object], None]:
        def on_item(item) -> None:
            now = time.perf_counter()
            if isinstance(item, Exception):
                self.errors.append(f"request {i}: {item}")
                self._finish(i, now)
                return
            if item.token_ids and not self.first[i]:
                self.first[i], self.rank[i] = now, item.dp_rank
            self.tokens[i] += len(item.token_ids)
            if item.finished:
                self._finish(i, now)
        return on_item

    def _finish(self, i: int, now: float) -> None:
        self.done[i] = now
        self.left -= 1
        if self.left == 0:
            self.all_done.set()


def run_workload(llm, prompts: list[list[int]], args: argparse.Namespace, tag: str) -> dict:
    from deepinfer_dp import SamplingParams

    router = llm.dp.router
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    before = llm.rank_stats()
    timings, rng = Timings(len(prompts)), random.Random(args.seed + 1)
    for i, ids in enumerate(prompts):
        timings.sent[i] = time.perf_counter()
        router.submit(f"{tag}-{i}", ids, params, timings.sink(i))
        time.sleep(rng.expovariate(args.rate))
    if not timings.all_done.wait(600):
        raise SystemExit(f"{tag}: {timings.left} requests unfinished after 600 s")
    if timings.errors:
        raise SystemExit(f"{tag}: {len(timings.errors)} requests failed: {timings.errors[:3]}")
    after = llm.rank_stats()
    query = sum(b["prefix_query_tokens"] - a["prefix_query_tokens"] for a, b in zip(before, after, strict=True))
    hits = sum(b["prefix_hit_tokens"] - a["prefix_hit_tokens"] for a, b in zip(before, after, strict=True))
    diff = {k: sum(b[k] - a[k] for a, b in zip(before, after, strict=True))
            for k in ("generate_step", "placeholder_steps", "step_time_s", "placeholder_step_time_s", "waves_run")}
    ttft = sorted(f - s for f, s in zip(timings.first, timings.sent, strict=True))
    span = max(timings.done) - min(timings.sent)
    step_s = diff["step_time_s"] / max(1, diff["generate_step"])
    return {"hit_rate": hits / max(1, query), "ttft_p50_ms": 1000 * _pct(ttft, 50),
            "ttft_p50_steps": _pct(ttft, 50) / step_s, "ttft_p99_steps": _pct(ttft, 99) / step_s,
            "ttft_p99_ms": 1000 * _pct(ttft, 99), "tok_per_s": sum(timings.tokens) / span,
            "per_rank": [timings.rank.count(r) for r in range(len(after))],
            "placeholder_share": diff["placeholder_steps"] / max(1, diff["generate_step"]),
            "placeholder_step_ms": 1000 * diff["placeholder_step_time_s"] / max(1, diff["placeholder_steps"]),
            "step_ms": 1000 * diff["step_time_s"] / max(1, diff["generate_step"]), "waves": diff["waves_run"],
            "prefill_tokens": query - hits}


def _pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


def run_side(policy: str, args: argparse.Namespace) -> dict:
    from deepinfer_dp import LLM, SamplingParams

    llm = LLM(build_model(), dp_size=2, torch_threads=1, dp_options={"policy": policy},
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.batch_tokens, block_size=16,
              num_kv_blocks=args.kv_blocks, enable_prefix_caching=True)
    try:
        warm = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        llm.generate(prompt_token_ids=[[5, 6, 7]] * 4, sampling_params=warm, use_tqdm=False)
        loads = workloads(args, llm.get_tokenizer().vocab_size)
        return {name: run_workload(llm, prompts, args, name) for name, prompts in loads.items()}
    finally:
        llm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rate", type=float, default=8.0, help="Poisson arrivals, requests/s")
    ap.add_argument("--systems", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=384)
    ap.add_argument("--user-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--batch-tokens", type=int, default=256, help="max_num_batched_tokens")
    ap.add_argument("--kv-blocks", type=int, default=160, help="KV blocks per rank (16 tokens each)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--side", default=None, help=argparse.SUPPRESS)  # child process: one policy
    args = ap.parse_args()
    if args.side is not None:
        emit(run_side(args.side, args))
        return
    build_model()
    runs: dict[str, list[dict]] = {p: [] for p in args.policies}
    for r in range(args.rounds):
        for policy in in_turn(list(args.policies), r):
            result = run_child(self_command(__file__, *child_flags(args), "--side", policy), f"policy {policy}",
                               ONE_THREAD_NO_RAY_AUTH)
            print(f"round {r + 1} {policy}: {result}", flush=True)
            runs[policy].append(result)
    report(runs, args)


def child_flags(args: argparse.Namespace) -> list[str]:
    """The workload's flags, for a child that runs one policy."""
    keys = ("requests", "rate", "systems", "system_len", "user_len", "max_tokens", "max_num_seqs", "batch_tokens",
            "kv_blocks", "seed")
    return [x for k in keys for x in ("--" + k.replace("_", "-"), str(getattr(args, k)))]


def report(runs: dict[str, list[dict]], args: argparse.Namespace) -> None:
    print(f"\ndp 2, {args.requests} requests per workload at {args.rate} req/s (Poisson), {args.systems} system "
          f"prompts of {args.system_len} + {args.user_len} tokens, {args.max_tokens} new tokens, "
          f"{args.kv_blocks} KV blocks per rank; median of {args.rounds} rounds [min-max]")
    for workload in ("shared", "uniform"):
        print(f"\n{workload}:\n| policy | prefix hit rate | prompt tokens computed | TTFT p50 ms | TTFT p99 ms "
              "| TTFT p50 / p99 in mean steps | output tok/s | requests per rank |")
        print("|---|---|---|---|---|---|---|---|")
        for policy, results in runs.items():
            rows = [res[workload] for res in results]

            def cell(key: str, fmt: str, rows=rows) -> str:
                vals = [r[key] for r in rows]
                return f"{statistics.median(vals):{fmt}} [{min(vals):{fmt}}-{max(vals):{fmt}}]"

            ranks = " / ".join(str(r["per_rank"]) for r in rows)
            print(f"| {policy} | {cell('hit_rate', '.2f')} | {cell('prefill_tokens', '.0f')} | "
                  f"{cell('ttft_p50_ms', '.0f')} | {cell('ttft_p99_ms', '.0f')} | "
                  f"{cell('ttft_p50_steps', '.1f')} / {cell('ttft_p99_steps', '.1f')} | {cell('tok_per_s', '.0f')} "
                  f"| {ranks} |")

    print("\nlockstep by-products (median over rounds): placeholder steps as a share of all steps, mean ms of a "
          "placeholder step and of any step, waves run (each rank counts them; summed)")
    for workload in ("shared", "uniform"):
        for policy, results in runs.items():
            rows = [res[workload] for res in results if "placeholder_share" in res[workload]]
            if rows:
                med = {k: statistics.median(r[k] for r in rows)
                       for k in ("placeholder_share", "placeholder_step_ms", "step_ms", "waves")}
                print(f"  {workload:8} {policy:16} placeholder {100 * med['placeholder_share']:.1f}% of steps, "
                      f"{med['placeholder_step_ms']:.2f} ms each (a step: {med['step_ms']:.2f} ms), "
                      f"{med['waves']:.0f} waves")

if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
