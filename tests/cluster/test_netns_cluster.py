"""`deepinfer-dp serve` across a real multi-node Ray cluster: three network namespaces with
their own addresses on a private bridge (tests/netns_utils.py), Ray's token auth on, the data
plane with CURVE. The ranks run on the two worker nodes, the router and the HTTP server on the
head. Greedy outputs equal DP=1's; an outsider on the bridge (a fourth namespace, no keys, no
token) is refused by the router's, the ranks' and the API server's ZeroMQ sockets and by
Ray's GCS while serving goes on; a worker node that loses every process fails the requests
of its rank with an error event while the other rank's finish, and the warm spare on the head
brings the group back to full size. Needs root (`ip netns`)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
import pytest  # noqa: E402
from netns_utils import NetnsCluster, in_netns, leftover_processes, namespaces  # noqa: E402
from test_data_plane_attack import attack, failed_handshakes, greets_as_zmq  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "netns_tiny_dp2.yaml"
CLUSTER_ID = f"t{os.getpid()}"
PROMPTS = [f"Node {i} of the cluster says" for i in range(4)]
MAX_TOKENS = 12
LONG_TOKENS = 400  # a stream still running when its node is killed
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2 (ip netns)"),
]


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind():
    """At the end of the session: no namespace, process or Ray session of this cluster."""
    yield
    cluster = NetnsCluster(CLUSTER_ID)
    assert [ns for ns in namespaces() if ns.startswith(cluster.ns(""))] == []
    assert leftover_processes(cluster.dir) == []
    assert not cluster.dir.exists()


@pytest.fixture(scope="module")
def cluster():
    c = NetnsCluster(CLUSTER_ID, workers=2)
    try:
        c.up()
        c.add_host("intruder", 9)
        yield c
    finally:
        c.down()


@pytest.fixture(scope="module")
def server(cluster, model_dir):
    """serve in the head's namespace against the cluster; its URL once /health says ok."""
    log = cluster.dir / "serve.log"
    proc = cluster.popen("head", [sys.executable, "-m", "deepinfer_dp.entrypoints.openai.launcher", "--config",
                                  str(CONFIG), "--model", model_dir, "--served-model-name", "tiny"], log=log,
                         env={**cluster.env(), "HF_HUB_OFFLINE": "1"})
    url = f"http://{cluster.head.address}:8000"
    try:
        while not _health(cluster, url, ok_only=True):
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.5)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the graceful stop; the cluster's down() kills what is left
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _health(cluster: NetnsCluster, url: str, ok_only: bool = False) -> dict | None:
    def get() -> dict | None:
        try:
            r = httpx.get(url + "/health", timeout=10)
        except httpx.TransportError:
            return None
        return r.json() if r.status_code == 200 or not ok_only else None

    health = in_netns(cluster.ns("head"), get)
    return health if not ok_only or (health and health["status"] == "ok") else None


def _complete(cluster: NetnsCluster, url: str, prompts: list[str], max_tokens: int = MAX_TOKENS) -> list[dict]:
    """Greedy streams of `prompts`, all at once, from the head's namespace: each one's text,
    finish reason and error event."""
    async def one(client: httpx.AsyncClient, prompt: str) -> dict:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True}
        got = {"text": "", "finish": None, "error": None, "ended": None}
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    got["error"] = event["error"]["message"]
                    continue
                got["text"] += event["choices"][0]["text"]
                got["finish"] = event["choices"][0]["finish_reason"] or got["finish"]
        got["ended"] = time.monotonic()
        return got

    async def run() -> list[dict]:
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*[one(client, p) for p in prompts])

    return in_netns(cluster.ns("head"), asyncio.run, run())


def _actors(cluster: NetnsCluster) -> list[dict]:
    """The cluster's live actors as its GCS lists them (class, node address, pid), asked with the token."""
    script = ("import json, ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR')\n"
              "from ray._private import state\n"
              "print(json.dumps([{'cls': a['ActorClassName'], 'ip': a['Address']['IPAddress'], 'pid': a['Pid']}"
              " for a in state.actors().values() if a['State'] == 'ALIVE']))")
    out = subprocess.run(["ip", "netns", "exec", cluster.ns("head"), sys.executable, "-c", script,
                          cluster.ray_address], capture_output=True, text=True, env=cluster.env(), timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def reference(model_dir) -> list[str]:
    from deepinfer_dp.entrypoints.llm import LLM
    from deepinfer_dp.sampling_params import SamplingParams

    llm = LLM(model_dir, num_kv_blocks=64, max_num_seqs=4, torch_threads=1, block_size=16, dtype="float32",
              device="cpu")
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                            use_tqdm=False)
    finally:
        llm.shutdown()
    return list(outs)  # generate gives the texts


def test_ranks_on_two_nodes_serve_like_dp1(cluster, server, reference):
    got = _complete(cluster, server, PROMPTS)
    assert [(g["text"], g["finish"], g["error"]) for g in got] == [(t, "length", None) for t in reference]
    actors = _actors(cluster)
    ranks = sorted(a["ip"] for a in actors if a["cls"] == "RankActor")
    routers = {a["ip"] for a in actors if a["cls"] == "RouterActor"}
    # the two ranks on the two workers; the router (and its standby) and the spare on the head
    head, w1, w2 = (cluster.nodes[n].address for n in ("head", "w1", "w2"))
    assert ranks == sorted([head, w1, w2]), actors
    assert routers == {head}, actors


