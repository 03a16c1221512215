"""Elastic scaling in the router without Ray or engines (a real Router against fake ranks,
tests/router_utils.py): growing takes new ranks in with a Reform at the new size and routes
to them; shrinking with no drain time moves a leaving rank's request to a staying rank by
recompute (the delivered tokens join the prompt, the limits shrink by as many, the old rank's
late tokens never reach the client); bad sizes and a second change at once are refused. The
recompute bookkeeping (cluster/migration.py) on its own, too."""

from __future__ import annotations

import queue
import threading
import time

import pytest
from test_router import PARAMS, _outcome, cluster

from deepinfer_dp.cluster import protocol as p
from deepinfer_dp.cluster.elastic import ScaleError
from deepinfer_dp.cluster.migration import RequestLog
from deepinfer_dp.engine.client import RankFailed, TokenDelta
from deepinfer_dp.sampling_params import SamplingParams


def test_growing_reforms_at_the_new_size_and_routes_to_the_new_rank():
    with cluster(2) as (router, ranks, liveness, new_client):
        done = router.scale(3, drain_timeout_s=0)
        assert (done["old_size"], done["new_size"], done["migrated"]) == (2, 3, 0)
        new = liveness.restarted[0]
        reforms = [r.next_message(p.Reform) for r in (*ranks, new)]
        assert [(m.group_rank, m.world_size) for m in reforms] == [(0, 3), (1, 3), (2, 3)]
        assert len({m.wave for m in reforms}) == 1
        client = new_client()
        got = {f"g{i}": queue.Queue() for i in range(3)}
        for rid, q in got.items():
            client.submit(rid, [5, 6], PARAMS, q.put)
        assert sorted(_outcome(q)[1].dp_rank for q in got.values()) == [0, 1, 2]
        assert router.elastic.state() == {"group_size": 3, "scaling": False,
                                          "scale_events": {"up": 1, "down": 0, "failed": 0}}
        new.close()


def test_shrinking_without_drain_moves_the_request_by_recompute():
    with cluster(2) as (router, ranks, liveness, new_client):
        ranks[1].hold = True
        client = new_client()
        got = {rid: queue.Queue() for rid in ("a", "b")}
        for rid, q in got.items():
            client.submit(rid, [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=6, min_tokens=4), q.put)
        _outcome(got["a"])  # rank 0 answered its own at once
        ranks[1].next_message(p.AddRequest)
        ranks[1].send(p.Deltas(1, [TokenDelta("b", [41, 42], prompt_len=3, output_len=2, dp_rank=1)]))
        assert got["b"].get(timeout=10).token_ids == [41, 42]
        done = router.scale(1, drain_timeout_s=0)
        assert (done["new_size"], done["migrated"]) == (1, 1)
        ranks[1].next_message(p.Shutdown)
        ranks[1].send(p.Deltas(1, [TokenDelta("b", [43], dp_rank=1)]))  # too late: dropped
        moved = ranks[0].next_message(p.AddRequest)
        while moved.request_id != "b":
            moved = ranks[0].next_message(p.AddRequest)
        assert moved.prompt_token_ids == [5, 6, 7, 41, 42]
        assert (moved.params["max_tokens"], moved.params["min_tokens"]) == (4, 2)
        deltas, last = _outcome(got["b"])
        assert [t for d in (*deltas, last) for t in d.token_ids] == [100, 100, 100]  # rank 0's, after 41, 42
        assert (last.prompt_len, last.output_len) == (0, 2)  # the fake sends none; shifted back by 2
        assert liveness.stopped_from == 1 and len(router.membership.ranks) == 1


def test_a_draining_rank_gets_no_new_requests_and_finishes_its_own():
    with cluster(2) as (router, ranks, liveness, new_client):
        ranks[1].hold = True
        client = new_client()
        got = {rid: queue.Queue() for rid in ("a", "b", "c", "d")}
        for rid in ("a", "b"):
            client.submit(rid, [5, 6], PARAMS, got[rid].put)
        ranks[1].next_message(p.AddRequest)
        result: list = []
        shrinking = threading.Thread(target=lambda: result.append(router.scale(1, drain_timeout_s=30)))
        shrinking.start()
        while not router.membership.ranks[1].leaving:
            time.sleep(0.01)
        for rid in ("c", "d"):  # round robin would give rank 1 one of them
            client.submit(rid, [5, 6], PARAMS, got[rid].put)
        assert [_outcome(got[rid])[1].dp_rank for rid in ("c", "d")] == [0, 0]
        assert shrinking.is_alive()  # still draining: rank 1 has "b"
        ranks[1].send(p.Deltas(1, [TokenDelta("b", [9], True, "length", dp_rank=1)]))
        shrinking.join(10)
        assert result[0]["migrated"] == 0 and _outcome(got["b"])[1].token_ids == [9]


