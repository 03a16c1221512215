"""Offline DP under torchrun: each process is one rank, generates its shard of the prompts,
and rank 0 prints every result in prompt order plus every rank's step counters. The engine
options are deepinfer-dp's own flags (one per EngineConfig option, the same defaults).

    torchrun --nproc-per-node 2 launch/torchrun_generate.py --max-tokens 32
    torchrun --nproc-per-node 2 launch/torchrun_generate.py --model /path/to/hf_dir \
        --prompts-file prompts.txt --output results.json

Every rank keeps stepping until the last rank is done (the lockstep vote), so a rank with
an empty shard runs placeholder steps and all ranks report the same generate_step.

A rank that dies ends the job: its peers' lockstep vote fails (LockstepError) and torchrun
stops the others. With `torchrun --max-restarts N` torchrun starts every rank again (a new
group on the same rendezvous) and the job runs from the start; --fail-rank R is the drill
(rank R dies on the job's first attempt, once its group has formed).
"""

import argparse
import json
import os

from deepinfer_dp.config_file import add_engine_args, engine_options_of
from deepinfer_dp.entrypoints.llm import LLM
from deepinfer_dp.sampling_params import SamplingParams

DEFAULT_PROMPTS = ["Hello, my name is", "The capital of France is", "Write a haiku about the sea.",
                   "What is 2 + 2?", "List three colors.", "Once upon a time",
                   "Explain data parallelism in one sentence.", "The best thing about Mondays is"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts-file", help="one prompt per line; default: eight built-in prompts")
    ap.add_argument("--shard-sizes", help="e.g. 7,1: rank r takes the next size[r] prompts "
                    "(a rank may take none); default strided: rank r takes prompts r, r+N, ...")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens generated per prompt (greedy)")
    ap.add_argument("--output", help="rank 0 writes {token_ids, rank_stats} as JSON here")
    ap.add_argument("--fail-rank", type=int, default=None, help="fault drill: this rank's process dies "
                    "on the first attempt (TORCHELASTIC_RESTART_COUNT 0) after joining the group")
    add_engine_args(ap, exclude=("dp_size",))  # the world size is torchrun's --nproc-per-node
    args = ap.parse_args()
    prompts = DEFAULT_PROMPTS
    if args.prompts_file:
        with open(args.prompts_file) as f:
            prompts = [line.rstrip("\n") for line in f if line.strip()]
    options = engine_options_of(args)
    if "torch_threads" not in options:  # ranks sharing the cores must not oversubscribe them
        options["torch_threads"] = max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    llm = LLM(decode_sequence=False, **options)
    if llm.dp is None:
        raise SystemExit("run this under torchrun with --nproc-per-node 2 or more (see the docstring)")
    rank, world = llm.dp.dp_rank, llm.dp.dp_size
    if rank == args.fail_rank and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        os._exit(1)  # as a crash would: no shutdown, no exit handlers
    mine = my_shard(len(prompts), rank, world, args.shard_sizes)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    outputs = llm.generate([prompts[i] for i in mine], params, use_tqdm=rank == 0)
    ids = [[t for o in outs for t in o.token_ids] for outs in outputs]
    gathered = llm.dp.all_gather([[i, t] for i, t in zip(mine, ids, strict=True)])
    stats = llm.rank_stats()
    if rank == 0:
        results = dict(pair for shard in gathered for pair in shard)
        ordered = [results[i] for i in range(len(prompts))]
        tok = llm.get_tokenizer()
        for i, token_ids in enumerate(ordered):
            print(f"[{i}] {prompts[i]!r} -> {tok.decode(token_ids, skip_special_tokens=True)!r}")
        for s in stats:
            print(f"rank {s['dp_rank']}: generate_step={s['generate_step']} "
                  f"placeholder_steps={s['placeholder_steps']} allreduce_time_s={s['allreduce_time_s']:.3f}")
        if args.output:
            with open(args.output, "w") as f:
                json.dump({"token_ids": ordered, "rank_stats": stats}, f, indent=1)
    llm.shutdown()  # destroys the DP group too


def my_shard(num: int, rank: int, world: int, sizes: str | None) -> list[int]:
    if sizes is None:
        return list(range(num))[rank::world]
    counts = [int(s) for s in sizes.split(",")]
    if len(counts) != world or sum(counts) != num:
        raise SystemExit(f"--shard-sizes {sizes}: need {world} sizes summing to {num} prompts")
    start = sum(counts[:rank])
    return list(range(start, start + counts[rank]))


if __name__ == "__main__":
    main()
