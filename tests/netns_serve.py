"""`deepinfer-dp serve` on the head of a NetnsCluster (tests/netns_utils.py), and the client
side of the multi-node tests: health, greedy streams and the cluster's actors, each asked from
inside a namespace."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from netns_utils import NetnsCluster, in_netns

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "netns_tiny_dp2.yaml"
# The streams a test acts under: seconds of decode on the step-heavy model.
LONG_TOKENS = 400
# every multi-node test module's marks: they run only where namespaces can be made. (A worker
# node's `ray start` must not inherit a loopback instance's single-node switch, which an earlier
# test of the same session sets: NetnsCluster.env() leaves it out.)
NETNS_MARKS = [
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2 (ip netns)"),
]


def cluster_fixture(prefix: str, workers: int = 2, hosts: dict[str, int] | None = None, ray: bool = True):
    """A module's `cluster` fixture: NetnsCluster `prefix`+pid with `workers` Ray workers (no
    Ray at all if not `ray`) and the bare `hosts` (name: last octet of the address), torn down
    (namespaces included) whatever happens; the session checks nothing of it is left."""
    @pytest.fixture(scope="module")
    def cluster(netns_cluster_ids) -> Iterator[NetnsCluster]:
        cluster_id = f"{prefix}{os.getpid()}"
        netns_cluster_ids.append(cluster_id)
        c = NetnsCluster(cluster_id, workers=workers)
        try:
            c.up(ray=ray)
            for name, octet in (hosts or {}).items():
                c.add_host(name, octet)
            yield c
        finally:
            c.down()

    return cluster


def build_step_heavy_model(path: Path) -> str:
    """A random Llama (with the tiny tokenizer) whose decode step takes milliseconds, not
    tenths of one: a stream of a few hundred tokens then lasts seconds, long enough to still
    be running when the test acts on it. Its 24 layers keep the tokens a second few enough that
    an API server short of CPU (the machine busy with another job) relays them as they come: at
    8 layers such a server fell seconds behind, and a stream's POST, its tokens and /health
    waited behind the backlog until the ranks had finished the streams."""
    from model_utils import write_tiny_model
    from transformers import LlamaConfig

    def config(vocab_size: int) -> LlamaConfig:
        return LlamaConfig(vocab_size=vocab_size, hidden_size=512, intermediate_size=2048, num_hidden_layers=24,
                           num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                           rms_norm_eps=1e-5, initializer_range=0.02, bos_token_id=1, eos_token_id=2, pad_token_id=0)

    return str(write_tiny_model(config, path))


@contextlib.contextmanager
def serve_on_head(cluster: NetnsCluster, model_dir: str, *flags: str) -> Iterator[str]:
    """configs/netns_tiny_dp2.yaml served from the head's namespace; its URL once /health says
    ok. Stopped with SIGTERM afterwards (the cluster's down() kills anything left)."""
    log = cluster.dir / "serve.log"
    proc = cluster.popen("head", [sys.executable, "-m", "deepinfer_dp.entrypoints.openai.launcher", "--config",
                                  str(CONFIG), "--model", model_dir, "--served-model-name", "tiny", *flags],
                         log=log, env={**cluster.env(), "HF_HUB_OFFLINE": "1"})
    url = f"http://{cluster.head.address}:8000"
    try:
        while (h := health(cluster, url)) is None or h["status"] != "ok":
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.5)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def health(cluster: NetnsCluster, url: str) -> dict | None:
    """/health's JSON (None: nothing answers yet), asked from the head's namespace."""
    def get() -> dict | None:
        try:
            return httpx.get(url + "/health", timeout=10).json()
        except (httpx.TransportError, json.JSONDecodeError):
            return None

    return in_netns(cluster.ns("head"), get)


def wait_full_size(cluster: NetnsCluster, url: str) -> dict:
    """Polls /health until every rank is up again; its last answer."""
    while (h := health(cluster, url)) is None or h["status"] != "ok" or not all(r["up"] for r in h["ranks"]):
        time.sleep(0.2)
    return h


