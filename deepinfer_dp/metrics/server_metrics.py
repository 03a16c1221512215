"""The server's own metrics: request latencies, outcomes and routing, per dp_rank.

Each server owns a CollectorRegistry (not prometheus-client's global one), so several
servers in one process, as in tests, never collide. Several API server processes on one port
(--api-server-count) run prometheus-client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR set
before they start): /metrics on any of them adds up every process's series.
"""

from __future__ import annotations

import os
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from deepinfer_dp.metrics.rank_collector import PREFIX, RankStatsCollector

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class ServerMetrics:
    def __init__(self, client: Any, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.rank_collector = RankStatsCollector(client)
        self.registry.register(self.rank_collector)
        labels = ["model_name", "dp_rank"]
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.",
                              labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between streamed token deltas.",
                             labels, buckets=_ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to last token.",
                             labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.requests = Counter(PREFIX + "requests", "Finished requests (choices) by status: stop, length, "
                                "abort (client went away), rejected (400), unavailable (503), error.",
                                ["model_name", "status"], registry=self.registry)
        self.routed = Counter(PREFIX + "requests_routed", "Requests (choices) served by each rank.",
                              labels, registry=self.registry)
        self.model_name = model_name

    def routed_to(self, rank: int) -> None:
        self.routed.labels(self.model_name, str(rank)).inc()

    def first_token(self, rank: int, seconds: float) -> None:
        self.ttft.labels(self.model_name, str(rank)).observe(seconds)

    def inter_token(self, rank: int, seconds: float) -> None:
        self.itl.labels(self.model_name, str(rank)).observe(seconds)

    def finished(self, rank: int | None, status: str, e2e_seconds: float | None = None) -> None:
        self.requests.labels(self.model_name, status).inc()
        if e2e_seconds is not None and rank is not None:
            self.e2e.labels(self.model_name, str(rank)).observe(e2e_seconds)

    def exposed_registry(self) -> CollectorRegistry:
        """What /metrics shows: this server's registry, or with several API server processes
        every process's server series (summed) and the ranks' series once."""
        if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
            return self.registry
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        registry.register(self.rank_collector)
        return registry

    def exposition(self) -> bytes:
        return generate_latest(self.exposed_registry())
