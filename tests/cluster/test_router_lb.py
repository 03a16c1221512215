"""The router's side of pinning a request to a rank (vLLM's data_parallel_rank) and of the
hybrid and external load-balancing modes, where a router serves only its local ranks and only
wakes the others: a real Router and RouterClient against fake ranks (tests/router_utils.py)."""

from __future__ import annotations

import contextlib
import queue
import threading

import pytest
from router_utils import FakeLiveness, FakeRank

from deepinfer_dp.cluster import protocol as p
from deepinfer_dp.cluster.fixed_group import FixedGroupMembership
from deepinfer_dp.cluster.policies import RoundRobin
from deepinfer_dp.cluster.router import Router
from deepinfer_dp.cluster.router_client import RouterClient
from deepinfer_dp.config_file import RouterSection
from deepinfer_dp.engine.client import NoCapacity, RankFailed, RequestRejected
from deepinfer_dp.engine.input_processor import InputProcessor
from deepinfer_dp.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=3)


@contextlib.contextmanager
def cluster(num_ranks: int, local: range | None = None, fixed_group: bool = False):
    """A router over `num_ranks` fake ranks of which it serves `local` (None: all);
    `fixed_group`: with the hybrid and external modes' membership (the ranks' liveness is then
    FakeLiveness: kill one with `liveness.dead.add(i)`)."""
    extra = {"membership_cls": FixedGroupMembership} if fixed_group else {}
    router = Router(RouterSection(max_rank_restarts=0), RoundRobin(), health_interval_s=0.1, **extra)
    ranks = [FakeRank(i, router.backend_address) for i in range(num_ranks)]
    router.liveness = FakeLiveness() if fixed_group else None
    router.attach_ranks([r.address for r in ranks], router.liveness, local=local)
    router.start()
    served = list(local if local is not None else range(num_ranks))
    client = RouterClient(router.frontend_address, None, "fake", 64, InputProcessor(200, 64), dp_ranks=served)
    try:
        yield router, ranks, client
    finally:
        client.close()
        router.close()
        for r in ranks:
            r.close()


def _final(got: queue.Queue, timeout: float = 10.0):
    while True:
        item = got.get(timeout=timeout)
        if isinstance(item, Exception) or item.finished:
            return item


def test_a_pinned_request_goes_to_its_rank_whatever_the_policy():
    with cluster(3) as (_, _, client):
        outcomes = []
        for i in range(4):
            got = queue.Queue()
            client.submit(f"r{i}", [1, 2], PARAMS, got.put, data_parallel_rank=2)
            outcomes.append(_final(got).dp_rank)
        assert outcomes == [2, 2, 2, 2]


def test_a_rank_that_does_not_exist_or_is_down_is_refused_by_name():
    with cluster(2) as (router, _, client):
        got = queue.Queue()
        client.submit("x", [1], PARAMS, got.put, data_parallel_rank=5)
        error = _final(got)
        assert isinstance(error, RequestRejected) and "data_parallel_rank 5" in str(error)
        router.membership.mark_down(1, "DP rank 1 died")
        got = queue.Queue()
        client.submit("y", [1], PARAMS, got.put, data_parallel_rank=1)
        error = _final(got)
        assert isinstance(error, NoCapacity) and "data_parallel_rank 1" in str(error) and "died" in str(error)


def test_a_router_of_local_ranks_routes_to_them_only_and_wakes_every_rank():
    """Hybrid mode, node 1 of two: ranks 2 and 3 are its own, 0 and 1 another endpoint's."""
    with cluster(4, local=range(2, 4)) as (router, ranks, client):
        finals = []
        for i in range(4):
            got = queue.Queue()
            client.submit(f"r{i}", [1], PARAMS, got.put)
            finals.append(_final(got).dp_rank)
        assert sorted(set(finals)) == [2, 3]
        for remote in ranks[:2]:  # woken for the waves, never sent a request
            assert remote.next_message(p.Wake).wave == 0
        got = queue.Queue()
        client.submit("elsewhere", [1], PARAMS, got.put, data_parallel_rank=0)
        assert isinstance(_final(got), RequestRejected)
        assert [h["dp_rank"] for h in client.health()] == [2, 3]  # /health: its own ranks
        assert [s["dp_rank"] for s in client.query_stats()] == [2, 3]  # /metrics: its own ranks
        router.close()
        for remote in ranks[:2]:  # another endpoint's ranks are not stopped from here
            with pytest.raises(queue.Empty):
                remote.next_message(p.Shutdown, timeout=0.5)
        assert isinstance(ranks[2].next_message(p.Shutdown), p.Shutdown)
        assert all(not isinstance(m, p.AddRequest) for r in ranks[:2] for m in list(r.received.queue))


@pytest.mark.parametrize("cause", ["a remote rank's vote failed", "a local rank died"])
def test_a_fixed_group_that_breaks_fails_its_requests_and_stops_its_server(cause):
    """Hybrid/external membership: no re-form, no restart; the server is told to stop."""
    with cluster(4, local=range(2, 4), fixed_group=True) as (router, ranks, client):
        stopped, told = [], threading.Event()
        router.membership.on_broken = lambda reason: (stopped.append(reason), told.set())
        ranks[2].hold = True  # its request stays in flight
        got = queue.Queue()
        client.submit("r0", [1], PARAMS, got.put)
        ranks[2].next_message(p.AddRequest)
        if cause == "a local rank died":
            router.liveness.dead.add(3)
        else:
            ranks[2].send(p.GroupBroken(2, 0, "the lockstep vote failed: peer rank(s) [0] died"))
        error = _final(got)
        assert isinstance(error, RankFailed) and "the DP group broke" in str(error), error
        assert told.wait(10)  # told after the requests failed, outside the router's lock
        assert len(stopped) == 1 and "cannot re-form" in stopped[0]
        assert not any(r["up"] for r in client.health())
        assert all(not isinstance(m, p.Reform) for r in ranks for m in list(r.received.queue))
        assert router.liveness.killed == []  # the server's stop ends its rank processes
