"""API server processes: `deepinfer-dp serve --api-server-count 1` against `2`, side by side.

Both sides serve through the router process over the same DP ranks; only the number of API
server processes differs. On a small model the ranks are fast and HTTP, JSON and
detokenization in Python are the bottleneck, which several API server processes share out.
Each round starts the server, runs benchmarks/serving.py against it at --request-rate, and
stops it; the sides alternate over --rounds rounds (this machine's speed drifts) and the best
round of each counts.

    python benchmarks/api_servers.py --model /tmp/deepinfer_dp_tiny/llama-gqa --dp-size 2 \\
        --num-prompts 256 --request-rate 200 --max-tokens 32 [--rounds 2]

(the tiny model: see configs/tiny_test.yaml for the command that builds it)
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

from harness import best_of_rounds
from server_proc import start_server, stop_server

HERE = Path(__file__).resolve().parent
METRICS = {"req_s": r"request throughput\s+: (\S+)", "tok_s": r"output token throughput: (\S+)",
           "ttft_p50": r"TTFT  p50 / p99\s+: (\S+) / (\S+)", "itl_p50": r"ITL   p50 / p99\s+: (\S+) / (\S+)"}


def one_round(args: argparse.Namespace, count: int) -> dict:
    proc, url = start_server(["--model", args.model, "--dp-size", str(args.dp_size), "--api-server-count",
                              str(count), "--torch-threads", "1", "--max-num-seqs", str(args.max_num_seqs),
                              *args.serve_flags], env={"RAY_AUTH_MODE": "disabled"})
    try:
        out = subprocess.run([sys.executable, str(HERE / "serving.py"), "--url", url, "--num-prompts",
                              str(args.num_prompts), "--request-rate", str(args.request_rate), "--max-tokens",
                              str(args.max_tokens), "--ignore-eos"], capture_output=True, text=True, check=True)
    finally:
        stop_server(proc)
    found = {k: float(re.search(p, out.stdout).group(1)) for k, p in METRICS.items()}
    found["failed"] = out.stdout.count("failed request")
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF directory or .gguf (a tiny model shows the HTTP cost)")
    ap.add_argument("--dp-size", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--request-rate", type=float, default=200.0)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--serve-flags", nargs=argparse.REMAINDER, default=[], help="more flags for `serve`")
    args = ap.parse_args()

    def run(count: int) -> dict:
        found = one_round(args, count)
        print(f"api servers {count}: {found}", flush=True)
        return found

    best = best_of_rounds(args.rounds, (1, 2), run, "tok_s")
    print(f"\nworkload: {args.num_prompts} streamed chat requests at {args.request_rate} req/s, {args.max_tokens} "
          f"tokens each, dp {args.dp_size}; best of {args.rounds} rounds")
    print(f"{'api servers':>12} {'req/s':>8} {'tok/s':>9} {'TTFT p50 ms':>12} {'ITL p50 ms':>11} {'failed':>7}")
    for count, r in sorted(best.items()):
        print(f"{count:>12} {r['req_s']:>8.2f} {r['tok_s']:>9.1f} {r['ttft_p50']:>12.1f} {r['itl_p50']:>11.1f} "
              f"{r['failed']:>7}")
    print(f"2 / 1 output tokens/s: {best[2]['tok_s'] / best[1]['tok_s']:.2f}x")


if __name__ == "__main__":
    main()
