"""The lockstep vote: "does any DP rank still have work?" as an all_reduce(MAX) per step.

Every rank calls vote() once per loop iteration, so all ranks take the same number of steps
(a rank without work runs placeholder steps). A dead or stuck peer makes the collective fail
within the group's timeout; vote() turns that into a LockstepError that names this rank, its
peers and the timeout, instead of Gloo's bare message.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from deepinfer_dp.distributed.groups import DPGroups


class LockstepError(RuntimeError):
    """The DP group is broken: a peer died or stopped voting. Re-form on a fresh store."""


class Lockstep:
    def __init__(self, groups: DPGroups, use_cpu_group: bool = True) -> None:
        """use_cpu_group: vote over Gloo on a host tensor (ZOS on: no device sync); else
        over the device group on a device tensor, as the seed does without ZOS."""
        self.groups = groups
        self.use_cpu_group = use_cpu_group
        self._group = groups.cpu_group if use_cpu_group else groups.device_group
        device = torch.device("cpu") if use_cpu_group else groups.device
        # [unfinished, arrival time in us]: the MAX of the arrival is when the last rank came,
        # which splits the vote's time into waiting for peers and the collective itself at
        # no extra cost (CLOCK_MONOTONIC is shared by the processes of one machine only).
        self._buf = torch.zeros(2, dtype=torch.int64, device=device)
        self.num_votes = 0
        self.allreduce_time_s = 0.0  # wall time inside the vote, waiting for peers included
        self.allreduce_wait_s = 0.0  # of which: until the last rank arrived (load imbalance)
        self.broken: LockstepError | None = None

    @property
    def rank(self) -> int:
        return self.groups.rank

    @property
    def world_size(self) -> int:
        return self.groups.world_size

    def vote(self, local: bool) -> bool:
        """True if this rank or any peer has unfinished work."""
        if self.broken is not None:
            raise self.broken
        start = time.perf_counter()
        arrival_us = time.monotonic_ns() // 1000
        self._buf.copy_(torch.tensor([int(local), arrival_us]))
        try:
            dist.all_reduce(self._buf, op=dist.ReduceOp.MAX, group=self._group)
            unfinished, last_arrival_us = self._buf.tolist()
        except (RuntimeError, dist.DistError) as e:
            self.broken = self._error(e, time.perf_counter() - start)
            raise self.broken from e
        self.allreduce_time_s += time.perf_counter() - start
        self.allreduce_wait_s += (last_arrival_us - arrival_us) / 1e6
        self.num_votes += 1
        return bool(unfinished)

    def _error(self, cause: Exception, waited_s: float) -> LockstepError:
        g = self.groups
        peers = [r for r in range(g.world_size) if r != g.rank]
        group = "CPU (Gloo)" if self.use_cpu_group else f"device ({g.device.type})"
        return LockstepError(
            f"DP rank {g.rank} of {g.world_size}: the lockstep vote (all_reduce MAX over the {group} "
            f"group from {g.origin}) failed after {waited_s:.1f}s, collective timeout {g.timeout_s:.0f}s: "
            f"peer rank(s) {peers} died or stopped calling step(). The group cannot be reused; "
            f"re-form it on a fresh store. Cause: {str(cause).splitlines()[0] if str(cause) else cause!r}")

    def stats(self) -> dict:
        return {"lockstep_votes": self.num_votes, "allreduce_time_s": self.allreduce_time_s,
                "allreduce_wait_s": self.allreduce_wait_s,
                "allreduce_collective_s": self.allreduce_time_s - self.allreduce_wait_s}