def _listening(cluster: NetnsCluster, node: str) -> list[int]:
    """TCP ports listening in node `node`'s namespace (from its /proc/net/tcp)."""
    out = subprocess.run(["ip", "netns", "exec", cluster.ns(node), "cat", "/proc/net/tcp"], capture_output=True,
                         text=True, check=True).stdout
    ports = set()
    for line in out.splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        if state == "0A" and not local.startswith("0100007F"):  # LISTEN, not on loopback
            ports.add(int(local.split(":")[1], 16))
    return sorted(ports)


def _gcs_call(cluster: NetnsCluster, token: str | None) -> str:
    """A call to the head's GCS (list its key-value keys) from the outsider's namespace, with
    `token` (None: token auth off, no token at all): "ok", or the error's class name."""
    script = ("import sys\n"
              "from ray._raylet import GcsClient\n"
              "try:\n    GcsClient(address=sys.argv[1]).internal_kv_keys(b'', None, timeout=20); print('ok')\n"
              "except Exception as e:\n    print(type(e).__name__)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update({"RAY_AUTH_MODE": "disabled"} if token is None else {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token})
    out = subprocess.run(["ip", "netns", "exec", cluster.ns("intruder"), sys.executable, "-c", script,
                          cluster.ray_address], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split()[-1]


def test_an_outsider_without_keys_is_refused(cluster, server, reference):
    head, w1 = cluster.head.address, cluster.nodes["w1"].address
    zmq_ports = {node: [port for port in _listening(cluster, node)
                        if in_netns(cluster.ns("intruder"), greets_as_zmq, port, cluster.nodes[node].address)]
                 for node in ("head", "w1")}
    # the head: the router's two sockets and the API server's inbox; w1: its rank's inbox
    assert len(zmq_ports["head"]) == 3 and len(zmq_ports["w1"]) == 1, zmq_ports
    in_netns(cluster.ns("intruder"), attack, zmq_ports["head"], head)
    in_netns(cluster.ns("intruder"), attack, zmq_ports["w1"], w1)
    failed = failed_handshakes(in_netns(cluster.ns("head"), lambda: httpx.get(server + "/metrics", timeout=30).text))
    ranks_failed = failed.get("rank 0", 0) + failed.get("rank 1", 0)
    assert failed["router"] > 0 and failed["client"] > 0 and ranks_failed > 0, failed
    # Ray's GCS: no token and a wrong one are refused; the cluster's token is let in
    assert _gcs_call(cluster, None) == "AuthenticationError"
    assert _gcs_call(cluster, "0" * 64) == "AuthenticationError"
    assert _gcs_call(cluster, cluster.token_path.read_text()) == "ok"
    health = _health(cluster, server)
    assert health["status"] == "ok" and not any(r["restarts"] for r in health["ranks"]), health
    got = _complete(cluster, server, PROMPTS)
    assert [g["text"] for g in got] == reference


def test_a_lost_node_fails_its_requests_and_the_group_returns(cluster, server, reference, tmp_path):
    """Runs last: it kills worker node w1 (every process in its namespace)."""
    results: list[dict] = []

    async def streams_then_kill() -> None:
        loop = asyncio.get_running_loop()
        running = loop.run_in_executor(None, _complete, cluster, server, PROMPTS, LONG_TOKENS)
        await asyncio.sleep(2.0)  # every stream has started (round robin: two on each rank)
        results.append({"killed": time.monotonic(), "pids": cluster.kill_node("w1")})
        results.append({"streams": await running})

    asyncio.run(streams_then_kill())
    killed, streams = results[0]["killed"], results[1]["streams"]
    assert results[0]["pids"], "nothing ran on w1"
    failed = [s for s in streams if s["error"] is not None]
    finished = [s for s in streams if s["error"] is None]
    # the two streams of the lost rank end with an error event naming it; the others run to the end
    assert len(failed) == 2 and all("DP rank" in s["error"] for s in failed), streams
    assert len(finished) == 2 and all(s["finish"] == "length" for s in finished), streams
    detect_and_fail_s = max(s["ended"] for s in failed) - killed
    while True:  # the spare on the head takes the lost rank's place: back to two ranks
        health = _health(cluster, server)
        if health["status"] == "ok" and all(r["up"] for r in health["ranks"]):
            break
        time.sleep(0.2)
    full_again_s = time.monotonic() - killed
    assert sum(r["restarts"] for r in health["ranks"]) == 1, health
    got = _complete(cluster, server, PROMPTS)
    assert [g["text"] for g in got] == reference
    times = {"detect_and_fail_s": round(detect_and_fail_s, 1), "full_size_s": round(full_again_s, 1)}
    print("lost node:", times)
    (tmp_path / "lost_node_times.json").write_text(json.dumps(times))
