"""What every engine script of the peers benchmark shares; standard library only (plus psutil
when present), since each script runs in its own engine's virtualenv.

An engine script reads a workload file (JSON: named workloads of prompt token ids and a
number of new tokens, plus the model paths) and prints one JSON line: cold start, peak RSS
and, per workload it ran, tokens/s, wall time and the generated token ids.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import threading
import time
from collections.abc import Callable


def parse_args(description: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--workload-file", required=True)
    ap.add_argument("--only", nargs="*", default=None, help="workload names to run (default: all it supports)")
    ap.add_argument("--kv-gb", type=float, default=None, help="KV cache size in GiB (default: the engine's)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype")
    ap.add_argument("--model-key", default=None, help="which model of the workload file (default: the engine's)")
    ap.add_argument("--label", default=None, help="the engine's name in the report (default: the engine's)")
    return ap.parse_args()


def load_workloads(args: argparse.Namespace) -> dict:
    with open(args.workload_file) as f:
        spec = json.load(f)
    if args.only is not None:
        spec["workloads"] = {k: v for k, v in spec["workloads"].items() if k in args.only}
    return spec


class PeakRss:
    """Peak resident memory of this process and its children (vLLM runs its engine in one),
    sampled every 50 ms with psutil; without psutil, this process's own ru_maxrss."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        try:
            import psutil

            self._proc = psutil.Process(os.getpid())
        except ImportError:
            self._proc = None
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while self._proc is not None and not self._stop.wait(0.05):
            try:
                procs = [self._proc, *self._proc.children(recursive=True)]
                self.peak = max(self.peak, sum(p.memory_info().rss for p in procs))
            except Exception:  # a child that ended between listing and reading
                continue

    def gb(self) -> float:
        self._stop.set()
        own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return max(self.peak, own) / 2**30


def run_workloads(spec: dict, generate: Callable[[list[list[int]], int], list[list[int]]]) -> dict:
    """Times generate(prompts, max_tokens) -> token ids per prompt on every workload. A workload
    with `prefill_prompts` (as many, as long, other tokens) then times those with 1 new token
    (after the timed run, so that it runs warm and the timed run means what it always did):
    `prefill_s`, and `decode_tok_s` = the tokens after each prompt's first over the rest of the
    timed wall (None when the machine's drift made the prefill pass the longer)."""
    results = {}
    for name, w in spec["workloads"].items():
        t = time.perf_counter()
        tokens = generate(w["prompts"], w["max_tokens"])
        wall = time.perf_counter() - t
        count = sum(len(x) for x in tokens)
        if count != len(w["prompts"]) * w["max_tokens"]:
            raise RuntimeError(f"{name}: got {count} tokens, expected {len(w['prompts'])} x {w['max_tokens']}")
        results[name] = {"tok_s": count / wall, "wall_s": wall, "tokens": tokens}
        if w.get("prefill_prompts"):
            t = time.perf_counter()
            generate(w["prefill_prompts"], 1)
            prefill_s = time.perf_counter() - t
            decoded = count - len(w["prompts"])
            results[name] |= {"prefill_s": prefill_s,
                              "decode_tok_s": decoded / (wall - prefill_s) if wall > prefill_s else None}
    return results


RESULT_MARK = "PEERS-RESULT "  # engines log to stdout too; the runner reads the line with this mark


def emit(engine: str, cold_start_s: float, rss: PeakRss, results: dict) -> None:
    print(RESULT_MARK + json.dumps({"engine": engine, "cold_start_s": cold_start_s, "peak_rss_gb": rss.gb(),
                      "workloads": results}), flush=True)
