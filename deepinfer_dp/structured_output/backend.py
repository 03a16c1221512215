"""The grammar library behind structured output: llguidance.

Chosen by measurement (benchmarks/grammar_backends.py, numbers in docs/benchmarks.md):
llguidance compiles a JSON schema about 8-11x faster than xgrammar and has no
dependencies, where xgrammar pulls in triton (about 1 GB) on Linux; xgrammar's masks are
faster per step, but llguidance's fit well inside a CPU decode step (and are computed while
the forward runs, see manager.py).

Two halves:
  - `grammar_text` / `check`: the request's spec as llguidance's grammar text, and whether it
    is valid. No tokenizer needed, so every front door (the engine, the router client, the
    OpenAI server) can refuse a bad schema, regex or grammar before anything is queued.
  - `GrammarBackend`: the tokenizer-dependent part, a compiled matcher per grammar. llguidance
    has no separate compiled-grammar object: a pristine matcher is the compiled grammar, and
    each request gets a deep copy of it (about 15 us).
"""

from __future__ import annotations

import functools
import json
import threading

import llguidance
import llguidance.hf
import torch

from deepinfer_dp.structured_output.params import StructuredOutputsParams

# What a JSON value may look like with `disable_any_whitespace` (llguidance's own option).
_COMPACT = {"whitespace_flexible": False}


def grammar_text(params: StructuredOutputsParams) -> str:
    """llguidance's grammar for `params`; ValueError naming the field when it cannot be read."""
    return _grammar_text(*params.key())


@functools.lru_cache(maxsize=256)
def _grammar_text(kind: str, spec: str) -> str:
    base, _, compact = kind.partition("/")
    overrides = _COMPACT if compact == "1" else None
    try:
        if base == "json":
            schema = json.loads(spec)  # the key holds the schema as JSON text
            if not isinstance(schema, dict):
                raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
            return llguidance.LLMatcher.grammar_from_json_schema(spec, overrides=overrides)
        if base == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=overrides)
        if base == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
        if base == "choice":
            return llguidance.grammar_from("choice", spec)
        return llguidance.grammar_from("grammar", spec)  # Lark, or GBNF converted to Lark
    except ValueError as e:
        raise ValueError(f"structured_outputs.{base}: {e}") from None


def check(params: StructuredOutputsParams) -> None:
    """ValueError naming the field when the schema, regex or grammar is not valid."""
    error = _check(*params.key())
    if error:
        raise ValueError(error)


@functools.lru_cache(maxsize=256)
def _check(kind: str, spec: str) -> str:
    try:
        text = _grammar_text(kind, spec)
    except ValueError as e:
        return str(e)
    error = llguidance.LLMatcher.validate_grammar(text)
    return f"structured_outputs.{kind.partition('/')[0]}: invalid: {error.strip()}" if error else ""


class GrammarBackend:
    """Compiles grammars for one tokenizer; thread-safe (compiles run on a pool)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        # ~0.7 s for a 49k vocabulary: built by the first compile (on the build pool), so an
        # engine that never sees a constrained request never pays it.
        self._args = (tokenizer, vocab_size, eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self.vocab_size = vocab_size
        # Fills the masks of a step's constrained rows in parallel, in Rust (the GIL released).
        self._executor = llguidance.LLExecutor(2)

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                tokenizer, vocab_size, eos = self._args
                self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos or None)
            return self._tokenizer

    def compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A pristine matcher for `params` (to be deep-copied per request); ValueError if the
        grammar does not compile against this tokenizer."""
        _torch_ops()  # here, on the build pool, rather than on the step loop at the first mask
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar_text(params))
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{params.kind}: {matcher.get_error()}")
        return matcher

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        return _torch_ops().allocate_token_bitmask(rows, self.vocab_size)

    def fill(self, matchers: list[llguidance.LLMatcher], bitmask: torch.Tensor) -> None:
        """Row i of `bitmask` := the tokens matchers[i] allows next."""
        _torch_ops().fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in enumerate(matchers)],
                                                 bitmask)


def _torch_ops():
    """llguidance's torch helpers, imported on first use: the import pulls in torch._dynamo
    (about 3.5 s here), which an engine that never sees a constrained request should not pay
    at start-up. The first grammar build imports it on the build pool, off the step loop."""
    import llguidance.torch

    return llguidance.torch


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Sets to -inf, in place, each logit of logits[rows[i]] that bitmask[i] forbids."""
    sub = logits.index_select(0, rows)
    _torch_ops().apply_token_bitmask_inplace(sub, bitmask)
    logits.index_copy_(0, rows, sub)