def test_a_request_with_every_token_delivered_finishes_instead_of_moving():
    with cluster(2) as (router, ranks, liveness, new_client):
        ranks[1].hold = True
        client = new_client()
        got = {rid: queue.Queue() for rid in ("a", "b")}
        for rid, q in got.items():
            client.submit(rid, [5, 6], PARAMS, q.put)  # max_tokens 3
        ranks[1].next_message(p.AddRequest)
        ranks[1].send(p.Deltas(1, [TokenDelta("b", [1, 2, 3], dp_rank=1)]))
        assert got["b"].get(timeout=10).token_ids == [1, 2, 3]
        assert router.scale(1, drain_timeout_s=0)["migrated"] == 0
        _, last = _outcome(got["b"])
        assert (last.token_ids, last.finish_reason) == ([], "length")


def test_a_request_that_cannot_move_fails_with_the_reason():
    with cluster(2) as (router, ranks, liveness, new_client):
        ranks[1].hold = True
        client = new_client()
        got = {rid: queue.Queue() for rid in ("a", "b")}
        params = SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=0)
        for rid, q in got.items():
            client.submit(rid, [5, 6, 7], params, q.put)
        ranks[1].next_message(p.AddRequest)
        router.scale(1, drain_timeout_s=0)
        _, error = _outcome(got["b"])
        assert isinstance(error, RankFailed) and "prompt logprobs" in str(error)


def test_bad_sizes_and_a_second_change_are_refused():
    with cluster(2) as (router, _, liveness, _new_client):
        for bad in (0, -1, 2.5, True):
            with pytest.raises(ScaleError) as e:
                router.scale(bad, 0)
            assert e.value.status == 400 and "new_data_parallel_size" in str(e.value)
        router.elastic.max_size = 2  # the model's experts, under expert parallelism
        with pytest.raises(ScaleError, match="at most 2") as e:
            router.scale(3, 0)
        assert e.value.status == 400
        router.elastic.max_size = None
        gate, entered = threading.Event(), threading.Event()
        start = liveness.start_ranks

        def slow_start(dp_ranks, world_size):
            entered.set()
            gate.wait(10)
            return start(dp_ranks, world_size)

        liveness.start_ranks = slow_start
        growing = threading.Thread(target=router.scale, args=(3, 0))
        growing.start()
        assert entered.wait(10) and router.elastic.state()["scaling"]
        with pytest.raises(ScaleError) as e:
            router.scale(1, 0)
        assert e.value.status == 409
        gate.set()
        growing.join(10)
        liveness.restart_error = RuntimeError("no room for a rank")
        with pytest.raises(ScaleError, match="no room for a rank") as e:
            router.scale(4, 0)
        assert e.value.status == 503 and len(router.membership.ranks) == 3
        assert router.elastic.state()["scale_events"] == {"up": 1, "down": 0, "failed": 1}
        for rank in liveness.restarted:
            rank.close()


def test_recompute_bookkeeping_over_two_moves():
    log = RequestLog()
    params = {"max_tokens": 10, "min_tokens": 5, "prompt_logprobs": None, "structured_outputs": None}
    log.add(p.AddRequest("r", [1, 2], params, "c"))
    log.delivered(TokenDelta("r", [3, 4], prompt_len=2, output_len=2))
    first = log.resubmission("r")
    assert (first.prompt_token_ids, first.params["max_tokens"], first.params["min_tokens"]) == ([1, 2, 3, 4], 8, 3)
    shown = log.delivered(TokenDelta("r", [5], prompt_len=4, output_len=1))
    assert (shown.prompt_len, shown.output_len) == (2, 3)
    second = log.resubmission("r")
    assert (second.prompt_token_ids, second.params["max_tokens"], second.params["min_tokens"]) == \
        ([1, 2, 3, 4, 5], 7, 2)
    assert log.migrated == 2
    log.add(p.AddRequest("g", [1], {**params, "structured_outputs": {"regex": "a+"}}, "c"))
    with pytest.raises(ValueError, match="structured-output"):
        log.resubmission("g")
