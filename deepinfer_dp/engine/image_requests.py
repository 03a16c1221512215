"""One rank's requests with images, between admission and the scheduler and beside it.

`LLMEngine.add_checked(..., mm=MultiModalPrompt)` hands a request's prompt and images to the
image worker (multimodal/image_worker.py) and keeps it out of the C++ scheduler; at the start
of each step the engine takes what is ready (`take_ready`), and a request enters the
scheduler with its expanded prompt, whose placeholder ids carry its images' content keys
(multimodal/processing.py: the prefix cache then tells images apart). While it runs, `plan`
tells each step which of its rows are image tokens; the model runner splices their
embeddings in from the encoder cache, encoding an image on its first use.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping

from deepinfer_dp import _C
from deepinfer_dp.engine.input_processor import InvalidRequest
from deepinfer_dp.engine.request_state import RequestState
from deepinfer_dp.multimodal.chat import render_chat_prompt
from deepinfer_dp.multimodal.encoder_cache import EncoderCache
from deepinfer_dp.multimodal.errors import MM_ERROR_PREFIX
from deepinfer_dp.multimodal.image_worker import ImageWorker, MultiModalPrompt
from deepinfer_dp.multimodal.media import MediaLimits
from deepinfer_dp.multimodal.mrope import MRopePositions, step_positions
from deepinfer_dp.multimodal.processing import ImageItem, ImagePromptProcessor, ProcessedPrompt
from deepinfer_dp.multimodal.qwen_processor import load_processor
from deepinfer_dp.multimodal.step_inputs import MultiModalStep, plan_step
from deepinfer_dp.sampling_params import SamplingParams
from deepinfer_dp.utils.chat_template import DEFAULT_RENDER, ChatRender


class ImageRequests:
    def __init__(self, worker: ImageWorker, cache: EncoderCache) -> None:
        self.worker = worker
        self.cache = cache
        self.items: dict[str, list[ImageItem]] = {}  # running requests' images
        self.mrope: dict[str, MRopePositions] = {}  # their M-RoPE positions (Qwen2-VL)
        self.prompts: dict[str, MultiModalPrompt] = {}  # waiting requests' prompts
        self._unpins: deque[list[tuple[str, str]]] = deque()  # per planned step: (image key, request) to unpin

    @classmethod
    def for_model(cls, model, model_dir: str, limits: MediaLimits, cache_tokens: int) -> ImageRequests | None:
        """None for a model without vision (`image_family` unset on its class)."""
        family = getattr(model, "image_family", None)
        if family is None:
            return None
        processor = load_processor(model_dir)
        prompts = ImagePromptProcessor(processor, model.image_token_id, family)
        return cls(ImageWorker(prompts, limits), EncoderCache(cache_tokens))

    def chat_prompt(self, messages: list[dict], render: ChatRender = DEFAULT_RENDER,
                    chat_template: str | None = None) -> MultiModalPrompt:
        """A conversation with image_url parts as one prompt: the processor's chat template's
        (or `chat_template`'s) text, placeholders where the images were, and the images' URLs,
        fetched later."""
        return render_chat_prompt(self.worker.processor.processor, messages, render, chat_template)

    def submit(self, request_id: str, prompt: MultiModalPrompt) -> None:
        self.prompts[request_id] = prompt
        self.worker.submit(request_id, prompt)

    def has_pending(self) -> bool:
        return self.worker.has_pending()

    def admit_ready(self, requests: Mapping[str, RequestState], limits: Callable[..., _C.SequenceLimits],
                    max_model_len: int, vocab_size: int) -> tuple[list[_C.Sequence], list[tuple[str, str]]]:
        """The C++ sequences of the requests whose images are ready, and (request id, error) for
        those that failed: an image, or an expanded prompt past the context. `limits` is the
        engine's (request id, prompt length, params, drafts) -> SequenceLimits."""
        ready, failed = [], []
        for rid, processed, error in self.worker.take_ready():
            mm, state = self.prompts.pop(rid, None), requests.get(rid)
            if state is None or mm is None:
                continue  # aborted meanwhile
            if error is None:
                try:
                    n = _fit(mm, processed, state.params, max_model_len)
                    # no drafts: an n-gram proposer would copy placeholder ids, which are not tokens
                    ids = processed.scheduler_token_ids(vocab_size)
                    seq = _C.Sequence(rid, ids, limits(rid, n, state.params, False))
                    seq.set_image_spans([(int(i.positions[0]), int(i.positions[-1]) + 1, i.num_tokens)
                                         for i in processed.items])  # the scheduler's encoder budget
                    ready.append(seq)
                except ValueError as e:
                    error = str(e)
            if error is not None:
                failed.append((rid, MM_ERROR_PREFIX + error))
            elif processed.items:
                self.items[rid] = processed.items
                if processed.mrope is not None:
                    self.mrope[rid] = processed.mrope
        return ready, failed

    def plan(self, sched_out: _C.SchedulerOutput) -> MultiModalStep | None:
        """The image rows of this step (and an M-RoPE model's positions), or None when it
        computes no image row and its positions are as scheduled. An image this step begins but
        does not finish stays pinned in the encoder cache until a step computes its last rows;
        the unpin waits two steps, until that step's forward surely ran (the post-processing of
        step N, which needs its forward, comes before step N + 2 is planned)."""
        if len(self._unpins) == 2:
            for key, rid in self._unpins.popleft():
                self.cache.unpin(key, rid)
        done: list[tuple[str, str]] = []
        self._unpins.append(done)
        if not self.items or sched_out.is_empty():
            return None
        rids, qsl, positions = list(sched_out.request_ids), sched_out.query_start_loc, sched_out.positions
        slices = plan_step(rids, qsl, positions, self.items)
        for s in slices:
            if s.item_rows[-1] + 1 < s.item.num_tokens:
                self.cache.pin(s.item.key, s.request_id)
            else:
                done.append((s.item.key, s.request_id))
        mrope = step_positions(rids, qsl, positions, self.mrope) if self.mrope else None
        return MultiModalStep(slices, self.cache, mrope) if slices or mrope is not None else None

    def cancel(self, request_ids: list[str]) -> list[str]:
        found = self.worker.cancel(request_ids)
        for rid in found:
            self.prompts.pop(rid, None)
        return found

    def forget(self, request_id: str) -> None:
        for item in self.items.pop(request_id, []):
            if self._unpins:
                self._unpins[-1].append((item.key, request_id))
            else:
                self.cache.unpin(item.key, request_id)
        self.mrope.pop(request_id, None)
        self.prompts.pop(request_id, None)

    def stats(self) -> dict:
        s = self.worker.stats
        return {"mm_requests_waiting": self.worker.num_waiting, "images_processed": s.images_processed,
                "image_failures": s.image_failures, "image_preprocess_time_s": s.preprocess_time_s,
                "image_wait_time_s": s.image_wait_time_s, **self.cache.stats()}

    def shutdown(self) -> None:
        self.worker.shutdown()


def _fit(mm: MultiModalPrompt, processed: ProcessedPrompt, params: SamplingParams, max_model_len: int) -> int:
    """The expanded prompt's length; max_tokens cut to the room left unless the request set it."""
    n = len(processed.prompt_token_ids)
    room = max_model_len - n
    if room < 1:
        raise InvalidRequest(f"the prompt has {n} tokens with its images expanded, which leaves no room to "
                             f"generate within the context length of {max_model_len}", "prompt")
    if params.max_tokens > room:
        if mm.max_tokens_set:
            raise InvalidRequest(f"the prompt has {n} tokens with its images expanded and max_tokens is "
                                 f"{params.max_tokens}, more than the context length of {max_model_len} allows",
                                 "max_tokens")
        params.max_tokens = room
    return n
