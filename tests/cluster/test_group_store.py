"""The DP group's authenticated rendezvous store (cluster/group_store.py): torch's store
semantics for the ranks that hold the rank key, nothing at all for anyone else, and a Gloo
group that forms over it."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from deepinfer_dp.cluster.data_plane import RANK, ROUTER, ClusterKey
from deepinfer_dp.cluster.group_store import GroupStoreClient, GroupStoreServer


@pytest.fixture
def key() -> ClusterKey:
    return ClusterKey.generate()


@pytest.fixture
def server(key):
    s = GroupStoreServer("127.0.0.1", key, ROUTER)
    yield s
    s.close()


def _client(server: GroupStoreServer, key: ClusterKey | None, timeout_s: float = 5.0) -> GroupStoreClient:
    return GroupStoreClient("127.0.0.1", server.port, key, ROUTER, timeout_s, connect_timeout_s=timeout_s)


def test_a_rank_gets_torchs_store_semantics(server, key):
    a, b = _client(server, key.for_role(RANK)), _client(server, key.for_role(RANK))
    a.set("k", b"v")
    assert b.get("k") == b"v" and b.check(["k"]) and not b.check(["k", "missing"])
    assert a.add("n", 2) == 2 and b.add("n", 3) == 5 and a.get("n") == b"5"
    assert a.compare_set("c", "", "first") == b"first"  # missing key, empty expected: set
    assert a.compare_set("c", "wrong", "second") == b"first"  # mismatch: the current value
    assert a.compare_set("absent", "x", "y") == b"x"  # missing key, expected given: unchanged
    assert a.num_keys() == 3 and a.delete_key("c") and not a.delete_key("c") and a.num_keys() == 2
    later = threading.Timer(0.3, lambda: a.set("late", b"here"))
    later.start()
    assert b.get("late") == b"here"  # a get waits for the key
    b.wait(["late", "k"], timedelta(seconds=1))
    with pytest.raises(dist.DistStoreError, match="timeout"):
        b.wait(["never"], timedelta(seconds=0.3))
    b.set_timeout(timedelta(seconds=0.3))
    with pytest.raises(dist.DistStoreError, match="timeout"):
        b.get("never")
    a.close()
    b.close()


def test_a_peer_without_the_rank_key_reaches_nothing(server, key):
    member = _client(server, key.for_role(RANK))
    member.set("gloo/address", b"10.0.0.2:40000")
    # another deployment's rank key, and no key at all (plain ZeroMQ): no answer, not even a ping
    for outsider in (ClusterKey.generate(), None):
        t0 = time.monotonic()
        with pytest.raises(dist.DistStoreError, match="did not answer ping"):
            _client(server, outsider, timeout_s=1.0)
        assert time.monotonic() - t0 < 10
    # the router's own key pair is not a rank's: the server admits ranks only
    router_only = ClusterKey(dict(key.publics), {RANK: key.pair(ROUTER)[1]})
    with pytest.raises(dist.DistStoreError, match="did not answer ping"):
        _client(server, router_only, timeout_s=1.0)
    # torch's own client speaks to the port and gets nowhere
    with pytest.raises(dist.DistError):
        dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=2))
    assert server.failed_handshakes >= 3
    assert member.get("gloo/address") == b"10.0.0.2:40000"  # the member still works
    member.close()


def test_torchs_tcpstore_shows_every_key_to_anyone():
    """Why the cluster does not use TCPStore (nor a secret prefix on its keys): any client that
    connects lists every key and reads it."""
    from deepinfer_dp.distributed.groups import serve_store

    store = serve_store()
    store.set("secret-prefix-1234/gloo/address", b"10.0.0.2:40000")
    outsider = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=5))
    keys = [k for k in outsider.list_keys() if "secret-prefix" in k]
    assert keys == ["secret-prefix-1234/gloo/address"] and outsider.get(keys[0]) == b"10.0.0.2:40000"


def _join_and_sum(rank: int, port: int, key: ClusterKey, out) -> None:
    import torch

    from deepinfer_dp.cluster.group_store import join_group
    from deepinfer_dp.distributed import destroy_dp_groups

    groups = join_group(rank, 2, "127.0.0.1", port, key, ROUTER, torch.device("cpu"), timeout_s=30)
    t = torch.tensor([rank + 1])
    dist.all_reduce(t, group=groups.cpu_group)
    out.put((rank, int(t.item())))
    destroy_dp_groups()


def test_two_ranks_form_a_gloo_group_over_it(server, key):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_join_and_sum, args=(r, server.port, key.for_role(RANK), out)) for r in range(2)]
    for proc in procs:
        proc.start()
    try:
        got = sorted(out.get(timeout=120) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    assert got == [(0, 3), (1, 3)]
    assert [proc.exitcode for proc in procs] == [0, 0]

