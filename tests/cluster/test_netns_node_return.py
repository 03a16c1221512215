"""A worker node of a namespaced Ray cluster (tests/netns_utils.py) loses every process while
its rank streams, with no spare rank anywhere: the lost rank's streams end with an error
event, the other rank's finish, the survivor serves alone; when the node comes back (Ray
started on it again) Ray places the lost rank's bundle there, the router's restart of the
rank lands in it and the group returns to full size, serving what it served before.
Needs root (`ip netns`)."""

from __future__ import annotations

import json
import time

from netns_serve import (
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

PROMPTS = [f"Node {i} comes back and says" for i in range(4)]
MAX_TOKENS = 12
pytestmark = NETNS_MARKS

cluster = cluster_fixture("r")


def test_a_lost_node_that_comes_back_restores_the_group(cluster, netns_model_dir, tmp_path):
    with serve_on_head(cluster, netns_model_dir, "--no-router-spare-rank") as url:
        before = [g["text"] for g in complete(cluster, url, PROMPTS, MAX_TOKENS)]
        killed, streams = lose_node_under_streams(cluster, url, "w1", PROMPTS, LONG_TOKENS)
        failed, finished = split_lost(streams)
        seen = streams_seen(streams, killed)
        assert len(failed) == 2 and all(failed_on_lost_rank(s) for s in failed), seen
        assert len(finished) == 2 and all(s["finish"] == "length" for s in finished), seen
        detect_and_fail_s = max(s["ended"] for s in failed) - killed
        h = health(cluster, url)
        assert [r["up"] for r in h["ranks"]].count(False) == 1, h  # nowhere to go: it stays down
        # the survivor serves alone meanwhile
        assert [g["text"] for g in complete(cluster, url, PROMPTS, MAX_TOKENS)] == before
        back = time.monotonic()
        cluster.start_ray("w1")  # the node comes back
        wait_full_size(cluster, url)
        full_size_s, after_return_s = time.monotonic() - killed, time.monotonic() - back
        ranks = sorted(a["ip"] for a in actors(cluster) if a["cls"] == "RankActor")
        assert ranks == sorted(cluster.nodes[n].address for n in ("w1", "w2"))  # one on each worker again
        assert [g["text"] for g in complete(cluster, url, PROMPTS, MAX_TOKENS)] == before
    times = {"detect_and_fail_s": round(detect_and_fail_s, 1), "full_size_s": round(full_size_s, 1),
             "after_node_return_s": round(after_return_s, 1)}
    print("lost node that comes back:", times)
    (tmp_path / "node_return_times.json").write_text(json.dumps(times))
