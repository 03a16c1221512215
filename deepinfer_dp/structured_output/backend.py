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

# The whitespace between JSON tokens. llguidance allows any amount by default, and a weak
# model can emit it forever: the grammar itself keeps an endless path open. So by default a
# gap is empty, one space, or a newline and up to 16 spaces of indent (compact or lightly
# indented JSON); `disable_any_whitespace` (vLLM's option) allows none
# (`{"a":1,"b":2}`), and a request's `whitespace_pattern` replaces the default
# ("[ \t\n]*": unbounded, as before).
DEFAULT_WHITESPACE = r"( |\n {0,16})?"
# json_object: "any object" is bounded too, or a weak model may nest, widen or write a string
# forever: objects and arrays nest at most JSON_OBJECT_MAX_DEPTH deep (a request's
# json_object_max_depth replaces it), hold at most JSON_OBJECT_MAX_ITEMS members, keys are at
# most JSON_OBJECT_MAX_KEY characters and string values at most JSON_OBJECT_MAX_STRING.
JSON_OBJECT_MAX_DEPTH = 8
JSON_OBJECT_MAX_ITEMS = 32
JSON_OBJECT_MAX_KEY = 64
JSON_OBJECT_MAX_STRING = 1024
_SCALARS = [{"type": "string", "maxLength": JSON_OBJECT_MAX_STRING}, {"type": "number"}, {"type": "boolean"},
            {"type": "null"}]


def _whitespace(mode: str) -> dict:
    """llguidance's JSON options for the whitespace part of a cache key (params.key)."""
    if mode == "1":
        return {"whitespace_flexible": False}
    pattern = mode[2:] if mode.startswith("p:") else DEFAULT_WHITESPACE
    return {"whitespace_flexible": True, "whitespace_pattern": pattern}


def json_object_schema(max_depth: int) -> dict:
    """Any JSON object within the bounds above, nesting at most `max_depth` deep (1: flat)."""
    defs = {"d1": {"anyOf": _SCALARS}}  # dK: a value holding at most K-1 more levels of nesting
    for d in range(2, max_depth + 1):
        defs[f"d{d}"] = {"anyOf": [*_SCALARS, _object(f"d{d - 1}"),
                                   {"type": "array", "items": {"$ref": f"#/$defs/d{d - 1}"},
                                    "maxItems": JSON_OBJECT_MAX_ITEMS}]}
    return {"$defs": defs, **_object(f"d{max_depth}")}


def _object(values: str) -> dict:
    return {"type": "object", "patternProperties": {f"^.{{0,{JSON_OBJECT_MAX_KEY}}}$": {"$ref": f"#/$defs/{values}"}},
            "additionalProperties": False, "maxProperties": JSON_OBJECT_MAX_ITEMS}


def grammar_text(params: StructuredOutputsParams) -> str:
    """llguidance's grammar for `params`; ValueError naming the field when it cannot be read."""
    return _grammar_text(*params.key())


@functools.lru_cache(maxsize=256)
def _grammar_text(kind: str, spec: str) -> str:
    base, _, whitespace = kind.partition("/")
    try:
        if base == "json":
            schema = json.loads(spec)  # the key holds the schema as JSON text
            if not isinstance(schema, dict):
                raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
            return llguidance.LLMatcher.grammar_from_json_schema(spec, overrides=_whitespace(whitespace))
        if base == "json_object":
            schema = json_object_schema(int(spec or JSON_OBJECT_MAX_DEPTH))
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_whitespace(whitespace))
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
