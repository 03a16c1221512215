"""Speculative decoding: tokens/s with speculation off, n-gram and a draft model, each with
the auto-off and always on (to find the batch size where it stops paying), on SmolLM2.

The draft model is a layer-skip draft: SmolLM2's own first --draft-layers layers with its
embeddings, norm and LM head (benchmarks/layer_skip_draft.py), since no smaller model of
SmolLM2's tokenizer is available offline. --draft PATH uses another draft instead.

Two workloads, greedy, chat template applied:
- repetition: five copy requests of realistic length, the kind prompt lookup is for: "repeat
  this text exactly" on three passages of 136-148 words, "repeat / copy this code exactly" on
  two Python files of 20 and 26 lines. The answers are 140-170 tokens after 200-225 prompt
  tokens, as real rewrite and edit requests return a whole document or file; with a short
  passage the prefill is half of every request and hides what drafting does in the decode.
  SmolLM2-135M does not carry out edits (fix the spelling, rename, add comments): it copies the
  input unchanged, drops parts, or loops until max_tokens, so only copies it makes faithfully
  and ends with EOS are kept (see REPETITION). EOS is live (the model ends when it is done, the
  same tokens on every side), capped at --repetition-max-tokens;
- ordinary: the offline-throughput prompts ("Write a short story about a robot number
  {i}."), exactly --max-tokens each (EOS ignored).
At batch sizes 1, 4, 16, 64 by default: `b` requests submitted together (batch 1: the five
prompts one request after the other, on both workloads; batches 2-8: 16 requests, as 16 / b
batches one after the other, so that a point is long enough to measure). Each side has
its own process and engine, built once, with its prefix cache reset before every point so that
every run of a point pays its prefill. At each point the sides run back to back, in an order
that rotates, and every round runs every point again: this machine's speed drifts 10-30% over
minutes, and a side's whole run against the next side's whole run compared two phases of it.
The best round of each side gives tokens/s; the ratio against "off" at the same point is the
median of the rounds' ratios (each side against off in the same round, back to back), with the
lowest and highest. The script checks that every side produced the same tokens, and prints the
mean accepted length and the answer lengths. Each speculative side runs once per --k value,
named e.g. ngram_k5 (--k 3 5 compares K side by side). The side off_again is off once more, in
a process of its own: its ratio to off is 1.0 but for the machine's noise, so its range is the
band within which a ratio says nothing.

--threshold measures the auto-off threshold (disable_by_batch_size): n-gram always on against
off, at batch sizes 1, 2, 4, 8, 16 and 32 (or --batches), on both workloads, and prints the
first batch size where speculation stops paying (ratio < 1.0) on the ordinary workload and
the default it suggests. --max-tokens caps only the ordinary workload: the repetition answers
run to 170 tokens whatever it says (--workloads ordinary leaves them out of a quick run).

    python benchmarks/spec_decode.py [--rounds 2] [--batches 1 4 16 64] [--k 3 [5 ...]] [--max-tokens 96]
        [--repetition-max-tokens 384]
        [--workloads repetition ordinary] [--sides off ngram ngram_always draft draft_always]
        (also: off_again, off_nozos)
        [--draft-layers 8 | --draft PATH] [--threshold]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The repetition workload: copy requests of realistic length (passages of 130-150 words, code
# files of 20-26 lines; answers of 140-170 tokens), as real prompt-lookup traffic (return a
# document or a file with small changes) has. SmolLM2-135M was run greedily on each candidate
# and only requests it answers sensibly are kept: a faithful copy that ends with EOS. It does
# not manage edits (fix spelling, rename, add comments or docstrings, change a name or a
# port): it copies the input unchanged, drops parts, or loops until max_tokens, so those are
# left out rather than timed on a degenerate loop that would flatter the n-gram drafts.
LIGHTHOUSE = (
    "The lighthouse keeper climbed the narrow stairs every evening at dusk. He polished the great lens, trimmed "
    "the wick, and wrote the weather in his logbook before the first ship passed the rocks. In winter the wind "
    "came off the sea so hard that the windows rattled in their frames, and he wrapped himself in two coats and "
    "a scarf his sister had knitted. In summer the tourists came with cameras and questions, and he answered "
    "each one patiently, though he had heard them all before. He liked the quiet hours best, after midnight, "
    "when the beam swept the water and nothing moved but the waves. Once a year the supply boat brought oil, "
    "flour, coffee and letters, and he read the letters slowly, one each night, to make them last until the "
    "boat came again.")
GARDEN = (
    "Every spring my grandfather planted tomatoes along the south wall of the garden. He started the seeds "
    "indoors in March, in old yogurt pots lined up on the kitchen windowsill. When the nights grew warm enough, "
    "he carried the young plants outside one by one and set them in the ground with a handful of compost. He "
    "tied each stem to a wooden stake with strips of cloth cut from worn shirts. Through the summer he watered "
    "them every evening, pinched out the side shoots, and talked to them as if they were old friends. By August "
    "the plants were taller than me, heavy with red and yellow fruit. We ate tomatoes with every meal, sliced "
    "with salt, cooked into sauce, or straight from the vine while they were still warm from the sun. What we "
    "could not eat, my grandmother preserved in glass jars for the winter.")
HARBOUR = (
    "The harbour town wakes slowly in the winter months. The fishing boats go out before dawn, their lights "
    "moving across the dark water like a string of small stars. By eight o'clock the cafe on the quay has its "
    "shutters up, and the first customers sit by the stove with their newspapers. The baker's van arrives at "
    "half past eight, and the postman follows at nine, walking the same route he has walked for thirty years. "
    "Children cross the square on their way to the school on the hill, their bags bouncing on their backs. At "
    "noon the boats return, and the fishermen unload their catch onto the stone pier, where buyers from the "
    "city wait with cold boxes and clipboards. In the afternoon the town is quiet again, and the only sound is "
    "the gulls arguing over scraps by the harbour wall.")
STATS_CODE = '''def read_numbers(path):
    numbers = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                numbers.append(float(line))
    return numbers


def mean(numbers):
    return sum(numbers) / len(numbers)


def variance(numbers):
    m = mean(numbers)
    return sum((x - m) ** 2 for x in numbers) / len(numbers)


def main():
    numbers = read_numbers("data.txt")
    print("mean:", mean(numbers))
    print("variance:", variance(numbers))


main()
'''
RECEIPT_CODE = '''def total_price(items):
    total = 0
    for item in items:
        total = total + item.price * item.quantity
    return total


def apply_discount(total, percent):
    if percent < 0 or percent > 100:
        raise ValueError("percent must be between 0 and 100")
    return total * (100 - percent) / 100


def format_receipt(items, percent):
    lines = []
    for item in items:
        lines.append(f"{item.name}: {item.quantity} x {item.price:.2f}")
    total = apply_discount(total_price(items), percent)
    lines.append(f"Total: {total:.2f}")
    return "\\n".join(lines)
'''
REPETITION = [
    f"Repeat the following text exactly, word for word:\n\n{LIGHTHOUSE}",
    f"Repeat the following code exactly:\n\n```python\n{STATS_CODE}```",
    f"Repeat the following text exactly, word for word:\n\n{GARDEN}",
    f"Copy the following code exactly, without any changes:\n\n```python\n{RECEIPT_CODE}```",
    f"Repeat the following text exactly, word for word:\n\n{HARBOUR}",
]
ORDINARY = "Write a short story about a robot number {i}."
THRESHOLD_BATCHES = [1, 2, 4, 8, 16, 32]
MIN_REQUESTS = 16  # below this batch size a point runs several batches, see requests_at
KV_GB = 1.0  # room for 64 repetition requests (about 400 tokens each) without preemption


def prompts(tokenizer, workload: str, n: int) -> list[list[int]]:
    texts = ([REPETITION[i % len(REPETITION)] for i in range(n)] if workload == "repetition"
             else [ORDINARY.format(i=i) for i in range(n)])
    convs = [[{"role": "user", "content": t}] for t in texts]
    chat = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in convs]
    return [tokenizer(t, add_special_tokens=False).input_ids for t in chat]


def side_names(sides: list[str], ks: list[int]) -> list[str]:
    """Each speculative side once per K, named e.g. ngram_k5 or draft_always_k3."""
    names = []
    for side in sides:
        names += [side] if side.startswith("off") else [f"{side}_k{k}" for k in ks]
    return names


def build(side: str, draft: str | None):
    from deepinfer_dp import LLM

    common = {"decode_sequence": False, "kv_cache_memory_gb": KV_GB, "max_model_len": 1024}

    if side in ("off", "off_again"):  # off_again: off once more, in its own process (the noise band)
        return LLM(**common)
    if side == "off_nozos":  # what giving up the ZOS deferral alone costs (speculative steps are not deferred)
        return LLM(zos=False, **common)
    method, k = side.rsplit("_k", 1)  # e.g. ngram_always_k5
    if method.startswith("ngram"):
        spec = {"method": "ngram", "num_speculative_tokens": int(k)}
    else:
        spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": int(k)}
    if method.endswith("_always"):
        spec["disable_by_batch_size"] = None
    return LLM(speculative_config=spec, **common)


def requests_at(batch: int) -> int:
    """Batch 1: the five prompts; under MIN_REQUESTS, that many as several batches (a point of
    a few hundred tokens swung 5% on noise alone); else one batch."""
    return len(REPETITION) if batch == 1 else batch * max(1, MIN_REQUESTS // batch)


def run_point(llm, ids: list[list[int]], batch: int, params) -> tuple[float, list, dict]:
    before = llm.rank_stats()[0]
    groups = [ids[i:i + batch] for i in range(0, len(ids), batch)]
    start = time.perf_counter()
    outs = []
    for g in groups:
        outs += llm.generate(prompt_token_ids=g, sampling_params=params, use_tqdm=False)
    wall = time.perf_counter() - start
    after = llm.rank_stats()[0]
    tokens = [[t for o in r for t in o.token_ids] for r in outs]
    delta = {key: after[key] - before[key] for key in ("spec_decode_num_drafts", "spec_decode_num_accepted_tokens",
                                                       "num_preemptions") if key in after}
    return sum(len(t) for t in tokens) / wall, tokens, delta


def serve_side(args: argparse.Namespace) -> None:
    """One side in its own process: builds its engine once, then runs the point named on each
    line of stdin ("workload batch") and prints its result as one JSON line."""
    from deepinfer_dp import SamplingParams

    llm = build(args.side, args.draft)
    tok = llm.get_tokenizer()
    # Warm-up on a prompt no point uses: a fresh process's first steps pay one-off costs (pages
    # of the weights and the cache touched for the first time, threads started).
    warm = [tok("Name three colours.", add_special_tokens=False).input_ids]
    llm.generate(prompt_token_ids=warm, sampling_params=SamplingParams(temperature=0.0, max_tokens=16),
                 use_tqdm=False)
    print("ready", flush=True)
    for line in sys.stdin:
        workload, batch = line.split()
        print(json.dumps(run_one(llm, tok, args, workload, int(batch))), flush=True)


def run_one(llm, tok, args: argparse.Namespace, workload: str, batch: int) -> dict:
    from deepinfer_dp import SamplingParams

    cap = args.repetition_max_tokens if workload == "repetition" else args.max_tokens
    params = SamplingParams(temperature=0.0, max_tokens=cap, ignore_eos=workload == "ordinary")
    n = requests_at(batch)
    # Every point runs once a round in the same engine: a repeat would otherwise find its
    # prompts in the prefix cache and skip the prefill, which is part of what a request costs.
    if not llm.llm_engine.reset_prefix_cache():
        raise RuntimeError("the prefix cache could not be reset: a request still holds KV blocks")
    tok_s, tokens, delta = run_point(llm, prompts(tok, workload, n), batch, params)
    drafts = delta.get("spec_decode_num_drafts", 0)
    return {"tok_s": tok_s, "tokens": hashlib.sha1(json.dumps(tokens).encode()).hexdigest(),
            "accepted_len": 1 + delta["spec_decode_num_accepted_tokens"] / drafts if drafts else None,
            "lengths": [min(len(t) for t in tokens), max(len(t) for t in tokens)],
            "cut": sum(len(t) >= cap for t in tokens) if workload == "repetition" else 0,
            "preemptions": delta.get("num_preemptions", 0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", help="batch sizes (default 1 4 16 64; --threshold: "
                    f"{' '.join(map(str, THRESHOLD_BATCHES))})")
    ap.add_argument("--k", type=int, nargs="+", default=[3],
                    help="speculative tokens; several values run each speculative side once per K (ngram_k3, ...)")
    ap.add_argument("--max-tokens", type=int, default=96, help="tokens per ordinary request (EOS ignored)")
    ap.add_argument("--repetition-max-tokens", type=int, default=384,
                    help="cap per repetition request (EOS live; the answers are 140-170 tokens)")
    ap.add_argument("--workloads", nargs="+", default=["repetition", "ordinary"])
    ap.add_argument("--sides", nargs="+", default=["off", "ngram", "ngram_always", "draft", "draft_always"])
    ap.add_argument("--draft-layers", type=int, default=8, help="layers of the layer-skip draft")
    ap.add_argument("--draft", help="a draft model directory (default: the layer-skip draft)")
    ap.add_argument("--threshold", action="store_true",
                    help="measure disable_by_batch_size: sides off and ngram_always, and print the suggestion")
    ap.add_argument("--side", help=argparse.SUPPRESS)  # internal: serve one side's points in this process
    args = ap.parse_args()
    if args.threshold:
        args.sides = ["off", "ngram_always"]
        if "ordinary" not in args.workloads:
            ap.error("--threshold reads the crossover off the ordinary workload: keep it in --workloads")
    args.batches = args.batches or (THRESHOLD_BATCHES if args.threshold else [1, 4, 16, 64])
    if args.side:
        serve_side(args)
        return
    args.sides = side_names(args.sides, args.k)
    if args.draft is None and any(s.startswith("draft") for s in args.sides):
        from layer_skip_draft import write_layer_skip_draft

        out = Path(tempfile.gettempdir()) / f"deepinfer-dp-smollm2-first{args.draft_layers}"
        args.draft = str(write_layer_skip_draft(None, out, args.draft_layers))
    best = run_rounds(args)
    report(args, best)
    if args.threshold:
        for k in args.k:
            suggest_threshold(args, best, k)


def start_sides(args: argparse.Namespace) -> dict[str, subprocess.Popen]:
    """One process per side, each with its engine built and warm; the sides' engines sit idle
    (their threads asleep) while another side runs."""
    procs = {}
    for side in args.sides:
        cmd = [sys.executable, __file__, "--side", side, "--max-tokens", str(args.max_tokens),
               "--repetition-max-tokens", str(args.repetition_max_tokens),
               *(["--draft", args.draft] if args.draft else [])]
        procs[side] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    for side, proc in procs.items():
        if proc.stdout.readline().strip() != "ready":
            raise SystemExit(f"side {side} did not start (exit code {proc.wait()})")
    return procs


def ask(proc: subprocess.Popen, side: str, point: str) -> dict:
    proc.stdin.write(point.replace("/", " ") + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"side {side} died at {point} (exit code {proc.wait()})")
    return json.loads(line)


def run_rounds(args: argparse.Namespace) -> dict[tuple, dict]:
    """Every point once per round on every side, the sides back to back at each point in an
    order that rotates from point to point and round to round: this machine's speed drifts
    over minutes, so the sides of one point meet the same phase of it. Per point and side:
    the best round's result, with every round's tokens/s in "rounds"."""
    points = [f"{w}/{b}" for w in args.workloads for b in args.batches]
    procs = start_sides(args)
    best: dict[tuple, dict] = {}
    try:
        for r in range(args.rounds):
            for i, point in enumerate(points):
                shift = (r + i) % len(args.sides)
                for side in args.sides[shift:] + args.sides[:shift]:
                    v = ask(procs[side], side, point)
                    print(json.dumps({"round": r, "side": side, "point": point, "tok_s": round(v["tok_s"], 2),
                                      "accepted_len": v["accepted_len"]}), flush=True)
                    rounds = best.get((point, side), {}).get("rounds", []) + [v["tok_s"]]
                    if best.get((point, side), {"tok_s": 0})["tok_s"] < v["tok_s"]:
                        best[(point, side)] = v
                    best[(point, side)]["rounds"] = rounds
    finally:
        for proc in procs.values():
            proc.stdin.close()
            proc.wait()
    return best


def suggest_threshold(args: argparse.Namespace, best: dict[tuple, dict], k: int) -> None:
    """The n-gram / off ratio by batch size, and the auto-off threshold read off the ordinary
    workload: drafting stays on while at most disable_by_batch_size requests run, so the
    suggestion is the largest measured batch size below the first one where it loses."""
    batches = sorted(args.batches)
    ratios = {w: {b: paired_ratio(best, f"{w}/{b}", f"ngram_always_k{k}", "off")[0] for b in batches}
              for w in args.workloads}
    print(f"\nn-gram always on / off, tokens/s ratio by batch size (K={k}, median of {args.rounds} rounds):")
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
    print(json.dumps({"threshold": {"k": k, "first_losing_batch": first, "suggested_disable_by_batch_size": suggested,
                                    "ratios": ratios}}))


def paired_ratio(best: dict[tuple, dict], point: str, side: str, base: str) -> tuple[float, float, float]:
    """The side's tokens/s over the base's, round by round (the two ran back to back): the
    median, lowest and highest. Pairing within a round cancels the machine's slow drift, which
    a ratio of two bests taken in different rounds does not."""
    pairs = sorted(a / b for a, b in zip(best[(point, side)]["rounds"], best[(point, base)]["rounds"], strict=True))
    return statistics.median(pairs), pairs[0], pairs[-1]


def report(args: argparse.Namespace, best: dict[tuple, dict]) -> None:
    draft = f", draft {args.draft}" if args.draft else ""
    print(f"\n{args.rounds} rounds{draft}: best tokens/s, ratio against {args.sides[0]} (median of the rounds' "
          "ratios, lowest-highest), [mean accepted length]; (answer tokens, shortest-longest)")
    print(f"{'point':<26}" + "".join(f"{s:>34}" for s in args.sides))
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
                mid, lo, hi = paired_ratio(best, point, side, args.sides[0])
                cells.append(f"{v['tok_s']:8.1f} {mid:.2f}x {lo:.2f}-{hi:.2f}{acc}")
            label = f"{point} ({base['lengths'][0]}-{base['lengths'][1]})"
            print(f"{label:<26}" + "".join(f"{c:>34}" for c in cells))
            if base["cut"] or any(best[(point, side)]["preemptions"] for side in args.sides):
                print(f"  {point}: {base['cut']} answers cut at the cap (raise --repetition-max-tokens), preemptions "
                      + ", ".join(f"{side} {best[(point, side)]['preemptions']}" for side in args.sides))


if __name__ == "__main__":
    main()
