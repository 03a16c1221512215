"""Offline throughput: this engine against transformers `generate` (static batching), side by side.

The fixed workload: N prompts, prompt i is the chat-template-applied "Write a short story
about a robot number {i}.", greedy, exactly 128 new tokens each (EOS ignored), all
submitted at once; N = 64 and N = 8. Each side runs in its own subprocess (so peak RSS is
its own), alternating over --rounds rounds in this one script run (this machine's speed
drifts by tens of percent over minutes), and the best round of each side gives the ratio.

    python benchmarks/offline_throughput.py [--points 64 8] [--max-tokens 128] [--rounds 2] [--skip-hf]
        [--model DIR] [--device cuda --dtype bfloat16]
"""

from __future__ import annotations

import argparse
import time

from harness import emit, run_child, self_command

PROMPT = "Write a short story about a robot number {i}."


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    convs = [[{"role": "user", "content": PROMPT.format(i=i)}] for i in range(n)]
    texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in convs]
    return [tokenizer(t, add_special_tokens=False).input_ids for t in texts]


def peak_rss_gb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run_ours(args: argparse.Namespace) -> dict:
    points, max_tokens = args.points, args.max_tokens
    t0 = time.perf_counter()
    from deepinfer_dp import LLM, SamplingParams

    llm = LLM(args.model, decode_sequence=False, zos=not args.no_zos, device=args.device, dtype=args.dtype)
    first = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=1, temperature=0),
                         use_tqdm=False)
    cold_start = time.perf_counter() - t0
    assert first and first[0]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    result = {"cold_start_s": cold_start, "points": {}}
    for n in points:
        ids = chat_prompts(llm.get_tokenizer(), n)
        forward_before = llm.rank_stats()[0]["forward_time_s"]
        t = time.perf_counter()
        outs = llm.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False)
        wall = time.perf_counter() - t
        forward_s = llm.rank_stats()[0]["forward_time_s"] - forward_before
        tokens = sum(len(o) for o in outs)
        assert tokens == n * max_tokens
        result["points"][n] = {"tok_s": tokens / wall, "wall_s": wall,
                               "overhead_share": max(0.0, 1.0 - forward_s / wall)}
    result["peak_rss_gb"] = peak_rss_gb()
    return result


def run_hf(args: argparse.Namespace) -> dict:
    points, max_tokens = args.points, args.max_tokens
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from deepinfer_dp.models.loader import resolve_model_dir

    t0 = time.perf_counter()
    model_dir = resolve_model_dir(args.model)
    device = torch.device(args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    auto_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else auto_dtype
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    result = {"cold_start_s": time.perf_counter() - t0, "points": {}}
    tok.padding_side = "left"
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    for n in points:
        ids = chat_prompts(tok, n)
        width = max(len(i) for i in ids)
        input_ids = torch.tensor([[pad] * (width - len(i)) + i for i in ids], device=device)
        mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids], device=device)
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=pad)
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
        tokens = (out.shape[1] - width) * n
        result["points"][n] = {"tok_s": tokens / wall, "wall_s": wall}
    result["peak_rss_gb"] = peak_rss_gb()
    return result


def in_subprocess(side: str, args: argparse.Namespace) -> dict:
    cmd = self_command(__file__, "--side", side, "--max-tokens", str(args.max_tokens),
                       "--points", *map(str, args.points), "--device", args.device, "--dtype", args.dtype)
    cmd += (["--no-zos"] if args.no_zos else []) + (["--model", args.model] if args.model else [])
    return run_child(cmd, f"the {side} run")


def best(runs: list[dict]) -> dict:
    """Per point, the round with the highest throughput; start time and RSS at their best too."""
    out = {"cold_start_s": min(r["cold_start_s"] for r in runs), "peak_rss_gb": max(r["peak_rss_gb"] for r in runs),
           "points": {}}
    for n in runs[0]["points"]:
        out["points"][n] = max((r["points"][n] for r in runs), key=lambda p: p["tok_s"])
    return out


def report(ours: dict, hf: dict | None, points: list[int]) -> None:
    print(f"cold start to first output: deepinfer-dp {ours['cold_start_s']:.1f} s"
          + (f", transformers load {hf['cold_start_s']:.1f} s" if hf else ""))
    hf_rss = f", transformers {hf['peak_rss_gb']:.2f} GB" if hf else ""
    print(f"peak RSS: deepinfer-dp {ours['peak_rss_gb']:.2f} GB{hf_rss}")
    print(f"{'prompts':>8} {'deepinfer-dp tok/s':>19} {'transformers tok/s':>19} {'ratio':>6} {'engine overhead':>16}")
    for n in points:
        o = ours["points"][str(n)]
        h = hf["points"][str(n)]["tok_s"] if hf else float("nan")
        print(f"{n:>8} {o['tok_s']:>19.1f} {h:>19.1f} {o['tok_s'] / h:>5.2f}x {o['overhead_share'] * 100:>15.1f}%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", type=int, nargs="+", default=[64, 8])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--skip-hf", action="store_true", help="measure this engine only")
    ap.add_argument("--rounds", type=int, default=2, help="alternating runs of each side; the best counts")
    ap.add_argument("--no-zos", action="store_true", help="run the engine with ZOS off")
    ap.add_argument("--model", default=None, help="HF directory or .gguf; default SmolLM2-135M-Instruct")
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda")
    ap.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16")
    ap.add_argument("--side", choices=["ours", "hf"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side == "ours":
        emit(run_ours(args))
    elif args.side == "hf":
        emit(run_hf(args))
    else:
        ours_runs, hf_runs = [], []
        for _ in range(args.rounds):
            ours_runs.append(in_subprocess("ours", args))
            if not args.skip_hf:
                hf_runs.append(in_subprocess("hf", args))
        report(best(ours_runs), best(hf_runs) if hf_runs else None, args.points)


if __name__ == "__main__":
    main()
