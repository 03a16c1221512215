"""How many requests/s the router and the API servers pass, with ranks that answer at once.

The ranks are tests/router_utils.py's FakeRank (threads of one process, each a real ZeroMQ
peer with the data plane's CURVE keys), answering each AddRequest with one token that
finishes it; the router is the real Router (cluster/router.py) in this process; so the
figures are the ceiling of the control path, with no model behind it.

  router:  --clients processes, each a RouterClient that keeps --window requests in flight,
           send --requests requests through the router (no HTTP); --ranks fake ranks, each
           answering with --tokens deltas of one token (one message each); with --waves
           each request is a wave of its own (the router wakes every other rank for it);
  http:    --api-servers API server processes (the real app, build_app over a RouterClient,
           sharing one listening socket as `serve --api-server-count` does) take non-streamed
           /v1/completions (max_tokens 1) from --load-procs processes of --concurrency
           connections each.
Prints requests/s, the router's (or API servers') CPU time per request, and the CPU each
process used per second of wall time (1.0: a whole core, the process is the bottleneck).
This machine has 2 cores shared with other work: every process here competes for them, so
the rates are lower bounds (the CPU time per request is the steadier figure); each
configuration runs --repeats times, interleaved, and the spread is printed.

    python benchmarks/router_throughput.py router [--ranks 2 8 64] [--clients 1 2] [--tokens 1 8] [--waves]
    python benchmarks/router_throughput.py http [--api-servers 1 2]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from harness import in_turn  # noqa: E402

VOCAB = 400  # the tiny test tokenizer's; FakeRank answers token 100 + its rank


def _fake_ranks(backend: str, key, count: int, tokens: int, waves: bool, addresses, stop) -> None:
    from router_utils import FakeRank

    ranks = [FakeRank(i, backend, num_tokens=tokens, key=key) for i in range(count)]
    for r in ranks:
        r.waves = waves
    addresses.put([r.address for r in ranks])
    stop.wait()
    for r in ranks:
        r.close()


def _processor():
    from deepinfer_dp.engine.input_processor import InputProcessor

    return InputProcessor(VOCAB, 64)


def _client(frontend: str, key, requests: int, window: int, ready, start, results, tag: str) -> None:
    from deepinfer_dp.cluster.router_client import RouterClient
    from deepinfer_dp.sampling_params import SamplingParams

    client = RouterClient(frontend, None, "fake", 64, _processor(), key=key)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    slots, done = threading.Semaphore(window), threading.Event()
    left, failed = [requests], []

    def on_item(item) -> None:
        if isinstance(item, Exception) or item.finished:
            if isinstance(item, Exception) or item.finish_reason != "length":
                failed.append(repr(item))
            slots.release()
            left[0] -= 1  # one receiver thread: no race
            if left[0] == 0:
                done.set()

    ready.put(tag)
    start.wait()
    t0, cpu0 = time.perf_counter(), time.process_time()
    for i in range(requests):
        slots.acquire()
        client.submit(f"{tag}-{i}", [5, 6, 7, 8], params, on_item)
    done.wait(600)
    results.put((t0, time.perf_counter(), time.process_time() - cpu0, requests - left[0] - len(failed), failed[:3]))
    client.close()


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process `pid` has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Cluster:
    """The Router in this process and `ranks` fake ranks in a child process, each answering a
    request with `tokens` deltas (one message each), as a wave of its own if `waves`."""

    def __init__(self, ranks: int, policy: str, tokens: int = 1, waves: bool = False) -> None:
        from router_utils import FakeLiveness

        from deepinfer_dp.cluster.data_plane import RANK, ROUTER, ClusterKey
        from deepinfer_dp.cluster.router import Router
        from deepinfer_dp.config_file import RouterSection

        self.ctx = mp.get_context("spawn")
        self.key = ClusterKey.generate()
        self.router = Router(RouterSection(max_rank_restarts=0, policy=policy), key=self.key.for_role(ROUTER))
        addresses, self.stop = self.ctx.Queue(), self.ctx.Event()
        rank_args = (self.router.backend_address, self.key.for_role(RANK), ranks, tokens, waves, addresses,
                     self.stop)
        self.ranks = self.ctx.Process(target=_fake_ranks, args=rank_args)
        self.ranks.start()
        self.router.attach_ranks(addresses.get(timeout=120), FakeLiveness())
        self.router.start()

    def client_key(self) -> object:
        """The data plane's key as a client process gets it."""
        from deepinfer_dp.cluster.data_plane import CLIENT

        return self.key.for_role(CLIENT)

    def close(self) -> None:
        self.router.close()
        self.stop.set()
        self.ranks.join(30)


