"""One rank's structured output: grammar builds, per-request matchers, and each step's mask.

Lifecycle of a constrained request (the engine's side is in engine/llm_engine.py):
  1. submit(): the grammar compiles on a background pool; the request waits here, outside
     the C++ scheduler, so it is never scheduled before its grammar exists. Pending builds
     count as local work (`has_pending`), so the rank keeps voting "unfinished" and, under
     DP, the group keeps stepping (placeholder steps) while a rank's only request compiles.
  2. take_ready(): at the start of a step, finished builds come back: the request enters the
     scheduler with its own matcher, or, if the build failed, it is finished with the error.
  3. bitmask(): before sampling, one bitmask row per constrained row of the step, filled in
     parallel; unconstrained rows have no row and pay nothing. Rows whose matchers are in the
     same state (the same grammar and the same consumed tokens: a mask depends on nothing
     else) are filled once and copied, e.g. requests with one schema inside its fixed prefix.
  4. accept(): after sampling, each token the C++ sequence appended advances its matcher.

Why the matcher is always current when a mask is filled, ZOS included: the worker samples
step N+1 only after it post-processed step N (its phase 2 runs before phase 3), and that
post-processing is where accept() runs; so the mask of step N+1 sees every token up to N,
and it is filled on the host while step N+1's forward runs on the device thread.
Preemption (recompute) keeps the sequence's output tokens, so the matcher, which holds
exactly the appended tokens, stays right; accept() checks the count and rebuilds the matcher
from the sequence's tokens if it ever differs.

Compiled grammars are cached by key (LRU); a build for a key already building is shared.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer_dp.structured_output.backend import GrammarBackend, apply_bitmask
from deepinfer_dp.structured_output.metrics import StructuredOutputStats
from deepinfer_dp.structured_output.params import BUILD_ERROR_PREFIX, StructuredOutputsParams


@dataclass
class GrammarMask:
    """The step's constrained rows (indices into the sampled rows) and their bitmask rows."""

    rows: torch.Tensor  # int64 [M]
    bitmask: torch.Tensor  # int32 [M, ceil(V / 32)]

    def apply(self, logits: torch.Tensor) -> None:
        """Forbidden tokens of the constrained rows to -inf, in place (the sampler's clone)."""
        apply_bitmask(logits, self.rows, self.bitmask)


@dataclass
class _Pending:
    future: Future
    payload: Any  # what the engine admits once built (the C++ Sequence)
    submitted: float


