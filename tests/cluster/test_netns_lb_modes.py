"""vLLM's hybrid load-balancing mode across two "nodes" with their own network stacks and
addresses (network namespaces on a private bridge, tests/netns_utils.py; no Ray: these
servers start their ranks themselves). Each node runs `deepinfer-dp serve
--data-parallel-hybrid-lb` over two local ranks; the four ranks form one lockstep group
through the store global rank 0 serves on node 0's address, each rank's Gloo listening on its
own node's address. Requests sent to either endpoint answer as internal mode does; with every
request at one endpoint, the other node's ranks take the same steps, all placeholders, and its
own /metrics shows them. Needs root (`ip netns`)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
from lb_utils import (  # noqa: E402
    PROMPTS,
    Server,
    check_codes,
    check_lockstep,
    complete,
    group_flags,
    internal_mode_texts,
    serve_argv,
    stop_all,
    texts,
    wait_healthy,
)
from netns_serve import NETNS_MARKS, cluster_fixture  # noqa: E402
from netns_utils import NetnsCluster  # noqa: E402

pytestmark = NETNS_MARKS
LOCAL = 2  # ranks per node
RPC_PORT, HTTP_PORT = 29550, 8000  # each node's own stack: fixed ports are free

cluster = cluster_fixture("h", workers=1, ray=False)


@pytest.fixture(scope="module")
def internal_texts(model_dir, ray_cluster) -> list[str]:
    return internal_mode_texts(model_dir)


@contextlib.contextmanager
def hybrid_nodes(cluster: NetnsCluster, model_dir: str, tmp_path: Path) -> Iterator[list[Server]]:
    """`serve --data-parallel-hybrid-lb` in the head's and w1's namespaces, each on its own
    address, LOCAL ranks each; stopped after, each with status 0."""
    store_host = cluster.head.address
    group = group_flags(tmp_path, RPC_PORT)
    servers: list[Server] = []
    try:
        for i, name in enumerate(("head", "w1")):
            address = cluster.nodes[name].address
            flags = ["--dp-size", str(2 * LOCAL), "--data-parallel-hybrid-lb", "--data-parallel-size-local",
                     str(LOCAL), "--data-parallel-start-rank", str(i * LOCAL), "--data-parallel-address", store_host,
                     "--router-data-plane-host", address, "--host", address, "--port", str(HTTP_PORT)]
            log = tmp_path / f"node{i}.log"
            proc = cluster.popen(name, serve_argv(model_dir, *group, *flags), log=log,
                                 env={**os.environ, "HF_HUB_OFFLINE": "1"})
            servers.append(Server(proc, f"http://{address}:{HTTP_PORT}", log, ns=cluster.ns(name)))
        wait_healthy(servers)
        yield servers
    finally:
        codes = stop_all(servers)
    check_codes(servers, codes, None)


def _listens_on(cluster: NetnsCluster, name: str) -> set[str]:
    """The addresses TCP sockets listen on in node `name`'s namespace (/proc/net/tcp)."""
    out = subprocess.run(["ip", "netns", "exec", cluster.ns(name), "cat", "/proc/net/tcp"], capture_output=True,
                         text=True, check=True).stdout
    found = set()
    for line in out.splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        if state == "0A":
            raw = bytes.fromhex(local.split(":")[0])[::-1]
            found.add(".".join(str(b) for b in raw))
    return found


def test_hybrid_mode_across_two_namespaced_nodes(cluster, model_dir, tmp_path, internal_texts):
    with hybrid_nodes(cluster, model_dir, tmp_path) as (node0, node1):
        assert texts(node1) == internal_texts  # every request at node 1: node 0's ranks idle
        first = check_lockstep([node0, node1], busy={2, 3})
        assert texts(node0) == internal_texts  # now at node 0
        steps = check_lockstep([node0, node1], busy={0, 1, 2, 3})
        assert next(iter(steps.values())) > next(iter(first.values()))  # node 1's ranks stepped along
        health = [s.request("GET", "/health").json() for s in (node0, node1)]
        assert [[r["dp_rank"] for r in h["ranks"]] for h in health] == [[0, 1], [2, 3]]
        refused = complete(node0, PROMPTS[0], data_parallel_rank=3)  # node 1's rank
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "data_parallel_rank"
        # nothing listens on a wildcard address: each node's sockets are on its own address (or loopback)
        for name in ("head", "w1"):
            assert _listens_on(cluster, name) <= {cluster.nodes[name].address, "127.0.0.1"}, name