def run_router(ranks: int, clients: int, tokens: int, args: argparse.Namespace) -> dict:
    cluster = Cluster(ranks, args.policy, tokens, args.waves)
    try:
        ready, start, results = cluster.ctx.Queue(), cluster.ctx.Event(), cluster.ctx.Queue()
        each = args.requests // clients
        procs = [cluster.ctx.Process(target=_client, args=(cluster.router.frontend_address, cluster.client_key(),
                                                           each, args.window, ready, start, results, f"c{c}"))
                 for c in range(clients)]
        for p in procs:
            p.start()
        for _ in procs:
            ready.get(timeout=300)
        time.sleep(0.5)  # the clients' Hello reaches the router
        cpu0, ranks_cpu0, t0 = time.process_time(), cpu_s(cluster.ranks.pid), time.perf_counter()
        start.set()
        got = [results.get(timeout=600) for _ in procs]
        wall, router_cpu = time.perf_counter() - t0, time.process_time() - cpu0
        ranks_cpu = cpu_s(cluster.ranks.pid) - ranks_cpu0
        for p in procs:
            p.join(30)
    finally:
        cluster.close()
    span = max(g[1] for g in got) - min(g[0] for g in got)
    done, failed = sum(g[3] for g in got), [f for g in got for f in g[4]]
    if failed:
        raise SystemExit(f"requests failed through the router: {failed}")
    return {"req_s": done / span, "done": done, "router_us_per_req": 1e6 * router_cpu / done,
            "router_cpu": router_cpu / wall, "fake_ranks_cpu": ranks_cpu / wall,
            "client_cpu": statistics.mean(g[2] for g in got) / span}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("router", "http"))
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 8, 64])
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1], help="deltas (messages) per request")
    ap.add_argument("--waves", action="store_true", help="each request a wave of its own (StartWave, "
                                                         "Wake to every other rank, WaveDone)")
    ap.add_argument("--api-servers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--requests", type=int, default=6000)
    ap.add_argument("--window", type=int, default=256, help="requests in flight per client")
    ap.add_argument("--load-procs", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=64, help="connections per load process")
    ap.add_argument("--policy", default="round_robin")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    if args.mode == "router":
        configs = [(r, c, t) for r in args.ranks for c in args.clients for t in args.tokens]
        measure = lambda cfg: run_router(*cfg, args)  # noqa: E731
        label = "fake ranks, client processes, tokens per request"
    else:
        from router_http import run_http

        configs = [(2, s) for s in args.api_servers]
        measure = lambda cfg: run_http(cfg[1], args)  # noqa: E731
        label = "fake ranks, API server processes"
    runs: dict = {cfg: [] for cfg in configs}
    for i in range(args.repeats):
        for cfg in in_turn(configs, i):
            runs[cfg].append(measure(cfg))
            print(f"repeat {i + 1}, {label} {cfg}: {runs[cfg][-1]}", flush=True)
    report(runs, label)


def report(runs: dict, label: str) -> None:
    keys = [k for k in next(iter(runs.values()))[0] if k != "done"]
    print("\nmedian of repeats [min-max]; CPU: core-seconds per second of wall time")
    print(f"| {label} | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for cfg, rows in runs.items():
        cells = []
        for k in keys:
            vals = [r[k] for r in rows]
            fmt = ".0f" if k in ("req_s", "failed") or k.endswith("us_per_req") else ".2f"
            cells.append(f"{statistics.median(vals):{fmt}} [{min(vals):{fmt}}-{max(vals):{fmt}}]")
        print(f"| {cfg} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
