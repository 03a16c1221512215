"""Offline DP from one driver: `LLM(model, dp_size=N)`.

DPEngine stands where LLMEngine stands in LLM: add_request, has_unfinished_requests, step,
flush_inflight_reqs. So LLM.generate keeps its one loop, its one progress bar and its
prompt-order results, while the requests run on N Ray actor ranks behind a Router. A step
here returns whatever TokenDeltas the ranks produced since the last call, as
RemoteOutputs that read like the RequestOutputs of one rank.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import os
import queue
from collections.abc import Iterable

from transformers import AutoTokenizer

from deepinfer_dp import _C
from deepinfer_dp.cluster.policies import make_policy
from deepinfer_dp.cluster.ray_launcher import RayRanks
from deepinfer_dp.cluster.router import Router
from deepinfer_dp.config import EngineConfig
from deepinfer_dp.engine.client import EngineError, RequestRejected, TokenDelta
from deepinfer_dp.models.loader import resolve_model_dir
from deepinfer_dp.sampling_params import SamplingParams

_STATUS = {"stop": _C.SequenceStatus.FINISHED_STOPPED, "length": _C.SequenceStatus.FINISHED_LENGTH,
           "abort": _C.SequenceStatus.FINISHED_ABORTED}


class RemoteOutput:
    """A rank's RequestOutput after the wire: same attribute names, already owned."""

    __slots__ = ("request_id", "token_ids", "finished", "finish_reason", "status", "prompt_len",
                 "output_len", "logprob", "dp_rank", "top_logprobs", "prompt_logprobs", "prompt_top_logprobs")

    def __init__(self, d: TokenDelta) -> None:
        self.request_id, self.token_ids, self.finished = d.request_id, d.token_ids, d.finished
        self.finish_reason = d.finish_reason
        self.status = _STATUS.get(d.finish_reason, _C.SequenceStatus.RUNNING)
        self.prompt_len, self.output_len, self.dp_rank = d.prompt_len, d.output_len, d.dp_rank
        self.logprob = d.logprobs[-1] if d.logprobs else None
        self.top_logprobs, self.prompt_logprobs = d.top_logprobs, d.prompt_logprobs
        self.prompt_top_logprobs = d.prompt_top_logprobs

    @property
    def token_id(self) -> int:
        return self.token_ids[-1]

    def clone(self) -> RemoteOutput:
        return self

    def __repr__(self) -> str:
        return (f"RemoteOutput(request_id={self.request_id!r}, token_ids={self.token_ids}, "
                f"finished={self.finished}, finish_reason={self.finish_reason!r}, dp_rank={self.dp_rank})")


class DPEngine:
    def __init__(self, config: EngineConfig, policy: str = "round_robin", address: str = "local",
                 strategy: str = "PACK", collective_timeout_s: float = 30.0, host: str = "127.0.0.1") -> None:
        if config.torch_threads is None and config.torch_device().type == "cpu":
            # One rank per core share: ranks oversubscribing the cores would slow each other.
            config = dataclasses.replace(config, torch_threads=max(1, (os.cpu_count() or 1) // config.dp_size))
        self.config = config
        model_dir = resolve_model_dir(config.model)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        name = str(config.model or model_dir)
        self.router = Router(self.tokenizer, name, 0, 0, make_policy(policy), host=host,
                             collective_timeout_s=collective_timeout_s)
        try:
            self.ranks = RayRanks(config, self.router, config.dp_size, address, strategy,
                                  timeout_s=collective_timeout_s)
        except BaseException:
            self.router.close()
            raise
        self.router.vocab_size = self.ranks.infos[0]["vocab_size"]
        self.router.max_model_len = self.max_model_len = self.ranks.infos[0]["max_model_len"]
        self._outputs: queue.Queue = queue.Queue()
        self._pending: set[str] = set()
        self._counter = itertools.count()
        self._closed = False
        atexit.register(self.shutdown)

    def add_request(self, prompt: str | None = None, sampling_params: SamplingParams | None = None,
                    prompt_token_ids: list[int] | None = None, request_id: str | None = None) -> str:
        params = (sampling_params or SamplingParams()).clone()
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("add_request needs a prompt or prompt_token_ids")
            prompt_token_ids = self.tokenizer(prompt).input_ids
        rid = str(next(self._counter)) if request_id is None else str(request_id)
        try:
            self.router.submit(rid, [int(t) for t in prompt_token_ids], params, self._outputs.put)
        except RequestRejected as e:
            raise ValueError(str(e)) from e
        self._pending.add(rid)
        return rid

    def abort_request(self, request_id: str | Iterable[str]) -> list[str]:
        ids = [request_id] if isinstance(request_id, str) else [str(r) for r in request_id]
        found = [r for r in ids if r in self._pending]
        self.router.abort_sync(found)
        self._pending.difference_update(found)
        return found

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending)

    def get_num_unfinished_requests(self) -> int:
        return len(self._pending)

    def step(self) -> list[RemoteOutput]:
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
            outputs.append(RemoteOutput(item))
            if item.finished:
                self._pending.discard(item.request_id)
        return outputs

    def _next_item(self):
        while True:  # short waits keep Ctrl-C working; the router's health checks end dead ranks
            try:
                return self._outputs.get(timeout=0.5)
            except queue.Empty:
                continue

    def flush_inflight_reqs(self) -> list:
        return []  # each rank flushes its own ZOS step when its wave ends

    def stats(self) -> dict:
        return {"num_unfinished": len(self._pending), "ranks": self.rank_stats()}

    def rank_stats(self) -> list[dict]:
        return self.router.query_stats()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.router.close()
        self.ranks.shutdown()
