"""The lockstep vote: "does any DP rank still have work?" as an all_reduce(MAX) per step.

Every rank calls vote() once per loop iteration, so all ranks take the same number of steps
(a rank without work runs placeholder steps). With an interval K > 1 (vLLM votes every 32
steps) only every K-th pass of a wave runs the collective, counted from the wave's first pass;
the passes between answer "some rank has work" without asking, so every rank still steps on
every pass and the counts stay equal, and a wave ends up to K-1 placeholder steps after its
last work. A dead or stuck peer makes the collective fail
within the group's timeout; vote() turns that into a LockstepError that names this rank, its
peers and the timeout, instead of Gloo's bare message.

A group that is fine is left on purpose the same way every rank leaves a wave: by the vote.
A rank told to move to a new group (request_regroup) sets a flag in its votes; the vote whose
MAX first carries it is the last one, every rank steps on until the next voting pass, and there
vote() raises RegroupRequested before starting a collective. So all ranks leave after the same
step, even the ones that vote ahead (they learn that result at their next voting pass).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from deepinfer_dp.distributed.groups import DPGroups


class LockstepError(RuntimeError):
    """The DP group is broken: a peer died or stopped voting. Re-form on a fresh store."""


class VoteIntervalMismatch(LockstepError):
    """The ranks of one group were started with different vote intervals: their step counts
    would drift apart, so the group refuses to go on."""


class RegroupRequested(Exception):
    """Every rank of the group agreed, by their last vote, to leave the step loop for a new
    group (a restarted rank returns): the group is whole, nothing failed."""


class Lockstep:
    def __init__(self, groups: DPGroups, use_cpu_group: bool = True, interval: int = 1) -> None:
        """use_cpu_group: vote over Gloo on a host tensor (ZOS on: no device sync); else
        over the device group on a device tensor, which waits for the device (ZOS off).
        interval: vote on every interval-th pass of a wave (the same on every rank)."""
        if interval < 1:
            raise ValueError(f"interval: must be at least 1 (got {interval})")
        self.groups = groups
        self.interval = interval
        self._pass = 0  # passes of this wave so far: a pass votes when this is a multiple of interval
        self.passes_without_vote = 0
        self.use_cpu_group = use_cpu_group
        self._group = groups.cpu_group if use_cpu_group else groups.device_group
        device = torch.device("cpu") if use_cpu_group else groups.device
        # [unfinished, arrival time in us, regroup]: the MAX of the arrival is when the last rank came,
        # which splits the vote's time into waiting for peers and the collective itself at
        # no extra cost (CLOCK_MONOTONIC is shared by the processes of one machine only);
        # then interval and -interval, whose MAXes tell every rank whether all ranks agree on it.
        self._buf = torch.zeros(5, dtype=torch.int64, device=device)
        self.num_votes = 0
        self.allreduce_time_s = 0.0  # wall time inside the vote, waiting for peers included
        self.allreduce_wait_s = 0.0  # of which: until the last rank arrived (load imbalance)
        self.broken: LockstepError | None = None
        self._pending: tuple | None = None  # (work, buffer, arrival) of a vote not waited for yet
        self._regroup_local = False  # this rank was told to move to a new group
        self._regroup_agreed = False  # a completed vote's MAX carried some rank's regroup flag

    def request_regroup(self) -> None:
        """Leave the step loop for a new group at a step every rank agrees on (see the top)."""
        self._regroup_local = True

    def vote(self, local: bool) -> bool:
        """True if this rank or any peer has unfinished work.

        On the CPU group, a rank that has work knows the answer (MAX) already: it starts the
        collective and returns at once, and waits for it at its next vote. So a rank may run
        one step ahead of a slower peer instead of idling at every step's jitter; the votes
        still pair up one per voting pass, so every rank takes the same number of steps, and a rank
        without work (which needs the answer) waits for it.

        Between voting passes (interval > 1) it answers True at once: the group assumes some
        rank still has work until the next vote, as vLLM does."""
        if self.broken is not None:
            raise self.broken
        if self._pass % self.interval:
            self._pass += 1
            self.passes_without_vote += 1
            return True
        start = time.perf_counter()
        try:
            self._finish_pending()
            if self._regroup_agreed:
                raise RegroupRequested(f"DP rank {self.groups.rank}: the group moves to a new one")
            arrival_us = time.monotonic_ns() // 1000
            ahead = local and self.use_cpu_group
            # a fresh buffer: a vote may be in flight
            values = torch.tensor([int(local), arrival_us, int(self._regroup_local), self.interval, -self.interval])
            buf = values if self.use_cpu_group else self._buf.copy_(values)
            work = dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self._group, async_op=ahead)
            if ahead:
                self._pending = (work, buf, arrival_us)
                unfinished = True
            else:
                unfinished = self._record(buf, arrival_us)
        except LockstepError as e:  # the group's vote intervals differ (_record)
            self.broken = e
            raise
        except (RuntimeError, dist.DistError) as e:
            self.broken = self._error(e, time.perf_counter() - start)
            raise self.broken from e
        finally:
            self.allreduce_time_s += time.perf_counter() - start
        self._pass = self._pass + 1 if unfinished else 0  # no work anywhere: every rank leaves the wave
        return bool(unfinished)

    def _finish_pending(self) -> None:
        if self._pending is not None:
            work, buf, _ = self._pending
            self._pending = None
            start = time.perf_counter()
            work.wait()  # raises on the group's timeout
            # Blocked here only while a peer has not voted yet: that is this vote's wait.
            self.allreduce_wait_s += time.perf_counter() - start
            self._record(buf, None)

    def _record(self, buf: torch.Tensor, arrival_us: int | None) -> int:
        unfinished, last_arrival_us, regroup, most, minus_least = buf.tolist()
        if most != -minus_least:
            g = self.groups
            raise VoteIntervalMismatch(
                f"DP rank {g.rank} of {g.world_size}: the ranks vote every {-minus_least} to {most} steps, "
                f"this one every {self.interval}; start every rank with the same dp_vote_interval")
        self._regroup_agreed = self._regroup_agreed or bool(regroup)
        if arrival_us is not None:  # a blocking vote waited until the last rank arrived
            self.allreduce_wait_s += (last_arrival_us - arrival_us) / 1e6
        self.num_votes += 1
        return unfinished

    def _error(self, cause: Exception, waited_s: float) -> LockstepError:
        g = self.groups
        peers = [r for r in range(g.world_size) if r != g.rank]
        group = "CPU (Gloo)" if self.use_cpu_group else f"device ({g.device.type})"
        return LockstepError(
            f"DP rank {g.rank} of {g.world_size}: the lockstep vote (all_reduce MAX over the {group} "
            f"group from {g.origin}) failed after {waited_s:.1f}s, collective timeout {g.timeout_s:.0f}s: "
            f"peer rank(s) {peers} died or stopped calling step(). The group cannot be reused; "
            f"re-form it on a fresh store. Cause: {str(cause).splitlines()[0] if str(cause) else cause!r}")

    def close(self) -> None:
        """Waits for a vote still in flight (only a loop left by an exception has one), so
        no collective outlives the group; the owner destroys the group after this."""
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending[0].wait()
            except (RuntimeError, dist.DistError):
                pass  # the group is broken anyway; it is being torn down

    def stats(self) -> dict:
        return {"lockstep_votes": self.num_votes, "passes_without_vote": self.passes_without_vote,
                "dp_vote_interval": self.interval, "allreduce_time_s": self.allreduce_time_s,
                "allreduce_wait_s": self.allreduce_wait_s,
                "allreduce_collective_s": self.allreduce_time_s - self.allreduce_wait_s}
