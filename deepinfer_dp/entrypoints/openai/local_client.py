"""An EngineClient over ONE in-process LLMEngine (dp_size=1), driven by a background thread.

The thread owns the engine. Idle, it blocks on its command queue (no CPU). A command (add,
abort) starts the step loop (engine/step_loop.py), which takes further commands between
steps and returns after the final flush once no request is left. Each step's outputs become
TokenDeltas, handed to the asyncio loop of the request's caller with call_soon_threadsafe.
Closing a generate() iterator early aborts the request, which frees its KV blocks.

When a stopping server's drain time is over, fail_inflight ends every request still running
with the server's error (a stream gets it as an error event, then [DONE]) and aborts it.

One request's failure (refused input, a failure while admitting or post-processing it)
fails that request only. If the loop itself fails, every waiting request gets the error,
health() reports the rank down and `on_fatal` is called: the server process then exits,
so a supervisor sees it and restarts it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from deepinfer_dp.engine.client import (
    NoCapacity,
    RankFailed,
    RequestFailed,
    RequestRejected,
    TokenDelta,
    deltas_until_finished,
)
from deepinfer_dp.engine.llm_engine import LLMEngine
from deepinfer_dp.engine.step_loop import StepLoop
from deepinfer_dp.multimodal.image_worker import MultiModalPrompt
from deepinfer_dp.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
STATS_PERIOD_S = 0.5  # how often the thread refreshes the stats snapshot while stepping


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class LocalEngineClient:
    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.engine = engine
        self.loop = StepLoop(engine)
        self.tokenizer = engine.tokenizer
        self.model_name = model_name
        self.max_model_len = engine.max_model_len
        self.dp_ranks = [0]  # what a request may pin (data_parallel_rank)
        self.input_processor = engine.input_processor
        # A vision model's images: the chat template of its processor, and how many a prompt may carry.
        self.images = engine.images
        self.image_limit = engine.config.limit_mm_per_prompt.get("image", 0)
        self.on_fatal: Callable[[BaseException], None] | None = None  # the engine loop died
        self._commands: queue.Queue = queue.Queue()
        # The engine thread adds and ends streams; fail_inflight (the event loop's thread) takes
        # them all at once, and from then on refuses new ones with its error.
        self._lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        self._failing: Exception | None = None
        self._ids = itertools.count()
        self._stats: dict = self.loop.stats()
        self._last_stats = 0.0
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="deepinfer-engine", daemon=True)
        self._thread.start()

    # ---- the EngineClient protocol (called from the asyncio side) ------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       mm: MultiModalPrompt | None = None,
                       data_parallel_rank: int | None = None) -> AsyncIterator[TokenDelta]:
        # data_parallel_rank: only 0 passes the server's check (dp_ranks), and it is this engine
        if not self._thread.is_alive():
            raise NoCapacity("the engine thread is not running")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        engine_id = f"{request_id}-{next(self._ids)}"  # unique even if a client reuses ids
        self._commands.put(("add", engine_id, list(prompt_token_ids), params, stream, mm))
        async for delta in deltas_until_finished(stream.queue, lambda: self._commands.put(("abort", engine_id))):
            yield delta

    async def abort(self, request_id: str) -> None:
        for engine_id in [r for r in list(self._streams) if r.rsplit("-", 1)[0] == request_id]:
            self._commands.put(("abort", engine_id))

    def health(self) -> list[dict]:
        alive = self._thread.is_alive() and not self._stopping.is_set()
        return [{"dp_rank": 0, "up": alive, "num_running": self._stats["num_running"],
                 "num_waiting": self._stats["num_waiting"]}]

    def rank_stats(self) -> list[dict]:
        return [dict(self._stats)]

    def fail_inflight(self, error: Exception) -> int:
        """Ends every request in flight with `error` (the server's drain time is over) and
        aborts them in the engine; a request still queued for admission gets the same error.
        Returns how many were in flight."""
        with self._lock:
            streams, self._streams = self._streams, {}
            self._failing = error
        if streams:
            self._commands.put(("drop", list(streams)))
        for stream in streams.values():
            _put(stream, error)
        return len(streams)

    def shutdown(self) -> None:
        self._stopping.set()
        self._commands.put(("stop",))
        self._thread.join(timeout=30)
        self.engine.shutdown()

    # ---- the engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._stats = self.loop.stats()
                self._handle(self._commands.get())  # idle: block until there is work
                self.loop.run(self._deliver, take_work=self._between_steps)
        except Exception as e:  # a crashed engine must not leave its callers waiting forever
            logger.exception("the engine loop failed")
            self._fail_all(RankFailed(f"the engine failed: {e!r}"))
            if self.on_fatal is not None:
                self.on_fatal(e)
            return  # the thread ends: health() reports the rank down, generate() answers 503
        self._fail_all(NoCapacity("the server is shutting down"))

    def _between_steps(self) -> None:
        self._drain_commands()
        now = time.perf_counter()
        if now - self._last_stats > STATS_PERIOD_S:
            # Read on this thread only, so the C++ scheduler is never touched by two threads.
            self._stats, self._last_stats = self.loop.stats(), now

    def _drain_commands(self) -> None:
        while True:
            try:
                self._handle(self._commands.get_nowait())
            except queue.Empty:
                return

    def _handle(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, engine_id, ids, params, stream, mm = command
            try:
                self.engine.add_checked(ids, params, engine_id, mm=mm)  # generate() takes validated requests
            except ValueError as e:
                _put(stream, RequestRejected(str(e)))
                return
            except Exception as e:  # not the request's fault, but it must not end the engine
                logger.exception("admitting request %s failed", engine_id)
                _put(stream, RequestFailed(f"request {engine_id}: admission failed: {e!r}"))
                return
            with self._lock:
                failing = self._failing
                if failing is None:
                    self._streams[engine_id] = stream
            if failing is not None:  # failed while it waited for admission
                self.engine.abort_request(engine_id)
                _put(stream, failing)
        elif kind == "abort":
            with self._lock:
                known = self._streams.pop(command[1], None) is not None
            if known:
                self.engine.abort_request(command[1])
        elif kind == "drop":  # their streams already ended (fail_inflight)
            self.engine.abort_request(command[1])

    def _deliver(self, outputs: list) -> None:
        for delta in self.engine.to_deltas(outputs):
            with self._lock:
                stream = self._streams.get(delta.request_id)
                if stream is not None and delta.finished:
                    del self._streams[delta.request_id]
            if stream is not None:  # else aborted or failed meanwhile
                _put(stream, delta)

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
        for stream in streams.values():
            _put(stream, error)


def _put(stream: _Stream, item: TokenDelta | Exception) -> None:
    try:
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
    except RuntimeError:
        pass  # the caller's event loop is closed: nobody is listening any more
