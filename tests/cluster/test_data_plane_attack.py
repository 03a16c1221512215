"""An outsider on the machine attacks `deepinfer-dp serve --dp-size 2 --api-server-count 2`
through the data plane, as the probe did: it finds every ZeroMQ port of every process of the
deployment (the router's two, each rank's, each API server's) and sends each of them garbage
(random bytes, not msgpack, msgpack of the wrong shape, huge frames, raw TCP junk) and
well-formed forged messages (Shutdown, Reform, AddRequest, Deltas, a HealthReply saying every
rank is down...), over plain sockets and over CURVE with a key pair of its own, again and
again while streaming requests run. Nothing dies, the streams equal a run without the attack,
/health stays ok throughout, and /metrics counts the failed handshakes of every process."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import threading
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
import psutil  # noqa: E402
import pytest  # noqa: E402
import zmq  # noqa: E402
from server_utils import serve_command, stop_serve_command, tiny_model_dir  # noqa: E402
from test_frames import garbage  # noqa: E402

from deepinfer_dp.cluster import protocol as p  # noqa: E402
from deepinfer_dp.engine.client import TokenDelta  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [f"Stream number {i} goes on and on" for i in range(4)]
MAX_TOKENS = 48
ATTACK_ROUNDS = 2
ZMTP_SIGNATURE = (0xFF, 0x7F)  # a ZeroMQ peer's greeting: bytes 0 and 9, sent at once on connect

FORGED = [p.Shutdown(), p.Reform("127.0.0.1", 1, 0, 1, 0), p.Wake(10**6),
          p.AddRequest("forged", [1, 2, 3], {"max_tokens": 1000}, "intruder"), p.Abort(["cmpl-0"], "intruder"),
          p.Hello("intruder", "tcp://127.0.0.1:9"), p.StatsQuery(0, "intruder"), p.HealthQuery("intruder", 0),
          p.Deltas(0, [TokenDelta("forged", [1], True, "stop")]), p.GroupBroken(0, 0, "forged", []),
          p.HealthReply(-1, [{"dp_rank": 0, "up": False}, {"dp_rank": 1, "up": False}]),
          p.RequestError("forged", "rank_failed", "forged")]


def deployment_processes(root: int) -> dict[str, list[psutil.Process]]:
    """The router, rank and API server processes under the `serve` process `root`."""
    found: dict[str, list[psutil.Process]] = {"router": [], "rank": [], "api_server": []}
    for proc in psutil.Process(root).children(recursive=True):
        try:
            cmd = " ".join(proc.cmdline())
        except psutil.NoSuchProcess:
            continue
        if "RouterActor" in cmd:
            found["router"].append(proc)
        elif "RankActor" in cmd:
            found["rank"].append(proc)
        elif "multiprocessing.spawn" in cmd:
            found["api_server"].append(proc)
    return found


def zmq_ports(procs: list[psutil.Process]) -> list[int]:
    """The ports these processes listen on whose peer greets as ZeroMQ (Ray's gRPC, Gloo and
    the HTTP server wait for the client to speak first)."""
    ports = []
    for proc in procs:
        for c in proc.net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN and greets_as_zmq(c.laddr.port):
                ports.append(c.laddr.port)
    return sorted(set(ports))


def greets_as_zmq(port: int, host: str = "127.0.0.1") -> bool:
    with socket.create_connection((host, port), timeout=2) as s:
        s.settimeout(1.0)
        got = b""
        try:
            while len(got) < 10:
                chunk = s.recv(10 - len(got))
                if not chunk:
                    break
                got += chunk
        except TimeoutError:
            pass
    return len(got) == 10 and (got[0], got[9]) == ZMTP_SIGNATURE


def attack(ports: list[int], host: str = "127.0.0.1") -> None:
    """One round on every port: raw TCP junk, then garbage and forged frames over a plain
    ZeroMQ socket and over CURVE with a key pair of its own (it cannot know the servers')."""
    ctx = zmq.Context()
    frames = [*garbage(), *(p.encoder.encode(m) for m in FORGED)]
    try:
        for port in ports:
            with socket.create_connection((host, port), timeout=2) as s:
                s.sendall(os.urandom(4096))
            for curve in (False, True):
                sock = ctx.socket(zmq.PUSH)
                if curve:
                    sock.curve_serverkey = zmq.curve_keypair()[0]
                    sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
                sock.connect(f"tcp://{host}:{port}")
                for frame in frames:
                    try:  # a peer refused at the handshake takes nothing: a blocking send would hang
                        sock.send(frame, zmq.NOBLOCK)
                    except zmq.Again:
                        break
                sock.close(linger=100)  # long enough for the handshake attempt
    finally:
        ctx.term()


async def streams(url: str) -> list[str]:
    async def one(prompt: str) -> str:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "stream": True, "ignore_eos": True}
        text, finish = "", None
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choice = json.loads(line[6:])["choices"][0]
                    text += choice["text"]
                    finish = choice.get("finish_reason") or finish
        assert finish == "length", (prompt, text)
        return text

    async with httpx.AsyncClient(timeout=120) as client:
        return await asyncio.gather(*[one(prompt) for prompt in PROMPTS])


