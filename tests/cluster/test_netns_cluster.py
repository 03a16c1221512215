"""`deepinfer-dp serve` across a real multi-node Ray cluster: three network namespaces with
their own addresses on a private bridge (tests/netns_utils.py), Ray's token auth on, the data
plane with CURVE. The ranks run on the two worker nodes, the router and the HTTP server on the
head. Greedy outputs equal DP=1's; an outsider on the bridge (a fourth namespace, no keys, no
token) is refused by the router's, the ranks' and the API server's ZeroMQ sockets, by the DP
group's store and by Ray's GCS, and its junk at the ranks' Gloo listeners changes nothing,
while serving goes on; a worker node that loses every process fails the requests
of its rank with an error event while the other rank's finish, and the warm spare on the head
brings the group back to full size. Needs root (`ip netns`)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
import pytest  # noqa: E402
from netns_serve import (  # noqa: E402
    LONG_TOKENS,
    NETNS_MARKS,
    actors,
    cluster_fixture,
    complete,
    failed_on_lost_rank,
    health,
    lose_node_under_streams,
    serve_on_head,
    split_lost,
    streams_seen,
    wait_full_size,
)
from netns_utils import NetnsCluster, in_netns  # noqa: E402
from test_data_plane_attack import attack, failed_handshakes, greets_as_zmq  # noqa: E402

PROMPTS = [f"Node {i} of the cluster says" for i in range(4)]
MAX_TOKENS = 12
pytestmark = NETNS_MARKS

cluster = cluster_fixture("t", hosts={"intruder": 9})


@pytest.fixture(scope="module")
def server(cluster, netns_model_dir):
    with serve_on_head(cluster, netns_model_dir) as url:
        yield url


@pytest.fixture(scope="module")
def reference(netns_model_dir) -> list[str]:
    from deepinfer_dp.entrypoints.llm import LLM
    from deepinfer_dp.sampling_params import SamplingParams

    llm = LLM(netns_model_dir, num_kv_blocks=64, max_num_seqs=4, torch_threads=1, block_size=16, dtype="float32",
              device="cpu")
    try:
        texts = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                             use_tqdm=False)
    finally:
        llm.shutdown()
    return list(texts)


def test_ranks_on_two_nodes_serve_like_dp1(cluster, server, reference):
    got = complete(cluster, server, PROMPTS, MAX_TOKENS)
    assert [(g["text"], g["finish"], g["error"]) for g in got] == [(t, "length", None) for t in reference]
    live = actors(cluster)
    ranks = sorted(a["ip"] for a in live if a["cls"] == "RankActor")
    routers = {a["ip"] for a in live if a["cls"] == "RouterActor"}
    # the two ranks on the two workers; the router (and its standby) and the spare on the head
    head, w1, w2 = (cluster.nodes[n].address for n in ("head", "w1", "w2"))
    assert ranks == sorted([head, w1, w2]), live
    assert routers == {head}, live


def _listening(cluster: NetnsCluster, node: str) -> list[int]:
    """TCP ports listening in node `node`'s namespace, loopback left out (its /proc/net/tcp)."""
    out = subprocess.run(["ip", "netns", "exec", cluster.ns(node), "cat", "/proc/net/tcp"], capture_output=True,
                         text=True, check=True).stdout
    ports = set()
    for line in out.splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        if state == "0A" and not local.startswith("0100007F"):  # LISTEN, not on 127.0.0.1
            ports.add(int(local.split(":")[1], 16))
    return sorted(ports)


def _store_answers(host: str, port: int) -> tuple[bool, bool]:
    """(whether torch's TCPStore client gets a connection at host:port, whether the group's
    store client with a key pair of its own gets an answer)."""
    import torch.distributed as dist

    from deepinfer_dp.cluster.data_plane import ROUTER, ClusterKey
    from deepinfer_dp.cluster.group_store import GroupStoreClient

    answers = []
    for connect in (lambda: dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=3)),
                    lambda: GroupStoreClient(host, port, ClusterKey.generate(), ROUTER, 3, 3)):
        try:
            connect().num_keys()
            answers.append(True)
        except dist.DistError:  # refused
            answers.append(False)
    return answers[0], answers[1]


def _junk(ports: list[int], host: str) -> None:
    for port in ports:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=2) as s:
            s.sendall(os.urandom(4096))


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
    # the head: the router's two sockets, the DP group's store and the API server's inbox;
    # w1: its rank's inbox
    assert len(zmq_ports["head"]) == 4 and len(zmq_ports["w1"]) == 1, zmq_ports
    for port in zmq_ports["head"]:  # the store among them: torch's client and a stranger's key get nothing
        assert in_netns(cluster.ns("intruder"), _store_answers, head, port) == (False, False), port
    in_netns(cluster.ns("intruder"), attack, zmq_ports["head"], head)
    in_netns(cluster.ns("intruder"), attack, zmq_ports["w1"], w1)
    others = [port for port in _listening(cluster, "w1") if port not in zmq_ports["w1"]]
    in_netns(cluster.ns("intruder"), _junk, others, w1)  # the rank's Gloo listener among Ray's
    failed = failed_handshakes(in_netns(cluster.ns("head"), lambda: httpx.get(server + "/metrics", timeout=30).text))
    ranks_failed = failed.get("rank 0", 0) + failed.get("rank 1", 0)
    assert failed["router"] > 0 and failed["client"] > 0 and ranks_failed > 0, failed
    # Ray's GCS: no token and a wrong one are refused; the cluster's token is let in
    assert _gcs_call(cluster, None) == "AuthenticationError"
    assert _gcs_call(cluster, "0" * 64) == "AuthenticationError"
    assert _gcs_call(cluster, cluster.token_path.read_text()) == "ok"
    h = health(cluster, server)
    assert h["status"] == "ok" and not any(r["restarts"] for r in h["ranks"]), h
    got = complete(cluster, server, PROMPTS, MAX_TOKENS)
    assert [g["text"] for g in got] == reference


def test_a_lost_node_fails_its_requests_and_the_spare_restores_the_group(cluster, server, reference, tmp_path):
    """Runs last: it kills worker node w1 (every process in its namespace)."""
    killed, streams = lose_node_under_streams(cluster, server, "w1", PROMPTS, LONG_TOKENS)
    failed, finished = split_lost(streams)
    # the two streams of the lost rank end with an error event naming it; the others run to the end
    seen = streams_seen(streams, killed)
    assert len(failed) == 2 and all(failed_on_lost_rank(s) for s in failed), seen
    assert len(finished) == 2 and all(s["finish"] == "length" and s["done"] for s in finished), seen
    detect_and_fail_s = max(s["ended"] for s in failed) - killed
    h = wait_full_size(cluster, server)  # the spare on the head took the lost rank's place
    full_size_s = time.monotonic() - killed
    assert sum(r["restarts"] for r in h["ranks"]) == 1, h
    got = complete(cluster, server, PROMPTS, MAX_TOKENS)
    assert [g["text"] for g in got] == reference
    times = {"detect_and_fail_s": round(detect_and_fail_s, 1), "full_size_s": round(full_size_s, 1)}
    print("lost node, spare on the head:", times)
    (tmp_path / "lost_node_times.json").write_text(json.dumps(times))
