"""Offline DP from one driver: `LLM(model, dp_size=N)` over Ray actor ranks and the router.

DPDriver takes LLM's requests (add_request, abort_request, validated here first) and hands
the ranks' outputs back (run_until_done) as OwnedOutputs that read like the RequestOutputs
of one rank, so LLM.generate keeps one progress bar and prompt-order results. The ranks run
the step loop; this process only waits for their outputs.
"""

from __future__ import annotations

import atexit
import itertools
import queue
from collections.abc import Callable, Iterable

from deepinfer_dp.cluster.deployment import DPDeployment
from deepinfer_dp.cluster.protocol import images_to_wire
from deepinfer_dp.config import EngineConfig
from deepinfer_dp.config_file import DPSettings
from deepinfer_dp.engine.client import EngineError, RequestRejected
from deepinfer_dp.engine.input_processor import InvalidRequest
from deepinfer_dp.engine.outputs import OwnedOutput
from deepinfer_dp.multimodal.front import image_for_wire
from deepinfer_dp.multimodal.image_worker import MultiModalPrompt
from deepinfer_dp.sampling_params import SamplingParams


class DPDriver:
    """The offline side of `LLM(dp_size=N)`: a DPDeployment (router and rank actors, as
    `settings` say, and a RouterClient to them). `router` is the client (submit, abort_sync,
    query_stats, health); `deployment` has the processes (kill_rank, infos)."""

    def __init__(self, config: EngineConfig, settings: DPSettings) -> None:
        self.deployment = DPDeployment(config, settings, str(config.model or "default"))
        self.config = self.deployment.config
        self.router = self.deployment.router
        self.tokenizer = self.router.tokenizer
        self.input_processor = self.router.input_processor
        self.images = self.router.images  # a vision model's ImageFront (chat template, limits), or None
        self._outputs: queue.Queue = queue.Queue()
        self._pending: set[str] = set()
        self._counter = itertools.count()
        self._closed = False
        atexit.register(self.shutdown)

    @property
    def dp_size(self) -> int:
        return self.config.dp_size

    def add_request(self, prompt: str | None = None, sampling_params: SamplingParams | None = None,
                    prompt_token_ids: list[int] | None = None, request_id: str | None = None) -> str:
        """Validates (InputProcessor.process; InvalidRequest naming the field; no params: the
        model's defaults) and sends the request to the router with add_checked."""
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("add_request needs a prompt or prompt_token_ids")
            prompt_token_ids = self.tokenizer(prompt).input_ids
        params = sampling_params if sampling_params is not None else self.input_processor.default_params()
        return self.add_checked(*self.input_processor.process(prompt_token_ids, params, one_sample=True), request_id)

    def add_checked(self, ids: list[int], params: SamplingParams, request_id: str | None = None,
                    mm: MultiModalPrompt | None = None, data_parallel_rank: int | None = None) -> str:
        """Sends a request (n=1) that has passed InputProcessor.process to the router (to the
        rank `data_parallel_rank` if given); the rank admits it without checking it again
        (engine/input_processor.py). With `mm` its images go as references (a PIL image as PNG
        bytes); the rank's image worker fetches them, and a failed one finishes only this
        request, as at dp 1."""
        rid = str(next(self._counter)) if request_id is None else str(request_id)
        wire = None
        if mm is not None:
            if self.images is None:
                raise InvalidRequest("this model does not take images", "multi_modal_data")
            images = [image_for_wire(image, f"image {i}") for i, image in enumerate(mm.images)]
            wire = images_to_wire(mm.prompt, images, mm.image_fields, mm.max_tokens_set)
        self.router.submit(rid, ids, params, self._outputs.put, wire, data_parallel_rank)
        self._pending.add(rid)
        return rid

    def abort_request(self, request_id: str | Iterable[str]) -> list[str]:
        ids = [request_id] if isinstance(request_id, str) else [str(r) for r in request_id]
        found = [r for r in ids if r in self._pending]
        self.router.abort_sync(found)
        self._pending.difference_update(found)
        return found

    def run_until_done(self, on_outputs: Callable[[list], None]) -> None:
        """Hands every output of the pending requests to `on_outputs` until all finished. A
        request the ranks refused or lost aborts the others and raises."""
        while self._pending:
            on_outputs(self._next_outputs())

    def _next_outputs(self) -> list[OwnedOutput]:
        """Waits for the next outputs from any rank, then takes everything already there."""
        items = [self._next_item()]
        while True:
            try:
                items.append(self._outputs.get_nowait())
            except queue.Empty:
                break
        outputs = []
        for item in items:
            if isinstance(item, EngineError):
                self.abort_request(list(self._pending))
                raise ValueError(str(item)) if isinstance(item, RequestRejected) else item
            outputs.append(OwnedOutput.from_delta(item))
            if item.finished:
                self._pending.discard(item.request_id)
        return outputs

    def _next_item(self):
        while True:  # short waits keep Ctrl-C working; the router's health checks end dead ranks
            try:
                return self._outputs.get(timeout=0.5)
            except queue.Empty:
                continue

    def rank_stats(self) -> list[dict]:
        return self.router.query_stats()

    def shutdown(self) -> None:
        """Stops the router and the rank actors (each exits cleanly); safe to call twice."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        self.deployment.shutdown()

