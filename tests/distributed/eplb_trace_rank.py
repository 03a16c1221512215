"""torchrun script for the forced-rebalance tests: one rank generates its contiguous shard of
the prompts (greedy) with the engine options given as JSON, and records what every step
computed: per row its request, query length and sequence length, and which requests were
sampled. Rank 0 writes every rank's token ids, stats and step trace as JSON.

    torchrun --nproc-per-node 3 eplb_trace_rank.py MODEL PROMPTS_FILE OUT SHARD_SIZES MAX_TOKENS ENGINE_JSON
"""

import json
import sys

from deepinfer_dp.entrypoints.llm import LLM
from deepinfer_dp.sampling_params import SamplingParams


def traced(engine, trace: list) -> None:
    """Wraps the engine's worker so that each step's rows are appended to `trace`."""
    execute = engine.worker.execute_model_step

    def run(sched_out, *args, **kwargs):
        starts = [int(s) for s in sched_out.query_start_loc]
        ids = [str(r) for r in sched_out.request_ids]
        rows = [[rid, starts[i + 1] - starts[i], int(sched_out.seq_lens[i])] for i, rid in enumerate(ids)]
        trace.append({"step": engine.generate_step + 1, "rows": rows,
                      "sampled": sorted({str(r) for r in sched_out.sample_request_ids})})
        return execute(sched_out, *args, **kwargs)

    engine.worker.execute_model_step = run


def main() -> None:
    model, prompts_file, out, sizes, max_tokens, options = sys.argv[1:7]
    prompts = [line.rstrip("\n") for line in open(prompts_file) if line.strip()]
    llm = LLM(model, decode_sequence=False, **json.loads(options))
    rank, world = llm.dp.dp_rank, llm.dp.dp_size
    counts = [int(s) for s in sizes.split(",")]
    assert len(counts) == world and sum(counts) == len(prompts), (sizes, world, len(prompts))
    mine = list(range(sum(counts[:rank]), sum(counts[:rank + 1])))
    trace: list = []
    traced(llm.llm_engine, trace)
    outputs = llm.generate([prompts[i] for i in mine], SamplingParams(temperature=0.0, max_tokens=int(max_tokens)),
                           use_tqdm=False)
    ids = [[t for o in outs for t in o.token_ids] for outs in outputs]
    gathered = llm.dp.all_gather({"ids": [[i, t] for i, t in zip(mine, ids, strict=True)], "trace": trace})
    stats = llm.rank_stats()
    if rank == 0:
        results = dict(pair for g in gathered for pair in g["ids"])
        with open(out, "w") as f:
            json.dump({"token_ids": [results[i] for i in range(len(prompts))], "rank_stats": stats,
                       "traces": [g["trace"] for g in gathered]}, f)
    llm.shutdown()


if __name__ == "__main__":
    main()
