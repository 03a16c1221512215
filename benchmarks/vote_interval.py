"""The lockstep vote through whole engines, and what voting every K steps saves: N rank
processes (2, 4, 8 by default) in one Gloo group, each an LLMEngine on the 4-layer hidden-256
Llama of benchmarks/routing.py running the StepLoop every front end runs, one torch thread each.
Each wave runs under one of three settings, the settings in turn:

  K=1      the vote every step (dp_vote_interval 1, the default);
  K=32     the vote on every 32nd step of the wave (vLLM's interval);
  alone    no vote at all: each process steps only its own work, as a dp 1 engine would.

and one of two workloads: "all" (every rank gets --requests prompts of --prompt-len tokens,
--max-tokens new tokens each, greedy, EOS ignored) and "one" (only rank 0 gets them; the others
run placeholder steps while the group votes, and nothing when alone). Every wave starts after a
barrier of all ranks. Per setting and workload it prints rank 0's milliseconds per step (its
wave's wall time over its steps: the vote's cost is what K=1 adds over alone; of which in
LLMEngine.step and in Lockstep.vote, waiting for peers included; and the CPU time rank 0's
process spent per step, all its threads, which waiting for a descheduled peer does not
inflate the way it does the wall time), the steps of the
wave, and the steps past rank 0's own work (what K costs at the end of a wave: up to K-1). On a
2-core machine N processes share 2 cores, so at 4 and 8 ranks every step also waits for a
descheduled peer; those rows bound the cost, they do not isolate it. Median of all repeats
[min-max].

    python benchmarks/vote_interval.py [--ranks 2 4 8] [--repeats 3] [--intervals 1 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import RESULT_MARK, emit, in_turn  # noqa: E402

WORKLOADS = ("all", "one")


def run_wave(engine, loop, groups, lockstep, requests: list[list[int]], params) -> dict:
    """One wave after a barrier of all ranks: its steps and wall time on this rank."""
    import torch.distributed as dist

    engine.lockstep = lockstep
    for ids in requests:
        engine.add_request(prompt_token_ids=ids, sampling_params=params)
    dist.barrier(group=groups.cpu_group)
    steps, placeholders, start = engine.generate_step, engine.placeholder_steps, time.perf_counter()
    cpu = time.process_time()
    in_step, in_placeholders = loop.step_time_s, loop.placeholder_step_time_s
    loop.run(lambda outputs: None)
    return {"wall_s": time.perf_counter() - start, "cpu_s": time.process_time() - cpu,
            "steps": engine.generate_step - steps,
            "placeholders": engine.placeholder_steps - placeholders, "step_s": loop.step_time_s - in_step,
            "placeholder_s": loop.placeholder_step_time_s - in_placeholders,
            "vote_s": lockstep.allreduce_time_s if lockstep is not None else 0.0}


def run_rank(rank: int, world: int, port: int, args: argparse.Namespace) -> list[dict]:
    from deepinfer_dp.config import EngineConfig
    from deepinfer_dp.distributed import Lockstep, destroy_dp_groups, init_dp_groups
    from deepinfer_dp.engine.llm_engine import LLMEngine
    from deepinfer_dp.engine.step_loop import StepLoop
    from deepinfer_dp.sampling_params import SamplingParams

    config = EngineConfig(model=args.model, dp_size=world, dp_rank=rank, torch_threads=1, num_kv_blocks=256,
                          max_num_seqs=args.requests)
    engine = LLMEngine(config)
    groups = init_dp_groups(rank, world, "127.0.0.1", port, engine.device, timeout_s=120)
    loop = StepLoop(engine)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = [[3 + (rank * 131 + r * 17 + i) % 300 for i in range(args.prompt_len)] for r in range(args.requests)]
    settings = [f"K={k}" for k in args.intervals] + ["alone"]
    run_wave(engine, loop, groups, Lockstep(groups), prompts, params)  # warm up
    found = []
    for i in range(args.repeats):
        for setting in in_turn(settings, i):
            for workload in WORKLOADS:
                lockstep = None if setting == "alone" else Lockstep(groups, interval=int(setting[2:]))
                mine = prompts if workload == "all" or rank == 0 else []
                found.append({"setting": setting, "workload": workload,
                              **run_wave(engine, loop, groups, lockstep, mine, params)})
    engine.lockstep = None
    engine.shutdown()
    destroy_dp_groups()
    return found


def run_group(world: int, args: argparse.Namespace) -> list[list[dict]]:
    """Starts `world` rank processes on a fresh TCPStore; every rank's list of waves."""
    from deepinfer_dp.distributed.groups import serve_store

    store = serve_store("127.0.0.1", timeout_s=300)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    child = [sys.executable, __file__, "--world", str(world), "--port", str(store.port), "--model", args.model,
             "--repeats", str(args.repeats), "--requests", str(args.requests), "--prompt-len", str(args.prompt_len),
             "--max-tokens", str(args.max_tokens), "--intervals", *map(str, args.intervals)]
    procs = [subprocess.Popen([*child, "--rank", str(r)], stdout=subprocess.PIPE, text=True, env=env)
             for r in range(world)]
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=3600)
        lines = [line for line in out.splitlines() if line.startswith(RESULT_MARK)]
        if proc.returncode != 0 or not lines:
            raise SystemExit(f"a rank of the {world}-rank group failed (exit status {proc.returncode})")
        results.append(json.loads(lines[-1][len(RESULT_MARK):]))
    return results


