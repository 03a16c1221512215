"""An owned step output in Python, read like the C++ RequestOutput (same attribute names).

Two kinds of outputs are made outside the C++ pool: a request that failed in the engine
(finish_reason "error", the cause in `error`), and, for the offline DP driver, what a rank
sent over the wire (from a TokenDelta). Both are already owned: clone() returns self.
"""

from __future__ import annotations

from deepinfer_dp import _C
from deepinfer_dp.engine.client import TokenDelta

_STATUS = {"stop": _C.SequenceStatus.FINISHED_STOPPED, "length": _C.SequenceStatus.FINISHED_LENGTH,
           "abort": _C.SequenceStatus.FINISHED_ABORTED, "error": _C.SequenceStatus.FINISHED_ABORTED}


class OwnedOutput:
    __slots__ = ("request_id", "token_ids", "finished", "finish_reason", "status", "prompt_len", "output_len",
                 "logprob", "dp_rank", "error", "top_logprobs", "prompt_logprobs", "prompt_top_logprobs")

    def __init__(self, request_id: str, token_ids: list[int], finished: bool, finish_reason: str | None,
                 prompt_len: int, output_len: int, logprob: float | None = None, dp_rank: int = 0,
                 error: str | None = None) -> None:
        self.request_id, self.token_ids, self.finished = request_id, token_ids, finished
        self.finish_reason = finish_reason
        self.status = _STATUS.get(finish_reason, _C.SequenceStatus.RUNNING)
        self.prompt_len, self.output_len, self.logprob = prompt_len, output_len, logprob
        self.dp_rank, self.error = dp_rank, error
        self.top_logprobs = self.prompt_logprobs = self.prompt_top_logprobs = None

    @classmethod
    def failed(cls, out, error: str, dp_rank: int) -> OwnedOutput:
        """`out` (this step's output of the request) turned into the request's failure."""
        return cls(out.request_id, [], True, "error", out.prompt_len, out.output_len, None, dp_rank, error)

    @classmethod
    def from_delta(cls, d: TokenDelta) -> OwnedOutput:
        out = cls(d.request_id, d.token_ids, d.finished, d.finish_reason, d.prompt_len, d.output_len,
                  d.logprobs[-1] if d.logprobs else None, d.dp_rank, d.error)
        out.top_logprobs, out.prompt_logprobs, out.prompt_top_logprobs = (
            d.top_logprobs, d.prompt_logprobs, d.prompt_top_logprobs)
        return out

    @property
    def token_id(self) -> int:
        return self.token_ids[-1]

    def clone(self) -> OwnedOutput:
        return self

    def __repr__(self) -> str:
        return (f"OwnedOutput(request_id={self.request_id!r}, token_ids={self.token_ids}, finished={self.finished}, "
                f"finish_reason={self.finish_reason!r}, dp_rank={self.dp_rank}, error={self.error!r})")
