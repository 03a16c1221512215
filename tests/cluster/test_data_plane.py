"""The data plane's CURVE authentication (cluster/data_plane.py): one key pair per role
(router, rank, client); each socket admits only the roles that may send to it, so a peer
without a key, or with the key of another role, is refused at the handshake and nothing it
sends takes effect, while the peers that hold the right keys are served on. Behind the
handshake each message's sender is checked against its type (cluster/inbox.py)."""

from __future__ import annotations

import queue
import time

import pytest
import zmq
from test_router import PARAMS, _outcome, cluster

from deepinfer_dp.cluster import protocol as p
from deepinfer_dp.cluster.data_plane import CLIENT, RANK, ROUTER, ClusterKey, DataPlane, cluster_key_for
from deepinfer_dp.cluster.inbox import Inbox

ATTACK_WAIT_S = 1.5  # long enough for a handshake and a delivery on loopback (both take ms)


def test_keys_are_made_on_every_host_unless_off_and_never_printed():
    for host in ("127.0.0.1", "::1", "10.1.2.3"):
        assert cluster_key_for(host) is not None and cluster_key_for(host, "on") is not None
        assert cluster_key_for(host, "off") is None
    a, b = cluster_key_for("127.0.0.1"), cluster_key_for("127.0.0.1")
    assert a.secrets[ROUTER] != b.secrets[ROUTER]  # fresh for every deployment
    assert len({a.publics[r] for r in (ROUTER, RANK, CLIENT)}) == 3  # one pair per role
    assert all(len(k) == 40 for k in (*a.publics.values(), *a.secrets.values()))  # Z85 of 32 bytes
    assert not any(s.decode() in repr(a) for s in a.secrets.values())
    client = a.for_role(CLIENT)  # what an API server process is given
    assert set(client.secrets) == {CLIENT} and client.publics == a.publics
    with pytest.raises(ValueError, match="router key"):
        DataPlane(client, ROUTER)
    with pytest.raises(ValueError, match="data_plane_auth"):
        cluster_key_for("127.0.0.1", "yes")


class _Intruder:
    """A peer of the deployment's sockets: `key` None is a plain socket; else a CURVE client
    that presents `key`'s pair for `role` (a stranger's key: a pair of its own)."""

    def __init__(self, server_keys: dict[str, bytes], key: ClusterKey | None = None, role: str = CLIENT) -> None:
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.address = f"tcp://127.0.0.1:{self.inbox.bind_to_random_port('tcp://127.0.0.1')}"
        self._server_keys, self._key, self._role = server_keys, key, role
        self.sockets = [self.inbox]

    def push(self, address: str, server_role: str, *messages) -> None:
        sock = self.ctx.socket(zmq.PUSH)
        if self._key is not None:
            sock.curve_serverkey = self._server_keys[server_role]
            sock.curve_publickey, sock.curve_secretkey = self._key.pair(self._role)
        sock.connect(address)
        self.sockets.append(sock)
        for msg in messages:
            # Never block: a PUSH whose handshake was refused may have no pipe to queue on, and a
            # send that waits for one hangs the test (what matters is that nothing gets through).
            try:
                sock.send(msg if isinstance(msg, bytes) else p.encoder.encode(msg), zmq.NOBLOCK)
            except zmq.Again:
                pass

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)
        self.ctx.term()


def _forge_everything(bad: _Intruder, router, ranks, victim_client, role: str | None) -> None:
    """Forged messages to every socket that `role` (the key the intruder holds) may not use."""
    if role != CLIENT:  # as a client: a Hello, a request and a stats query to the router's frontend
        bad.push(router.frontend_address, ROUTER, p.Hello("intruder", bad.address),
                 p.AddRequest("stolen", [1, 2], {}, "intruder"), p.StatsQuery(0, "intruder"))
    if role != RANK:  # as a rank: a forged result and a failed vote to the router's backend
        bad.push(router.backend_address, ROUTER, p.Deltas(0, []), p.GroupBroken(0, 0, "forged", []))
    # As the router: a request, a Reform and a Shutdown straight to a rank.
    bad.push(ranks[0].address, RANK, p.AddRequest("forged", [1], {}, "intruder"),
             p.Reform("127.0.0.1", 1, 0, 1, 0), p.Shutdown())
    # As the router to a client: every rank down.
    bad.push(victim_client._address, CLIENT, p.HealthReply(-1, [{"dp_rank": 0, "up": False}]))


