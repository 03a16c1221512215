"""A worker node of a namespaced Ray cluster (tests/netns_utils.py) drops off the network while
its rank streams: its link to the bridge goes down, its processes keep running. The router's
ping of the rank times out, the rank is killed and marked down, its streams end with an error
event, the other rank's finish, and the warm spare on the head takes its place. The link comes
back once Ray has declared the node dead: the old rank process (still holding the rank's keys)
ends with its node's Ray processes, the group stays at full size and serves what it served
before. Needs root (`ip netns`)."""

from __future__ import annotations

import json
import time

import psutil
from netns_serve import (
    LONG_TOKENS,
    NETNS_MARKS,
    act_under_streams,
    actors,
    alive_nodes,
    cluster_fixture,
    complete,
    failed_on_lost_rank,
    health,
    serve_on_head,
    split_lost,
    streams_seen,
    wait_full_size,
)

PROMPTS = [f"Node {i} drops off and says" for i in range(4)]
MAX_TOKENS = 12
pytestmark = NETNS_MARKS

cluster = cluster_fixture("l")


def test_a_node_cut_off_the_network_is_replaced_and_stays_out(cluster, netns_model_dir, tmp_path):
    w1 = cluster.nodes["w1"].address
    with serve_on_head(cluster, netns_model_dir) as url:
        before = [g["text"] for g in complete(cluster, url, PROMPTS, MAX_TOKENS)]
        old = [a["pid"] for a in actors(cluster) if a["cls"] == "RankActor" and a["ip"] == w1]
        assert len(old) == 1, actors(cluster)
        cut, streams = act_under_streams(cluster, url, PROMPTS, LONG_TOKENS, lambda: cluster.set_link("w1", up=False))
        failed, finished = split_lost(streams)
        seen = streams_seen(streams, cut)
        assert len(failed) == 2 and all(failed_on_lost_rank(s) for s in failed), seen
        assert len(finished) == 2 and all(s["finish"] == "length" for s in finished), seen
        detect_and_fail_s = max(s["ended"] for s in failed) - cut
        h = wait_full_size(cluster, url)  # the spare on the head
        full_size_s = time.monotonic() - cut
        assert sum(r["restarts"] for r in h["ranks"]) == 1, h
        assert psutil.pid_exists(old[0])  # cut off, not dead
        while w1 in alive_nodes(cluster):
            time.sleep(1.0)
        declared_dead_s = time.monotonic() - cut
        cluster.set_link("w1", up=True)
        while psutil.pid_exists(old[0]):  # its raylet learns it was declared dead and ends its workers
            time.sleep(0.5)
        old_gone_s = time.monotonic() - cut
        h = health(cluster, url)
        assert h["status"] == "ok" and sum(r["restarts"] for r in h["ranks"]) == 1, h
        assert [g["text"] for g in complete(cluster, url, PROMPTS, MAX_TOKENS)] == before
    times = {"detect_and_fail_s": round(detect_and_fail_s, 1), "full_size_s": round(full_size_s, 1),
             "node_declared_dead_s": round(declared_dead_s, 1), "old_rank_gone_s": round(old_gone_s, 1)}
    print("node cut off:", times)
    (tmp_path / "link_down_times.json").write_text(json.dumps(times))
