"""The one validator of a request, run before anything is queued anywhere.

Every front door calls it: LLMEngine.add_request (offline, torchrun, a rank), the router
client (the offline DP driver and the API servers, before a request goes on the wire) and the
OpenAI server (to answer 400 with the offending parameter). Whatever it accepts, everything
after it trusts: no later stage may fail on a request's own values. So it checks what a
later stage would choke on: the sampling values and their ranges (SamplingParams.verify,
seeds within 64 bits), a structured-output schema, regex or grammar that does not parse,
the prompt (non-empty, token ids inside the vocabulary, room left
under max_model_len), stop token ids, and, where the API asks for it, that max_tokens fits.

The C++ scheduler keeps its own checks on what crosses the binding; they are the last guard,
never the first: a request that reaches them has already passed here.
"""

from __future__ import annotations

from collections.abc import Iterable
from numbers import Integral

from deepinfer_dp.sampling_params import SamplingParams


class InvalidRequest(ValueError):
    """A request the engine cannot run; `param` names the request field at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class InputProcessor:
    def __init__(self, vocab_size: int, max_model_len: int) -> None:
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def process(self, prompt_token_ids: Iterable[int], params: SamplingParams, which: str | None = None,
                max_tokens_must_fit: bool = False) -> tuple[list[int], SamplingParams]:
        """Checks one engine request (n=1). Returns the prompt as plain ints and a copy of the
        params with max_tokens resolved (None: as many as fit). `which` names the prompt in
        messages ("prompt 2"); with `max_tokens_must_fit` (the OpenAI API) a max_tokens past
        the context is refused instead of cut at max_model_len."""
        params = self._check_params(params)
        ids = self.check_prompt(prompt_token_ids, which)
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

    def check_prompt(self, prompt_token_ids: Iterable[int], which: str | None = None) -> list[int]:
        """The prompt as a list of ints, or InvalidRequest naming what is wrong with it."""
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
                raise InvalidRequest(f"{where}token id {t!r} at position {i} is outside the vocabulary "
                                     f"[0, {self.vocab_size})", "prompt")
        return [int(t) for t in ids]

    def _check_params(self, params: SamplingParams) -> SamplingParams:
        if not isinstance(params, SamplingParams):
            raise InvalidRequest(f"sampling params must be SamplingParams, got {type(params).__name__}")
        params = params.clone()  # verified again: fields may have been set after construction
        try:
            params.verify()
        except ValueError as e:
            name = str(e).split()[0].removeprefix("SamplingParams.")
            raise InvalidRequest(str(e).removeprefix("SamplingParams."), name) from None
        if params.n != 1:
            raise InvalidRequest(f"an engine request has n=1, got {params.n} (LLM.generate and the server "
                                 f"expand n)", "n")
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"stop_token_ids: {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                                 "stop_token_ids")
        bad = [t for t in (params.logit_bias or {}) if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                                 "logit_bias")
        if params.structured_outputs is not None:
            from deepinfer_dp.structured_output import backend  # the grammar library, loaded when used
            try:
                backend.check(params.structured_outputs)
            except ValueError as e:
                raise InvalidRequest(str(e), f"structured_outputs.{params.structured_outputs.kind}") from None
        return params
