"""What batch-invariant steps cost: the same workload with batch_invariant on and off.

Each side runs in its own process (the default model, SmolLM2's Q4_1 GGUF), the sides
alternate in every round, and each round prints on's and off's wall seconds for the whole
generate call and their ratio (off / on: below 1.0 means invariance costs). Workloads:
"long", --prompts prompts of --prompt-len tokens with --max-tokens new (prefill-bound: long
chunks through the many-row kernels and the paged attention kernel instead of torch's GEMMs
and SDPA), and "batch", 64 prompts of 40-400 tokens with 64 new each. Greedy, EOS ignored;
the report says whether the two sides' tokens agreed.

    python benchmarks/batch_invariance_cost.py [--workload long|batch] [--rounds 3]
        [--prompts 2] [--prompt-len 2000] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

from harness import emit, in_turn, run_child, self_command


def prompts(args) -> list[list[int]]:
    if args.workload == "long":
        lengths = [args.prompt_len] * args.prompts
    else:
        lengths = [40 + (i * 97) % 361 for i in range(64)]
    return [[100 + (i * 7919 + j * 104729) % 40000 for j in range(n)] for i, n in enumerate(lengths)]


def run_side(args) -> None:
    from deepinfer_dp import LLM, SamplingParams

    new = args.max_tokens if args.workload == "long" else 64
    llm = LLM(decode_sequence=False, batch_invariant=args.child == "on", max_model_len=4096, max_num_seqs=64,
              kv_cache_memory_gb=2.0, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    llm.generate(prompt_token_ids=[[100, 200, 300]], sampling_params=params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    results = llm.generate(prompt_token_ids=prompts(args), sampling_params=params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [[o.token_id for o in outs] for outs in results]
    digest = hashlib.sha1(json.dumps(tokens).encode()).hexdigest()[:12]
    llm.shutdown()
    emit({"seconds": seconds, "tokens": digest})


def side(args, name: str) -> dict:
    cmd = self_command(__file__, "--child", name, "--workload", args.workload, "--prompts", str(args.prompts),
                       "--prompt-len", str(args.prompt_len), "--max-tokens", str(args.max_tokens))
    return run_child(cmd, f"batch_invariant {name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=["long", "batch"], default="long")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--child", choices=["on", "off"])
    args = ap.parse_args()
    if args.child:
        run_side(args)
        return
    ratios = []
    for r in range(args.rounds):
        order = in_turn(["on", "off"], r)
        got = {name: side(args, name) for name in order}
        ratios.append(got["off"]["seconds"] / got["on"]["seconds"])
        same = "same tokens" if got["on"]["tokens"] == got["off"]["tokens"] else "tokens differ"
        print(f"round {r + 1}: on {got['on']['seconds']:.2f} s  off {got['off']['seconds']:.2f} s  "
              f"off/on {ratios[-1]:.2f}x  ({same})", flush=True)
    print(f"{args.workload}: off/on median {sorted(ratios)[len(ratios) // 2]:.2f}x, range "
          f"{min(ratios):.2f}-{max(ratios):.2f}x over {args.rounds} rounds")


if __name__ == "__main__":
    main()
