"""The image worker: fetches, decodes and preprocesses requests' images on a thread pool.

A request with images waits here, outside the C++ scheduler, until its inputs are ready.
The engine submits it (`submit`), collects finished work at the start of each step
(`take_ready`) and counts `has_pending()` as local work in the DP vote, exactly as pending
grammar builds are counted. A failure names the image it comes from and touches nothing but
its own request.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from deepinfer_dp.multimodal.media import MediaError, MediaLimits, load_image
from deepinfer_dp.multimodal.processing import ImagePromptProcessor, ProcessedPrompt


@dataclass
class MultiModalPrompt:
    """A prompt with the model's image placeholders in its text, and its images."""

    prompt: str
    images: list[object]  # PIL images, bytes, or URL strings (data:, http(s):, file:)
    # Per image, the request field that carried it, for error messages ("messages.0.content.1.image_url");
    # None: "image <index>".
    image_fields: list[str] | None = None
    max_tokens_set: bool = True  # False: max_tokens may shrink to the room left once images expand

    def where(self, index: int) -> str:
        return self.image_fields[index] if self.image_fields else f"image {index}"


@dataclass
class ImageWorkerStats:
    images_processed: int = 0
    image_failures: int = 0
    preprocess_time_s: float = 0.0  # fetch + decode + processor, summed over jobs
    image_wait_time_s: float = 0.0  # submit to ready, summed over requests
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def observe(self, images: int, seconds: float, failed: bool) -> None:
        with self._lock:
            self.images_processed += images
            self.image_failures += failed
            self.preprocess_time_s += seconds


class ImageWorker:
    def __init__(self, processor: ImagePromptProcessor, limits: MediaLimits, threads: int = 2) -> None:
        self.processor = processor
        self.limits = limits
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="image-worker")
        self._pending: dict[str, tuple[Future, float]] = {}
        self.stats = ImageWorkerStats()

    def submit(self, request_id: str, prompt: MultiModalPrompt) -> None:
        self._pending[request_id] = (self._pool.submit(self._run, prompt), time.perf_counter())

    def _run(self, prompt: MultiModalPrompt) -> ProcessedPrompt:
        start, failed = time.perf_counter(), True
        try:
            images = []
            for i, source in enumerate(prompt.images):
                try:
                    images.append(load_image(source, self.limits))
                except MediaError as e:
                    raise MediaError(f"{prompt.where(i)}: {e}") from None
            processed = self.processor.process(prompt.prompt, images)
            failed = False
            return processed
        finally:
            self.stats.observe(len(prompt.images), time.perf_counter() - start, failed)

    def has_pending(self) -> bool:
        return bool(self._pending)

    @property
    def num_waiting(self) -> int:
        return len(self._pending)

    def wait(self, timeout_s: float) -> None:
        """Blocks until a pending job finishes or `timeout_s` passes (a rank alone with only
        waiting requests waits here instead of spinning placeholder steps)."""
        if self._pending:
            wait([f for f, _ in self._pending.values()], timeout=timeout_s, return_when="FIRST_COMPLETED")

    def take_ready(self) -> list[tuple[str, ProcessedPrompt | None, str | None]]:
        """(request id, processed prompt, error or None) for every finished job."""
        ready = []
        for rid, (future, submitted) in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[rid]
            self.stats.image_wait_time_s += time.perf_counter() - submitted
            error = future.exception()
            if error is None:
                ready.append((rid, future.result(), None))
            else:
                text = str(error) if isinstance(error, MediaError) else f"{type(error).__name__}: {error}"
                ready.append((rid, None, text))
        return ready

    def cancel(self, request_ids) -> list[str]:
        """Drops requests still waiting for their images; returns the ids it found."""
        found = []
        for rid in request_ids:
            entry = self._pending.pop(rid, None)
            if entry is not None:
                entry[0].cancel()
                found.append(rid)
        return found

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
