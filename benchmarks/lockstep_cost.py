"""The lockstep vote's cost as the group grows: N processes in one Gloo group (N = 2, 4, 8 by
default) each run the engine's `Lockstep.vote` (distributed/lockstep.py: an all_reduce MAX
of five int64s) in a loop, with nothing else, and with a stand-in step between votes.

Per N it prints, over the ranks (their median of --votes votes each):
  idle vote:     vote(False), the blocking all-reduce a rank without work waits for;
  busy vote:     vote(True), which starts the all-reduce and waits for it at the next vote
                 (what a rank with work pays per step);
  step + vote:   a --step-ms sleep (the stand-in for a placeholder or a real step: it holds
                 no core, so the protocol is measured, not compute) and vote(True), against
                 the same loop without the vote; the difference is the vote's cost per step;
  vote's cost per step, every 1 and every K (means): step + vote against step alone as
                 means over the passes, with the vote every pass and with a Lockstep of
                 interval --interval (dp_vote_interval), which runs the collective on every
                 K-th pass only (the median would hide it).
On a 2-core machine 8 processes share 2 cores: the figures at 4 and 8 ranks include waiting
for a descheduled peer, which is the bound of what the protocol costs, not the protocol alone.
Each N runs --repeats times, the Ns interleaved; the spread over the repeats is printed.

    python benchmarks/lockstep_cost.py [--ranks 2 4 8] [--votes 2000] [--step-ms 1] [--repeats 3] [--interval 32]
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


def _loop_us(lockstep, votes: int, local: bool, step_s: float, mean: bool = False) -> float:
    """Median (or mean) microseconds of one pass of a loop of `votes` passes (vote and/or step)."""
    times = []
    for _ in range(votes):
        t = time.perf_counter()
        if step_s:
            time.sleep(step_s)
        if lockstep is not None:
            lockstep.vote(local)
        times.append(time.perf_counter() - t)
    return 1e6 * (statistics.fmean(times) if mean else statistics.median(times))


def run_rank(rank: int, world: int, port: int, votes: int, step_ms: float, interval: int) -> dict:
    import torch

    from deepinfer_dp.distributed.groups import destroy_dp_groups, init_dp_groups
    from deepinfer_dp.distributed.lockstep import Lockstep

    torch.set_num_threads(1)
    groups = init_dp_groups(rank, world, "127.0.0.1", port, torch.device("cpu"), timeout_s=60)
    lockstep = Lockstep(groups)
    step_s = step_ms / 1000
    _loop_us(lockstep, 100, False, 0.0)  # warm the connections
    found = {"idle_vote_us": _loop_us(lockstep, votes, False, 0.0),
             "busy_vote_us": _loop_us(lockstep, votes, True, 0.0),
             "step_vote_us": _loop_us(lockstep, votes // 4, True, step_s)}
    lockstep.vote(False)  # the last busy vote is waited for; every rank leaves together
    spaced = Lockstep(groups, interval=interval)
    # The mean, not the median: K-1 of every K passes have no vote, so the median hides it.
    found["step_vote_k_us"] = _loop_us(spaced, votes // 4, True, step_s, mean=True)
    while spaced.vote(False):  # to the next voting pass, where every rank learns nobody has work
        pass
    found["step_vote_mean_us"] = _loop_us(lockstep, votes // 4, True, step_s, mean=True)
    lockstep.vote(False)
    found["step_only_us"] = _loop_us(None, votes // 4, True, step_s)
    found["step_only_mean_us"] = _loop_us(None, votes // 4, True, step_s, mean=True)
    lockstep.close()
    destroy_dp_groups()
    return found


def run_group(world: int, args: argparse.Namespace) -> dict:
    """Starts `world` rank processes on a fresh TCPStore; their results, per key the median over ranks."""
    from deepinfer_dp.distributed.groups import serve_store

    store = serve_store("127.0.0.1", timeout_s=120)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--world", str(world), "--port",
                               str(store.port), "--votes", str(args.votes), "--step-ms", str(args.step_ms),
                               "--interval", str(args.interval)],
                              stdout=subprocess.PIPE, text=True, env=env) for r in range(world)]
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=600)
        lines = [line for line in out.splitlines() if line.startswith(RESULT_MARK)]
        if proc.returncode != 0 or not lines:
            raise SystemExit(f"a rank of the {world}-rank group failed (exit status {proc.returncode})")
        results.append(json.loads(lines[-1][len(RESULT_MARK):]))
    return {k: statistics.median(r[k] for r in results) for k in results[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--votes", type=int, default=2000)
    ap.add_argument("--step-ms", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--interval", type=int, default=32, help="K of the step + vote every K column")
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)  # child: one rank
    ap.add_argument("--world", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank is not None:
        emit(run_rank(args.rank, args.world, args.port, args.votes, args.step_ms, args.interval))
        return
    runs: dict[int, list[dict]] = {n: [] for n in args.ranks}
    for i in range(args.repeats):
        for n in in_turn(list(args.ranks), i):
            runs[n].append(run_group(n, args))
            print(f"repeat {i + 1}, {n} ranks: {runs[n][-1]}", flush=True)
    report(runs, args)


def report(runs: dict[int, list[dict]], args: argparse.Namespace) -> None:
    print(f"\nmicroseconds per loop pass, median over ranks; median of {args.repeats} repeats [min-max]; "
          f"{os.cpu_count()} cores")
    print(f"| ranks | idle vote | busy vote | {args.step_ms:g} ms step + vote | step alone | "
          f"vote's cost per step | mean, every step | mean, every {args.interval} |")
    print("|---|---|---|---|---|---|---|---|")
    for n, rows in runs.items():
        def cell(vals: list[float]) -> str:
            return f"{statistics.median(vals):.0f} [{min(vals):.0f}-{max(vals):.0f}]"

        cost = [r["step_vote_us"] - r["step_only_us"] for r in rows]
        cost_1 = [r["step_vote_mean_us"] - r["step_only_mean_us"] for r in rows]
        cost_k = [r["step_vote_k_us"] - r["step_only_mean_us"] for r in rows]
        print(f"| {n} | {cell([r['idle_vote_us'] for r in rows])} | {cell([r['busy_vote_us'] for r in rows])} | "
              f"{cell([r['step_vote_us'] for r in rows])} | {cell([r['step_only_us'] for r in rows])} | "
              f"{cell(cost)} | {cell(cost_1)} | {cell(cost_k)} |")


if __name__ == "__main__":
    main()
