"""Fake DP ranks for testing the router without Ray or engines: each answers the router's
messages over ZeroMQ the way cluster/rank.py does, with scripted tokens."""

from __future__ import annotations

import queue
import threading
import time

import zmq

from deepinfer_dp.cluster import protocol as p
from deepinfer_dp.cluster.data_plane import RANK, ROUTER, ClusterKey, DataPlane
from deepinfer_dp.engine.client import TokenDelta


class FakeRank:
    """Answers AddRequest with `num_tokens` deltas (token = 100 + dp_rank), unless `hold` is
    set (the request then stays in flight); Abort with an abort delta; StatsQuery with
    {"fake": dp_rank} unless `mute`; Reform with Reformed. With `waves` set, each request is a
    wave of its own: StartWave before its deltas, WaveDone after. Every message received is kept
    in `received`."""

    def __init__(self, dp_rank: int, backend: str, num_tokens: int = 3, key: ClusterKey | None = None) -> None:
        self.dp_rank = dp_rank
        self.num_tokens = num_tokens
        self.hold = False
        self.mute = False
        self.waves = False
        self._wave = 0  # the latest wave this rank heard of
        self.received: queue.Queue = queue.Queue()
        self._plane = DataPlane(key, RANK)
        self._inbox = self._plane.bound(zmq.PULL, "127.0.0.1", (ROUTER,))
        self.address = self._inbox.getsockopt_string(zmq.LAST_ENDPOINT)
        self._outbox = self._plane.connected(zmq.PUSH, backend, ROUTER)
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def send(self, msg) -> None:
        with self._send_lock:
            self._outbox.send(p.encoder.encode(msg))

    def next_message(self, kind: type, timeout: float = 10.0):
        """The next received message of type `kind` (others before it are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            msg = self.received.get(timeout=max(0.01, deadline - time.monotonic()))
            if isinstance(msg, kind):
                return msg

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self._inbox.poll(50):
                continue
            msg = p.rank_decoder.decode(self._inbox.recv())
            self.received.put(msg)
            if isinstance(msg, p.Wake):
                self._wave = max(self._wave, msg.wave)
            elif isinstance(msg, p.AddRequest) and not self.hold:
                self._answer(msg)
            elif isinstance(msg, p.Abort):
                self.send(p.Deltas(self.dp_rank, [TokenDelta(r, [], True, "abort", dp_rank=self.dp_rank)
                                                  for r in msg.request_ids]))
            elif isinstance(msg, p.Reform):
                self.send(p.Reformed(self.dp_rank, msg.wave))
            elif isinstance(msg, p.StatsQuery) and not self.mute:
                self.send(p.Stats(self.dp_rank, msg.query_id, {"dp_rank": self.dp_rank, "fake": True}))

    def _answer(self, msg: p.AddRequest) -> None:
        if self.waves:
            self.send(p.StartWave(self.dp_rank, self._wave))
        for i in range(self.num_tokens):
            last = i == self.num_tokens - 1
            self.send(p.Deltas(self.dp_rank, [TokenDelta(msg.request_id, [100 + self.dp_rank], last,
                                                         "length" if last else None, dp_rank=self.dp_rank)]))
        if self.waves:
            self.send(p.WaveDone(self.dp_rank, self._wave))
            self._wave += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._inbox.close(linger=0)
        self._outbox.close(linger=0)
        self._plane.close()


class FakeLiveness:
    """The launcher's view of the ranks: every rank alive unless listed in `dead`."""

    def __init__(self) -> None:
        self.dead: set[int] = set()
        self.killed: list[int] = []
        self.backend = ""
        self.restarted: list[FakeRank] = []
        self.restart_gate = threading.Event()
        self.restart_error: Exception | None = None
        self.key: ClusterKey | None = None  # the restarted ranks' data-plane key

    def alive(self, dp_rank: int) -> bool:
        return dp_rank not in self.dead

    def kill(self, dp_rank: int) -> None:
        self.killed.append(dp_rank)

    def start_ranks(self, dp_ranks: list[int], world_size: int) -> list[str]:
        """New fake ranks for a growing group (set `backend` first)."""
        if self.restart_error is not None:
            raise self.restart_error
        ranks = [FakeRank(i, self.backend, key=self.key) for i in dp_ranks]
        self.restarted += ranks
        return [r.address for r in ranks]

    def stop_ranks(self, size: int) -> None:
        self.stopped_from = size

    def restart(self, dp_rank: int) -> str:
        """A new fake rank for `dp_rank` (set `backend` first), once `restart_gate` opens;
        a set `restart_error` fails the restart instead."""
        self.restart_gate.wait(10)
        if self.restart_error is not None:
            raise self.restart_error
        rank = FakeRank(dp_rank, self.backend, key=self.key)
        self.restarted.append(rank)
        self.dead.discard(dp_rank)
        return rank.address
