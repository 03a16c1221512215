"""A lost rank that nothing replaces (router.rank_loss: shrink), in the router against fake
ranks (tests/router_utils.py), no Ray: the survivors re-form at N-1 and the lost rank's
requests continue on them by recompute (the delivered tokens join the prompt; none fails,
none is streamed twice); a survivor's requests that a lost MoE step took down move too; a
lost middle rank leaves a hole that the next scale-up fills; restart mode is unchanged."""

from __future__ import annotations

import queue
import time

from test_router import PARAMS, _outcome, cluster

from deepinfer_dp.cluster import protocol as p
from deepinfer_dp.engine.client import RankFailed, TokenDelta
from deepinfer_dp.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=4)


def _next_add(rank, request_id: str) -> p.AddRequest:
    msg = rank.next_message(p.AddRequest)
    while msg.request_id != request_id:
        msg = rank.next_message(p.AddRequest)
    return msg


def test_a_lost_rank_shrinks_the_group_and_its_request_moves_by_recompute():
    with cluster(2, rank_loss="shrink") as (router, ranks, liveness, new_client):
        ranks[1].hold = True
        client = new_client()
        got = {rid: queue.Queue() for rid in ("a", "b")}
        for rid, q in got.items():
            client.submit(rid, [5, 6, 7], GREEDY, q.put)
        _outcome(got["a"])  # rank 0 answered its own at once
        ranks[1].next_message(p.AddRequest)
        ranks[1].send(p.Deltas(1, [TokenDelta("b", [41, 42], prompt_len=3, output_len=2, dp_rank=1)]))
        assert got["b"].get(timeout=10).token_ids == [41, 42]
        liveness.dead.add(1)
        reform = ranks[0].next_message(p.Reform)
        assert (reform.group_rank, reform.world_size) == (0, 1)
        moved = _next_add(ranks[0], "b")  # after the Reform: it runs in the new group
        assert moved.prompt_token_ids == [5, 6, 7, 41, 42]
        assert (moved.params["max_tokens"], moved.params["min_tokens"]) == (4, 2)
        deltas, last = _outcome(got["b"])
        assert not isinstance(last, Exception), last
        assert [t for d in (*deltas, last) for t in d.token_ids] == [100, 100, 100]  # rank 0's, after 41, 42
        assert (last.prompt_len, last.output_len) == (0, 2)  # the fake sends none; shifted back by 2
        assert [h["dp_rank"] for h in client.health()] == [0]  # the group is 1 rank now, not 1 of 2 down
        assert router.elastic.state()["group_size"] == 1 and router.loss.moved == 1
        assert liveness.stopped_from == 1 and liveness.killed == [1]
        time.sleep(0.5)  # health checks went by: nothing restarts it
        assert liveness.restarted == [] and len(router.membership.ranks) == 1


def test_requests_a_lost_moe_step_took_down_move_instead_of_failing():
    with cluster(2, rank_loss="shrink") as (router, ranks, liveness, new_client):
        for r in ranks:
            r.hold = True
        client = new_client()
        got = {rid: queue.Queue() for rid in ("a", "b")}
        for rid, q in got.items():
            client.submit(rid, [5, 6], GREEDY, q.put)
        ranks[0].next_message(p.AddRequest)
        ranks[0].send(p.Deltas(0, [TokenDelta("a", [31], prompt_len=2, output_len=1, dp_rank=0)]))
        assert got["a"].get(timeout=10).token_ids == [31]
        ranks[0].hold = False
        # rank 1 dies inside a MoE layer: rank 0's step is lost with it, and rank 0 aborted "a"
        ranks[0].send(p.GroupBroken(0, 0, "the MoE all-to-all of layer 0 failed", ["a"]))
        liveness.dead.add(1)
        assert ranks[0].next_message(p.Reform).world_size == 1
        assert _next_add(ranks[0], "a").prompt_token_ids == [5, 6, 31]
        assert _next_add(ranks[0], "b").prompt_token_ids == [5, 6]
        for rid in ("a", "b"):
            _, last = _outcome(got[rid])
            assert not isinstance(last, Exception) and last.finish_reason == "length", last
        assert router.loss.moved == 2


def test_a_lost_middle_rank_leaves_a_hole_that_growing_fills():
    with cluster(3, rank_loss="shrink") as (router, ranks, liveness, new_client):
        liveness.backend = router.backend_address
        liveness.restart_gate.set()
        client = new_client()
        liveness.dead.add(1)
        reforms = [ranks[i].next_message(p.Reform) for i in (0, 2)]
        assert [(m.group_rank, m.world_size) for m in reforms] == [(0, 2), (1, 2)]
        assert [h["dp_rank"] for h in client.health()] == [0, 2]
        got = {f"r{i}": queue.Queue() for i in range(4)}
        for rid, q in got.items():
            client.submit(rid, [1], PARAMS, q.put)
        assert {_outcome(q)[1].dp_rank for q in got.values()} == {0, 2}
        done = router.scale(3, drain_timeout_s=0)  # the hole is filled first
        assert (done["old_size"], done["new_size"]) == (2, 3)
        back = liveness.restarted[0]
        assert back.dp_rank == 1 and back.next_message(p.Reform).world_size == 3
        assert [h["dp_rank"] for h in client.health()] == [0, 1, 2]
        shrunk = router.scale(2, drain_timeout_s=0)
        assert shrunk["new_size"] == 2 and liveness.stopped_from == 2


def test_restart_mode_still_fails_the_lost_ranks_requests():
    with cluster(2) as (router, ranks, liveness, new_client):
        ranks[1].hold = True
        client = new_client()
        got = {rid: queue.Queue() for rid in ("a", "b")}
        for rid, q in got.items():
            client.submit(rid, [5, 6], PARAMS, q.put)
        ranks[1].next_message(p.AddRequest)
        liveness.dead.add(1)
        _, error = _outcome(got["b"])
        assert isinstance(error, RankFailed) and router.loss is None
        assert [h["up"] for h in client.health()] == [True, False]
