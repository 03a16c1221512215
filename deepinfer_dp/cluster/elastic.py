"""Elastic data/expert parallelism: the router grows or shrinks the DP group while it serves.

Growing from N to M ranks: the launcher starts ranks N..M-1 (the warm spare first), each loads
the model and serves with no group; they join the membership and every rank gets a Reform at
size M, the same machinery that takes a restarted rank back: idle ranks join at once, ranks in
a wave leave it after a step they all agree on (the lockstep's regroup flag) with their
requests intact. With expert parallelism each rank then holds its share of the experts for
size M (LLMEngine.join_dp_group -> bind_ep_group moves them over the group:
models/expert_regroup.py). The
router sends to the new ranks as soon as they are members.

Shrinking from N to M: ranks M..N-1 stop getting new requests and keep stepping with the
group while their requests finish, up to the drain timeout. What is left is moved by
recompute to the staying ranks (cluster/migration.py: the delivered tokens join the prompt;
nothing lost, nothing streamed twice); the leaving ranks are told to shut down, the others
re-form at size M, and the launcher stops the leaving processes.

A change answers once every member reported joining the new group (Reformed). One change at a
time; a size the model's experts cannot be spread over, or below one, is refused before
anything moves.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)
POLL_S = 0.05


class ScaleError(Exception):
    """A scale that did not happen: `status` 400 (a bad size), 409 (a change is already in
    progress) or 503 (it failed; the group is as it was, or being restored by the health check)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class ElasticScaler:
    """The router's side of scaling. `router` is the Router (its membership, request table and
    lock); the membership's liveness (RouterActor) starts and stops rank processes."""

    def __init__(self, router: Any, lock: threading.RLock, collective_timeout_s: float) -> None:
        self._router, self._lock = router, lock
        self._busy = threading.Lock()  # one change at a time
        self.scaling = False
        self.events = {"up": 0, "down": 0, "failed": 0}
        self.max_size: int | None = None  # the routed experts under expert parallelism (the launcher's)
        # joining a group waits up to the collective timeout for every peer, then some slack
        self.reform_timeout_s = 2 * collective_timeout_s + 10.0

    def state(self) -> dict[str, Any]:
        return {"group_size": self._router.membership.size(), "scaling": self.scaling,
                "scale_events": dict(self.events)}

    # ---- one change ------------------------------------------------------------------------
    def begin(self, new_size: int) -> None:
        """Claims the one change and checks the size (ScaleError 400/409/503); run() follows."""
        if not self._busy.acquire(blocking=False):
            raise ScaleError(409, "a change of the DP group's size is already in progress")
        try:
            self._check(new_size)
        except BaseException:
            self._busy.release()
            raise
        self.scaling = True

    def run(self, new_size: int, drain_timeout_s: float) -> dict[str, Any]:
        """The change begin() claimed; what it did ({"old_size", "new_size", "seconds",
        "migrated"}), or ScaleError 503."""
        started, membership = time.monotonic(), self._router.membership
        old_size, migrated = membership.size(), self._router.log.migrated
        try:
            if new_size > old_size:
                self._grow(new_size)
            elif new_size < old_size:
                self._shrink(new_size, drain_timeout_s)
        except ScaleError:
            self.events["failed"] += 1
            raise
        except Exception as e:
            self.events["failed"] += 1
            logger.exception("scaling the DP group from %d to %d failed", old_size, new_size)
            raise ScaleError(503, f"scaling the DP group from {old_size} to {new_size} ranks failed: "
                                  f"{type(e).__name__}: {e}") from e
        finally:
            self.scaling = False
            self._busy.release()
        if new_size != old_size:
            self.events["up" if new_size > old_size else "down"] += 1
        done = {"old_size": old_size, "new_size": new_size, "seconds": round(time.monotonic() - started, 3),
                "migrated": self._router.log.migrated - migrated}
        logger.warning("the DP group scaled: %s", done)
        return done

    def _check(self, new_size: int) -> None:
        if isinstance(new_size, bool) or not isinstance(new_size, int) or new_size < 1:
            raise ScaleError(400, f"new_data_parallel_size must be an integer of at least 1, got {new_size!r}")
        if self.max_size is not None and new_size > self.max_size:
            raise ScaleError(400, f"new_data_parallel_size {new_size}: expert parallelism spreads the model's "
                                  f"{self.max_size} routed experts over the ranks, so at most {self.max_size}")
        membership = self._router.membership
        if membership.liveness is None:
            raise ScaleError(400, "this router has no launcher to start or stop ranks with")
        with self._lock:
            down = [r for r in membership.ranks if not r.up and not r.removed]
        if down:
            raise ScaleError(503, f"DP rank {down[0].dp_rank} is down ({down[0].down_reason}); the group "
                                  "can change size once every rank is up")

    # ---- growing ---------------------------------------------------------------------------
    def _grow(self, new_size: int) -> None:
        membership = self._router.membership
        old_size = membership.size()
        # the holes ranks lost for good left (rank_loss: shrink) are filled first
        holes = [r.dp_rank for r in membership.ranks if r.removed][:new_size - old_size]
        first, end = len(membership.ranks), len(membership.ranks) + new_size - old_size - len(holes)
        try:  # nothing changed yet if this fails: the launcher stopped what it had started
            refills = [(i, membership.liveness.restart(i)) for i in holes]
            addresses = membership.liveness.start_ranks(list(range(first, end)), new_size) if end > first else []
        except Exception as e:
            raise ScaleError(503, f"starting DP ranks {holes + list(range(first, end))} failed, the group stays "
                                  f"at {old_size}: {type(e).__name__}: {e}") from e
        for i, address in refills:
            membership.refill(i, address)
        membership.add_ranks(addresses)
        self._await(membership.reform(), new_size)

    # ---- shrinking -------------------------------------------------------------------------
    def _shrink(self, new_size: int, drain_timeout_s: float) -> None:
        router, membership = self._router, self._router.membership
        with self._lock:
            leaving = [r for r in membership.ranks if not r.removed][new_size:]
            cut = leaving[0].dp_rank  # the ranks from here on leave (holes included)
            for r in leaving:
                r.leaving = True
        deadline = time.monotonic() + max(0.0, drain_timeout_s)
        while time.monotonic() < deadline and self._inflight(leaving):
            time.sleep(POLL_S)
        with self._lock:
            moves = [router.take_off(rid) for r in leaving for rid in sorted(r.inflight)]
            membership.remove_ranks(cut)
            wave = membership.reform()  # before the moved requests: a staying rank joins, then takes them
            staying = membership.accepting()
            for msg in moves:
                if msg is not None:
                    load = {r.dp_rank: len(r.inflight) for r in staying}
                    router.send_to(membership.ranks[router.policy.choose(msg.prompt_token_ids, load)], msg)
        if moves:
            logger.warning("moved %d request(s) of the leaving DP rank(s) by recompute", len(moves))
        membership.liveness.stop_ranks(cut)
        self._await(wave, new_size)

    def _inflight(self, ranks: list) -> int:
        with self._lock:
            return sum(len(r.inflight) for r in ranks)

    def _await(self, wave: int, size: int) -> None:
        """Until every member reported joining the group of `wave` (Reformed)."""
        deadline = time.monotonic() + self.reform_timeout_s
        while True:
            with self._lock:
                missing = [r.dp_rank for r in self._router.membership.ranks if r.group_wave < wave and not r.removed]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise ScaleError(503, f"DP rank(s) {missing} did not join the group of {size} within "
                                      f"{self.reform_timeout_s:.0f}s; the health check restores the group")
            time.sleep(POLL_S)
