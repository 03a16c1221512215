"""The client side of the router process: an EngineClient for an API server, and a thread-safe
submit / abort / query core for the offline driver (cluster/dp_driver.py).

A request comes to submit() / generate() validated: its callers (DPDriver.add_request, the
OpenAI server's prepare) ran `input_processor.process` on it once, so the router and the
ranks trust it and only ever see requests that can run. One receiver thread reads the replies and
hands each request's deltas to its sink; it also sends the heartbeat (a HealthQuery every
second, after a Hello: a router process that Ray restarted learns of this client from it).
If the router stops answering for `router_timeout_s`, every waiting request fails with
NoCapacity and health() reports every rank down, until it answers again. A health reply with a
new router_id means the router restarted and forgot the requests in flight: they fail at once
with RankFailed (a clean error, never a stream that waits forever).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import zmq

from deepinfer_dp.cluster import protocol as p
from deepinfer_dp.cluster.data_plane import CLIENT, ROUTER, ClusterKey, DataPlane
from deepinfer_dp.cluster.inbox import Inbox
from deepinfer_dp.engine.client import (
    NoCapacity,
    RankFailed,
    RequestRejected,
    TokenDelta,
    deltas_until_finished,
)
from deepinfer_dp.engine.input_processor import InputProcessor
from deepinfer_dp.multimodal.errors import image_error_field
from deepinfer_dp.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
Sink = Callable[[Any], None]  # receives TokenDelta, or an EngineError that ends the request
HEARTBEAT_S = 1.0
ROUTER_TIMEOUT_S = 10.0
_ERRORS = {"rejected": RequestRejected, "no_capacity": NoCapacity, "rank_failed": RankFailed}


class RouterClient:
    def __init__(self, frontend_address: str, tokenizer: Any, model_name: str, max_model_len: int,
                 input_processor: InputProcessor, host: str = "127.0.0.1",
                 router_timeout_s: float = ROUTER_TIMEOUT_S, key: ClusterKey | None = None,
                 images: Any = None, dp_ranks: list[int] | None = None) -> None:
        """`dp_ranks`: the ranks the router serves, those a request may pin (default: rank 0 only)."""
        self.tokenizer = tokenizer
        self.dp_ranks = list(dp_ranks) if dp_ranks is not None else [0]
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.input_processor = input_processor
        # A vision model's ImageFront (multimodal/front.py: chat template, reference checks), or None.
        self.images = images
        self.image_limit = images.image_limit if images is not None else 0
        self.client_id = uuid.uuid4().hex[:16]
        self._plane = DataPlane(key, CLIENT)  # `key`: peers by role (cluster/data_plane.py)
        # Only the router may send here; a frame that does not decode is dropped and counted.
        self._inbox = Inbox(self._plane, host, p.client_decoder, p.TO_CLIENT_SENDERS, "router client", RCVHWM=0)
        self._outbox = self._plane.connected(zmq.PUSH, frontend_address, ROUTER, SNDHWM=0)
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # the sinks and the replies
        self._sinks: dict[str, Sink] = {}
        self._replies: dict[int, Any] = {}
        self._reply_ready = threading.Condition(self._lock)
        self._query_ids = itertools.count()
        self._router_timeout_s = router_timeout_s
        self._last_heard = time.monotonic()
        self._last_health: list[dict] = []
        self._router_dropped: dict[str, int] = {}  # the router's, as its last stats reply gave them
        self._router_id = ""  # the router process's, from its health replies
        self._address = self._inbox.address
        self.group_failures = 0  # the router's count of failed lockstep votes, as of the last health reply
        self.elastic_state: dict = {}  # the group's size and scale events, as of the last health reply
        # Set by the HTTP server (stop_when_the_engine_dies): called when the ranks behind this
        # client can serve no more (a hybrid or external group broke, cluster/lb_node.py).
        self.on_fatal: Callable[[BaseException], None] | None = None
        self._stop = threading.Event()
        self._send(p.Hello(self.client_id, self._address))
        self._thread = threading.Thread(target=self._receive_loop, name="router-client", daemon=True)
        self._thread.start()

    # ---- the sync core -----------------------------------------------------------------------
    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, sink: Sink,
               mm: p.ImageInputs | None = None, data_parallel_rank: int | None = None) -> None:
        """Sends one validated request (n=1) to the router, with its images' references (`mm`,
        fetched by the rank), to the rank `data_parallel_rank` if given; its deltas, or the
        error that ends it, go to `sink` on the receiver thread."""
        if self.router_down():
            raise NoCapacity(f"the router has not answered for over {self._router_timeout_s:.0f}s")
        with self._lock:
            if request_id in self._sinks:
                raise RequestRejected(f"request {request_id} is already running")
            self._sinks[request_id] = sink
        pin = -1 if data_parallel_rank is None else data_parallel_rank
        self._send(p.AddRequest(request_id, prompt_token_ids, p.params_to_wire(params), self.client_id, mm, pin))

    def abort_sync(self, request_ids: list[str]) -> None:
        with self._lock:
            ids = [rid for rid in request_ids if self._sinks.pop(rid, None) is not None]
        if ids:
            self._send(p.Abort(ids, self.client_id))

    def query_stats(self, timeout_s: float = 15.0) -> list[dict]:
        """Every rank's counters (the step loop's stats dict plus its waves), in rank order."""
        reply = self._call(lambda qid: p.StatsQuery(qid, self.client_id), timeout_s)
        if reply is None:
            raise NoCapacity(f"the router did not answer a stats query within {timeout_s:.0f}s")
        self._router_dropped = reply.router
        return reply.stats

    def dropped_frames(self) -> dict[str, int]:
        """Frames this client's inbox dropped (malformed, wrong sender), handshakes it refused."""
        return {**self._inbox.dropped, "refused_handshakes": self._plane.refused,
                "failed_handshakes": self._plane.failed_handshakes}

    def data_plane_drops(self) -> dict[str, dict[str, int]]:
        """This client's dropped frames and the router's (as of the last stats query), for /metrics."""
        return {"client": self.dropped_frames(), "router": dict(self._router_dropped)}

    def router_down(self) -> bool:
        return time.monotonic() - self._last_heard > self._router_timeout_s

    # ---- EngineClient --------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       mm: Any = None, data_parallel_rank: int | None = None) -> AsyncIterator[TokenDelta]:
        """TokenDeltas of one request; closing the iterator early aborts it on its rank. `mm`: a
        chat's MultiModalPrompt, whose image URLs go to the rank as they are."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        wire = None if mm is None else _images_to_wire(mm)
        self.submit(request_id, prompt_token_ids, params,
                    lambda item: loop.call_soon_threadsafe(queue.put_nowait, item), wire, data_parallel_rank)
        async for delta in deltas_until_finished(queue, lambda: self.abort_sync([request_id])):
            yield delta

    def fail_inflight(self, error: Exception) -> int:
        """Ends every request in flight with `error` (the server's drain time is over) and
        aborts them on their ranks; returns how many there were."""
        with self._lock:
            sinks, self._sinks = self._sinks, {}
        if sinks:
            self._send(p.Abort(list(sinks), self.client_id))
        for sink in sinks.values():
            _call(sink, error)
        return len(sinks)

    async def abort(self, request_id: str) -> None:
        self.abort_sync([request_id])

    def health(self, timeout_s: float = 2.0) -> list[dict]:
        """One entry per rank ({"dp_rank", "up", "inflight", "reason"}), asked of the router."""
        reply = self._call(lambda qid: p.HealthQuery(self.client_id, qid), timeout_s)
        if reply is not None:
            return reply.ranks
        known = self._last_health or [{"dp_rank": 0, "inflight": 0}]
        return [{**r, "up": False, "reason": "the router process is not answering"} for r in known]

    def rank_stats(self) -> list[dict]:
        return self.query_stats()

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._send(p.Goodbye(self.client_id))
        self._thread.join(timeout=5)
        self._inbox.close()
        self._outbox.close(linger=500)
        self._plane.close()


    # ---- the receiver thread -------------------------------------------------------------------
    def _receive_loop(self) -> None:
        last_beat = 0.0
        while not self._stop.is_set():
            if self._inbox.socket.poll(100):
                while True:
                    try:
                        got = self._inbox.recv(zmq.NOBLOCK)  # None: a frame dropped (malformed)
                    except zmq.Again:
                        break
                    if got is None:
                        continue
                    self._last_heard = time.monotonic()  # only a message that decoded says the router lives
                    try:
                        self._on_message(got[0])
                    except Exception:  # one bad message must not end the receiver thread
                        logger.exception("dropping a message from the router")
            now = time.monotonic()
            if now - last_beat > HEARTBEAT_S:
                last_beat = now
                self._send(p.Hello(self.client_id, self._address))  # known already: a no-op
                self._send(p.HealthQuery(self.client_id, -1))
                if self.router_down():
                    self._fail_all(NoCapacity(f"the router has not answered for over "
                                              f"{self._router_timeout_s:.0f}s"))

    def _on_message(self, msg) -> None:
        if isinstance(msg, p.Deltas):
            for delta in msg.deltas:
                with self._lock:  # no sink: aborted here while its delta was on the way
                    sink = (self._sinks.pop(delta.request_id, None) if delta.finished
                            else self._sinks.get(delta.request_id))
                if sink is not None:
                    _call(sink, delta)
        elif isinstance(msg, p.RequestError):
            with self._lock:
                sink = self._sinks.pop(msg.request_id, None)
            if sink is not None:
                _call(sink, _ERRORS.get(msg.kind, RankFailed)(msg.message))
        elif isinstance(msg, (p.StatsReply, p.HealthReply)):
            if isinstance(msg, p.HealthReply):
                self._last_health, self.group_failures = msg.ranks, msg.group_failures
                self.elastic_state = msg.elastic
                self._check_router_id(msg.router_id)
            if msg.query_id >= 0:
                with self._lock:
                    self._replies[msg.query_id] = msg
                    self._reply_ready.notify_all()

    def _call(self, make: Callable[[int], Any], timeout_s: float):
        qid = next(self._query_ids)
        self._send(make(qid))
        with self._lock:
            self._reply_ready.wait_for(lambda: qid in self._replies, timeout_s)
            return self._replies.pop(qid, None)

    def _check_router_id(self, router_id: str) -> None:
        previous, self._router_id = self._router_id, router_id
        if previous and router_id != previous:
            n = self._fail_all(RankFailed("the router process restarted; this request was lost with it"))
            logger.warning("the router process restarted: %d request(s) in flight failed", n)

    def _fail_all(self, error: Exception) -> int:
        with self._lock:
            sinks, self._sinks = self._sinks, {}
        for sink in sinks.values():
            _call(sink, error)
        return len(sinks)

    def _send(self, msg) -> None:
        with self._send_lock:
            self._outbox.send(p.encoder.encode(msg))


def _images_to_wire(mm: Any) -> p.ImageInputs:
    try:
        return p.images_to_wire(mm.prompt, mm.images, mm.image_fields, mm.max_tokens_set)
    except ValueError as e:  # past the wire's bounds: the caller's input, a 400 naming the part
        error = RequestRejected(str(e))
        error.param = image_error_field(str(e)) or "messages"
        raise error from None


def _call(sink: Sink, item) -> None:
    # A broken sink (e.g. a closed event loop) must not kill the receiver thread.
    try:
        sink(item)
    except Exception:
        logger.exception("dropping an output: its consumer failed")
