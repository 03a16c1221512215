"""Serving through a lost rank that nothing replaces (router.rank_loss: shrink).

The membership drops a dead rank from the group for good and re-forms the survivors at N-1
(cluster/membership.py); with expert parallelism they take over its experts as any re-formed
group does (models/expert_regroup.py: from a survivor that holds a replica, else from the
checkpoint). Its requests are not failed: each moves by recompute, as a leaving rank's do when
the group shrinks on purpose (cluster/migration.py: the tokens the client got join the prompt;
the dead rank's later deltas are never taken, so nothing is streamed twice). So are a
survivor's requests that a MoE step lost with the peer (the rank aborted them, GroupBroken
lists them). They wait here until the survivors have their Reform, then go to them through
the routing policy: a rank reads the Reform first, so a moved request runs in the new group.
"""

from __future__ import annotations

import logging
from typing import Any

from deepinfer_dp.cluster import protocol as p

logger = logging.getLogger(__name__)


class LostRequests:
    """The router's requests of lost ranks, moving to the survivors (under the router's lock)."""

    def __init__(self, router: Any) -> None:
        self._router = router
        self._parked: list[p.AddRequest] = []
        self.moved = 0  # requests of lost ranks (or lost steps) continued on another rank

    def move(self, request_ids: list[str], now: bool) -> None:
        """Takes `request_ids` off their (lost) rank; they go to a survivor at the next re-form,
        or at once when `now` (the group already re-formed since they were lost)."""
        router = self._router
        if not router.membership.accepting():
            for rid in request_ids:
                router.fail_request(rid, "no_capacity", f"request {rid}: its DP rank was lost and no rank is "
                                                        "left to continue it")
            return
        for rid in request_ids:
            moved = router.take_off(rid)
            if moved is not None:
                self._parked.append(moved)
        if now:
            self.dispatch()

    def dispatch(self) -> None:
        """Sends the parked requests to the ranks accepting work (the membership calls it once
        a re-form's Reforms went out)."""
        router = self._router
        parked, self._parked = self._parked, []
        staying = router.membership.accepting()
        for msg in parked:
            if not staying:
                router.fail_request(msg.request_id, "no_capacity", f"request {msg.request_id}: its DP rank was "
                                                                   "lost and no rank is left to continue it")
                continue
            load = {r.dp_rank: len(r.inflight) for r in staying}
            router.send_to(router.membership.ranks[router.policy.choose(msg.prompt_token_ids, load)], msg)
            self.moved += 1
        if parked:
            logger.warning("moved %d request(s) of a lost DP rank to the survivors by recompute", len(parked))
