"""The lockstep vote on its own: a dead or stuck peer makes it raise a clear LockstepError
within the collective timeout instead of hanging."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest


def _vote_then_fail(rank: int, port: int, mode: str, out, release, interval: int = 1) -> None:
    import torch

    from deepinfer_dp.distributed import Lockstep, LockstepError, init_dp_groups

    lockstep = Lockstep(init_dp_groups(rank, 2, "127.0.0.1", port, torch.device("cpu"), timeout_s=5),
                        interval=interval)
    for i in range(1000):
        if rank == 1 and i == 3:
            if mode == "die":
                os._exit(1)
            release.wait(120)  # stuck: alive, but never votes again
            os._exit(0)
        try:
            lockstep.vote(rank == 0)
        except LockstepError as e:
            out.put(str(e))
            return
    out.put("no error")


@pytest.mark.parametrize(("mode", "interval"), [("die", 1), ("stuck", 1), ("die", 4)])
def test_dead_or_stuck_peer_makes_the_vote_raise(mode, interval):
    """Voting every 4 passes, the dead peer is noticed at the next voting pass."""
    from deepinfer_dp.distributed.groups import serve_store

    store = serve_store()
    ctx = mp.get_context("spawn")
    out, release = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_vote_then_fail, args=(r, store.port, mode, out, release, interval))
             for r in range(2)]
    for proc in procs:
        proc.start()
    try:
        message = out.get(timeout=120)
    finally:
        release.set()
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    assert "DP rank 0 of 2" in message and "peer rank(s) [1]" in message
    assert "collective timeout 5s" in message and "re-form" in message


def _vote_until_regroup(rank: int, port: int, asks_at: int, ahead: bool, out, interval: int = 1) -> None:
    import torch

    from deepinfer_dp.distributed import Lockstep, RegroupRequested, init_dp_groups

    lockstep = Lockstep(init_dp_groups(rank, 2, "127.0.0.1", port, torch.device("cpu"), timeout_s=30),
                        interval=interval)
    for step in range(1000):
        if step == asks_at:
            lockstep.request_regroup()
        try:
            lockstep.vote(ahead)  # a rank with work votes ahead (async); one without waits
        except RegroupRequested:
            out.put((rank, step, lockstep.num_votes))
            return
    out.put((rank, "never", lockstep.num_votes))


@pytest.mark.parametrize(("asker", "interval"), [(0, 1), (1, 1), (0, 4), (1, 4)])
def test_regroup_leaves_every_rank_after_the_same_vote(asker, interval):
    """One rank is told to move to a new group at its 5th pass; rank 0 votes ahead (it has
    work), rank 1 waits for each result: both leave at the same pass, with the same votes.
    Voting every 4 passes, the flag rides the vote of pass 8 and both leave at pass 12."""
    from deepinfer_dp.distributed.groups import serve_store

    store = serve_store()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_vote_until_regroup,
                         args=(r, store.port, 5 if r == asker else -1, r == 0, out, interval)) for r in range(2)]
    for proc in procs:
        proc.start()
    try:
        left = sorted(out.get(timeout=120) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    (_, step0, votes0), (_, step1, votes1) = left
    assert step0 == step1 != "never" and votes0 == votes1
    if interval > 1:
        assert (step0, votes0) == (12, 3)


def _waves(rank: int, port: int, interval: int, work: list[list[int]], out) -> None:
    """Wave after wave, rank r has work on the first work[wave][r] passes; per wave, the
    passes until the vote said nobody has work."""
    import torch

    from deepinfer_dp.distributed import Lockstep, LockstepError, init_dp_groups

    lockstep = Lockstep(init_dp_groups(rank, 2, "127.0.0.1", port, torch.device("cpu"), timeout_s=30),
                        interval=interval)
    passes = []
    try:
        for wave in work:
            n = 0
            while lockstep.vote(n < wave[rank]):
                n += 1
            passes.append(n)
    except LockstepError as e:
        out.put((rank, type(e).__name__, str(e)))
        return
    out.put((rank, passes, lockstep.stats()))


def _run_waves(intervals: tuple[int, int], work: list[list[int]]) -> list[tuple]:
    from deepinfer_dp.distributed.groups import serve_store

    store = serve_store()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_waves, args=(r, store.port, intervals[r], work, out)) for r in range(2)]
    for proc in procs:
        proc.start()
    try:
        return sorted(out.get(timeout=120) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()


def test_vote_every_fourth_pass():
    """Wave 0: rank 0 has work for 10 passes, rank 1 none; wave 1 (the group idle in between):
    rank 1 has work for 3. Voting every 4 passes both ranks step 12 passes, then 4: up to 3
    past the last work, the same on both, and only the voting passes reach the collective."""
    (_, passes0, stats0), (_, passes1, stats1) = _run_waves((4, 4), [[10, 0], [0, 3]])
    assert passes0 == passes1 == [12, 4]
    assert stats0["lockstep_votes"] == stats1["lockstep_votes"] == (12 // 4 + 1) + (4 // 4 + 1)
    assert stats0["passes_without_vote"] == stats1["passes_without_vote"] == (12 + 1 + 4 + 1) - 6


def test_ranks_with_different_intervals_refuse_to_go_on():
    (rank0, kind0, message0), (rank1, kind1, message1) = _run_waves((1, 4), [[0, 0]])
    assert kind0 == kind1 == "VoteIntervalMismatch"
    assert "DP rank 0 of 2: the ranks vote every 1 to 4 steps, this one every 1" in message0
    assert "this one every 4; start every rank with the same dp_vote_interval" in message1
