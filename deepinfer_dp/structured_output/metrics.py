"""A rank's structured-output counters, in the flat shape of the rank's stats dict.

The compile-time histogram travels as cumulative bucket counts (a list), a sum and a count,
which metrics/rank_collector.py turns into a Prometheus histogram; everything else is a
plain counter. Updated by the build threads and the step, read when stats are asked for.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

COMPILE_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass
class StructuredOutputStats:
    constrained_requests: int = 0  # admitted with a grammar
    cache_hits: int = 0
    cache_misses: int = 0
    build_failures: int = 0
    matcher_rebuilds: int = 0
    mask_time_s: float = 0.0  # host time filling bitmasks, all steps
    mask_steps: int = 0  # steps that filled one
    mask_rows: int = 0
    build_wait_s: float = 0.0  # submit -> grammar ready, summed over requests
    compile_count: int = 0
    compile_sum_s: float = 0.0
    compile_buckets: list[int] = field(default_factory=lambda: [0] * len(COMPILE_BUCKETS_S))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def observe_compile(self, seconds: float) -> None:
        with self._lock:  # build threads
            self.compile_count += 1
            self.compile_sum_s += seconds
            i = bisect.bisect_left(COMPILE_BUCKETS_S, seconds)
            if i < len(self.compile_buckets):
                self.compile_buckets[i] += 1

    def observe_mask(self, seconds: float, rows: int) -> None:
        self.mask_time_s += seconds
        self.mask_steps += 1
        self.mask_rows += rows

    def observe_wait(self, seconds: float) -> None:
        self.build_wait_s += seconds

    def as_dict(self) -> dict:
        with self._lock:
            cumulative, total = [], 0
            for n in self.compile_buckets:
                total += n
                cumulative.append(total)
            return {"so_constrained_requests": self.constrained_requests, "so_cache_hits": self.cache_hits,
                    "so_cache_misses": self.cache_misses, "so_build_failures": self.build_failures,
                    "so_matcher_rebuilds": self.matcher_rebuilds, "so_mask_time_s": self.mask_time_s,
                    "so_mask_steps": self.mask_steps, "so_mask_rows": self.mask_rows,
                    "so_build_wait_s": self.build_wait_s, "so_compile_count": self.compile_count,
                    "so_compile_sum_s": self.compile_sum_s, "so_compile_buckets": cumulative}