def _health_ok(url: str) -> bool:
    r = httpx.get(url + "/health", timeout=30)
    return r.status_code == 200 and r.json()["status"] == "ok" and not any(x["restarts"] for x in r.json()["ranks"])


def failed_handshakes(metrics: str) -> dict[str, float]:
    """Connections whose handshake failed, by process, from a /metrics page."""
    found = {}
    for line in metrics.splitlines():
        m = re.match(r'deepinfer:data_plane_drops_total\{process="(\w+)",reason="failed_handshakes"\} (\S+)', line)
        if m:
            found[m[1]] = float(m[2])
        m = re.match(r'deepinfer:data_plane_failed_handshakes_total\{dp_rank="(\d+)"\} (\S+)', line)
        if m:
            found[f"rank {m[1]}"] = float(m[2])
    return found


@pytest.mark.slow
def test_garbage_and_forged_frames_on_every_port_change_nothing(tmp_path):
    model = tiny_model_dir(tmp_path / "models")
    # max_num_seqs 1: every request runs alone on its rank, so its tokens cannot depend on
    # how it was batched, only on whether the attack changed anything.
    proc, url = serve_command("--config", str(ROOT / "configs" / "tiny_test.yaml"), "--model", model,
                              "--dp-size", "2", "--api-server-count", "2", "--max-num-seqs", "1",
                              "--served-model-name", "tiny", env={"RAY_AUTH_MODE": "disabled"})
    try:
        procs = deployment_processes(proc.pid)
        # the router (and its warm standby), the ranks (and the spare), the API servers
        assert len(procs["router"]) >= 1 and len(procs["rank"]) >= 2 and len(procs["api_server"]) == 2, procs
        pids = sorted(q.pid for group in procs.values() for q in group)
        ports = zmq_ports([q for group in procs.values() for q in group])
        # the router's two and the DP group's store, one per rank, one per API server
        assert len(ports) == 3 + 2 + 2, ports
        reference = asyncio.run(streams(url))

        stop, health = threading.Event(), []

        def keep_attacking() -> None:
            while not stop.is_set():
                attack(ports)
                health.append(_health_ok(url))

        attacker = threading.Thread(target=keep_attacking, daemon=True)
        attacker.start()
        attacked = []
        try:  # streams back to back until the attacker has finished ATTACK_ROUNDS rounds
            while len(health) < ATTACK_ROUNDS:
                attacked.append(asyncio.run(streams(url)))
        finally:
            stop.set()
            attacker.join(timeout=120)
        assert attacked and all(a == reference for a in attacked)
        assert len(health) >= ATTACK_ROUNDS and all(health), health
        assert _health_ok(url)
        after = deployment_processes(proc.pid)
        assert sorted(q.pid for group in after.values() for q in group) == pids  # nothing died or restarted
        assert asyncio.run(streams(url)) == reference
        # /metrics counts the failed handshakes: the router's, the answering API server's, every rank's
        failed = failed_handshakes(httpx.get(url + "/metrics", timeout=30).text)
        assert failed["router"] > 0 and failed["client"] > 0, failed
        assert [failed[f"rank {r}"] > 0 for r in (0, 1)] == [True, True], failed
    finally:
        code = stop_serve_command(proc)
    assert code == 0, proc.stderr.read()[-3000:]
