"""CPU DP ranks each on their own cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from deepinfer_dp.distributed.cpu_binding import rank_cpus


def test_dp_ranks_get_disjoint_cores():
    cpus = [0, 1, 2, 3, 4, 5, 6, 7]
    assert [rank_cpus(r, 3, cpus) for r in range(3)] == [[0, 1], [2, 3], [4, 5]]
    assert rank_cpus(0, 1, cpus) is None  # one rank: leave it unbound
    assert rank_cpus(1, 4, [0, 1]) is None  # fewer cores than ranks: no binding


def test_binding_covers_threads_started_before_and_after():
    # In a child process, so pytest's own affinity stays as it is.
    mine = os.sched_getaffinity(0)
    code = (
        "import os, threading, time\n"
        "from deepinfer_dp.distributed.cpu_binding import bind_this_process\n"
        "ev = threading.Event(); seen = {'start': os.sched_getaffinity(0)}\n"
        "def early(): ev.wait(); seen['early'] = os.sched_getaffinity(0)\n"
        "t = threading.Thread(target=early); t.start()\n"
        "cpu = min(os.sched_getaffinity(0)); bind_this_process([cpu]); ev.set(); t.join()\n"
        "late = threading.Thread(target=lambda: seen.__setitem__('late', os.sched_getaffinity(0)))\n"
        "late.start(); late.join()\n"
        "assert seen['early'] == seen['late'] == os.sched_getaffinity(0) == {cpu}, seen\n"
        "print(sorted(seen['start']))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    # The child began on all of our cores, and ended on one (its own assert): the binding
    # narrowed it, while this process kept its cores.
    assert set(json.loads(res.stdout.strip().splitlines()[-1])) == mine
    assert os.sched_getaffinity(0) == mine
