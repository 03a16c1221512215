"""Prometheus metrics: every rank's engine series (dp_rank label) and the server's own."""

from deepinfer_dp.metrics.rank_collector import PREFIX, RANK_METRICS, RankStatsCollector
from deepinfer_dp.metrics.server_metrics import ServerMetrics

__all__ = ["PREFIX", "RANK_METRICS", "RankStatsCollector", "ServerMetrics"]
