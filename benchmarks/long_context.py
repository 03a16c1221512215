"""Long-context workload on our engine alone: prefill time, decode tok/s, and where decode goes.

The workload of `benchmarks/peers/run.py`'s long16: 16 chat prompts of exactly 2,000 tokens
(numbered notes, no shared prefix beyond the template), 256 new tokens each, greedy, EOS
ignored, a 2 GiB KV cache; the default model (SmolLM2-135M-Instruct from its Q4_1 GGUF file).

    python benchmarks/long_context.py [--prompts 16] [--prompt-len 2000] [--max-tokens 256]
        [--rounds 1] [--kv-gb 2.0] [--kv-cache-dtype auto] [--baseline-python PY]

The prompts are submitted at once. Steps that carry prompt tokens (about one 2,000-token
prompt each, with the decode tokens of the prompts already done) form the prefill phase,
which ends with the last of them; decode tok/s counts the tokens of the decode-only steps
after it over the wall time after it. Forward time of each phase is split by wrapping the
attention kernels, the KV store and every linear module with timers: "attention" is the
attention proper (C++ paged kernel or SDPA), "linear" every matrix product (lm_head
included), "other" the rest of the forward (norms, rotary, activations, embedding), and
"engine" the wall time outside the forward (scheduling, sampling, detokenizing).

With --baseline-python, each round runs this script under that interpreter too (another
checkout's environment, e.g. main's), alternating, and the report gives our/baseline ratios
of the best rounds; the tokens of both are compared.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

from harness import emit, run_child, self_command

HERE = Path(__file__).resolve().parent


class Timers:
    """Seconds spent in wrapped callables, per phase ("prefill" / "decode") and part."""

    def __init__(self) -> None:
        self.phase = "decode"
        self.last_prefill_end = 0.0
        self.decode_tokens = 0
        self.seconds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))

    def wrap(self, fn, part: str):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[self.phase][part] += time.perf_counter() - start
        return timed


def instrument(llm, timers: Timers) -> None:
    """Wraps the attention kernels, the KV store, every linear module and the forward."""
    from deepinfer_dp.layers import attention

    for name in ("paged_attention_cpu", "_causal_attention", "_attention_with_context",
                 "_gathered_decode_attention"):
        setattr(attention, name, timers.wrap(getattr(attention, name), "attention"))
    attention.store_kv = timers.wrap(attention.store_kv, "store_kv")
    runner = llm.llm_engine.worker.runner
    for module in runner.model.modules():
        if "Linear" in type(module).__name__:
            module.forward = timers.wrap(module.forward, "linear")
    inner = runner._forward

    def forward(inp):
        md = inp.attn_metadata
        if md.is_placeholder:  # ZOS's dummy step: no work of its own
            return inner(inp)
        timers.phase = "prefill" if md.is_prefill else "decode"
        try:
            return timers.wrap(inner, "forward")(inp)
        finally:
            if md.is_prefill:
                timers.last_prefill_end = time.perf_counter()
                timers.decode_tokens = 0  # count only the decode-only steps after the last prefill
            else:
                timers.decode_tokens += len(md.query_lens_host)

    runner._forward = forward


def long_prompts(tok, n: int, length: int) -> list[list[int]]:
    sys.path.insert(0, str(HERE / "peers"))
    from run import long_prompts as make  # the peers benchmark's long16 prompts

    return make(tok, n, length)


def run_once(args: argparse.Namespace) -> dict:
    from deepinfer_dp import LLM, SamplingParams

    options = {"kv_cache_memory_gb": args.kv_gb}
    if args.kv_cache_dtype != "auto":
        options["kv_cache_dtype"] = args.kv_cache_dtype
    llm = LLM(None, decode_sequence=False, **options)
    llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=1, temperature=0),
                 use_tqdm=False)
    prompts = long_prompts(llm.get_tokenizer(), args.prompts, args.prompt_len)
    timers = Timers()
    instrument(llm, timers)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = [[o.token_id for o in out] for out in outs]
    if sum(map(len, tokens)) != args.prompts * args.max_tokens:
        raise RuntimeError(f"got {sum(map(len, tokens))} tokens, expected {args.prompts} x {args.max_tokens}")
    return {"wall_s": wall, "prefill_wall_s": timers.last_prefill_end - start, "decode_tokens": timers.decode_tokens,
            "seconds": {k: dict(v) for k, v in timers.seconds.items()}, "tokens": tokens}


def summarize(r: dict, prompts: int, max_tokens: int) -> dict:
    """Prefill seconds, decode tok/s and the decode split, from one run's raw numbers."""
    decode_wall = r["wall_s"] - r["prefill_wall_s"]
    dec = r["seconds"].get("decode", {})
    fwd = dec.get("forward", 0.0)
    parts = {k: dec.get(k, 0.0) for k in ("attention", "linear", "store_kv")}
    parts["other"] = fwd - sum(parts.values())
    parts["engine"] = decode_wall - fwd
    pre = r["seconds"].get("prefill", {})
    return {"tok_s": prompts * max_tokens / r["wall_s"], "prefill_s": r["prefill_wall_s"],
            "prefill_attention_s": pre.get("attention", 0.0), "prefill_linear_s": pre.get("linear", 0.0),
            "decode_tok_s": r["decode_tokens"] / decode_wall, "decode_s": decode_wall,
            "decode_split": {k: v / decode_wall for k, v in parts.items()}}


