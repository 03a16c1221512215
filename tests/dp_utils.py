"""Helpers shared by the DP tests."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
from pathlib import Path

from loopback_netns import loopback_netns

from deepinfer_dp.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent

# Eight prompts of different lengths; max_num_seqs=2 makes a busy rank take many steps.
PROMPTS = ["Hello, my name is", "The capital of France is", "Write a haiku about the sea.",
           "What is 2 + 2?", "List three colors.", "Once upon a time",
           "Explain data parallelism in one sentence, please, and be brief.", "Hi"]
MAX_TOKENS = 8
ENGINE = dict(num_kv_blocks=64, max_num_seqs=2, torch_threads=1)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
# The expert-parallel tests' engine: a 12-token step budget, so that longer prompts are
# prefilled in chunks, beside other sequences.
EP_ENGINE = {**ENGINE, "max_num_batched_tokens": 12}


def token_ids(results) -> list[list[int]]:
    return [[t for o in outs for t in o.token_ids] for outs in results]


def run_torchrun(args: list[str], nproc: int = 2, env: dict | None = None,
                 timeout_s: float = 300, netns: str | None = None) -> subprocess.CompletedProcess:
    """`torchrun --standalone` of `args` (a script and its arguments) in `nproc` processes,
    from the repository root, in its own process group so that past `timeout_s` the whole
    group is killed (torchrun's rank processes too, not only torchrun). It runs in network
    namespace `netns`, or in a private one made for the run: torchrun's agent listens on
    every interface (tests/loopback_netns.py)."""
    with contextlib.ExitStack() as stack:
        ns = netns or stack.enter_context(loopback_netns())
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(nproc), *args]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                start_new_session=True, env={**os.environ, **(env or {})})
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def torchrun_ep(model_dir: Path, out: Path, shard_sizes: str = "8,0", backend: str = "all_to_all",
               extra_args: tuple[str, ...] = (), env: dict | None = None,
               timeout_s: float = 300) -> subprocess.CompletedProcess:
    """launch/torchrun_generate.py in 2 processes with expert parallelism and EP_ENGINE's
    options over PROMPTS (written beside `out`), its JSON results in `out`."""
    out.with_suffix(".txt").write_text("\n".join(PROMPTS) + "\n")
    return run_torchrun([str(ROOT / "launch" / "torchrun_generate.py"), "--model", str(model_dir),
                         "--shard-sizes", shard_sizes, "--max-tokens", str(MAX_TOKENS),
                         "--num-kv-blocks", str(EP_ENGINE["num_kv_blocks"]),
                         "--max-num-seqs", str(EP_ENGINE["max_num_seqs"]),
                         "--max-num-batched-tokens", str(EP_ENGINE["max_num_batched_tokens"]),
                         "--enable-expert-parallel", "--all2all-backend", backend, "--output", str(out),
                         "--prompts-file", str(out.with_suffix(".txt")), *extra_args],
                        env=env, timeout_s=timeout_s)


def submit_all(router, prefix: str, num: int, params: SamplingParams, prompt: list[int]) -> dict[str, queue.Queue]:
    """Sends `num` requests through a RouterClient; request id -> the queue of its deltas."""
    got = {f"{prefix}-{i}": queue.Queue() for i in range(num)}
    for rid, q in got.items():
        router.submit(rid, prompt, params, q.put)
    return got


def first_ranks(got: dict[str, queue.Queue], timeout: float) -> dict[str, int]:
    """The rank serving each request, from its first delta (so every one has started)."""
    ranks = {}
    for rid, q in got.items():
        item = q.get(timeout=timeout)
        assert not isinstance(item, Exception), item
        ranks[rid] = item.dp_rank
    return ranks


def outcome(q: queue.Queue, timeout: float):
    """The finished delta of a request, or the exception that ended it."""
    while True:
        item = q.get(timeout=timeout)
        if isinstance(item, Exception) or item.finished:
            return item


def assert_actors_exited_cleanly(pids: list[int], timeout_s: float = 30.0) -> None:
    """Every Ray actor process in `pids` exited on purpose with status 0 (Ray's own record in
    the worker's log), and nothing in its stderr says it aborted."""
    import glob
    import os
    import time

    import ray

    logs = os.path.join(ray._private.worker._global_node.get_session_dir_path(), "logs")
    for pid in pids:
        deadline = time.monotonic() + timeout_s
        while True:
            text = "".join(open(f).read() for f in glob.glob(f"{logs}/python-core-worker-*_{pid}.log"))
            if "exit_type=" in text or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert "exit_type=INTENDED_USER_EXIT" in text and "exit code 0" in text, f"actor {pid}: {text[-2000:]}"
        err = "".join(open(f).read() for f in glob.glob(f"{logs}/worker-*-{pid}.err"))
        for sign in ("terminate called", "Aborted", "Fatal Python error", "Traceback"):
            assert sign not in err, f"actor {pid}: {err[-2000:]}"


def listening_off_loopback(root_pids: list[int]) -> list[str]:
    """The TCP listening sockets, of the processes `root_pids` and all their descendants, that
    are bound to an address other than loopback ("pid name address:port" each)."""
    import ipaddress

    import psutil

    procs = {}
    for pid in root_pids:
        root = psutil.Process(pid)
        for proc in [root, *root.children(recursive=True)]:
            procs[proc.pid] = proc
    found = []
    for proc in procs.values():
        try:
            conns = proc.net_connections(kind="tcp")
            name = proc.name()
        except psutil.NoSuchProcess:
            continue
        for c in conns:
            if c.status != psutil.CONN_LISTEN:
                continue
            ip = ipaddress.ip_address(c.laddr.ip)
            mapped = getattr(ip, "ipv4_mapped", None)
            if not (mapped or ip).is_loopback:
                found.append(f"{proc.pid} {name} {c.laddr.ip}:{c.laddr.port}")
    return found
