"""The lockstep vote on its own: a dead or stuck peer makes it raise a clear LockstepError
within the collective timeout instead of hanging."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest


def _vote_then_fail(rank: int, port: int, mode: str, out, release) -> None:
    import torch

    from deepinfer_dp.distributed import Lockstep, LockstepError, init_dp_groups

    lockstep = Lockstep(init_dp_groups(rank, 2, "127.0.0.1", port, torch.device("cpu"), timeout_s=5))
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


@pytest.mark.parametrize("mode", ["die", "stuck"])
def test_dead_or_stuck_peer_makes_the_vote_raise(mode):
    from deepinfer_dp.distributed.groups import serve_store

    store = serve_store()
    ctx = mp.get_context("spawn")
    out, release = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_vote_then_fail, args=(r, store.port, mode, out, release)) for r in range(2)]
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


def _vote_until_regroup(rank: int, port: int, asks_at: int, ahead: bool, out) -> None:
    import torch

    from deepinfer_dp.distributed import Lockstep, RegroupRequested, init_dp_groups

    lockstep = Lockstep(init_dp_groups(rank, 2, "127.0.0.1", port, torch.device("cpu"), timeout_s=30))
    for step in range(1000):
        if step == asks_at:
            lockstep.request_regroup()
        try:
            lockstep.vote(ahead)  # a rank with work votes ahead (async); one without waits
        except RegroupRequested:
            out.put((rank, step, lockstep.num_votes))
            return
    out.put((rank, "never", lockstep.num_votes))


@pytest.mark.parametrize("asker", [0, 1])
def test_regroup_leaves_every_rank_after_the_same_vote(asker):
    """One rank is told to move to a new group at its 5th pass; rank 0 votes ahead (it has
    work), rank 1 waits for each result: both leave at the same pass, with the same votes."""
    from deepinfer_dp.distributed.groups import serve_store

    store = serve_store()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_vote_until_regroup, args=(r, store.port, 5 if r == asker else -1, r == 0, out))
             for r in range(2)]
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