def complete(cluster: NetnsCluster, url: str, prompts: list[str], max_tokens: int) -> list[dict]:
    """Greedy streams of `prompts`, all at once, from the head's namespace: each one's HTTP
    status, text, finish reason, error (event, or the body of a 503: the server answers with a
    status while no byte of the stream has gone out, so a rank lost before a stream's first
    token fails it that way), whether [DONE] came, and when (monotonic) it was sent, its
    response opened, its first token came and it ended."""
    async def one(client: httpx.AsyncClient, prompt: str) -> dict:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True}
        got = {"status": None, "text": "", "finish": None, "error": None, "done": False, "first": None, "ended": None,
               "sent": time.monotonic(), "opened": None}
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            got["status"], got["opened"] = r.status_code, time.monotonic()
            if r.status_code != 200:
                assert r.status_code == 503, await r.aread()
                got["error"] = json.loads(await r.aread())["error"]["message"]
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    got["done"] = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        got["error"] = event["error"]["message"]
                        continue
                    got["first"] = got["first"] or time.monotonic()
                    got["text"] += event["choices"][0]["text"]
                    got["finish"] = event["choices"][0]["finish_reason"] or got["finish"]
        got["ended"] = time.monotonic()
        return got

    async def run() -> list[dict]:
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*[one(client, p) for p in prompts])

    return in_netns(cluster.ns("head"), asyncio.run, run())


def actors(cluster: NetnsCluster) -> list[dict]:
    """The cluster's live actors as its GCS lists them (class, node address, pid)."""
    return _ask_gcs(cluster, "[{'cls': a['ActorClassName'], 'ip': a['Address']['IPAddress'], 'pid': a['Pid']}"
                             " for a in state.actors().values() if a['State'] == 'ALIVE']")


def alive_nodes(cluster: NetnsCluster) -> list[str]:
    """The addresses of the nodes the GCS holds alive."""
    return _ask_gcs(cluster, "[n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']]")


