"""Speculative decoding: tokens/s with speculation off, n-gram and a draft model, each with
the auto-off and always on (to find the batch size where it stops paying), on SmolLM2.

The draft model is a layer-skip draft: SmolLM2's own first --draft-layers layers with its
embeddings, norm and LM head (benchmarks/layer_skip_draft.py), since no smaller model of
SmolLM2's tokenizer is available offline. --draft PATH uses another draft instead.

Two workloads, greedy, chat template applied:
- repetition: rewrite / repeat a given passage, edit a given piece of code (EOS live:
  the model ends when it is done, the same tokens on every side);
- ordinary: the offline-throughput prompts ("Write a short story about a robot number
  {i}."), exactly --max-tokens each (EOS ignored).
At batch sizes 1, 4, 16, 64 by default: `b` requests submitted together (batch 1: two
requests one after the other). Each side runs in its own subprocess (no idle
engine's threads beside it), the sides alternating round by round (this machine's speed
drifts over minutes), and the best round of each side gives tokens/s; the ratio is against
"off" at the same point. The script checks that every
side produced the same tokens, and prints the mean accepted length.

--threshold measures the auto-off threshold (disable_by_batch_size): n-gram always on against
off, at batch sizes 1, 2, 4, 8, 16 and 32 (or --batches), on both workloads, and prints the
first batch size where speculation stops paying (ratio < 1.0) on the ordinary workload and
the default it suggests. With --rounds 1 --max-tokens 40 it takes a few minutes.

    python benchmarks/spec_decode.py [--rounds 2] [--batches 1 4 16 64] [--k 3] [--max-tokens 96]
        [--workloads repetition ordinary] [--sides off ngram ngram_always draft draft_always] (also: off_nozos)
        [--draft-layers 8 | --draft PATH] [--threshold]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PASSAGE = ("The lighthouse keeper climbed the narrow stairs every evening at dusk. He polished the great lens, "
           "trimmed the wick, and wrote the weather in his logbook before the first ship passed the rocks.")
CODE = ("def total_price(items):\n    total = 0\n    for item in items:\n        total = total + item.price * "
        "item.quantity\n    return total\n")
REPETITION = [
    f"Rewrite this passage word for word, then once more in capital letters:\n\n{PASSAGE}",
    f"Rename the function to compute_total and add a docstring. Return the whole code:\n\n{CODE}",
    f"Summarise this passage in two sentences, reusing its words:\n\n{PASSAGE}",
    f"Add type hints to this code and return all of it:\n\n{CODE}",
    f"Repeat the following text exactly twice:\n\n{PASSAGE}",
    f"Rewrite this code with a while loop instead of the for loop, keeping everything else:\n\n{CODE}",
]
ORDINARY = "Write a short story about a robot number {i}."
THRESHOLD_BATCHES = [1, 2, 4, 8, 16, 32]


def prompts(tokenizer, workload: str, n: int) -> list[list[int]]:
    texts = ([REPETITION[i % len(REPETITION)] for i in range(n)] if workload == "repetition"
             else [ORDINARY.format(i=i) for i in range(n)])
    convs = [[{"role": "user", "content": t}] for t in texts]
    chat = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in convs]
    return [tokenizer(t, add_special_tokens=False).input_ids for t in chat]


def build(side: str, k: int, draft: str | None):
    from deepinfer_dp import LLM

    spec = None
    if side == "off_nozos":  # what giving up the ZOS deferral alone costs (speculative steps are not deferred)
        return LLM(decode_sequence=False, zos=False, kv_cache_memory_gb=0.5, max_model_len=1024)
    if side.startswith("ngram"):
        spec = {"method": "ngram", "num_speculative_tokens": k}
    elif side.startswith("draft"):
        spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
    if side.endswith("_always"):
        spec["disable_by_batch_size"] = None
    return LLM(decode_sequence=False, speculative_config=spec, kv_cache_memory_gb=0.5, max_model_len=1024)


def run_point(llm, ids: list[list[int]], batch: int, params) -> tuple[float, list, dict]:
    before = llm.rank_stats()[0]
    groups = [ids[:1], ids[1:2]] if batch == 1 else [ids]
    start = time.perf_counter()
    outs = []
    for g in groups:
        outs += llm.generate(prompt_token_ids=g, sampling_params=params, use_tqdm=False)
    wall = time.perf_counter() - start
    after = llm.rank_stats()[0]
    tokens = [[t for o in r for t in o.token_ids] for r in outs]
    delta = {key: after[key] - before[key] for key in ("spec_decode_num_drafts", "spec_decode_num_accepted_tokens")
             if key in after}
    return sum(len(t) for t in tokens) / wall, tokens, delta


def run_side(args: argparse.Namespace) -> dict:
    """One side, every point: what its subprocess prints as one JSON line."""
    from deepinfer_dp import SamplingParams

    llm = build(args.side, args.k, args.draft)
    tok = llm.get_tokenizer()
    # Warm-up on a prompt no point uses: a fresh process's first steps pay one-off costs (pages
    # of the weights and the cache touched for the first time, threads started) that would
    # otherwise land on the first point of every side alike and squash its ratio.
    warm = [tok("Name three colours.", add_special_tokens=False).input_ids]
    llm.generate(prompt_token_ids=warm, sampling_params=SamplingParams(temperature=0.0, max_tokens=16),
                 use_tqdm=False)
    points = {}
    for workload in args.workloads:
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=workload == "ordinary")
        for batch in args.batches:
            tok_s, tokens, delta = run_point(llm, prompts(tok, workload, max(batch, 2)), batch, params)
            drafts = delta.get("spec_decode_num_drafts", 0)
            points[f"{workload}/{batch}"] = {
                "tok_s": tok_s, "tokens": hashlib.sha1(json.dumps(tokens).encode()).hexdigest(),
                "accepted_len": 1 + delta["spec_decode_num_accepted_tokens"] / drafts if drafts else None}
    return points


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", help="batch sizes (default 1 4 16 64; --threshold: "
                    f"{' '.join(map(str, THRESHOLD_BATCHES))})")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--workloads", nargs="+", default=["repetition", "ordinary"])
    ap.add_argument("--sides", nargs="+", default=["off", "ngram", "ngram_always", "draft", "draft_always"])
    ap.add_argument("--draft-layers", type=int, default=8, help="layers of the layer-skip draft")
    ap.add_argument("--draft", help="a draft model directory (default: the layer-skip draft)")
    ap.add_argument("--threshold", action="store_true",
                    help="measure disable_by_batch_size: sides off and ngram_always, and print the suggestion")
    ap.add_argument("--side", help=argparse.SUPPRESS)  # internal: run one side in this process
    args = ap.parse_args()
    if args.threshold:
        args.sides = ["off", "ngram_always"]
        if "ordinary" not in args.workloads:
            ap.error("--threshold reads the crossover off the ordinary workload: keep it in --workloads")
    args.batches = args.batches or (THRESHOLD_BATCHES if args.threshold else [1, 4, 16, 64])
    if args.side:
        print(json.dumps(run_side(args)))
        return
    if args.draft is None and any(s.startswith("draft") for s in args.sides):
        from layer_skip_draft import write_layer_skip_draft

        out = Path(tempfile.gettempdir()) / f"deepinfer-dp-smollm2-first{args.draft_layers}"
        args.draft = str(write_layer_skip_draft(None, out, args.draft_layers))
    best: dict[tuple, dict] = {}
    for r in range(args.rounds):
        for side in args.sides:  # each side in its own process: no idle engine's threads around
            cmd = [sys.executable, __file__, "--side", side, "--k", str(args.k), "--max-tokens", str(args.max_tokens),
                   "--batches", *map(str, args.batches), "--workloads", *args.workloads,
                   *(["--draft", args.draft] if args.draft else [])]
            points = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            for point, v in points.items():
                print(json.dumps({"round": r, "side": side, "point": point, "tok_s": round(v["tok_s"], 2),
                                  "accepted_len": v["accepted_len"]}), flush=True)
                if best.get((point, side), {"tok_s": 0})["tok_s"] < v["tok_s"]:
                    best[(point, side)] = v
    report(args, best)
    if args.threshold:
        suggest_threshold(args, best)


def suggest_threshold(args: argparse.Namespace, best: dict[tuple, dict]) -> None:
    """The n-gram / off ratio by batch size, and the auto-off threshold read off the ordinary
    workload: drafting stays on while at most disable_by_batch_size requests run, so the
    suggestion is the largest measured batch size below the first one where it loses."""
    batches = sorted(args.batches)
    ratios = {w: {b: best[(f"{w}/{b}", "ngram_always")]["tok_s"] / best[(f"{w}/{b}", "off")]["tok_s"]
                  for b in batches} for w in args.workloads}
    print(f"\nn-gram always on / off, tokens/s ratio by batch size (K={args.k}, best of {args.rounds} rounds):")
    for w, by_batch in ratios.items():
        print(f"  {w:<12}" + "".join(f"  b{b}: {r:.2f}x" for b, r in by_batch.items()))
    losing = [b for b in batches if ratios["ordinary"][b] < 1.0]
    first = losing[0] if losing else None
    paying = [b for b in batches if first is None or b < first]
    suggested = paying[-1] if paying else None
    if first is None:
        print(f"ordinary workload: n-gram pays at every measured batch size (up to {batches[-1]}); "
              f"disable_by_batch_size >= {batches[-1]}")
    elif suggested is None:
        print(f"ordinary workload: n-gram loses already at batch {first} ({ratios['ordinary'][first]:.2f}x): "
              "no batch size where it pays")
    else:
        print(f"ordinary workload: n-gram stops paying at batch {first} ({ratios['ordinary'][first]:.2f}x); "
              f"suggested disable_by_batch_size = {suggested} (the largest measured batch size below it: "
              f"drafting stays on while at most that many requests run)")
    print(json.dumps({"threshold": {"first_losing_batch": first, "suggested_disable_by_batch_size": suggested,
                                    "ratios": ratios}}))


def report(args: argparse.Namespace, best: dict[tuple, dict]) -> None:
    draft = f", draft {args.draft}" if args.draft else ""
    print(f"\nbest of {args.rounds} rounds, K={args.k}{draft}: tokens/s, ratio against off, [mean accepted length]")
    print(f"{'point':<16}" + "".join(f"{s:>26}" for s in args.sides))
    for workload in args.workloads:
        for batch in args.batches:
            point = f"{workload}/{batch}"
            base = best[(point, args.sides[0])]
            cells = []
            for side in args.sides:
                v = best[(point, side)]
                if v["tokens"] != base["tokens"]:
                    raise SystemExit(f"{side} produced other tokens than {args.sides[0]} at {point}")
                acc = f" [{v['accepted_len']:.2f}]" if v["accepted_len"] else ""
                cells.append(f"{v['tok_s']:8.1f} {v['tok_s'] / base['tok_s']:.2f}x{acc}")
            print(f"{point:<16}" + "".join(f"{c:>26}" for c in cells))


if __name__ == "__main__":
    main()
