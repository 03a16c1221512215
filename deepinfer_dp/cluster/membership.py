"""Membership: which DP ranks are in the group, and what happens when one fails or returns.

The router's health thread calls check() about once a second (and at once when a rank
reports a failed vote). A rank the launcher says is dead is killed for good and marked down:
its in-flight requests fail with RankFailed (through `on_down`), and the survivors re-form a
fresh DP group on a new TCPStore served here (a Gloo group cannot be rejoined). A rank that is
alive but stopped voting (frozen) is found because its peers report GroupBroken and it does
not, for twice the collective timeout.

A dead rank comes back (up to `max_restarts` times per rank): once it is marked down and the
survivors re-formed, a thread asks the launcher for a new process (Liveness.restart: it loads
the model and serves with no group) and then calls rank_returned(), which marks it up and
re-forms the group at full size. The healthy ranks are not restarted: a Reform reaching them
mid-wave makes them leave the step loop after a step they all agree on (the lockstep's
regroup flag) and join the new group with their requests intact.

With `shrink_on_loss` (router.rank_loss: shrink) a dead rank never comes back: it leaves the
group for good (the highest rank is dropped, another stays as a `removed` hole that a later
scale-up fills), the survivors re-form at N-1, and the router's `on_down` moves its requests
instead of failing them (cluster/rank_loss.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Protocol

import zmq

from deepinfer_dp.cluster import protocol as p
from deepinfer_dp.cluster.data_plane import RANK, ROUTER, DataPlane
from deepinfer_dp.cluster.waves import Waves

logger = logging.getLogger(__name__)


class Liveness(Protocol):
    """What the launcher knows about rank processes (Ray: the actor handles)."""

    def alive(self, dp_rank: int) -> bool: ...

    def kill(self, dp_rank: int) -> None: ...

    def restart(self, dp_rank: int) -> str:
        """A new process for a dead rank, loaded and serving with no group; its address.
        Blocks while it loads; raises when it cannot start."""
        ...


@dataclass
class RankHandle:
    dp_rank: int
    address: str
    socket: zmq.Socket
    up: bool = True
    inflight: set[str] = field(default_factory=set)
    woken_wave: int = -1  # the latest wave this rank was sent a Wake for
    down_reason: str = ""
    last_step: float = 0.0  # monotonic time of its latest step report (Deltas, StartWave, WaveDone)
    leaving: bool = False  # the group shrinks past it: no new requests (cluster/elastic.py)
    group_wave: int = -1  # the wave of the latest Reform it reported joining (Reformed)
    local: bool = True  # False: another endpoint's rank (hybrid/external modes), only woken for waves
    removed: bool = False  # lost for good under rank_loss: shrink; a hole in the dp_ranks, not a member

    def send(self, msg) -> None:
        self.socket.send(p.encoder.encode(msg))


class Membership:
    can_reform = True  # False: a group of separately started servers (cluster/fixed_group.py)

    def __init__(self, plane: DataPlane, lock: threading.RLock, waves: Waves, host: str,
                 collective_timeout_s: float, on_down: Callable[[RankHandle, str], None],
                 max_restarts: int) -> None:
        self.ranks: list[RankHandle] = []
        self.liveness: Liveness | None = None
        self.group_failures = 0  # GroupBroken reports (a failed lockstep vote on some rank)
        self._plane, self._lock, self._waves, self._host = plane, lock, waves, host
        self._collective_timeout_s = collective_timeout_s
        self._on_down = on_down
        self._stores: list = []  # stores of re-formed groups, kept alive while ranks use them
        self._broken_since: float | None = None  # first GroupBroken not yet resolved by a re-form
        self._broken_ranks: set[int] = set()
        self._reform_wave = -1  # GroupBroken from before the latest re-form is already handled
        self.max_restarts = max_restarts
        self.restarts: dict[int, int] = {}  # dp_rank -> restarts started
        self.busy_since = 0.0  # when the group last went from no request in flight to some
        self._restarting: set[int] = set()
        self._closed = False
        self.shrink_on_loss = False  # router.rank_loss: shrink (a dead rank leaves the group for good)
        self.on_reform: Callable[[], None] | None = None  # after each re-form's Reforms went out, under the lock
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="rank-liveness")

    def attach(self, addresses: list[str], liveness: Liveness | None, up: list[bool] | None = None,
               local: range | None = None) -> None:
        """The ranks of the first group (dp_rank = index); `up` False: a rank that a restarted
        router found gone (checked and restarted as any dead rank). `local`: the ranks this
        router serves when other endpoints serve the rest (hybrid and external modes; the
        others are only woken for waves); None: all."""
        up = up or [True] * len(addresses)
        local = local if local is not None else range(len(addresses))
        with self._lock:
            self.ranks = [RankHandle(i, addr, self._connect(addr) if ok else self._plane.ctx.socket(zmq.PUSH), up=ok,
                                     down_reason="" if ok else f"DP rank {i} was lost while the router restarted",
                                     local=i in local)
                          for i, (addr, ok) in enumerate(zip(addresses, up, strict=True))]
            self.liveness = liveness

    def _connect(self, address: str) -> zmq.Socket:
        # No high-water mark: a blocked send under the lock would stop the router's loop too,
        # and with it the ranks' replies (a deadlock on a large burst).
        return self._plane.connected(zmq.PUSH, address, RANK, SNDHWM=0)

    def local(self) -> list[RankHandle]:
        """The ranks this router serves (every rank but in hybrid and external modes, and but
        those lost for good)."""
        return [r for r in self.ranks if r.local and not r.removed]

    def size(self) -> int:
        """The group's size: its ranks up or down, not those it lost for good."""
        return sum(1 for r in self.ranks if not r.removed)

    def up(self) -> list[RankHandle]:
        """This router's ranks that are up: those it may route to and ask for stats."""
        return [r for r in self.ranks if r.up and r.local]

    def accepting(self) -> list[RankHandle]:
        """The ranks new requests may go to: up, and not leaving the group."""
        return [r for r in self.ranks if r.up and r.local and not r.leaving]

    # ---- elastic scaling (cluster/elastic.py) ----------------------------------------------
    def add_ranks(self, addresses: list[str]) -> None:
        """New ranks, serving with no group, as dp_ranks len(ranks)...; reform() takes them in."""
        with self._lock:
            for address in addresses:
                self.ranks.append(RankHandle(len(self.ranks), address, self._connect(address)))

    def refill(self, dp_rank: int, address: str) -> None:
        """A new process at `address` fills the hole a rank lost for good left; reform() takes
        it in."""
        with self._lock:
            rank = self.ranks[dp_rank]
            rank.socket.close(linger=0)
            rank.address, rank.socket = address, self._connect(address)
            rank.up, rank.removed, rank.down_reason, rank.inflight = True, False, "", set()

    def remove_ranks(self, size: int) -> list[RankHandle]:
        """Drops the ranks from dp_rank `size` on (their requests moved away) and asks them to
        leave; the caller re-forms the others and stops the processes."""
        with self._lock:
            gone, self.ranks = self.ranks[size:], self.ranks[:size]
            for r in gone:
                self._restarting.discard(r.dp_rank)
                self.restarts.pop(r.dp_rank, None)
                r.up = False
                r.send(p.Shutdown())
                r.socket.close(linger=500)
            return gone

    def reform(self) -> int:
        """A fresh group of the ranks that are up; its wave (each member reports Reformed)."""
        with self._lock:
            self._reform()
            return self._reform_wave

    def reformed(self, msg: p.Reformed) -> None:
        if 0 <= msg.dp_rank < len(self.ranks):
            self.ranks[msg.dp_rank].group_wave = max(self.ranks[msg.dp_rank].group_wave, msg.wave)

    def health(self) -> list[dict]:
        # "restarts": a rank replaced by the warm spare can be down for well under a second,
        # less than a poll of "up" sees; the count records that it happened.
        # "step_age_s": while any request is in flight every rank that is up must step (the
        # lockstep: one rank's work keeps the whole group in its wave), so this is how long
        # the rank has gone without a step report since then; None when the group is idle.
        now, busy = time.monotonic(), any(r.inflight for r in self.ranks if r.up)
        return [{"dp_rank": r.dp_rank, "up": r.up, "inflight": len(r.inflight), "reason": r.down_reason,
                 "restarts": self.restarts.get(r.dp_rank, 0),
                 "step_age_s": round(now - max(r.last_step, self.busy_since), 3) if busy and r.up else None}
                for r in self.local()]

    def work_arrives(self) -> None:
        """A request is about to be sent to a rank: an idle group's stall clock starts now."""
        if not any(r.inflight for r in self.ranks if r.up):
            self.busy_since = time.monotonic()

    def stepped(self, dp_rank: int) -> None:
        """Rank `dp_rank` reported a step (or entered or left a wave)."""
        if 0 <= dp_rank < len(self.ranks):
            self.ranks[dp_rank].last_step = time.monotonic()

    # ---- failures ------------------------------------------------------------------------
    def group_broken(self, msg: p.GroupBroken) -> bool:
        """A rank's vote failed; True when the health check should run now."""
        if msg.wave < self._reform_wave:
            return False  # from before the latest re-form: already handled
        logger.error("DP rank %d: %s", msg.dp_rank, msg.message)
        self.group_failures += 1
        self._broken_ranks.add(msg.dp_rank)
        if self._broken_since is None:
            self._broken_since = time.monotonic()
        return True

    def check(self) -> None:
        """Marks dead or stuck ranks down (failing their requests) and re-forms the survivors.
        Runs on the health thread: the liveness calls can block, so not under the lock."""
        if self.liveness is None:
            return
        with self._lock:
            if self._closed:
                return
            candidates = [r.dp_rank for r in self.ranks if r.up]
        # All at once, each dead rank handled as soon as its answer comes: a ping to a busy
        # rank can take a while, and must not delay failing a dead one's requests.
        try:
            pings = {self._pool.submit(self.liveness.alive, i): i for i in candidates}
        except RuntimeError:
            if self._closed:  # close() shut the pool while this check ran: nothing left to watch
                return
            raise
        dead = []
        for done in as_completed(pings):
            if not done.result():
                i = pings[done]
                dead.append(i)
                self.liveness.kill(i)  # gone, or frozen: make sure it never comes back half-way
                self.mark_down(i, f"DP rank {i} died or stopped answering health checks")
        with self._lock:
            dead += self._kill_stuck()
            up = [r.dp_rank for r in self.ranks if r.up]
            # Every survivor reported a failed vote and nobody died: a retry on a fresh group.
            all_broken = self._broken_since is not None and set(up) <= self._broken_ranks
            cut = self._shrink_away(dead) if self.shrink_on_loss else None
            if up and (dead or all_broken):
                self._reform()
            elif dead and self.on_reform is not None:
                self.on_reform()  # no survivor: what waited for one fails now
            self._start_restarts()
        if cut is not None:  # the launcher forgets the dropped ranks' (dead) processes
            self.liveness.stop_ranks(cut)

    def _shrink_away(self, dead: list[int]) -> int | None:
        """rank_loss: shrink: the dead ranks leave the group for good; the highest are dropped
        (the new size's first dp_rank returned, for the launcher), the others stay as holes.
        Under the lock."""
        for i in dead:
            if i < len(self.ranks):
                self.ranks[i].removed = True
                self.ranks[i].down_reason += "; the group shrank without it (rank_loss: shrink)"
        size = len(self.ranks)
        while self.ranks and self.ranks[-1].removed:
            self.ranks.pop().socket.close(linger=0)
        if dead:
            logger.warning("DP rank(s) %s lost: the group shrinks to %d rank(s) without them", sorted(dead),
                           self.size())
        return len(self.ranks) if len(self.ranks) < size else None

    def _start_restarts(self) -> None:
        """A thread per down rank that may still restart (it loads a model: not here)."""
        for r in self.ranks:
            i = r.dp_rank
            if (r.up or r.removed or self.shrink_on_loss or i in self._restarting or self._closed
                    or self.restarts.get(i, 0) >= self.max_restarts):
                continue
            self._restarting.add(i)
            self.restarts[i] = self.restarts.get(i, 0) + 1
            r.down_reason += f"; restarting ({self.restarts[i]} of {self.max_restarts})"
            threading.Thread(target=self._restart, args=(i,), name=f"restart-rank-{i}", daemon=True).start()

    def _restart(self, dp_rank: int) -> None:
        started = time.monotonic()
        try:
            address = self.liveness.restart(dp_rank)
        except Exception as e:  # the next check tries again while restarts remain
            logger.exception("DP rank %d: restarting it failed", dp_rank)
            with self._lock:
                self.ranks[dp_rank].down_reason += f"; the restart failed: {type(e).__name__}: {e}"
                self._restarting.discard(dp_rank)
            return
        with self._lock:
            self._restarting.discard(dp_rank)
            if self._closed or dp_rank >= len(self.ranks):  # stopped, or the group shrank past it
                self.liveness.kill(dp_rank)
                return
            logger.warning("DP rank %d restarted in %.1fs; re-forming at full size", dp_rank,
                           time.monotonic() - started)
            self.rank_returned(dp_rank, address)

    def _kill_stuck(self) -> list[int]:
        """Ranks alive but silent while their peers' votes failed, for twice the timeout."""
        since = self._broken_since
        if since is None or time.monotonic() - since <= 2 * self._collective_timeout_s:
            return []
        stuck = [r.dp_rank for r in self.ranks if r.up and r.dp_rank not in self._broken_ranks]
        for i in stuck:
            self.liveness.kill(i)
            self.mark_down(i, f"DP rank {i} stopped answering (no lockstep vote within "
                              f"{self._collective_timeout_s:.0f}s)")
        return stuck

    def mark_down(self, dp_rank: int, reason: str) -> None:
        with self._lock:
            if dp_rank >= len(self.ranks):
                return  # the group shrank past it
            rank = self.ranks[dp_rank]
            if not rank.up:
                return
            rank.up, rank.down_reason = False, reason
            logger.error("%s; failing its %d in-flight request(s)", reason, len(rank.inflight))
            self._on_down(rank, reason)

    def rank_returned(self, dp_rank: int, address: str) -> None:
        """A restarted rank is ready at `address`: it serves again, in a group at full size."""
        with self._lock:
            rank = self.ranks[dp_rank]
            rank.socket.close(linger=0)
            rank.address, rank.socket = address, self._connect(address)
            rank.up, rank.down_reason, rank.inflight = True, "", set()
            self._reform()

    def _reform(self) -> None:
        """A fresh group of the ranks that are up, on a new store."""
        self._broken_since, self._broken_ranks = None, set()
        from deepinfer_dp.cluster.group_store import GroupStoreServer  # torch: only once a group re-forms

        store = GroupStoreServer(self._host, self._plane.key, ROUTER)
        self._stores.append(store)
        members = self.up()
        wave = self._waves.next_for_reform()
        self._reform_wave = wave
        for i, r in enumerate(members):
            r.woken_wave = -1
            r.send(p.Reform(self._host, store.port, i, len(members), wave))
        logger.warning("re-forming the DP group with ranks %s", [r.dp_rank for r in members])
        if self.on_reform is not None:
            self.on_reform()

    def reformed_since(self, wave: int) -> bool:
        """Whether the group re-formed after a failure a rank reported at `wave`."""
        return wave < self._reform_wave

    def close(self) -> None:
        """Asks every rank that is up to shut down, and closes the sockets."""
        with self._lock:
            self._closed = True
            for r in self.ranks:
                if r.up and r.local:  # another endpoint's ranks are its own to stop
                    r.send(p.Shutdown())
            for r in self.ranks:
                r.socket.close(linger=500)
            for store in self._stores:
                store.close()
        self._pool.shutdown(wait=False)
