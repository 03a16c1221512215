"""The one validator of a request, run once before anything is queued anywhere.

`InputProcessor.process` is where a request's values are checked, and the only place: it
runs `SamplingParams.verify` (the sampling values and their ranges, seeds within 64 bits),
then what needs the model (stop token ids and logit_bias keys inside the vocabulary, a
structured-output schema, regex, choice or grammar that parses and stays within the grammar
bounds, the prompt: non-empty, token ids inside the vocabulary, room left under
max_model_len) and, where the API asks for it, that max_tokens fits. Every failure is an
`InvalidRequest` whose `param` names the field at fault.

Each front door calls it once per prompt, and everything after it trusts the request:
  - offline: `LLM.generate` (entrypoints/llm.py) validates each prompt with its params, then
    submits the n samples with `add_checked` (the engine, or the DP driver);
  - `LLMEngine.add_request` and `DPDriver.add_request` (the public one-request API) validate,
    then `add_checked`;
  - the OpenAI server validates in `prepare` (serving_engine.check_request), then hands the
    choices to its EngineClient (the in-process engine's `add_checked`, or the router client);
  - a rank admits a router's `AddRequest` with `add_checked` without validating again: only
    peers holding the cluster's data-plane key (the API servers and the DP driver, which
    validated it) can send one (cluster/data_plane.py).
No later stage may fail on a request's own values. The C++ scheduler keeps its own checks on
what crosses the binding; they are the last guard, never the first.
"""

from __future__ import annotations

from collections.abc import Iterable
from numbers import Integral

from deepinfer_dp.sampling_params import InvalidRequest, SamplingParams
from deepinfer_dp.structured_output import limits

__all__ = ["InputProcessor", "InvalidRequest"]


class InputProcessor:
    def __init__(self, vocab_size: int, max_model_len: int, sampling_defaults: dict | None = None) -> None:
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        # The model's sampling defaults (engine/sampling_defaults.py): what a request that
        # sets a field leaves unset gets; carried here so that every front end has them.
        self.sampling_defaults = dict(sampling_defaults or {})

    def default_params(self) -> SamplingParams:
        """The params of a request that sets none (vLLM's LLM.get_default_sampling_params)."""
        return SamplingParams(**self.sampling_defaults)

    def process(self, prompt_token_ids: Iterable[int], params: SamplingParams, which: str | None = None,
                max_tokens_must_fit: bool = False, one_sample: bool = False) -> tuple[list[int], SamplingParams]:
        """Checks one request. Returns the prompt as plain ints and a copy of the params with
        max_tokens resolved (None: as many as fit). `which` names the prompt in messages
        ("prompt 2"); with `max_tokens_must_fit` (the OpenAI API) a max_tokens past the
        context is refused instead of cut at max_model_len. n may be above 1 (unless
        `one_sample`): the caller expands the samples (SamplingParams.for_sample), which need
        no further check."""
        params = self._check_params(params)
        if one_sample and params.n != 1:
            raise InvalidRequest(f"an engine request has n=1, got {params.n} (LLM.generate and the server "
                                 f"expand n)", "n")
        ids = self._check_prompt(prompt_token_ids, which)
        room = self.max_model_len - len(ids)
        if params.max_tokens is None:
            params.max_tokens = room
        elif max_tokens_must_fit and params.max_tokens > room:
            raise InvalidRequest(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{len(ids) + params.max_tokens} tokens ({len(ids)} in the {which or 'prompt'}, "
                f"{params.max_tokens} for the completion). Please reduce the length of the prompt or "
                f"max_tokens.", "max_tokens")
        return ids, params

    def _check_prompt(self, prompt_token_ids: Iterable[int], which: str | None = None) -> list[int]:
        where = f"{which}: " if which else ""
        if isinstance(prompt_token_ids, (str, bytes)) or not isinstance(prompt_token_ids, Iterable):
            raise InvalidRequest(f"{where}a prompt must be a list of token ids, got "
                                 f"{type(prompt_token_ids).__name__}", "prompt")
        ids = list(prompt_token_ids)
        if not ids:
            raise InvalidRequest(f"{where}the prompt is empty", "prompt")
        if len(ids) >= self.max_model_len:  # before the walk below: a huge list is refused at once
            raise InvalidRequest(
                f"{where}This model's maximum context length is {self.max_model_len} tokens, and the prompt "
                f"has {len(ids)}, which leaves no room to generate. Please reduce the length of the prompt.",
                "prompt")
        for i, t in enumerate(ids):
            # bool is an int subclass: True must not become token 1
            if isinstance(t, bool) or not isinstance(t, Integral) or not 0 <= t < self.vocab_size:
                shown = t if isinstance(t, Integral) and abs(t) < 2**64 else type(t).__name__
                raise InvalidRequest(f"{where}token id {shown!r} at position {i} is outside the vocabulary "
                                     f"[0, {self.vocab_size})", "prompt")
        return [int(t) for t in ids]

    def _check_params(self, params: SamplingParams) -> SamplingParams:
        if not isinstance(params, SamplingParams):
            raise InvalidRequest(f"sampling params must be SamplingParams, got {type(params).__name__}")
        params = params.clone()  # the caller's object stays as given; the engine keeps this copy
        params.verify()
        for name, tokens in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or {})):
            bad = [t for t in tokens if not 0 <= t < self.vocab_size]
            if bad:
                shown = bad[0] if bad[0] < 2**64 else f"of {bad[0].bit_length()} bits"
                raise InvalidRequest(f"{name}: token id {shown} is outside the vocabulary [0, {self.vocab_size})",
                                     name)
        if params.structured_outputs is not None:
            try:
                limits.check(params.structured_outputs)
            except ValueError as e:
                raise InvalidRequest(str(e), f"structured_outputs.{params.structured_outputs.kind}") from None
        return params
