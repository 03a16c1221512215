"""The router: shards requests across DP ranks, wakes idle ranks, streams TokenDeltas back.

It implements EngineClient (deepinfer_dp/engine/client.py) for the HTTP server, and a
thread-safe sync core (submit/abort/query_stats) for the offline driver. One receiver thread
reads every rank's messages; a health thread asks the launcher whether ranks are alive. A
dead rank's requests fail with RankFailed; the survivors re-form a fresh DP group through a
new TCPStore served here, and keep serving.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import zmq

from deepinfer_dp.cluster import protocol as p
from deepinfer_dp.cluster.policies import RoutingPolicy
from deepinfer_dp.distributed.groups import serve_store
from deepinfer_dp.engine.client import NoCapacity, RankFailed, RequestRejected, TokenDelta
from deepinfer_dp.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
Sink = Callable[[Any], None]  # receives TokenDelta, or an EngineError that ends the request


class Liveness(Protocol):
    def alive(self, dp_rank: int) -> bool: ...

    def kill(self, dp_rank: int) -> None: ...


@dataclass
class RankHandle:
    dp_rank: int
    address: str
    socket: zmq.Socket
    up: bool = True
    inflight: set[str] = field(default_factory=set)
    woken_wave: int = -1
    down_reason: str = ""


class Router:
    def __init__(self, tokenizer, model_name: str, max_model_len: int, vocab_size: int,
                 policy: RoutingPolicy, host: str = "127.0.0.1", health_interval_s: float = 1.0,
                 collective_timeout_s: float = 30.0) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.policy = policy
        self.host = host
        self.wave = 0  # the latest wave index any rank reported
        self.group_failures = 0  # GroupBroken reports (a failed lockstep vote on some rank)
        self.ranks: list[RankHandle] = []
        self.liveness: Liveness | None = None
        self._ctx = zmq.Context()
        self._inbox = self._ctx.socket(zmq.PULL)
        self.address = f"tcp://{host}:{self._inbox.bind_to_random_port(f'tcp://{host}')}"
        self._lock = threading.RLock()  # sockets and request state
        self._stats_ready = threading.Condition(self._lock)
        self._requests: dict[str, tuple[int, Sink]] = {}
        self._queries: dict[int, dict[int, dict]] = {}
        self._query_ids = itertools.count()
        self._stores: list = []  # stores of re-formed groups, kept alive while ranks use them
        self._stop = threading.Event()
        self._health_interval_s = health_interval_s
        self._collective_timeout_s = collective_timeout_s
        self._health_kick = threading.Event()  # set on GroupBroken: check the ranks now
        self._broken_since: float | None = None  # first GroupBroken not yet resolved by a re-form
        self._broken_ranks: set[int] = set()
        self._reform_wave = -1  # GroupBroken from before the latest re-form is already handled
        self._threads: list[threading.Thread] = []

    def attach_ranks(self, addresses: list[str], liveness: Liveness | None = None) -> None:
        """Connects to the ranks (dp_rank = index) and starts the receiver and health threads."""
        for i, addr in enumerate(addresses):
            sock = self._ctx.socket(zmq.PUSH)
            # No high-water mark: a blocked send under the lock would stop the receiver
            # thread too, and with it the rank's replies (a deadlock on a large burst).
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.connect(addr)
            self.ranks.append(RankHandle(i, addr, sock))
        self.liveness = liveness
        self._start_thread(self._receive_loop, "router-recv")
        if liveness is not None:
            self._start_thread(self._health_loop, "router-health")

    def _start_thread(self, target, name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    # ---- sync core -----------------------------------------------------------------------
    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, sink: Sink) -> int:
        """Sends the request to the rank the policy picks and wakes the others; returns the rank."""
        self._validate(request_id, prompt_token_ids)
        with self._lock:
            load = {r.dp_rank: len(r.inflight) for r in self.ranks if r.up}
            if not load:
                raise NoCapacity("no DP rank is up: " + "; ".join(r.down_reason for r in self.ranks))
            if request_id in self._requests:
                raise RequestRejected(f"request {request_id} is already running")
            rank = self.ranks[self.policy.choose(prompt_token_ids, load)]
            self._requests[request_id] = (rank.dp_rank, sink)
            rank.inflight.add(request_id)
            self._send(rank, p.AddRequest(request_id, list(prompt_token_ids), p.params_to_wire(params)))
            for other in self.ranks:
                # An optimization only: StartWave from the woken rank guarantees the wave.
                if other is not rank and other.up and other.woken_wave < self.wave:
                    other.woken_wave = self.wave
                    self._send(other, p.Wake(self.wave))
            return rank.dp_rank

    def _validate(self, request_id: str, ids: list[int]) -> None:
        if not ids:
            raise RequestRejected(f"request {request_id}: empty prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestRejected(f"request {request_id}: token id {bad[0]} outside the vocabulary "
                                  f"[0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise RequestRejected(f"request {request_id}: prompt of {len(ids)} tokens leaves no room "
                                  f"under max_model_len={self.max_model_len}")

    def abort_sync(self, request_ids: list[str]) -> None:
        with self._lock:
            by_rank: dict[int, list[str]] = {}
            for rid in request_ids:
                entry = self._requests.pop(rid, None)
                if entry is not None:
                    by_rank.setdefault(entry[0], []).append(rid)
                    self.ranks[entry[0]].inflight.discard(rid)
            for dp_rank, rids in by_rank.items():
                if self.ranks[dp_rank].up:
                    self._send(self.ranks[dp_rank], p.Abort(rids))

    def query_stats(self, timeout_s: float = 10.0) -> list[dict]:
        """Every rank's counters (LLMEngine.stats() plus lockstep and wave counters)."""
        qid = next(self._query_ids)
        with self._lock:
            self._queries[qid] = {}
            up = [r for r in self.ranks if r.up]
            for r in up:
                self._send(r, p.StatsQuery(qid))
        with self._stats_ready:
            self._stats_ready.wait_for(lambda: len(self._queries[qid]) >= len(up), timeout_s)
            got = self._queries.pop(qid)
        return [got.get(r.dp_rank, {"dp_rank": r.dp_rank, "up": r.up, "down_reason": r.down_reason})
                for r in self.ranks]

    def _send(self, rank: RankHandle, msg) -> None:
        rank.socket.send(p.encoder.encode(msg))

    # ---- messages from the ranks ---------------------------------------------------------
    def _receive_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._inbox, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            msg = p.router_decoder.decode(self._inbox.recv())
            with self._lock:
                self._on_message(msg)

    def _on_message(self, msg) -> None:
        if isinstance(msg, p.Deltas):
            for delta in msg.deltas:
                self._deliver(delta)
        elif isinstance(msg, p.StartWave):
            # No de-duplication here: a rank may have dropped an earlier Wake(w) while it
            # was still finishing wave w-1.
            self.wave = max(self.wave, msg.wave)
            for r in self.ranks:
                if r.up and r.dp_rank != msg.dp_rank:
                    r.woken_wave = max(r.woken_wave, msg.wave)
                    self._send(r, p.Wake(msg.wave))
        elif isinstance(msg, p.WaveDone):
            self.wave = max(self.wave, msg.wave + 1)
        elif isinstance(msg, p.Rejected):
            self._finish(msg.request_id, RequestRejected(msg.message))
        elif isinstance(msg, p.Stats):
            if msg.query_id in self._queries:
                self._queries[msg.query_id][msg.dp_rank] = {"up": True, **msg.stats}
                self._stats_ready.notify_all()
        elif isinstance(msg, p.GroupBroken):
            for rid in msg.request_ids:  # lost with a failed step: fail them even if a re-form is under way
                self._finish(rid, RankFailed(f"request {rid}: DP rank {msg.dp_rank} lost it: {msg.message}"))
            if msg.wave < self._reform_wave:
                return
            logger.error("DP rank %d: %s", msg.dp_rank, msg.message)
            self.group_failures += 1
            self._broken_ranks.add(msg.dp_rank)
            if self._broken_since is None:
                self._broken_since = time.monotonic()
            self._health_kick.set()  # liveness calls can block: not on this thread

    def _deliver(self, delta: TokenDelta) -> None:
        entry = self._requests.get(delta.request_id)
        if entry is None:
            return  # aborted by the client: drop what was already on the wire
        if delta.finished:
            self._requests.pop(delta.request_id)
            self.ranks[entry[0]].inflight.discard(delta.request_id)
        _call(entry[1], delta)

    def _finish(self, request_id: str, error: Exception) -> None:
        entry = self._requests.pop(request_id, None)
        if entry is not None:
            self.ranks[entry[0]].inflight.discard(request_id)
            _call(entry[1], error)

    # ---- failures ------------------------------------------------------------------------
    def _health_loop(self) -> None:
        while not self._stop.is_set():
            self._health_kick.wait(self._health_interval_s)
            self._health_kick.clear()
            if not self._stop.is_set():
                self._check_ranks()

    def _check_ranks(self) -> None:
        """Marks dead or stuck ranks down, fails their requests, and re-forms the survivors.
        Stuck: alive, but it reported no failed vote a collective timeout after a peer did
        (a rank that stopped calling step() never fails its own vote)."""
        with self._lock:
            candidates = [r.dp_rank for r in self.ranks if r.up]
        dead = [i for i in candidates if not self.liveness.alive(i)]
        for i in dead:
            self.liveness.kill(i)  # gone, or frozen: make sure it never comes back half-way
        with self._lock:
            for i in dead:
                self.mark_down(i, f"DP rank {i} died or stopped answering health checks")
            since = self._broken_since
            if not dead and since is not None and time.monotonic() - since > 2 * self._collective_timeout_s:
                for r in self.ranks:
                    if r.up and r.dp_rank not in self._broken_ranks:
                        self.liveness.kill(r.dp_rank)
                        self.mark_down(r.dp_rank, f"DP rank {r.dp_rank} stopped answering (no lockstep "
                                                  f"vote within {self._collective_timeout_s:.0f}s)")
                        dead.append(r.dp_rank)
            up = [r.dp_rank for r in self.ranks if r.up]
            all_broken = since is not None and set(up) <= self._broken_ranks  # nobody died: retry
            if up and (dead or all_broken):
                self._broken_since, self._broken_ranks = None, set()
                self._reform()

    def mark_down(self, dp_rank: int, reason: str) -> None:
        with self._lock:
            rank = self.ranks[dp_rank]
            if not rank.up:
                return
            rank.up, rank.down_reason = False, reason
            logger.error("%s; failing its %d in-flight request(s)", reason, len(rank.inflight))
            for rid in sorted(rank.inflight):
                self._finish(rid, RankFailed(f"request {rid}: {reason}"))

    def _reform(self) -> None:
        """A fresh group of the survivors, on a new store (Gloo groups cannot be rejoined)."""
        store = serve_store(self.host)
        self._stores.append(store)
        survivors = [r for r in self.ranks if r.up]
        self.wave += 1
        self._reform_wave = self.wave
        for i, r in enumerate(survivors):
            r.woken_wave = -1
            self._send(r, p.Reform(self.host, store.port, i, len(survivors), self.wave))
        logger.warning("re-forming the DP group with ranks %s", [r.dp_rank for r in survivors])

    # ---- EngineClient --------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[TokenDelta]:
        """TokenDeltas of one request; closing the iterator early aborts it on its rank."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        self.submit(request_id, prompt_token_ids, params,
                    lambda item: loop.call_soon_threadsafe(queue.put_nowait, item))
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort_sync([request_id])

    async def abort(self, request_id: str) -> None:
        self.abort_sync([request_id])

    def health(self) -> list[dict]:
        with self._lock:
            return [{"dp_rank": r.dp_rank, "up": r.up, "inflight": len(r.inflight), "reason": r.down_reason}
                    for r in self.ranks]

    def rank_stats(self) -> list[dict]:
        return self.query_stats()

    def close(self) -> None:
        """Asks every rank to shut down and stops the threads (the launcher ends the processes)."""
        with self._lock:
            for r in self.ranks:
                if r.up:
                    self._send(r, p.Shutdown())
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        for r in self.ranks:
            r.socket.close(linger=500)
        self._inbox.close(linger=0)
        self._ctx.term()


def _call(sink: Sink, item) -> None:
    # A broken sink (e.g. a closed event loop) must not kill the receiver thread.
    try:
        sink(item)
    except Exception:
        logger.exception("dropping an output: its consumer failed")