def report(world: int, ranks: list[list[dict]]) -> None:
    """Rank 0's ms per step, the waves' steps and the steps past rank 0's work, per setting."""
    def cell(vals: list[float], fmt: str = ".2f") -> str:
        return f"{statistics.median(vals):{fmt}} [{min(vals):{fmt}}-{max(vals):{fmt}}]"

    rank0 = ranks[0]
    for workload in WORKLOADS:
        own = [w["steps"] for w in rank0 if w["setting"] == "alone" and w["workload"] == workload]
        for setting in dict.fromkeys(w["setting"] for w in rank0):
            waves = [w for w in rank0 if w["setting"] == setting and w["workload"] == workload]
            ms = [1000 * w["wall_s"] / w["steps"] for w in waves]
            in_step = [1000 * w["step_s"] / w["steps"] for w in waves]
            in_vote = [1000 * w["vote_s"] / w["steps"] for w in waves]
            cpu = [1000 * w["cpu_s"] / w["steps"] for w in waves]
            past = [w["steps"] - statistics.median(own) for w in waves]
            others = [w["placeholders"] for r in ranks[1:] for w in r
                      if w["setting"] == setting and w["workload"] == workload]
            print(f"| {world} | {workload} | {setting} | {cell(ms)} | {cell(in_step)} | {cell(in_vote)} | "
                  f"{cell(cpu)} | "
                  f"{cell([w['steps'] for w in waves], '.0f')} | "
                  f"{cell(past, '.0f')} | {cell(others or [0], '.0f')} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--intervals", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=100)
    ap.add_argument("--model", default=None, help="default: benchmarks/routing.py's 4-layer Llama")
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)  # child: one rank
    ap.add_argument("--world", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank is not None:
        emit(run_rank(args.rank, args.world, args.port, args))
        return
    if args.model is None:
        from routing import build_model

        args.model = build_model()
    print(f"{os.cpu_count()} cores; rank 0's ms per step, the wave's steps, steps past rank 0's own work, "
          f"placeholder steps of each other rank; median of {args.repeats} repeats [min-max]")
    print("| ranks | workload | setting | ms per step | of which in step() | in the vote | CPU ms per step | steps | "
          "steps past the work | others' placeholders |")
    print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for n in args.ranks:
        report(n, run_group(n, args))


if __name__ == "__main__":
    main()
