"""Binding a CPU data-parallel rank to its own cores.

Unbound, the ranks' threads (each rank's host thread, its device thread and its OpenMP
team) wander across all cores: a rank loses its L2 contents whenever the OS moves it, and
one rank's host work can preempt the other's forward pass, so their step times jitter and
the lockstep makes both wait for the slower one every step. Each rank gets a disjoint,
contiguous share of the cores this process may use, the way CPU serving stacks pin
workers (numactl, or vLLM's VLLM_CPU_OMP_THREADS_BIND).
"""

from __future__ import annotations

import os


def rank_cpus(dp_rank: int, dp_size: int, cpus: list[int] | None = None) -> list[int] | None:
    """The cores of rank `dp_rank` of `dp_size` sharing `cpus` (default: this process's
    allowed cores); None when there are fewer cores than ranks."""
    cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    per_rank = len(cpus) // dp_size
    if dp_size <= 1 or per_rank < 1:
        return None
    slot = dp_rank % dp_size
    return cpus[slot * per_rank:(slot + 1) * per_rank]


def bind_this_process(cpus: list[int]) -> None:
    """Restricts every thread of this process to `cpus`; threads started later inherit it."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, PermissionError):  # the thread ended, or is not ours to move
            continue
