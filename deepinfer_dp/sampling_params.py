"""Per-request sampling parameters, with vLLM's names, defaults and ranges.

A `SamplingParams` is plain data: constructing or changing one checks nothing. Validation
happens once per request, where it enters an engine: `InputProcessor.process`
(engine/input_processor.py) calls `verify()` and checks what needs the model (vocabulary,
context); everything after it trusts the request. Every bad value raises `InvalidRequest`
(a ValueError) whose `param` names the field, with the range it must lie in in the message,
so a client sees what to fix. Call `verify()` yourself to check params before submitting them.
"""

import copy
import math
from dataclasses import dataclass

from deepinfer_dp.structured_output.params import StructuredOutputsParams

# Temperatures below this are treated as greedy: dividing logits by ~0
# overflows to inf/NaN, and the argmax is what the user meant anyway.
GREEDY_EPS = 1e-5
# vLLM's default max_logprobs: the most alternatives a request may ask for, per token.
MAX_LOGPROBS = 20
# OpenAI's range for a logit_bias value.
MAX_LOGIT_BIAS = 100.0
# What torch.Generator.manual_seed accepts (int64 for OpenAI's seed, and uint64), and msgspec can carry.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# Counts the C++ scheduler and the sampler's tensors hold as 32-bit ints (max_tokens, top_k, ...).
INT32_MAX = 2**31 - 1
# The one default of max_tokens (vLLM's and OpenAI's completions default); the C++ side has none.
DEFAULT_MAX_TOKENS = 16


class InvalidRequest(ValueError):
    """A request the engine cannot run; `param` names the request field at fault (None: the
    request as a whole). The one error type of request validation: no caller parses messages."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = DEFAULT_MAX_TOKENS  # None: until the context is full
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # 0: chosen token only; k > 0: also the top k
    prompt_logprobs: int | None = None  # None: off; k >= 0: each prompt token's logprob (+ top k)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    structured_outputs: StructuredOutputsParams | None = None  # JSON schema, regex, choice or grammar

    def __post_init__(self) -> None:
        # Normalize only (plain lists and dicts, copied); what is not a sequence is left for
        # verify() to name.
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        if isinstance(self.logit_bias, dict):
            self.logit_bias = dict(self.logit_bias)
        if isinstance(self.structured_outputs, dict):  # from the wire (dataclasses.asdict)
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)

    def verify(self) -> None:
        """Raise InvalidRequest, naming the field, for the first one outside its allowed range."""
        _check_number("temperature", self.temperature)
        if self.temperature < 0.0:
            _fail("temperature", "must be >= 0", self.temperature)
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            _fail("top_p", "must be in (0, 1]", self.top_p)
        _check_int("top_k", self.top_k)
        if not -1 <= self.top_k <= INT32_MAX:
            _fail("top_k", f"must be -1 or 0 (off) or in [1, {INT32_MAX}]", self.top_k)
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            _fail("min_p", "must be in [0, 1]", self.min_p)
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not SEED_MIN <= self.seed <= SEED_MAX:
                _fail("seed", "must fit in 64 bits, [-2**63, 2**64 - 1]", self.seed)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not -2.0 <= value <= 2.0:
                _fail(name, "must be in [-2, 2]", value)
        _check_number("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= 2.0:
            _fail("repetition_penalty", "must be in (0, 2]", self.repetition_penalty)
        self._verify_lengths()
        self._verify_stops()
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value)
                if not 0 <= value <= MAX_LOGPROBS:
                    _fail(name, f"must be None or in [0, {MAX_LOGPROBS}]", value)
        self._verify_logit_bias()
        self._verify_structured_outputs()
        _check_int("n", self.n)
        if not 1 <= self.n <= INT32_MAX:
            _fail("n", f"must be in [1, {INT32_MAX}]", self.n)

    def _verify_lengths(self) -> None:
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens)
            if not 1 <= self.max_tokens <= INT32_MAX:
                _fail("max_tokens", f"must be None or in [1, {INT32_MAX}]", self.max_tokens)
        _check_int("min_tokens", self.min_tokens)
        if not 0 <= self.min_tokens <= INT32_MAX:
            _fail("min_tokens", f"must be in [0, {INT32_MAX}]", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail(
                "min_tokens",
                f"must be <= max_tokens ({self.max_tokens})",
                self.min_tokens,
            )

    def _verify_stops(self) -> None:
        if not isinstance(self.stop, list):
            _fail("stop", "must be a string or a list of strings", self.stop)
        if not isinstance(self.stop_token_ids, list):
            _fail("stop_token_ids", "must be a list of integers", self.stop_token_ids)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                _fail("stop", "must hold non-empty strings only", s)
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                _fail("stop_token_ids", "must hold integers >= 0 only", t)

    def _verify_logit_bias(self) -> None:
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            _fail("logit_bias", "must be a dict of token id -> bias", self.logit_bias)
        for token, bias in (self.logit_bias or {}).items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                _fail("logit_bias", "keys must be token ids (integers >= 0)", token)
            _check_number("logit_bias", bias)
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                _fail("logit_bias", f"values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]", bias)

    def _verify_structured_outputs(self) -> None:
        so = self.structured_outputs
        if so is None:
            return
        if not isinstance(so, StructuredOutputsParams):
            _fail("structured_outputs", "must be StructuredOutputsParams", type(so).__name__)
        try:
            so.verify()
        except ValueError as e:
            raise InvalidRequest(str(e), "structured_outputs") from None
        if self.ignore_eos:  # a finished grammar allows only EOS: ignoring it leaves no valid token
            _fail("structured_outputs", "cannot be combined with ignore_eos", True)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def needs_history(self) -> bool:
        """True when a penalty needs the prompt/output token ids."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def clone(self) -> "SamplingParams":
        # Deep copy: the stop lists must not be shared between requests.
        return copy.deepcopy(self)

    def for_sample(self, index: int) -> "SamplingParams":
        """The params of sample `index` of n (n=1): seeded samples get seed + index, wrapped
        to stay a 64-bit seed, so they are reproducible yet differ from each other."""
        child = self.clone()
        child.n = 1
        if self.seed is not None:
            child.seed = (self.seed + index - SEED_MIN) % (SEED_MAX - SEED_MIN + 1) + SEED_MIN
        return child


def _fail(name: str, rule: str, value: object) -> None:
    raise InvalidRequest(f"{name} {rule}, got {_shown(value)}", name)


def _shown(value: object) -> str:
    """The value for a message, short: a client may send an integer of thousands of digits
    (whose str() Python refuses past 4300) or a huge list."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2**128:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 100 else text[:100] + "..."


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(name, "must be a number", value)
    if isinstance(value, int):
        if abs(value) > 2**128:  # float() of it would overflow; no range here reaches it
            _fail(name, "is out of range", value)
    elif not math.isfinite(value):  # NaN passes every range comparison, so reject it here
        _fail(name, "must be a finite number", value)


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(name, "must be an integer", value)