class StructuredOutputManager:
    def __init__(self, backend: GrammarBackend, cache_size: int = 128, build_threads: int = 2) -> None:
        self.backend = backend
        self.cache_size = cache_size
        self._pool = ThreadPoolExecutor(build_threads, thread_name_prefix="grammar-build")
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()  # key -> pristine matcher
        self._cache_lock = threading.Lock()
        self._pending: dict[str, _Pending] = {}
        self._matchers: dict[str, Any] = {}  # request id -> its LLMatcher
        self._consumed: dict[str, list[int]] = {}  # request id -> the tokens its matcher consumed
        self._digest: dict[str, int] = {}  # request id -> a hash of those tokens (finds equal states)
        self._pristine: dict[str, Any] = {}  # request id -> the cached matcher it was copied from
        self.stats = StructuredOutputStats()

    # ---- builds --------------------------------------------------------------------------
    def submit(self, request_id: str, params: StructuredOutputsParams, payload: Any) -> None:
        self._pending[request_id] = _Pending(self._compiled(params), payload, time.perf_counter())
        self.stats.constrained_requests += 1

    def _compiled(self, params: StructuredOutputsParams) -> Future:
        key = params.key()
        with self._cache_lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self.stats.cache_hits += 1
                return future
            self.stats.cache_misses += 1
            future = self._pool.submit(self._build, params)
            self._cache[key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        # A failed build is not kept: the same spec sent again is compiled (and refused) again.
        future.add_done_callback(lambda f: f.exception() is not None and self._evict(key, f))
        return future

    def _build(self, params: StructuredOutputsParams) -> Any:
        start = time.perf_counter()
        try:
            return self.backend.compile(params)
        finally:
            self.stats.observe_compile(time.perf_counter() - start)

    def _evict(self, key: tuple[str, str], future: Future) -> None:
        with self._cache_lock:
            if self._cache.get(key) is future:
                del self._cache[key]

    def has_pending(self) -> bool:
        return bool(self._pending)

    def wait_for_build(self, timeout_s: float) -> None:
        """Blocks until a pending build finishes or `timeout_s` passes (a rank alone with only
        compiling requests waits here instead of spinning placeholder steps)."""
        if self._pending:
            wait([p.future for p in self._pending.values()], timeout=timeout_s, return_when="FIRST_COMPLETED")

    def take_ready(self) -> list[tuple[str, Any, str | None]]:
        """(request id, payload, error or None) for every build that finished."""
        ready = []
        for rid, p in list(self._pending.items()):
            if not p.future.done():
                continue
            del self._pending[rid]
            error = p.future.exception()
            if error is None:
                self._pristine[rid] = p.future.result()
                self._matchers[rid] = self._pristine[rid].deep_copy()
                self._consumed[rid], self._digest[rid] = [], 0
                self.stats.observe_wait(time.perf_counter() - p.submitted)
            else:
                self.stats.build_failures += 1
            ready.append((rid, p.payload, None if error is None else _describe(error)))
        return ready

    def cancel(self, request_ids: Iterable[str]) -> list[str]:
        """Drops requests still waiting for their grammar; returns the ids it found."""
        return [rid for rid in request_ids if self._pending.pop(rid, None) is not None]

    # ---- the step ------------------------------------------------------------------------
    def bitmask(self, request_ids: list[str], device: torch.device) -> GrammarMask | None:
        """The mask of a step's sampled rows (row i samples for request_ids[i]), or None when
        no row is constrained."""
        if not self._matchers:
            return None
        rows = [i for i, rid in enumerate(request_ids) if rid in self._matchers]
        if not rows:
            return None
        start = time.perf_counter()
        distinct, source = self._distinct_states([request_ids[i] for i in rows])
        bitmask = self.backend.allocate_bitmask(len(distinct))
        self.backend.fill([self._matchers[rid] for rid in distinct], bitmask)
        if len(distinct) < len(rows):
            bitmask = bitmask.index_select(0, torch.tensor(source, dtype=torch.int64))
        self.stats.observe_mask(time.perf_counter() - start, len(rows))
        return GrammarMask(torch.tensor(rows, dtype=torch.int64, device=device), bitmask.to(device))

    def _distinct_states(self, rids: list[str]) -> tuple[list[str], list[int]]:
        """One request per distinct matcher state, and for each of `rids` the index of its
        state in that list. Equal digests are confirmed on the tokens themselves."""
        distinct: list[str] = []
        by_key: dict[tuple[int, int, int], list[int]] = {}
        source = []
        for rid in rids:
            tokens = self._consumed[rid]
            key = (id(self._pristine[rid]), len(tokens), self._digest[rid])
            candidates = by_key.setdefault(key, [])
            same = next((k for k in candidates if self._consumed[distinct[k]] == tokens), None)
            if same is None:
                same = len(distinct)
                distinct.append(rid)
                candidates.append(same)
            source.append(same)
        return distinct, source

    def tracks(self, request_id: str) -> bool:
        """True for a constrained request that runs (its grammar built)."""
        return request_id in self._matchers

    def accept(self, request_id: str, token_ids: list[int], output_len: int,
               output_tokens: Callable[[], list[int]]) -> None:
        """Advances the request's matcher by the tokens its sequence just appended. ValueError
        when the grammar refuses one (the engine then fails that request alone)."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return
        consumed = self._consumed[request_id]
        if len(consumed) + len(token_ids) != output_len:  # out of step: rebuild it
            matcher = self._matchers[request_id] = self._pristine[request_id].deep_copy()
            token_ids, consumed = output_tokens(), []
            self._consumed[request_id], self._digest[request_id] = consumed, 0
            self.stats.matcher_rebuilds += 1
        digest = self._digest[request_id]
        for t in token_ids:
            if not matcher.consume_token(t):
                raise ValueError(f"structured output: the grammar refused token {t}: {matcher.get_error()}")
            consumed.append(t)
            digest = hash((digest, t))
        self._digest[request_id] = digest

    def forget(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._consumed.pop(request_id, None)
        self._digest.pop(request_id, None)
        self._pristine.pop(request_id, None)
        self._pending.pop(request_id, None)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _describe(error: BaseException) -> str:
    """A failed build's message; a grammar the library refused already names its field
    ("structured_outputs.json: ..."), the front ends' sign of the request's own fault."""
    text = str(error)
    return text if text.startswith(BUILD_ERROR_PREFIX) else f"grammar build failed: {type(error).__name__}: {text}"
