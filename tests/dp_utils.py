"""Helpers shared by the DP tests."""

from __future__ import annotations

import queue

from deepinfer_dp.engine.client import RankFailed


def collect_outcomes(got: queue.Queue, num_requests: int, timeout: float) -> tuple[list[str], list[str]]:
    """Reads router deltas until every request either failed (RankFailed) or finished;
    returns (failure messages, finished request ids)."""
    failed: list[str] = []
    finished: list[str] = []
    while len(failed) + len(finished) < num_requests:
        item = got.get(timeout=timeout)
        if isinstance(item, RankFailed):
            failed.append(str(item))
        elif item.finished:
            finished.append(item.request_id)
    return failed, finished