def print_run(label: str, s: dict) -> None:
    split = "  ".join(f"{k} {100 * v:.0f}%" for k, v in s["decode_split"].items())
    print(f"{label}: {s['tok_s']:.1f} tok/s overall | prefill {s['prefill_s']:.1f} s (attention "
          f"{s['prefill_attention_s']:.1f} s, linear {s['prefill_linear_s']:.1f} s) | decode "
          f"{s['decode_tok_s']:.1f} tok/s over {s['decode_s']:.1f} s: {split}", flush=True)


def run_with(python: str, args: argparse.Namespace) -> dict:
    cmd = self_command(__file__, "--child", "--prompts", str(args.prompts), "--prompt-len", str(args.prompt_len),
                       "--max-tokens", str(args.max_tokens), "--kv-gb", str(args.kv_gb),
                       "--kv-cache-dtype", args.kv_cache_dtype, python=python)
    return run_child(cmd, python)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--kv-gb", type=float, default=2.0, help="KV cache size in GiB (the peers' long16 uses 2)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="our engine's kv_cache_dtype (baseline: always auto)")
    ap.add_argument("--baseline-python", default=None, help="interpreter of another checkout to compare against")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        emit(run_once(args))
        return
    sides = {"ours": sys.executable}
    if args.baseline_python:
        sides["baseline"] = args.baseline_python
    best: dict[str, dict] = {}
    tokens: dict[str, list] = {}
    for rnd in range(args.rounds):
        for side, python in sides.items():
            child_args = args if side == "ours" else argparse.Namespace(**{**vars(args), "kv_cache_dtype": "auto"})
            r = run_with(python, child_args)
            s = summarize(r, args.prompts, args.max_tokens)
            print_run(f"round {rnd + 1} {side}", s)
            tokens[side] = r["tokens"]
            if side not in best or s["tok_s"] > best[side]["tok_s"]:
                best[side] = s
    if "baseline" in best:
        o, b = best["ours"], best["baseline"]
        same = sum(x == y for x, y in zip(tokens["ours"], tokens["baseline"], strict=True))
        print(f"best rounds, ours/baseline: overall {o['tok_s'] / b['tok_s']:.2f}x, prefill "
              f"{b['prefill_s'] / o['prefill_s']:.2f}x faster, decode {o['decode_tok_s'] / b['decode_tok_s']:.2f}x; "
              f"{same}/{args.prompts} outputs identical")


if __name__ == "__main__":
    main()
