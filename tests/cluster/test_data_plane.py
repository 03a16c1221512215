"""The data plane's CURVE authentication (cluster/data_plane.py): with a cluster key, the
router and the ranks refuse peers that do not hold it (a plain socket, or a CURVE socket with
a key pair of its own), nothing those peers send takes effect, and the cluster keeps serving
the peers that do hold it. Forced on for 127.0.0.1 here; `auto` turns it on off loopback."""

from __future__ import annotations

import queue
import time

import pytest
import zmq
from test_router import PARAMS, _outcome, cluster

from deepinfer_dp.cluster import protocol as p
from deepinfer_dp.cluster.data_plane import ClusterKey, DataPlane, cluster_key_for

ATTACK_WAIT_S = 1.5  # long enough for a handshake and a delivery on loopback (both take ms)


def test_key_is_made_off_loopback_or_when_forced_and_never_printed():
    assert cluster_key_for("127.0.0.1") is None and cluster_key_for("::1", "auto") is None
    assert cluster_key_for("10.1.2.3", "off") is None
    a, b = cluster_key_for("10.1.2.3"), cluster_key_for("127.0.0.1", "on")
    assert a is not None and b is not None and a.secret != b.secret  # fresh for every deployment
    assert len(a.public) == len(a.secret) == 40  # Z85 text of 32-byte keys
    assert a.secret.decode() not in repr(a)
    with pytest.raises(ValueError, match="data_plane_auth"):
        cluster_key_for("127.0.0.1", "yes")


class _Intruder:
    """A peer without the cluster's secret: `keypair` None is a plain socket, else a CURVE
    client with a key pair of its own that knows the cluster's public key."""

    def __init__(self, public_key: bytes, keypair: tuple[bytes, bytes] | None) -> None:
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.address = f"tcp://127.0.0.1:{self.inbox.bind_to_random_port('tcp://127.0.0.1')}"
        self._public_key, self._keypair = public_key, keypair
        self.sockets = [self.inbox]

    def push(self, address: str, *messages) -> None:
        sock = self.ctx.socket(zmq.PUSH)
        if self._keypair is not None:
            sock.curve_serverkey = self._public_key
            sock.curve_publickey, sock.curve_secretkey = self._keypair
        sock.connect(address)
        for msg in messages:
            sock.send(p.encoder.encode(msg))
        self.sockets.append(sock)

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)
        self.ctx.term()


@pytest.mark.parametrize("intruder_keys", ["plain", "own_keypair"])
def test_router_and_ranks_refuse_a_peer_without_the_key_and_keep_serving(intruder_keys):
    key = ClusterKey.generate()
    with cluster(key=key) as (router, ranks, _, new_client):
        c = new_client()
        q = queue.Queue()
        c.submit("before", [1], PARAMS, q.put)
        assert _outcome(q)[1].finish_reason == "length"
        bad = _Intruder(key.public, None if intruder_keys == "plain" else zmq.curve_keypair())
        try:
            # As a client: a Hello, a request and a stats query to the router's frontend.
            bad.push(router.frontend_address, p.Hello("intruder", bad.address),
                     p.AddRequest("stolen", [1, 2], {}, "intruder"), p.StatsQuery(0, "intruder"))
            # As a rank: a forged result and a failed vote to the router's backend.
            bad.push(router.backend_address, p.Deltas(0, []), p.GroupBroken(0, 0, "forged", []))
            # As the router: a request and a Shutdown straight to a rank.
            bad.push(ranks[0].address, p.AddRequest("forged", [1], {}, "intruder"), p.Shutdown())
            time.sleep(ATTACK_WAIT_S)
            assert bad.inbox.poll(0) == 0  # the router never connected back to it
            for r in ranks:
                got = []
                while not r.received.empty():
                    got.append(r.received.get())
                assert not [m for m in got if isinstance(m, p.Shutdown)
                            or isinstance(m, p.AddRequest) and m.request_id in ("stolen", "forged")]
            assert "intruder" not in router._clients and router.membership.group_failures == 0
            for i in range(4):  # both ranks still serve the client that holds the key
                q = queue.Queue()
                c.submit(f"after{i}", [1], PARAMS, q.put)
                assert _outcome(q)[1].finish_reason == "length"
        finally:
            bad.close()


def test_a_peer_with_the_key_is_accepted_and_one_without_is_refused_at_the_handshake():
    """The socket layer itself: a monitor on the bound socket sees the refused handshakes."""
    key = ClusterKey.generate()
    plane = DataPlane(key)
    server = plane.bound(zmq.PULL, "127.0.0.1")
    address = server.getsockopt_string(zmq.LAST_ENDPOINT)
    monitor = server.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                        | zmq.EVENT_HANDSHAKE_SUCCEEDED)
    bad = _Intruder(key.public, zmq.curve_keypair())
    friend = DataPlane(key)
    try:
        bad.push(address, p.Shutdown())
        assert _next_event(monitor) == zmq.EVENT_HANDSHAKE_FAILED_AUTH
        sock = friend.connected(zmq.PUSH, address)
        sock.send(p.encoder.encode(p.Wake(7)))
        assert _next_event(monitor) == zmq.EVENT_HANDSHAKE_SUCCEEDED
        assert server.poll(5000) and p.rank_decoder.decode(server.recv()) == p.Wake(7)  # only the friend's
        assert server.poll(ATTACK_WAIT_S * 1000) == 0
        sock.close(linger=0)
    finally:
        bad.close()
        server.disable_monitor()
        monitor.close(linger=0)
        server.close(linger=0)
        friend.close()
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


def _next_event(monitor: zmq.Socket, timeout_s: float = 5.0) -> int:
    from zmq.utils.monitor import recv_monitor_message

    assert monitor.poll(timeout_s * 1000), "no handshake event"
    return recv_monitor_message(monitor)["event"]
