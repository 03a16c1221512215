"""Membership of a DP group that cannot re-form: the hybrid and external load-balancing modes
(cluster/lb_node.py, docs/lb_modes.md), whose ranks belong to servers started separately.

Internal mode's router re-forms the survivors of a failure and restarts the dead rank
(cluster/membership.py); here no server can, since the missing members are another server's
processes. So a dead local rank, or a failed lockstep vote (a rank of another server died or
hung), breaks this server for good: every local rank is marked down, their requests fail with
the cause (a 503 that says the group broke), nobody is woken any more, and `on_broken` tells
the server to stop with status 1, so that its supervisor restarts it.
"""

from __future__ import annotations

from collections.abc import Callable

from deepinfer_dp.cluster.membership import Membership


class FixedGroupMembership(Membership):
    """Membership whose health check never re-forms nor restarts (see the module's docstring)."""

    can_reform = False  # so rank_loss: shrink has nothing to shrink to
    on_broken: Callable[[str], None] | None = None
    broken = ""

    def check(self) -> None:
        if self.liveness is None:
            return
        with self._lock:
            if self._closed or self.broken:
                return
            local = [r.dp_rank for r in self.ranks if r.local and r.up]
        dead = [i for i in local if not self.liveness.alive(i)]
        with self._lock:
            if not dead and self._broken_since is None:
                return
            why = (f"DP rank(s) {dead} of this server died" if dead else
                   f"a lockstep vote failed on DP rank(s) {sorted(self._broken_ranks)} (a rank of another "
                   f"server died or stopped answering)")
            self.broken = (f"the DP group broke: {why}; a group of separately started servers cannot re-form "
                           f"without its members, so this server stops (restart every server of the group)")
            for r in self.ranks:
                if r.local:
                    self.mark_down(r.dp_rank, self.broken)
                r.up = False  # nobody is woken any more
        if self.on_broken is not None:
            self.on_broken(self.broken)
