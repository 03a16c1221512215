"""A request's values are checked once on each path into an engine: offline (LLM.generate), the
server at dp 1, and the server over the router client to a rank, which trusts what arrives
(engine/input_processor.py). Counted: the validator (InputProcessor.process) and the sampling
values' check it runs (SamplingParams.verify)."""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
import zmq
from server_utils import MODEL_NAME, served

from deepinfer_dp import LLM
from deepinfer_dp.cluster import protocol as p
from deepinfer_dp.cluster.rank import RankServer
from deepinfer_dp.cluster.router_client import RouterClient
from deepinfer_dp.config import EngineConfig
from deepinfer_dp.engine.input_processor import InputProcessor
from deepinfer_dp.engine.llm_engine import LLMEngine
from deepinfer_dp.entrypoints.openai.launcher import ServerThread
from deepinfer_dp.sampling_params import SamplingParams

OPTIONS = {"kv_cache_memory_gb": 0.02, "seed": 0}
COMPLETION = {"model": MODEL_NAME, "prompt": "Hello there", "max_tokens": 3, "temperature": 0.7, "top_k": 5}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "top_p": 0.9}


@pytest.fixture
def calls(monkeypatch) -> Counter:
    counts: Counter = Counter()
    for owner, name in ((SamplingParams, "verify"), (InputProcessor, "process")):
        real = getattr(owner, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            counts[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)
    return counts


def test_offline_checks_each_prompt_once(model_dir, calls):
    llm = LLM(model_dir, **OPTIONS)
    calls.clear()  # the engine checked the model's sampling defaults once at start
    try:
        llm.generate("Hello there", SamplingParams(max_tokens=3, temperature=0.7), use_tqdm=False)
        assert calls == {"verify": 1, "process": 1}
        calls.clear()  # n samples of one prompt: still one check
        out = llm.generate("Hello there", SamplingParams(max_tokens=3, temperature=0.7, n=3), use_tqdm=False)
        assert len(out[0]) == 3 and calls == {"verify": 1, "process": 1}
    finally:
        llm.shutdown()


def test_server_at_dp_1_checks_once(model_dir, calls):
    with served(model_dir, **OPTIONS) as server:
        for route, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
            calls.clear()
            r = httpx.post(server.url + route, json=body, timeout=120)
            assert r.status_code == 200, r.text
            assert calls == {"verify": 1, "process": 1}, route


class _MiniRouter:
    """The router's part in one request, in-process: the client's messages to the rank and the
    rank's deltas back to the client; health queries answered so the client stays up."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.front = self._bound()
        self.back = self._bound()
        self.rank_box: zmq.Socket | None = None
        self.client_box: zmq.Socket | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _bound(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.PULL)
        sock.bind("tcp://127.0.0.1:*")
        return sock

    def address(self, sock: zmq.Socket) -> str:
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def connect_rank(self, address: str) -> None:
        self.rank_box = self.ctx.socket(zmq.PUSH)
        self.rank_box.connect(address)
        self.thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        poller.register(self.back, zmq.POLLIN)
        while not self.stop.is_set():
            for sock, _ in poller.poll(50):
                raw = sock.recv()
                msg = (p.frontend_decoder if sock is self.front else p.router_decoder).decode(raw)
                if isinstance(msg, p.Hello):
                    self.client_box = self.ctx.socket(zmq.PUSH)
                    self.client_box.connect(msg.address)
                elif isinstance(msg, p.HealthQuery) and self.client_box is not None:
                    up = {"dp_rank": 0, "up": True, "inflight": 0, "reason": ""}
                    self.client_box.send(p.encoder.encode(p.HealthReply(msg.query_id, [up])))
                elif isinstance(msg, (p.AddRequest, p.Abort)):
                    self.rank_box.send(p.encoder.encode(msg))
                elif isinstance(msg, p.Deltas):
                    self.client_box.send(p.encoder.encode(msg))

    def close(self) -> None:
        self.rank_box.send(p.encoder.encode(p.Shutdown()))
        self.stop.set()
        self.thread.join(timeout=10)
        self.ctx.destroy(linger=0)


@contextlib.contextmanager
def _server_over_a_rank(model_dir: str) -> Iterator[ServerThread]:
    engine = LLMEngine(EngineConfig(model=model_dir, **OPTIONS))
    router = _MiniRouter()
    rank = RankServer(engine, 0, router.address(router.back))
    router.connect_rank(rank.address)
    rank_thread = threading.Thread(target=rank.serve, daemon=True)
    rank_thread.start()
    client = RouterClient(router.address(router.front), engine.tokenizer, MODEL_NAME, engine.max_model_len,
                          InputProcessor(engine.vocab_size, engine.max_model_len))
    server = ServerThread(client, MODEL_NAME, None).start()
    try:
        yield server
    finally:
        server.stop()
        client.close()
        router.close()
        rank_thread.join(timeout=30)


def test_server_over_the_router_client_checks_once_and_the_rank_trusts_it(model_dir, calls):
    with _server_over_a_rank(model_dir) as server:
        for route, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
            calls.clear()
            r = httpx.post(server.url + route, json=body, timeout=120)
            assert r.status_code == 200, r.text
            assert calls == {"verify": 1, "process": 1}, route
