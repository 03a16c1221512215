"""The stats RPC: a client's StatsQuery fans out to every rank that is up; the StatsReply
(one dict per rank, in rank order, a rank that is down or did not answer in time described by
its health entry) goes back once all answered or the timeout passed. Nothing blocks: the
router's loop calls ready() on every turn."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from deepinfer_dp.cluster import protocol as p

DEFAULT_TIMEOUT_S = 10.0


@dataclass
class _Query:
    client_id: str
    client_query_id: int
    waiting_for: set[int]
    deadline: float
    got: dict[int, dict] = field(default_factory=dict)


class StatsQueries:
    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._queries: dict[int, _Query] = {}
        self._ids = itertools.count()

    def start(self, client_id: str, query_id: int, ranks: list) -> None:
        """Asks every rank in `ranks` (those that are up) for its stats."""
        qid = next(self._ids)
        self._queries[qid] = _Query(client_id, query_id, {r.dp_rank for r in ranks},
                                    time.monotonic() + self.timeout_s)
        for r in ranks:
            r.send(p.StatsQuery(qid))

    def on_stats(self, msg: p.Stats) -> None:
        query = self._queries.get(msg.query_id)
        if query is not None:
            query.got[msg.dp_rank] = {"up": True, **msg.stats}
            query.waiting_for.discard(msg.dp_rank)

    def ready(self, health: list[dict], router: dict[str, int]) -> list[tuple[str, p.StatsReply]]:
        """(client, reply) for every query complete or past its deadline; `router`: the
        router's own counters, sent along."""
        now, done = time.monotonic(), []
        for qid, q in list(self._queries.items()):
            if q.waiting_for and now < q.deadline:
                continue
            del self._queries[qid]
            stats = [q.got.get(h["dp_rank"], {"dp_rank": h["dp_rank"], "up": h["up"], "down_reason": h["reason"]})
                     for h in health]
            done.append((q.client_id, p.StatsReply(q.client_query_id, stats, router)))
        return done
