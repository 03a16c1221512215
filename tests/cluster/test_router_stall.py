"""The router's view of rank progress for /health's stall check (Membership.health's
step_age_s), with a real Router and fake ranks: no age while the group is idle (idle ranks do
not step), an age for every rank that is up while any request is in flight (the lockstep keeps
the whole group in its wave), and a rank's step report (an empty Deltas) restarts its clock."""

from __future__ import annotations

import queue
import time

from router_utils import FakeLiveness, FakeRank

from deepinfer_dp.cluster import protocol as p
from deepinfer_dp.cluster.policies import RoundRobin
from deepinfer_dp.cluster.router import Router
from deepinfer_dp.cluster.router_client import RouterClient
from deepinfer_dp.config_file import RouterSection
from deepinfer_dp.engine.input_processor import InputProcessor
from deepinfer_dp.sampling_params import SamplingParams


def _until(predicate):
    while True:  # no time limit: pytest's
        value = predicate()
        if value:
            return value
        time.sleep(0.02)


def _ages(router: Router) -> list:
    return [r["step_age_s"] for r in router.membership.health()]


def test_step_age_only_while_the_group_has_work():
    router = Router(RouterSection(max_rank_restarts=0), RoundRobin(), health_interval_s=0.1)
    ranks = [FakeRank(i, router.backend_address) for i in range(2)]
    router.attach_ranks([r.address for r in ranks], FakeLiveness())
    router.start()
    client = RouterClient(router.frontend_address, None, "fake", 64, InputProcessor(200, 64))
    try:
        assert _ages(router) == [None, None]
        for r in ranks:
            r.hold = True  # the request stays in flight and its rank reports nothing
        got: queue.Queue = queue.Queue()
        client.submit("held", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3), got.put)
        _until(lambda: all(a is not None for a in _ages(router)))  # both ranks owe steps now
        ranks[1].send(p.Deltas(1, []))  # rank 1 steps (a rank without requests sends empty Deltas)
        _until(lambda: (a := _ages(router))[1] < a[0])  # its clock restarted, rank 0's did not
        client.abort_sync(["held"])
        _until(lambda: _ages(router) == [None, None])  # idle again: nobody is expected to step
    finally:
        client.close()
        router.close()
        for r in ranks:
            r.close()
