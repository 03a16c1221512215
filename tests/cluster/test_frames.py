"""Garbage on the data plane: frames that do not decode (random bytes, not msgpack, msgpack of
the wrong shape or types, huge, empty, multipart) sent by peers that hold the right key to
every receiving socket (the router's two, a client's, a real rank's) are counted and
dropped; every receive loop goes on, and the requests after them come out the same."""

from __future__ import annotations

import queue
import random
import threading
import time

import msgspec
import zmq
from test_router import PARAMS, _outcome, cluster

from deepinfer_dp.cluster import protocol as p
from deepinfer_dp.cluster.data_plane import CLIENT, RANK, ROUTER, ClusterKey, DataPlane
from deepinfer_dp.cluster.inbox import Inbox
from deepinfer_dp.metrics.rank_collector import drop_families
from deepinfer_dp.sampling_params import SamplingParams

HUGE = 32 * 2**20


def garbage() -> list[bytes]:
    """One frame of each kind that must not decode into any message."""
    rng = random.Random(0)
    enc = msgspec.msgpack.encode
    return [
        bytes(rng.getrandbits(8) for _ in range(256)),  # random bytes
        b"not msgpack!!",  # 13 bytes, as the probe sent
        b"",
        enc([1, 2, 3]),  # msgpack of the wrong shape
        enc({"type": "NoSuchMessage"}),
        enc({"type": "AddRequest", "request_id": 5}),  # fields missing, wrong types
        enc({"type": "Wake", "wave": "soon"}),
        enc({"type": "AddRequest", "request_id": "x", "prompt_token_ids": ["a"], "params": {}}),
        enc({"type": "Deltas", "dp_rank": 0, "deltas": [{"request_id": 1}]}),
        # images past the wire's bounds, or of the wrong shape
        enc({"type": "AddRequest", "request_id": "x", "prompt_token_ids": [1], "params": {},
             "mm": {"prompt": "x", "images": [{"url": "u"}] * (p.MAX_WIRE_IMAGES + 1)}}),
        enc({"type": "AddRequest", "request_id": "x", "prompt_token_ids": [1], "params": {},
             "mm": {"prompt": "x", "images": ["data:image/png;base64,AAAA"]}}),
        b"\xcf" + b"\xff" * 4,  # a uint64 cut short
        rng.randbytes(HUGE),  # huge
    ]


def _send_garbage(plane: DataPlane, address: str, server: str) -> int:
    sock = plane.connected(zmq.PUSH, address, server)
    frames = garbage()
    for frame in frames:
        sock.send(frame)
    sock.send_multipart([b"\x00\x01", b"\xc1"])  # two parts, neither decodes
    sock.close(linger=5000)
    return len(frames) + 2


def _wait_for(check, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_router_and_clients_drop_garbage_and_serve_on():
    key = ClusterKey.generate()
    with cluster(key=key) as (router, _, _, new_client):
        a, b = new_client(), new_client()
        planes = {role: DataPlane(key, role) for role in (CLIENT, RANK, ROUTER)}
        try:
            n = _send_garbage(planes[CLIENT], router.frontend_address, ROUTER)
            _send_garbage(planes[RANK], router.backend_address, ROUTER)
            _send_garbage(planes[ROUTER], a._address, CLIENT)
            _wait_for(lambda: router.dropped_frames()["malformed"] == 2 * n, "the router did not drop them all")
            _wait_for(lambda: a.dropped_frames()["malformed"] == n, "the client did not drop them all")
            assert router.dropped_frames()["unauthorized"] == 0
            a.query_stats()  # /metrics asks the same: the router's counters come with the reply
            drops = {tuple(s.labels.values()): s.value for f in drop_families(a) for s in f.samples}
            assert drops[("router", "malformed")] == 2 * n and drops[("client", "malformed")] == n, drops
            assert drops[("router", "unauthorized")] == drops[("client", "unauthorized")] == 0, drops
            for c in (a, b):
                for i in range(4):
                    q = queue.Queue()
                    c.submit(f"after{i}", [1], PARAMS, q.put)
                    deltas, last = _outcome(q)
                    assert last.finish_reason == "length" and len(deltas) == 2
                assert all(h["up"] for h in c.health())
        finally:
            for plane in planes.values():
                plane.close()


class _Router:
    """The test plays the router for one real RankServer: a backend inbox and a PUSH to the rank."""

    def __init__(self, key: ClusterKey) -> None:
        self.plane = DataPlane(key, ROUTER)
        self.inbox = Inbox(self.plane, "127.0.0.1", p.router_decoder, p.FROM_RANK_SENDERS, "test router")
        self.to_rank = None

    def connect(self, address: str) -> None:
        self.to_rank = self.plane.connected(zmq.PUSH, address, RANK)

    def send(self, msg) -> None:
        self.to_rank.send(p.encoder.encode(msg))

    def tokens(self, request_id: str, prompt: list[int], params: SamplingParams) -> list[int]:
        self.send(p.AddRequest(request_id, prompt, p.params_to_wire(params)))
        out = []
        while True:
            assert self.inbox.socket.poll(60_000), "the rank did not answer"
            msg = self.inbox.recv()[0]
            for d in msg.deltas if isinstance(msg, p.Deltas) else []:
                if d.request_id == request_id:
                    out += d.token_ids
                    if d.finished:
                        assert d.finish_reason == "length", d
                        return out

    def close(self) -> None:
        self.to_rank.close(linger=0)
        self.inbox.close()
        self.plane.close()


def test_a_rank_drops_garbage_from_the_router_and_serves_on(tiny_model_dir):
    from deepinfer_dp.cluster.rank import RankServer
    from deepinfer_dp.config import EngineConfig
    from deepinfer_dp.engine.llm_engine import LLMEngine

    key = ClusterKey.generate()
    router = _Router(key)
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, max_num_seqs=2, torch_threads=1))
    rank = RankServer(engine, 0, router.inbox.address, key=key)
    thread = threading.Thread(target=rank.serve, daemon=True)
    thread.start()
    router.connect(rank.address)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    try:
        before = router.tokens("before", [5, 6, 7, 8], params)
        n = _send_garbage(router.plane, rank.address, RANK)
        _wait_for(lambda: rank.stats()["dropped_frames"] == n, "the rank did not drop them all")
        assert thread.is_alive()
        assert router.tokens("after", [5, 6, 7, 8], params) == before
        router.send(p.Shutdown())  # the router's own Shutdown still stops it
        thread.join(timeout=30)
        assert not thread.is_alive()
    finally:
        router.close()