def _ask_gcs(cluster: NetnsCluster, expression: str):
    """`expression` (over `ray` and `state`) evaluated by a driver on the head, with the token."""
    script = ("import json, ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR')\n"
              "from ray._private import state\n"
              f"print('GCS-ANSWER ' + json.dumps({expression}))")
    out = subprocess.run(["ip", "netns", "exec", cluster.ns("head"), sys.executable, "-c", script,
                          cluster.ray_address], capture_output=True, text=True, env=cluster.env(), timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    # Ray may print its own warnings after the answer ("raylet has lagging heartbeats ...")
    answers = [line for line in out.stdout.splitlines() if line.startswith("GCS-ANSWER ")]
    assert answers, out.stdout[-3000:]
    return json.loads(answers[-1].removeprefix("GCS-ANSWER "))


# /health asked every 50 ms by a process of its own in the head's namespace, one JSON line an
# answer: {"asked", "answered" (monotonic, as this process reads it), "health" (None: no answer)}.
POLLER = """
import json, sys, time, httpx
with httpx.Client(timeout=10) as client:
    while True:
        asked = time.monotonic()
        try:
            health = client.get(sys.argv[1] + "/health").json()
        except (httpx.TransportError, ValueError):
            health = None
        print(json.dumps({"asked": asked, "answered": time.monotonic(), "health": health}), flush=True)
        time.sleep(0.05)
"""


@contextlib.contextmanager
def health_readings(cluster: NetnsCluster, url: str) -> Iterator[queue.Queue]:
    """POLLER's readings of `url`'s /health, as they come (a thread feeds them to the queue).
    A process of its own: from a thread of the test's process (in_netns) a reading took up to
    14 s on a loaded machine while the server answered curl from another process in 40 ms,
    and the streams the test acts under had ended by then."""
    proc = subprocess.Popen(["ip", "netns", "exec", cluster.ns("head"), sys.executable, "-c", POLLER, url],
                            stdout=subprocess.PIPE, text=True, env=cluster.env())
    readings: queue.Queue = queue.Queue()
    feeder = threading.Thread(target=lambda: [readings.put(json.loads(line)) for line in proc.stdout], daemon=True)
    feeder.start()
    try:
        yield readings
    finally:
        proc.kill()
        proc.wait()
        feeder.join(timeout=10)


def act_under_streams(cluster: NetnsCluster, url: str, prompts: list[str], max_tokens: int,
                      action: Callable[[], None]) -> tuple[float, list[dict]]:
    """Streams `prompts`; once the router holds every one of them in flight and every rank has
    some (/health's `inflight`: the ranks are generating them), runs `action`. Returns when
    it ran (monotonic) and the streams' results. (A client-side trigger, every stream's first
    token, came too late on a loaded machine: a rank had finished its streams by then.)"""
    def all_in_flight(h: dict | None) -> bool:
        return h is not None and all(r["inflight"] for r in h["ranks"]) \
            and sum(r["inflight"] for r in h["ranks"]) >= len(prompts)

    with ThreadPoolExecutor(1) as pool, health_readings(cluster, url) as readings:
        # The poller's first answer before the streams start: on a loaded machine its start
        # (a Python process importing httpx) took 15 s, longer than the streams lasted.
        try:
            readings.get(timeout=120)
        except queue.Empty:
            raise AssertionError(f"the /health poller gave no reading of {url} in 120 s") from None
        running = pool.submit(complete, cluster, url, prompts, max_tokens)
        seen = []  # (asked when, answered how many seconds later, each rank's in-flight, up, reason)
        while True:
            try:
                reading = readings.get(timeout=0.5)
            except queue.Empty:
                reading = None
            if reading is not None:
                h = reading["health"]
                if all_in_flight(h):
                    break
                seen.append((round(reading["asked"], 2), round(reading["answered"] - reading["asked"], 2),
                             h and [(r["inflight"], r["up"], r.get("reason")) for r in h["ranks"]]))
            if running.done():
                streams = [{k: s[k] for k in ("status", "sent", "opened", "first", "ended", "finish")}
                           for s in running.result()]
                log = cluster.dir / "serve.log"
                raise AssertionError(f"the streams ended before they were all in flight: {streams}; "
                                     f"/health: {seen[-40:]}; "
                                     f"serve.log: {log.read_text()[-4000:] if log.exists() else None}")
        action()
        acted = time.monotonic()
        return acted, running.result()


def lose_node_under_streams(cluster: NetnsCluster, url: str, node: str, prompts: list[str],
                            max_tokens: int) -> tuple[float, list[dict]]:
    """act_under_streams with every process of `node` killed (SIGKILL) as the action."""
    def kill() -> None:
        assert cluster.kill_node(node), f"nothing ran on {node}"

    return act_under_streams(cluster, url, prompts, max_tokens, kill)


def split_lost(streams: list[dict]) -> tuple[list[dict], list[dict]]:
    """(the streams that ended with an error, the others)."""
    return [s for s in streams if s["error"] is not None], [s for s in streams if s["error"] is None]


def streams_seen(streams: list[dict], acted: float) -> list[dict]:
    """What an assertion on `streams` should print: each one's status, finish, error, whether
    [DONE] came, text length, and when it opened, got its first token and ended, in seconds
    after `acted`."""
    def since(t: float | None) -> float | None:
        return None if t is None else round(t - acted, 2)

    return [{"status": s["status"], "finish": s["finish"], "error": s["error"], "done": s["done"],
             "chars": len(s["text"]),
             "opened": since(s["opened"]), "first": since(s["first"]), "ended": since(s["ended"])} for s in streams]


def failed_on_lost_rank(stream: dict) -> bool:
    """`stream` ended with an error naming the lost rank: an error event then [DONE], or a 503
    when the rank was lost before the stream's first byte went out."""
    return "DP rank" in stream["error"] and (stream["done"] or stream["status"] == 503)
