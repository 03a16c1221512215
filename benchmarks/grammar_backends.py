"""xgrammar against llguidance on this machine, with SmolLM2's tokenizer: how long a JSON
schema takes to compile (cold, and again from the library's cache) and how long one decode
step's mask takes (one matcher: fill + accept per token; 64 matchers filled as a batch).

Run: python benchmarks/grammar_backends.py [--rounds 3]
xgrammar is not a dependency of the project (on Linux it pulls in triton, about 1 GB); to
compare, install it without that: pip install --no-deps xgrammar apache-tvm-ffi

Both libraries run in alternating rounds in one process; the tables give the median of the
rounds. The mask walk feeds a valid document for the schema token by token, so every step
is a real step of a constrained decode.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import AutoTokenizer

from deepinfer_dp.models.loader import resolve_model_dir

SMALL = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
         "required": ["name", "age"]}
MEDIUM = {"type": "object", "properties": {
    "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
    "items": {"type": "array", "items": {"type": "object", "properties": {
        "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}, "price": {"type": "number"}},
        "required": ["sku", "qty", "price"]}, "minItems": 1, "maxItems": 5},
    "status": {"enum": ["new", "paid", "shipped"]}, "note": {"type": "string"}},
    "required": ["id", "items", "status"]}


def large_schema(n: int = 60) -> dict:
    """n properties: strings, bounded integers, enums and small nested objects."""
    props = {}
    for i in range(n):
        kind = i % 4
        props[f"field_{i}"] = (
            {"type": "string", "maxLength": 16} if kind == 0 else
            {"type": "integer", "minimum": 0, "maximum": 1000} if kind == 1 else
            {"enum": [f"v{i}_{j}" for j in range(6)]} if kind == 2 else
            {"type": "object", "properties": {"x": {"type": "number"}, "tags": {"type": "array",
                                                                                   "items": {"type": "string"}}},
             "required": ["x", "tags"]})
    return {"type": "object", "properties": props, "required": list(props)}


def large_doc(n: int = 60) -> dict:
    doc = {}
    for i in range(n):
        kind = i % 4
        doc[f"field_{i}"] = (f"s{i}" if kind == 0 else i * 7 if kind == 1 else f"v{i}_{i % 6}" if kind == 2 else
                             {"x": i / 4, "tags": ["a", "bc"]})
    return doc


CASES = {
    "small": (SMALL, {"name": "Ada Lovelace", "age": 36}),
    "medium": (MEDIUM, {"id": "ABC-1234", "items": [{"sku": "pen", "qty": 2, "price": 1.5},
                                                      {"sku": "ink", "qty": 1, "price": 7.25}], "status": "paid"}),
    "large": (large_schema(), large_doc()),
}


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import xgrammar as xgr
        self.xgr = xgr
        start = time.perf_counter()
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.setup_s = time.perf_counter() - start
        self.vocab_size = vocab_size
        self.new_compiler()

    def new_compiler(self) -> None:
        self.compiler = self.xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=True)

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, rows: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(rows, self.vocab_size)

    def fill(self, m, mask: torch.Tensor, row: int = 0) -> None:
        m.fill_next_token_bitmask(mask, row)

    def accept(self, m, token: int) -> None:
        assert m.accept_token(token), f"xgrammar refused token {token}"

    def fill_batch(self, matchers: list, mask: torch.Tensor) -> None:
        self.xgr.BatchGrammarMatcher(max_threads=2).batch_fill_next_token_bitmask(matchers, mask)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.llg = llguidance
        start = time.perf_counter()
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.setup_s = time.perf_counter() - start
        self.vocab_size = vocab_size
        self.executor = llguidance.LLExecutor(2)
        self.cache: dict[str, object] = {}

    def new_compiler(self) -> None:
        self.cache = {}

    def compile(self, schema: dict):
        # llguidance has no compiled-grammar object: the matcher is the compiled grammar. A
        # cache keeps a pristine matcher per schema and hands out deep copies (~15 us), as the
        # engine does (structured_output/backend.py).
        key = json.dumps(schema)
        pristine = self.cache.get(key)
        if pristine is None:
            grammar = self.llg.LLMatcher.grammar_from_json_schema(key)
            pristine = self.cache[key] = self.llg.LLMatcher(self.tok, grammar)
            assert not pristine.is_error(), pristine.get_error()
        return pristine

    def matcher(self, compiled):
        return compiled.deep_copy()

    def bitmask(self, rows: int) -> torch.Tensor:
        return self.llg.torch.allocate_token_bitmask(rows, self.vocab_size)

    def fill(self, m, mask: torch.Tensor, row: int = 0) -> None:
        self.llg.torch.fill_next_token_bitmask(m, mask, row)

    def accept(self, m, token: int) -> None:
        assert m.consume_token(token), f"llguidance refused token {token}: {m.get_error()}"

    def fill_batch(self, matchers: list, mask: torch.Tensor) -> None:
        self.llg.torch.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], mask)


def measure(lib, schema: dict, tokens: list[int], batch: int) -> dict[str, float]:
    lib.new_compiler()
    t0 = time.perf_counter()
    compiled = lib.compile(schema)
    t1 = time.perf_counter()
    lib.compile(schema)
    t2 = time.perf_counter()
    mask = lib.bitmask(1)
    steps = []
    for walk in range(2):  # the first walk warms per-state caches; the second is a steady decode
        m = lib.matcher(compiled)
        for t in tokens:
            s = time.perf_counter()
            lib.fill(m, mask)
            lib.accept(m, t)
            if walk == 1:
                steps.append(time.perf_counter() - s)
    matchers = [lib.matcher(compiled) for _ in range(batch)]
    big = lib.bitmask(batch)
    batch_steps = []
    for t in tokens:
        s = time.perf_counter()
        lib.fill_batch(matchers, big)
        batch_steps.append(time.perf_counter() - s)
        for m in matchers:
            lib.accept(m, t)
    return {"cold_ms": (t1 - t0) * 1e3, "cached_ms": (t2 - t1) * 1e3,
            "step_us": statistics.median(steps) * 1e6, "batch_step_ms": statistics.median(batch_steps) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(2)
    model_dir = resolve_model_dir(None)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    libs = [XGrammar(tokenizer, vocab_size), LLGuidance(tokenizer, vocab_size)]
    for lib in libs:
        print(f"{lib.name}: tokenizer set-up {lib.setup_s * 1e3:.0f} ms (once per engine)")
    results: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.rounds):
        for case, (schema, doc) in CASES.items():
            tokens = tokenizer(json.dumps(doc, separators=(",", ":")), add_special_tokens=False).input_ids
            for lib in libs:  # alternating, so both see the same machine load
                results.setdefault((case, lib.name), []).append(measure(lib, schema, tokens, args.batch))
    print(f"\n{'schema':8} {'library':11} {'compile cold ms':>16} {'cached ms':>10} {'mask+accept us/step':>20} "
          f"{f'fill {args.batch} rows ms':>18}")
    for (case, name), rows in results.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(f"{case:8} {name:11} {med['cold_ms']:16.2f} {med['cached_ms']:10.3f} {med['step_us']:20.1f} "
              f"{med['batch_step_ms']:18.2f}")


if __name__ == "__main__":
    main()
