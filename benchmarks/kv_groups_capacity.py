"""How many sequences of 8k tokens a fixed KV budget serves at once for a Gemma 3 model, with
KV groups (the sliding layers keep only their window's blocks: layers/kv_groups.py,
block_manager.h) and without (disable_hybrid_kv_cache_manager: every layer keeps every block).

The C++ scheduler is driven by a stand-in worker (each step's sampled tokens are made up; no
model runs): what is measured is the allocator's decision, which does not depend on the
model's numbers. The groups are the ones the engine plans for the model's layers
(`plan_kv_groups`), and the budget is bytes of bf16 KV in the model's geometry, in blocks of
16 tokens: a block of a group costs its layers' share.

    .venv/bin/python benchmarks/kv_groups_capacity.py --model 270m --kv-gib 1
    .venv/bin/python benchmarks/kv_groups_capacity.py --model 4b --kv-gib 8

prints one RESULT line per mode: the most sequences running at once, the most that decode in
one step, preemptions, and the steps the whole batch took.
"""

from __future__ import annotations

import argparse
import json

from sliding_window_capacity import fill_and_drain

from deepinfer_dp.layers.kv_groups import plan_kv_groups

# (layers, KV heads, head_dim, sliding window); every 6th layer global (Gemma 3's pattern).
GEOMETRY = {"270m": (18, 1, 256, 512), "1b": (26, 1, 256, 512), "4b": (34, 4, 256, 1024)}


def run(hybrid: bool, args: argparse.Namespace) -> dict:
    layers, kv_heads, head_dim, window = GEOMETRY[args.model]
    groups = plan_kv_groups([0 if (i + 1) % 6 == 0 else window for i in range(layers)], hybrid=hybrid)
    layer_block_bytes = 2 * kv_heads * head_dim * 2 * args.block_size  # (K, V) x bf16, one layer
    num_blocks = int(args.kv_gib * 2**30) // (layer_block_bytes * groups.group_size) + 1  # + the dummy block
    result = fill_and_drain(num_blocks, args, **groups.scheduler_args())
    return {"model": args.model, "kv_gib": args.kv_gib, "hybrid": hybrid, "kv_groups": groups.num_groups,
            "layers_per_group": groups.group_size, **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(GEOMETRY), default="270m")
    parser.add_argument("--kv-gib", type=float, default=1.0, help="KV budget (bf16)")
    parser.add_argument("--seq-len", type=int, default=8192, help="prompt + generated tokens of each sequence")
    parser.add_argument("--new-tokens", type=int, default=192)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens")
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    for hybrid in (False, True):
        print("RESULT " + json.dumps(run(hybrid, args)), flush=True)


if __name__ == "__main__":
    main()
