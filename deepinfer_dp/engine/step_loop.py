"""The step loop: the one loop that drives an LLMEngine, on every kind of rank.

LLM.generate (one process, or each torchrun process), the in-process server engine
(entrypoints/openai/local_client.py) and a Ray rank (cluster/rank.py) all run it. One pass:

    take_work()                   the driver's new requests and aborts, between steps
    local = has local work?       the rank's own queues
    unfinished = vote(local)      the DP vote: all_reduce(MAX) over the ranks (dp 1: local);
                                  with dp_vote_interval K, only every K-th pass asks (True between)
    step()                        while any rank has work: a real step, or a placeholder step
    flush_inflight_reqs()         when none has: the decode step ZOS kept in flight, once; leave

Every rank therefore takes the same number of steps and leaves together (lockstep, see
docs/architecture.md). The loop also times the steps, once for every driver, and builds the
rank's stats dict, the one shape every front end reports.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from deepinfer_dp.engine.llm_engine import LLMEngine

NO_LOCKSTEP = {"lockstep_votes": 0, "passes_without_vote": 0, "dp_vote_interval": 1, "allreduce_time_s": 0.0,
               "allreduce_wait_s": 0.0, "allreduce_collective_s": 0.0}


class StepLoop:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.step_time_s = 0.0  # wall time in step() and the flush; the vote is not counted
        self.placeholder_step_time_s = 0.0  # of which placeholder steps

    def run(self, on_outputs: Callable[[list], None], take_work: Callable[[], None] | None = None) -> None:
        """Steps until no rank has work, then returns after the final flush. `on_outputs` gets
        each step's outputs, pooled: valid until the next step (clone() to keep one)."""
        engine = self.engine
        while True:
            if take_work is not None:
                take_work()
            local = engine.has_local_unfinished_requests()
            unfinished = engine.vote(local)  # the DP vote: does any rank still have work?
            outputs = self._timed(engine.step if unfinished else engine.flush_inflight_reqs)
            if outputs:
                on_outputs(outputs)
            if not unfinished:
                return

    def _timed(self, fn: Callable[[], list]) -> list:
        start, placeholders = time.perf_counter(), self.engine.placeholder_steps
        try:
            return fn()
        finally:
            elapsed = time.perf_counter() - start
            self.step_time_s += elapsed
            if self.engine.placeholder_steps != placeholders:
                self.placeholder_step_time_s += elapsed

    def stats(self) -> dict[str, Any]:
        """This rank's counters: the engine's, the loop's timing and the vote's."""
        engine = self.engine
        lockstep = engine.lockstep.stats() if engine.lockstep is not None else NO_LOCKSTEP
        return {"dp_rank": engine.config.dp_rank, **engine.stats(), "step_time_s": self.step_time_s,
                "placeholder_step_time_s": self.placeholder_step_time_s, **lockstep}
