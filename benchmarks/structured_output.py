"""What structured output costs, with SmolLM2 on this machine.

Run: python benchmarks/structured_output.py [--rounds 2] [--requests 64] [--max-tokens 48]

1. Throughput: 64 requests, all unconstrained / half JSON-schema / all JSON-schema, in
   alternating rounds in one engine; tokens/s and the ratio to unconstrained. Every request
   generates exactly --max-tokens tokens (the unconstrained ones ignore EOS; the schema asks
   for a 50-item array, so no constrained output completes before that), so the three runs do
   the same model work and differ only by the grammar masks.
2. Compile time of a large schema (60 properties): cold (a new grammar) and cached (the LRU
   cache's copy), through the engine's own manager.
3. TTFT of a constrained request that arrives while 16 others decode, with its grammar built
   asynchronously (the engine's way) against a synchronous build (the step loop blocked until
   the grammar is ready), and the longest step gap the 16 others see meanwhile.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from deepinfer_dp import LLM, SamplingParams, StructuredOutputsParams

sys.path.insert(0, str(Path(__file__).parent))
from grammar_backends import large_schema  # noqa: E402

LONG_ARRAY = {"type": "object", "properties": {"items": {
    "type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 50}}, "required": ["items"]}


def throughput(llm: LLM, prompts: list[str], constrained: int, max_tokens: int) -> float:
    plain = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    json_ = SamplingParams(temperature=0, max_tokens=max_tokens,
                           structured_outputs=StructuredOutputsParams(json=LONG_ARRAY))
    params = [json_ if i < constrained else plain for i in range(len(prompts))]
    before = llm.rank_stats()[0]["generation_tokens"]
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = llm.rank_stats()[0]["generation_tokens"] - before
    assert tokens == len(prompts) * max_tokens, (tokens, "every request must run to max_tokens")
    return tokens / elapsed


def compile_times(llm: LLM, rounds: int) -> tuple[float, float]:
    manager = llm.llm_engine.structured
    cold, cached = [], []
    for r in range(rounds):
        params = StructuredOutputsParams(json=large_schema(60 + r))  # a new schema each round: cold
        for sink in (cold, cached):
            start = time.perf_counter()
            manager.submit(f"bench-{r}-{len(sink)}", params, None)
            manager.wait_for_build(60)
            sink.append(time.perf_counter() - start)
        manager.take_ready()
    for r in range(rounds):
        manager.forget(f"bench-{r}-0")
        manager.forget(f"bench-{r}-1")
    return statistics.median(cold), statistics.median(cached)


def ttft(llm: LLM, prompts: list[str], sync: bool, tag: int) -> tuple[float, float]:
    """(TTFT of the constrained request, longest step gap of the others while it waited)."""
    engine = llm.llm_engine
    plain = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    others = [engine.add_request(p, plain) for p in prompts[:16]]
    for _ in range(3):
        engine.step()  # the 16 are decoding
    params = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(
        json=large_schema(80 + tag)))
    start = last = time.perf_counter()
    rid = engine.add_request(prompts[16], params)
    if sync:
        engine.structured.wait_for_build(60)  # what a synchronous build does: the loop waits
    first, gap = None, 0.0
    while first is None:
        outs = engine.step()
        now = time.perf_counter()
        gap, last = max(gap, now - last), now
        if any(o.request_id == rid for o in outs):
            first = now - start
    engine.abort_request([rid, *others])
    while engine.has_unfinished_requests():
        engine.step()
    engine.flush_inflight_reqs()
    return first, gap


KINDS = ["famous", "small", "old", "popular", "red", "rare", "modern", "ancient"]
THINGS = ["fruits", "cities", "rivers", "birds", "tools", "books", "songs", "games"]


def question(style: str, i: int) -> str:
    if style == "same":
        return f"List {i + 3} fruits as JSON."
    return f"List {i % 5 + 3} {KINDS[i // 8 % 8]} {THINGS[i % 8]} as JSON."


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompts", choices=["varied", "same"], default="varied",
                    help="varied: every request asks about its own topic, so the grammar states (and "
                         "masks) differ from row to row; same: one question with a different count, where "
                         "greedy outputs share states and the manager fills each shared mask once")
    args = ap.parse_args()
    llm = LLM(max_model_len=1024, max_num_seqs=max(args.requests, 17))
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": question(args.prompts, i)}],
                                       tokenize=False, add_generation_prompt=True) for i in range(args.requests)]
    throughput(llm, prompts[:4], 2, 4)  # warm-up: the grammar tokenizer, the schema's cache entry
    runs = {"unconstrained": 0, "half JSON": args.requests // 2, "all JSON": args.requests}
    results: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.rounds):
        for name, constrained in runs.items():
            results[name].append(throughput(llm, prompts, constrained, args.max_tokens))
    base = statistics.median(results["unconstrained"])
    print(f"throughput, {args.requests} requests x {args.max_tokens} tokens, {args.prompts} prompts "
          f"(median of {args.rounds} rounds):")
    for name, values in results.items():
        med = statistics.median(values)
        print(f"  {name:14} {med:8.1f} tok/s  ({med / base:.1%} of unconstrained)  rounds: "
              f"{', '.join(f'{v:.1f}' for v in values)}")
    stats = llm.rank_stats()[0]
    print(f"  mask time: {stats['so_mask_time_s'] * 1e3 / max(stats['so_mask_steps'], 1):.2f} ms per masked step, "
          f"{stats['so_mask_rows'] / max(stats['so_mask_steps'], 1):.1f} rows per masked step")
    cold, cached = compile_times(llm, max(args.rounds, 3))
    print(f"large schema (60 properties) compile: cold {cold * 1e3:.1f} ms, cached {cached * 1e3:.2f} ms")
    ttfts: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    decoding = (prompts * 17)[:17]
    for r in range(args.rounds):
        for sync in (False, True):
            ttfts[sync].append(ttft(llm, decoding, sync, 2 * r + sync))
    for sync, values in ttfts.items():
        print(f"TTFT with a {'synchronous' if sync else 'asynchronous'} build: "
              f"{statistics.median(v[0] for v in values) * 1e3:.0f} ms; longest step gap of 16 decoding requests: "
              f"{statistics.median(v[1] for v in values) * 1e3:.0f} ms")
    llm.shutdown()


if __name__ == "__main__":
    main()
