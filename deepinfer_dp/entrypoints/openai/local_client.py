"""An EngineClient over ONE in-process LLMEngine (dp_size=1), driven by a background thread.

The thread owns the engine: it runs the step loop (step() while there is work, then one
flush_inflight_reqs()), and between steps takes commands (add, abort) from a queue. Each
step's outputs become TokenDeltas, handed to the asyncio loop of the request's caller with
call_soon_threadsafe. With no work the thread blocks on the command queue and burns no CPU.
Closing a generate() iterator early aborts the request, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from deepinfer_dp.engine.client import NoCapacity, RankFailed, RequestRejected, TokenDelta
from deepinfer_dp.engine.llm_engine import LLMEngine
from deepinfer_dp.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
STATS_PERIOD_S = 0.5  # how often the thread refreshes the stats snapshot while stepping


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    want_logprobs: bool


class LocalEngineClient:
    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = model_name
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._step_time_s = 0.0
        self._placeholder_step_time_s = 0.0
        self._stats: dict = self._snapshot()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="deepinfer-engine", daemon=True)
        self._thread.start()

    # ---- the EngineClient protocol (called from the asyncio side) ------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[TokenDelta]:
        if not self._thread.is_alive():
            raise NoCapacity("the engine thread is not running")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), params.logprobs is not None)
        engine_id = f"{request_id}-{next(self._ids)}"  # unique even if a client reuses ids
        self._commands.put(("add", engine_id, list(prompt_token_ids), params, stream))
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:  # the caller went away (or failed): free the rank's blocks
                self._commands.put(("abort", engine_id))

    async def abort(self, request_id: str) -> None:
        for engine_id in [r for r in list(self._streams) if r.rsplit("-", 1)[0] == request_id]:
            self._commands.put(("abort", engine_id))

    def health(self) -> list[dict]:
        alive = self._thread.is_alive() and not self._stopping.is_set()
        return [{"dp_rank": 0, "up": alive, "num_running": self._stats["num_running"],
                 "num_waiting": self._stats["num_waiting"]}]

    def rank_stats(self) -> list[dict]:
        return [dict(self._stats)]

    def shutdown(self) -> None:
        self._stopping.set()
        self._commands.put(("stop",))
        self._thread.join(timeout=30)
        self.engine.shutdown()

    # ---- the engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._step_loop()
        except Exception as e:  # a crashed engine must not leave its callers waiting forever
            logger.exception("the engine thread failed")
            self._fail_all(RankFailed(f"the engine failed: {e!r}"))
            return  # the thread ends: health() reports the rank down, generate() answers 503
        self._fail_all(NoCapacity("the server is shutting down"))

    def _step_loop(self) -> None:
        in_loop = False  # inside a step loop: a flush is owed before going idle
        last_stats = 0.0
        while not self._stopping.is_set():
            if not self.engine.has_unfinished_requests():
                if in_loop:
                    self._deliver(self.engine.flush_inflight_reqs())
                    in_loop = False
                self._stats = self._snapshot()
                self._handle(self._commands.get())  # idle: block until there is work
                continue
            self._drain_commands()
            start, placeholders = time.perf_counter(), self.engine.placeholder_steps
            outputs = self.engine.step()
            elapsed = time.perf_counter() - start
            self._step_time_s += elapsed
            if self.engine.placeholder_steps != placeholders:
                self._placeholder_step_time_s += elapsed
            in_loop = True
            self._deliver(outputs)
            if start - last_stats > STATS_PERIOD_S:
                self._stats, last_stats = self._snapshot(), start

    def _drain_commands(self) -> None:
        while True:
            try:
                self._handle(self._commands.get_nowait())
            except queue.Empty:
                return

    def _handle(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, engine_id, ids, params, stream = command
            try:
                self.engine.add_request(None, params, ids, engine_id)
            except ValueError as e:
                _put(stream, RequestRejected(str(e)))
                return
            self._streams[engine_id] = stream
        elif kind == "abort":
            if self._streams.pop(command[1], None) is not None:
                self.engine.abort_request(command[1])

    def _deliver(self, outputs: list) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted meanwhile
            logprob = out.logprob if stream.want_logprobs else None
            delta = TokenDelta(out.request_id, list(out.token_ids), out.finished, out.finish_reason,
                               None if logprob is None else [logprob] * len(out.token_ids),
                               out.prompt_len, out.output_len, 0, out.top_logprobs, out.prompt_logprobs,
                               out.prompt_top_logprobs)
            if out.finished:
                del self._streams[out.request_id]
            _put(stream, delta)

    def _fail_all(self, error: Exception) -> None:
        for stream in self._streams.values():
            _put(stream, error)
        self._streams.clear()

    def _snapshot(self) -> dict[str, Any]:
        # Read on this thread only, so the C++ scheduler is never touched by two threads.
        return {"dp_rank": 0, **self.engine.stats(), "step_time_s": self._step_time_s,
                "placeholder_step_time_s": self._placeholder_step_time_s, "allreduce_time_s": 0.0}


def _put(stream: _Stream, item: TokenDelta | Exception) -> None:
    try:
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
    except RuntimeError:
        pass  # the caller's event loop is closed: nobody is listening any more
