"""DP scaling: the offline workload of benchmarks/offline_throughput.py on DP=1 and on DP=2
(Ray actor ranks behind the router), one torch thread per rank, and the lockstep's cost.

Workload: N prompts (default 64), prompt i is the chat-template-applied "Write a short
story about a robot number {i}.", greedy, exactly 128 new tokens each (EOS ignored), all
submitted at once. Prints output tokens/s of each, the scaling ratio, and, per DP=2 rank,
the all-reduce (vote) collective, the placeholder steps and the compute thread's idle time as
shares of the rank's loop.
Each side runs in its own subprocess, one after the other, so they never share the cores;
the sides alternate over --rounds rounds and the best run of each counts.

    python benchmarks/dp_scaling.py [--model DIR] [--prompts 64] [--max-tokens 128] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from harness import ONE_THREAD_NO_RAY_AUTH, best_of_rounds, emit, run_child, self_command  # noqa: E402
from offline_throughput import chat_prompts  # noqa: E402


def run_side(dp_size: int, model: str | None, prompts: int, max_tokens: int, policy: str) -> dict:
    from deepinfer_dp import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model, decode_sequence=False, dp_size=dp_size, torch_threads=1,
              dp_options={"policy": policy} if dp_size > 1 else None)
    warm = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    llm.generate(prompt_token_ids=[[1, 2, 3]] * max(2, dp_size), sampling_params=warm, use_tqdm=False)
    start_s = time.perf_counter() - t0
    before = llm.rank_stats()
    ids = chat_prompts(llm.get_tokenizer(), prompts)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    results = llm.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    tokens = sum(len(o.token_ids) for outs in results for o in outs)
    after = llm.rank_stats()
    llm.shutdown()
    ranks = [{k: b[k] - a[k] for k in ("generate_step", "placeholder_steps", "step_time_s",
                                       "placeholder_step_time_s", "allreduce_time_s", "allreduce_wait_s",
                                       "allreduce_collective_s", "prompt_tokens", "device_busy_s")
              if k in b}
             for a, b in zip(before, after, strict=True)]
    return {"dp_size": dp_size, "tokens": tokens, "seconds": elapsed, "tok_per_s": tokens / elapsed,
            "start_s": start_s, "ranks": ranks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--policy", default="round_robin")
    ap.add_argument("--rounds", type=int, default=2, help="alternating runs of each side; the best of each counts")
    ap.add_argument("--side", type=int, default=None, help=argparse.SUPPRESS)  # child process
    args = ap.parse_args()
    if args.side is not None:
        emit(run_side(args.side, args.model, args.prompts, args.max_tokens, args.policy))
        return
    sides = best_of_rounds(args.rounds, (1, 2), lambda dp: run_in_subprocess(dp, args), "tok_per_s")
    report(sides, args)


def run_in_subprocess(dp: int, args) -> dict:
    cmd = self_command(__file__, "--side", str(dp), "--prompts", str(args.prompts),
                       "--max-tokens", str(args.max_tokens), "--policy", args.policy)
    if args.model:
        cmd += ["--model", args.model]
    return run_child(cmd, f"DP={dp}", ONE_THREAD_NO_RAY_AUTH)


def report(sides: dict, args) -> None:
    one, two = sides[1], sides[2]
    print(f"workload: {args.prompts} prompts x {args.max_tokens} new tokens, greedy, one torch thread per rank")
    for s in (one, two):
        print(f"DP={s['dp_size']}: {s['tokens']} tokens in {s['seconds']:.1f} s = {s['tok_per_s']:.1f} tok/s "
              f"(start-up {s['start_s']:.1f} s)")
    print(f"scaling DP=2 / DP=1: {two['tok_per_s'] / one['tok_per_s']:.2f}x")
    print("lockstep cost per DP=2 rank, as a share of the rank's loop (its step() calls, votes and flush):")
    for i, r in enumerate(two["ranks"]):
        loop = (r["step_time_s"] + r["allreduce_time_s"]) or float("nan")

        def share(key: str, r=r, loop=loop) -> str:
            return f"{r[key]:.3f} s = {100 * r[key] / loop:.2f}%"

        print(f"  rank {i}: {r['generate_step']} steps ({r['placeholder_steps']} placeholder), "
              f"prompt tokens {r['prompt_tokens']}, loop {loop:.2f} s")
        print(f"    the all-reduce itself {share('allreduce_collective_s')}, "
              f"placeholder steps {share('placeholder_step_time_s')}")
        # A ZOS decode step returns while its forward runs, so most of the vote's wait for the
        # slower rank overlaps this rank's own compute; what it really costs is compute idle.
        idle = max(0.0, 100 - 100 * r["device_busy_s"] / loop)  # the last forward may end after the loop
        print(f"    compute thread busy {share('device_busy_s')}; idle {idle:.2f}% "
              f"(waiting for the slower rank, host work not overlapped); "
              f"host thread in the vote {r['allreduce_wait_s']:.2f} s")

if __name__ == "__main__":
    main()
