"""How many sequences of 8k tokens a fixed KV budget serves at once, with and without giving
back the blocks that leave a sliding window (block_manager.h, free_outside_window).

The C++ scheduler is driven by a stand-in worker (each step's sampled tokens are made up;
no model runs): what is measured is the allocator's decision, which does not depend on the
model's numbers. The budget is a byte budget of bf16 KV for Mistral 7B's geometry (32 layers,
8 KV heads of 128: 128 KiB a token), in blocks of 16 tokens; `--window` is the model's
sliding window (4096 for Mistral 7B v0.1), 0 the same model without freeing.

    .venv/bin/python benchmarks/sliding_window_capacity.py --kv-gib 8 --window 4096

prints one RESULT line per mode: the most sequences running at once, the most that decode
in one step, preemptions, and the steps the whole batch took.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from deepinfer_dp import _C

BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2  # layers x (K, V) x KV heads x head_dim x bf16


def fill_and_drain(num_blocks: int, args: argparse.Namespace, **scheduler_args) -> dict:
    """Drives the real C++ scheduler with a stand-in worker (every sampled token 7) over
    `args.requests` distinct prompts until all finish; what fitted at once and what it cost.
    `scheduler_args`: the SchedulerConfig fields under test (sliding_window, KV groups)."""
    sched = _C.Scheduler(_C.SchedulerConfig(
        max_num_seqs=args.requests, max_num_batched_tokens=args.chunk, block_size=args.block_size,
        num_blocks=num_blocks, max_model_len=args.seq_len, vocab_size=32000, enable_prefix_caching=True,
        **scheduler_args))
    prompt_len = args.seq_len - args.new_tokens
    for i in range(args.requests):  # distinct prompts: no prefix-cache sharing
        prompt = [(i * 7919 + j * 31) % 31000 + 1 for j in range(prompt_len)]
        sched.add_sequence(_C.Sequence(f"r{i}", prompt, _C.SequenceLimits(max_tokens=args.new_tokens,
                                                                          ignore_eos=True)))
    most_running = most_decoding = steps = 0
    while sched.has_unfinished_seqs():
        out = sched.schedule()
        steps += 1
        most_running = max(most_running, sched.num_running)
        if not out.is_prompt:
            most_decoding = max(most_decoding, out.num_seqs)
        sched.process_outputs(out, np.full(out.num_samples, 7, dtype=np.int64))
    return {"num_blocks": num_blocks, "most_running": most_running, "most_decoding_together": most_decoding,
            "preemptions": sched.stats["num_preemptions"], "steps": steps}


def run(window: int, num_blocks: int, args: argparse.Namespace) -> dict:
    return {"window": window, **fill_and_drain(num_blocks, args, sliding_window=window)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kv-gib", type=float, default=8.0, help="KV budget (bf16, Mistral 7B geometry)")
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=8192, help="prompt + generated tokens of each sequence")
    parser.add_argument("--new-tokens", type=int, default=192)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens")
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    num_blocks = int(args.kv_gib * 2**30) // (BYTES_PER_TOKEN * args.block_size) + 1  # + the dummy block
    for window in (0, args.window):
        print("RESULT " + json.dumps({"kv_gib": args.kv_gib, **run(window, num_blocks, args)}), flush=True)


if __name__ == "__main__":
    main()