@pytest.mark.parametrize("intruder", ["plain", "own_keypair", "client_key", "rank_key"])
def test_router_ranks_and_clients_refuse_a_peer_without_the_right_key(intruder):
    """A stranger (no key, or a pair of its own) is refused everywhere; a client's key only
    opens the router's frontend, a rank's only its backend, so neither can stop a rank."""
    key = ClusterKey.generate()
    with cluster(key=key) as (router, ranks, _, new_client):
        c = new_client()
        q = queue.Queue()
        c.submit("before", [1], PARAMS, q.put)
        assert _outcome(q)[1].finish_reason == "length"
        holds = {"plain": None, "own_keypair": ClusterKey.generate(), "client_key": key, "rank_key": key}[intruder]
        bad = _Intruder(key.publics, holds, RANK if intruder == "rank_key" else CLIENT)
        try:
            _forge_everything(bad, router, ranks, c, {"client_key": CLIENT, "rank_key": RANK}.get(intruder))
            time.sleep(ATTACK_WAIT_S)
            assert bad.inbox.poll(0) == 0  # the router never connected back to it
            if intruder == "plain":  # no CURVE at all: the handshake fails before ZAP is asked, counted
                assert router.dropped_frames()["failed_handshakes"] >= 2, router.dropped_frames()
                assert c.dropped_frames()["failed_handshakes"] >= 1, c.dropped_frames()
            for r in ranks:
                got = []
                while not r.received.empty():
                    got.append(r.received.get())
                assert not [m for m in got if isinstance(m, (p.Shutdown, p.Reform))
                            or isinstance(m, p.AddRequest) and m.request_id in ("stolen", "forged")]
            assert "intruder" not in router._clients and router.membership.group_failures == 0
            assert all(h["up"] for h in c.health())
            for i in range(4):  # both ranks still serve the client that holds the key
                q = queue.Queue()
                c.submit(f"after{i}", [1], PARAMS, q.put)
                assert _outcome(q)[1].finish_reason == "length"
        finally:
            bad.close()


def test_each_socket_refuses_the_roles_that_may_not_send_to_it_at_the_handshake():
    """The socket layer itself: a rank's inbox refuses a client's and a rank's handshakes (its
    ZAP handler counts them; the socket's one monitor is the plane's, which counts the
    handshakes that fail before ZAP) and takes the router's message."""
    key = ClusterKey.generate()
    rank_plane, router_plane = DataPlane(key, RANK), DataPlane(key, ROUTER)
    server = rank_plane.bound(zmq.PULL, "127.0.0.1", (ROUTER,))
    address = server.getsockopt_string(zmq.LAST_ENDPOINT)
    client, other_rank = _Intruder(key.publics, key, CLIENT), _Intruder(key.publics, key, RANK)
    try:
        client.push(address, RANK, p.Shutdown())
        _wait_until(lambda: rank_plane.refused == 1)
        other_rank.push(address, RANK, p.Shutdown())
        _wait_until(lambda: rank_plane.refused == 2)
        sock = router_plane.connected(zmq.PUSH, address, RANK)
        sock.send(p.encoder.encode(p.Wake(7)))
        assert server.poll(5000) and p.rank_decoder.decode(server.recv()) == p.Wake(7)  # only the router's
        assert server.poll(ATTACK_WAIT_S * 1000) == 0
        assert (rank_plane.refused, rank_plane.failed_handshakes) == (2, 0)
        sock.close(linger=0)
    finally:
        client.close()
        other_rank.close()
        server.close(linger=0)
        rank_plane.close()
        router_plane.close()


def test_a_message_type_is_taken_only_from_the_role_allowed_to_send_it():
    """The second line behind the handshake: an inbox that admits two roles takes a Shutdown
    only from the router (the frame's User-Id, set by the ZAP handler, names the role)."""
    key = ClusterKey.generate()
    plane = DataPlane(key, RANK)
    senders = {p.Shutdown: (ROUTER,), p.Wake: (ROUTER, CLIENT)}
    inbox = Inbox(plane, "127.0.0.1", p.rank_decoder, senders, "test inbox")
    as_client, as_router = DataPlane(key, CLIENT), DataPlane(key, ROUTER)
    try:
        c = as_client.connected(zmq.PUSH, inbox.address, RANK)
        c.send(p.encoder.encode(p.Shutdown()))
        c.send(p.encoder.encode(p.Wake(1)))
        assert inbox.socket.poll(5000) and inbox.recv() is None  # the client's Shutdown: dropped
        assert inbox.socket.poll(5000) and inbox.recv()[0] == p.Wake(1)
        r = as_router.connected(zmq.PUSH, inbox.address, RANK)
        r.send(p.encoder.encode(p.Shutdown()))
        assert inbox.socket.poll(5000) and inbox.recv()[0] == p.Shutdown()
        assert inbox.dropped == {"malformed": 0, "unauthorized": 1}
        c.close(linger=0)
        r.close(linger=0)
    finally:
        inbox.close()
        as_client.close()
        as_router.close()
        plane.close()


def test_a_restarted_rank_gets_the_key_and_rejoins():
    key = ClusterKey.generate()
    with cluster(key=key, max_rank_restarts=1) as (router, ranks, liveness, new_client):
        c = new_client()
        liveness.restart_gate.set()
        liveness.dead.add(1)
        deadline = time.monotonic() + 20
        while not (liveness.restarted and all(h["up"] for h in c.health())):
            assert time.monotonic() < deadline, "the rank did not come back"
            time.sleep(0.1)
        try:
            for i in range(4):
                q = queue.Queue()
                c.submit(f"back{i}", [1], PARAMS, q.put)
                assert _outcome(q)[1].finish_reason == "length"
        finally:
            for r in liveness.restarted:
                r.close()


def _wait_until(check, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "no handshake refused"
        time.sleep(0.02)
