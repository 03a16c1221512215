"""Elastic EP: how long changing the group's size takes on the realistic-shape random MoE of
benchmarks/moe_ep.py (64 experts, top-8), under expert parallelism, offline.

One LLM(dp_size=2, enable_expert_parallel=True), one torch thread per rank. First a reference
run at DP=2 (N prompts, greedy, exactly T new tokens). Then, idle: 2 -> 3 and 3 -> 2. Then
under load, the same workload on another thread while the group changes, once the ranks
generate: 2 -> 3 (drain 60 s: nothing moves) and 3 -> 2 with drain 0 (the leaving rank's
requests move by recompute). Prints each change's time (ScaleResponse.seconds: from the
router's start to every rank in the new group), the requests moved, the workload's tokens/s
and whether its tokens equal the reference, and per rank what its experts cost
(rank_stats' moe_regroups: slots kept, received over the group, read from the checkpoint,
MiB sent, seconds), beside the time this process takes to read the same experts from the
checkpoint (what every rank paid before experts moved over the group).

    python benchmarks/elastic.py [--prompts 32] [--max-tokens 64] [--layers 4] [--hidden 1024]
        [--moe-intermediate 512]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
from moe_ep import model_dir  # noqa: E402
from offline_throughput import chat_prompts  # noqa: E402


def workload(llm, ids: list[list[int]], params) -> tuple[list[list[int]], float]:
    t = time.perf_counter()
    results = llm.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False)
    return [[t for o in outs for t in o.token_ids] for outs in results], time.perf_counter() - t


def experts_report(llm, path: str) -> str:
    """Each rank's last expert change, beside the time this process takes to read and copy that
    rank's whole new share from the checkpoint (what every changed rank did before experts
    moved over the group)."""
    import torch

    from deepinfer_dp.models.expert_regroup import EXPERT_NAME
    from deepinfer_dp.models.weights import iterate_weights

    parts = []
    for s in llm.rank_stats():
        last = (s.get("moe_regroups") or [{}])[-1]
        if not last:
            continue
        start, shard = time.perf_counter(), last["shard"]
        share = range(shard[0] * 64 // shard[1], (shard[0] + 1) * 64 // shard[1])

        def in_share(name: str, share: range = share) -> bool:
            match = EXPERT_NAME.match(name)
            return match is not None and int(match.group(2)) in share

        read = 0
        for _, t in iterate_weights(Path(path), in_share):  # memory-mapped: copy it, as the loader does
            torch.empty_like(t).copy_(t)
            read += t.numel()
        parts.append(f"rank {s['dp_rank']}: kept {last['kept']}, received {last['received']} "
                     f"({last['received_bytes'] / 2**20:.0f} MiB), read {last['loaded']}, {last['seconds']:.2f} s "
                     f"(reading its whole share here: {read * 4 / 2**20:.0f} MiB, {time.perf_counter() - start:.2f} s)")
    return "; ".join(parts)


def under_load(llm, ids, params, size: int, drain_s: float) -> tuple[dict, list, float]:
    """The workload on a thread, the change once a rank runs a request; (change, tokens, s)."""
    got: list = []
    thread = threading.Thread(target=lambda: got.append(workload(llm, ids, params)))
    thread.start()
    while not any(s.get("num_running") for s in llm.rank_stats()):
        time.sleep(0.05)
    done = llm.scale_elastic_ep(size, drain_timeout=drain_s)
    thread.join()
    return done, *got[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--moe-intermediate", type=int, default=512)
    args = ap.parse_args()
    from deepinfer_dp import LLM, SamplingParams

    path = str(model_dir(args))
    llm = LLM(path, decode_sequence=False, dp_size=2, enable_expert_parallel=True, torch_threads=1,
              kv_cache_memory_gb=0.5, dp_options={"collective_timeout_s": 300})
    try:
        ids = chat_prompts(llm.get_tokenizer(), args.prompts)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        want, seconds = workload(llm, ids, params)
        tokens = sum(map(len, want))
        print(f"workload: {args.prompts} prompts x {args.max_tokens} tokens; DP=2 EP reference "
              f"{tokens / seconds:.1f} tok/s")
        for size in (3, 2):
            done = llm.scale_elastic_ep(size, drain_timeout=0)
            print(f"idle {done['old_size']} -> {size}: {done['seconds']:.2f} s; {experts_report(llm, path)}")
        for size, drain in ((3, 60.0), (2, 0.0)):
            done, got, seconds = under_load(llm, ids, params, size, drain)
            print(f"under load {done['old_size']} -> {size} (drain {drain:g} s): {done['seconds']:.2f} s, "
                  f"{done['migrated']} moved; workload {tokens / seconds:.1f} tok/s, "
                  f"tokens {'equal to' if got == want else 'DIFFERENT from'} the reference; "
                  f"{experts_report(llm, path)}")
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main()
