"""The router: its own process between the clients (API servers, the offline driver) and the
DP ranks. Clients send token ids and get TokenDeltas back; the router never tokenizes.

It owns, each in a file of its own:
  - sharding: a RoutingPolicy picks the rank of each request (cluster/policies.py);
  - waves: waking the other ranks so that all step together (cluster/waves.py);
  - membership: health checks, a dead or stuck rank, re-forming the group (cluster/membership.py);
  - scaling the group up and down while it serves (cluster/elastic.py), and moving a leaving
    rank's requests to a staying one by recompute (cluster/migration.py);
  - the stats RPC (cluster/stats_rpc.py).
This file holds the sockets, the request table and the loop that dispatches the messages.

One loop thread polls two PULL sockets, the frontend (clients) and the backend (ranks); a
health thread runs Membership.check(). Both take one lock to touch the state. A client says
Hello with the address to push its replies to, and sends a HealthQuery every second; a client
silent for `client_timeout_s` is dropped and its requests are aborted on their ranks.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import defaultdict

import zmq

from deepinfer_dp.cluster import protocol as p
from deepinfer_dp.cluster.data_plane import CLIENT, ROUTER, ClusterKey, DataPlane
from deepinfer_dp.cluster.elastic import ElasticScaler
from deepinfer_dp.cluster.inbox import Inbox
from deepinfer_dp.cluster.membership import Liveness, Membership, RankHandle
from deepinfer_dp.cluster.migration import RequestLog
from deepinfer_dp.cluster.policies import RoutingPolicy, image_digests, make_policy
from deepinfer_dp.cluster.rank_loss import LostRequests
from deepinfer_dp.cluster.stats_rpc import StatsQueries
from deepinfer_dp.cluster.waves import Waves
from deepinfer_dp.config_file import RouterSection
from deepinfer_dp.engine.client import TokenDelta

logger = logging.getLogger(__name__)
CLIENT_TIMEOUT_S = 30.0
POLL_MS = 100


class _Client:
    def __init__(self, socket: zmq.Socket) -> None:
        self.socket = socket
        self.last_seen = time.monotonic()
        self.requests: set[str] = set()


class Router:
    def __init__(self, settings: RouterSection, policy: RoutingPolicy | None = None, host: str = "127.0.0.1",
                 health_interval_s: float = 1.0, client_timeout_s: float = CLIENT_TIMEOUT_S,
                 key: ClusterKey | None = None, ports: tuple[int, int] = (0, 0),
                 membership_cls: type[Membership] = Membership) -> None:
        """`settings`: the deployment's router section; `policy` (tests) replaces its policy;
        `membership_cls`: how rank failures are handled (cluster/lb_node.py's for a group that
        cannot re-form)."""
        self.policy = policy if policy is not None else make_policy(settings.policy)
        self.host = host
        self.router_id = uuid.uuid4().hex[:16]  # told to clients: a new one means a restart
        self._plane = DataPlane(key, ROUTER)  # `key`: peers by role (cluster/data_plane.py)
        # clients -> router, ranks -> router; a frame that does not decode, or comes from the
        # wrong role, is dropped and counted (cluster/inbox.py)
        self._frontend = Inbox(self._plane, host, p.frontend_decoder, p.FROM_CLIENT_SENDERS, "router frontend",
                               port=ports[0], RCVHWM=0)
        self._backend = Inbox(self._plane, host, p.router_decoder, p.FROM_RANK_SENDERS, "router backend",
                              port=ports[1], RCVHWM=0)
        self.frontend_address = self._frontend.address
        self.backend_address = self._backend.address
        self._lock = threading.RLock()
        self.waves = Waves()
        self.membership = membership_cls(self._plane, self._lock, self.waves, host, settings.collective_timeout_s,
                                     on_down=self._fail_requests_of, max_restarts=settings.max_rank_restarts)
        self.stats = StatsQueries()
        self._clients: dict[str, _Client] = {}
        self._requests: dict[str, tuple[str, int]] = {}  # request id -> (client id, dp rank)
        self.log = RequestLog()  # what moving a request to another rank needs (cluster/migration.py)
        self.elastic = ElasticScaler(self, self._lock, settings.collective_timeout_s)
        # rank_loss: shrink: a dead rank's requests move to the survivors (cluster/rank_loss.py)
        self.loss = LostRequests(self) if settings.rank_loss == "shrink" and self.membership.can_reform else None
        self.membership.shrink_on_loss = self.loss is not None
        self.membership.on_reform = self.loss.dispatch if self.loss is not None else None
        self._health_interval_s = health_interval_s
        self._client_timeout_s = client_timeout_s
        self._health_kick = threading.Event()  # set on GroupBroken: check the ranks now
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def attach_ranks(self, addresses: list[str], liveness: Liveness | None = None, up: list[bool] | None = None,
                     wave: int = 0, local: range | None = None) -> None:
        """The ranks; `up` and `wave` (the latest any rank is at) when a restarted router takes
        over running ranks; `local`: the ranks this router serves when other endpoints serve
        the rest (hybrid and external modes: the others are only woken for waves)."""
        self.membership.attach(addresses, liveness, up, local)
        self.waves.wave = max(self.waves.wave, wave)

    def start(self) -> Router:
        """Runs the loop and the health checks on background threads."""
        for target, name in ((self.serve_forever, "router-loop"), (self._health_loop, "router-health")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    # ---- the loop --------------------------------------------------------------------------
    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self._frontend.socket, zmq.POLLIN)
        poller.register(self._backend.socket, zmq.POLLIN)
        last_sweep = time.monotonic()
        while not self._stop.is_set():
            ready = dict(poller.poll(POLL_MS))
            with self._lock:
                if self._backend.socket in ready:
                    self._drain(self._backend, self._on_rank_message)
                if self._frontend.socket in ready:
                    self._drain(self._frontend, self._on_client_message)
                for client_id, reply in self.stats.ready(self.membership.health(), self.dropped_frames()):
                    self._to_client(client_id, reply)
                if time.monotonic() - last_sweep > 1.0:
                    last_sweep = time.monotonic()
                    self._drop_silent_clients()

    def _drain(self, inbox: Inbox, handle) -> None:
        while True:
            try:
                got = inbox.recv(zmq.NOBLOCK)  # None: a frame dropped (malformed, wrong sender)
            except zmq.Again:
                return
            try:
                if got is not None:
                    handle(*got)
            except Exception:  # a message the router cannot act on must not end the router
                logger.exception("dropping a message the router could not handle")

    def dropped_frames(self) -> dict[str, int]:
        """Frames the router's two sockets dropped, and handshakes its ZAP handler refused."""
        return {"malformed": self._frontend.dropped["malformed"] + self._backend.dropped["malformed"],
                "unauthorized": self._frontend.dropped["unauthorized"] + self._backend.dropped["unauthorized"],
                "refused_handshakes": self._plane.refused, "failed_handshakes": self._plane.failed_handshakes}

    # ---- from the clients --------------------------------------------------------------------
    def _on_client_message(self, msg, raw: bytes) -> None:
        client = self._clients.get(getattr(msg, "client_id", ""))
        if client is not None:
            client.last_seen = time.monotonic()
        if isinstance(msg, p.Hello):
            self._connect_client(msg)
        elif client is None:
            logger.warning("dropping %s from an unknown client", type(msg).__name__)
        elif isinstance(msg, p.AddRequest):
            self._dispatch(msg, client)
        elif isinstance(msg, p.Abort):
            self._abort(msg.client_id, msg.request_ids)
        elif isinstance(msg, p.StatsQuery):
            self.stats.start(msg.client_id, msg.query_id, self.membership.up())
        elif isinstance(msg, p.HealthQuery):
            self._to_client(msg.client_id, p.HealthReply(msg.query_id, self.membership.health(),
                                                         self.membership.group_failures, self.router_id,
                                                         self.elastic.state()))
        elif isinstance(msg, p.Goodbye):
            self._drop_client(msg.client_id)

    def _connect_client(self, msg: p.Hello) -> None:
        if msg.client_id in self._clients:
            return
        # no high-water mark: never block the loop on a slow client
        self._clients[msg.client_id] = _Client(self._plane.connected(zmq.PUSH, msg.address, CLIENT, SNDHWM=0))

    def _dispatch(self, msg: p.AddRequest, client: _Client) -> None:
        """Sharding: the policy picks a rank among those up and not leaving the group; the
        others are woken."""
        rid = msg.request_id
        up = self.membership.accepting()
        if not up:
            reasons = "; ".join(r.down_reason for r in self.membership.ranks)
            self._to_client(msg.client_id, p.RequestError(rid, "no_capacity", f"no DP rank is up: {reasons}"))
            return
        if rid in self._requests:
            self._to_client(msg.client_id, p.RequestError(rid, "rejected", f"request {rid} is already running"))
            return
        if msg.dp_rank >= 0:
            rank = self._pinned(msg)
        else:
            load = {r.dp_rank: len(r.inflight) for r in up}
            images = image_digests(msg.mm.images) if msg.mm is not None else ()
            rank = self.membership.ranks[self.policy.choose(msg.prompt_token_ids, load, images)]
        if rank is None:
            return
        client.requests.add(rid)
        self.log.add(msg)
        self.send_to(rank, msg)

    def send_to(self, rank: RankHandle, msg: p.AddRequest) -> None:
        """Sends a request to `rank` and wakes the others. Under the lock."""
        self.membership.work_arrives()
        self._requests[msg.request_id] = (msg.client_id, rank.dp_rank)
        rank.inflight.add(msg.request_id)
        rank.send(msg)
        self.waves.wake_others(rank, self.membership.ranks)

    def take_off(self, request_id: str) -> p.AddRequest | None:
        """Takes a running request off its rank (which leaves the group) and returns what
        continues it elsewhere by recompute, for send_to (cluster/migration.py); the old rank's
        later deltas for it are dropped (_deliver takes a request's deltas only from the rank
        it is on). One that cannot move fails with the reason (None). Under the lock."""
        entry = self._requests.get(request_id)
        if entry is None:
            return None
        old = self.membership.ranks[entry[1]]
        old.inflight.discard(request_id)
        try:
            moved = self.log.resubmission(request_id)
        except ValueError as e:
            self.fail_request(request_id, "rank_failed", f"{e}; DP rank {old.dp_rank} left the group before "
                                                         "it finished")
            return None
        if moved is None:
            self._forget(request_id)  # every token delivered, only the finish was still to come
            self._to_client(entry[0], p.Deltas(old.dp_rank, [TokenDelta(request_id, [], True, "length",
                                                                        dp_rank=old.dp_rank)]))
            return None
        self._requests[request_id] = (entry[0], -1)  # on no rank until send_to
        return moved

    def scale(self, new_size: int, drain_timeout_s: float) -> dict:
        """Grows or shrinks the DP group to `new_size` ranks while serving (cluster/elastic.py);
        blocks until done. Raises ScaleError (its status: 400, 409, 503)."""
        self.elastic.begin(new_size)
        return self.elastic.run(new_size, drain_timeout_s)

    def _pinned(self, msg: p.AddRequest) -> RankHandle | None:
        """The rank a request was pinned to, or None when it cannot take it (the client told why)."""
        served = [r.dp_rank for r in self.membership.local()]
        if msg.dp_rank not in served:
            self._to_client(msg.client_id, p.RequestError(msg.request_id, "rejected", (
                f"data_parallel_rank {msg.dp_rank}: this endpoint serves DP ranks {served}")))
            return None
        rank = self.membership.ranks[msg.dp_rank]
        if not rank.up:
            self._to_client(msg.client_id, p.RequestError(msg.request_id, "no_capacity", (
                f"data_parallel_rank {msg.dp_rank}: the rank is down: {rank.down_reason}")))
            return None
        return rank

    def _abort(self, client_id: str, request_ids: list[str]) -> None:
        by_rank: dict[int, list[str]] = defaultdict(list)
        for rid in request_ids:
            entry = self._forget(rid)
            if entry is not None and entry[0] == client_id:
                by_rank[entry[1]].append(rid)
        for dp_rank, rids in by_rank.items():
            if 0 <= dp_rank < len(self.membership.ranks) and self.membership.ranks[dp_rank].up:
                self.membership.ranks[dp_rank].send(p.Abort(rids))

    # ---- from the ranks ----------------------------------------------------------------------
    def _on_rank_message(self, msg, raw: bytes) -> None:
        ranks = self.membership.ranks
        if isinstance(msg, (p.Deltas, p.StartWave, p.WaveDone)):
            self.membership.stepped(msg.dp_rank)  # /health's stall check
        if isinstance(msg, p.Deltas):
            self._deliver(msg, raw)
        elif isinstance(msg, p.StartWave):
            self.waves.start_wave(msg, ranks)
        elif isinstance(msg, p.WaveDone):
            self.waves.wave_done(msg)
        elif isinstance(msg, p.Rejected):
            entry = self._forget(msg.request_id)
            if entry is not None:
                self._to_client(entry[0], p.RequestError(msg.request_id, "rejected", msg.message))
        elif isinstance(msg, p.Stats):
            self.stats.on_stats(msg)
        elif isinstance(msg, p.Reformed):
            self.membership.reformed(msg)
        elif isinstance(msg, p.GroupBroken):
            self._fail_lost(msg)
            if self.membership.group_broken(msg):
                self._health_kick.set()  # liveness calls can block: not on this thread

    def _fail_lost(self, msg: p.GroupBroken) -> None:
        """Requests a failed MoE step took down are failed (or, under rank_loss: shrink, moved)
        even while a re-form is under way (their rank will never report them)."""
        lost = [rid for rid in msg.request_ids if self._requests.get(rid, ("", -1))[1] == msg.dp_rank]
        if self.loss is not None:  # not those moved to another rank before this one lost them
            self.loss.move(lost, now=self.membership.reformed_since(msg.wave))
            return
        for rid in lost:
            self.fail_request(rid, "rank_failed", f"request {rid}: DP rank {msg.dp_rank} lost it: {msg.message}")

    def _deliver(self, msg: p.Deltas, raw: bytes) -> None:
        """Each client gets its own requests' deltas; a delta of an aborted request is dropped,
        and one of a request this router never saw (its predecessor's, before a restart) is
        aborted on its rank."""
        per_client: dict[str, list] = defaultdict(list)
        unknown = []
        as_sent = True  # every delta goes on unchanged
        for delta in msg.deltas:
            entry = self._requests.get(delta.request_id)
            if entry is None:
                if not delta.finished:
                    unknown.append(delta.request_id)
                continue
            if entry[1] != msg.dp_rank:
                as_sent = False
                continue  # from the rank a migrated request left: its new rank continues it
            shown = self.log.delivered(delta)
            as_sent = as_sent and shown is delta
            if delta.finished:
                self._forget(delta.request_id)
            per_client[entry[0]].append(shown)
        if unknown and 0 <= msg.dp_rank < len(self.membership.ranks) and self.membership.ranks[msg.dp_rank].up:
            self.membership.ranks[msg.dp_rank].send(p.Abort(unknown))
        if as_sent and len(per_client) == 1 and sum(map(len, per_client.values())) == len(msg.deltas):
            client_id = next(iter(per_client))  # the common case: pass the message on as it came
            self._to_client_raw(client_id, raw)
            return
        for client_id, deltas in per_client.items():
            self._to_client(client_id, p.Deltas(msg.dp_rank, deltas))

    # ---- bookkeeping -------------------------------------------------------------------------
    def _forget(self, request_id: str) -> tuple[str, int] | None:
        entry = self._requests.pop(request_id, None)
        self.log.forget(request_id)
        if entry is not None:
            client = self._clients.get(entry[0])
            if client is not None:
                client.requests.discard(request_id)
            if 0 <= entry[1] < len(self.membership.ranks):
                self.membership.ranks[entry[1]].inflight.discard(request_id)
        return entry

    def _fail_requests_of(self, rank: RankHandle, reason: str) -> None:
        """Membership marked `rank` down: its in-flight requests fail (rank_loss: shrink: move)."""
        if self.loss is not None:
            self.loss.move(sorted(rank.inflight), now=False)
            return
        for rid in sorted(rank.inflight):
            self.fail_request(rid, "rank_failed", f"request {rid}: {reason}")

    def fail_request(self, request_id: str, kind: str, message: str) -> None:
        """Ends a request with an error its client gets (RequestError `kind`). Under the lock."""
        entry = self._forget(request_id)
        if entry is not None:
            self._to_client(entry[0], p.RequestError(request_id, kind, message))

    def _to_client(self, client_id: str, msg) -> None:
        self._to_client_raw(client_id, p.encoder.encode(msg))

    def _to_client_raw(self, client_id: str, raw: bytes) -> None:
        client = self._clients.get(client_id)
        if client is not None:
            client.socket.send(raw)

    def _drop_silent_clients(self) -> None:
        now = time.monotonic()
        for client_id, client in list(self._clients.items()):
            if now - client.last_seen > self._client_timeout_s:
                logger.warning("client %s silent for %.0fs: aborting its %d request(s)", client_id,
                               now - client.last_seen, len(client.requests))
                self._drop_client(client_id)

    def _drop_client(self, client_id: str) -> None:
        client = self._clients.get(client_id)
        if client is not None:
            self._abort(client_id, list(client.requests))
            del self._clients[client_id]
            client.socket.close(linger=0)

    # ---- health and shutdown -------------------------------------------------------------------
    def _health_loop(self) -> None:
        while not self._stop.is_set():
            self._health_kick.wait(self._health_interval_s)
            self._health_kick.clear()
            if not self._stop.is_set():
                try:
                    self.membership.check()
                except Exception:  # a failed check is retried next turn; the router keeps routing
                    logger.exception("the rank health check failed")

    def close(self) -> None:
        """Asks every rank to shut down and stops the threads (the launcher ends the processes);
        safe to call twice."""
        if self._stop.is_set():
            return
        self.membership.close()
        self._stop.set()
        self._health_kick.set()
        for t in self._threads:
            t.join(timeout=5)
        with self._lock:
            for client in self._clients.values():
                client.socket.close(linger=0)
            self._clients.clear()
        self._frontend.close()
        self._backend.close()
        self._plane.close()
