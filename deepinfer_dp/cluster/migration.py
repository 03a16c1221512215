"""Moving a running request to another DP rank by recompute (a rank leaving the group).

The router keeps, while elastic scaling is on, each request's AddRequest and the tokens it has
delivered to the client. To move a request, the router resubmits it to a staying rank with
the delivered tokens appended to the prompt and the limits shortened by as many: under greedy
(and, with batch-invariant kernels, any unseeded sampling) the new rank continues exactly
where the client's stream stopped. Tokens the old rank produced but the router never
delivered are dropped with it, so nothing is lost and nothing is streamed twice. The new
rank's deltas are shifted back (prompt_len, output_len) so the client sees one request.

What cannot continue that way is refused with a clear reason: a structured-output request
(its grammar would start again at the first generated token) and one that asked for prompt
logprobs and has not received them yet.
"""

from __future__ import annotations

import dataclasses

import msgspec

from deepinfer_dp.cluster import protocol as p
from deepinfer_dp.engine.client import TokenDelta


@dataclasses.dataclass
class _Entry:
    request: p.AddRequest
    delivered: list[int] = dataclasses.field(default_factory=list)
    shift: int = 0  # tokens moved into the prompt by earlier migrations


class RequestLog:
    """Every running request's AddRequest and delivered tokens (the router's, under its lock)."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self.migrated = 0  # requests moved to another rank so far

    def add(self, msg: p.AddRequest) -> None:
        self._entries[msg.request_id] = _Entry(msg)

    def forget(self, request_id: str) -> None:
        self._entries.pop(request_id, None)

    def delivered(self, delta: TokenDelta) -> TokenDelta:
        """Records `delta` as sent to its client; returns it as the client must see it (a
        migrated request's lengths counted from its original prompt)."""
        entry = self._entries.get(delta.request_id)
        if entry is None:
            return delta
        entry.delivered.extend(delta.token_ids)
        if entry.shift == 0:
            return delta
        return msgspec.structs.replace(delta, prompt_len=max(0, delta.prompt_len - entry.shift),
                                       output_len=delta.output_len + entry.shift)

    def resubmission(self, request_id: str) -> p.AddRequest | None:
        """The AddRequest that continues `request_id` on another rank; None when every token
        it may have was delivered already (only its finish was still to come); ValueError
        (naming why) when it cannot continue there."""
        entry = self._entries.get(request_id)
        if entry is None:
            raise ValueError(f"request {request_id}: the router has no record of it to move")
        params = dict(entry.request.params)
        done = len(entry.delivered) - entry.shift
        if params.get("structured_outputs") is not None:
            raise ValueError(f"request {request_id} has a structured-output grammar, which cannot be "
                             "moved to another rank mid-generation")
        if params.get("prompt_logprobs") is not None and not entry.delivered:
            raise ValueError(f"request {request_id} asked for prompt logprobs, which it would get for "
                             "another prompt on another rank")
        if params.get("max_tokens") is not None:
            params["max_tokens"] = params["max_tokens"] - done
            if params["max_tokens"] <= 0:
                return None
        params["min_tokens"] = max(0, params.get("min_tokens", 0) - done)
        params["prompt_logprobs"] = None  # delivered already with the first delta
        prompt = entry.request.prompt_token_ids + entry.delivered[entry.shift:]
        moved = p.AddRequest(request_id, prompt, params, entry.request.client_id)
        entry.request, entry.shift = moved, len(entry.delivered)
        self.migrated += 1
        return moved
