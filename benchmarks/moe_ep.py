"""Expert parallelism: a random-weight MoE of realistic layer shape (OLMoE / Qwen3-30B-A3B-like:
64 experts, top-8, scaled down to fit this machine) served offline on DP=1, on DP=2 with
replicated experts, and on DP=2 with expert parallelism under each dispatcher; plus our MoE
layer against transformers' own sparse MoE block at the same batch.

Workload: N prompts (default 64), prompt i the chat-template-applied "Write a short story
about a robot number {i}." (SmolLM2's tokenizer), greedy, exactly 128 new tokens each, all
submitted at once; one torch thread per rank. Each side runs in its own subprocess, the
sides alternate over --rounds rounds and the best run of each counts. Prints tokens/s and the
ratio to DP=1, each rank's peak RSS and routed-expert bytes, and the MoE collectives' share
of each rank's compute time; then the layer benchmark (batch 64 tokens, both on one thread,
interleaved, the best of --layer-reps each).

    python benchmarks/moe_ep.py [--prompts 64] [--max-tokens 128] [--rounds 2] [--layers 4]
        [--hidden 1024] [--moe-intermediate 512] [--skip-engine] [--skip-layer]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from harness import ONE_THREAD_NO_RAY_AUTH, best_of_rounds, emit, run_child, self_command  # noqa: E402
from offline_throughput import chat_prompts  # noqa: E402

SIDES = {"dp1": (1, None), "dp2-replicated": (2, None), "dp2-ep-all_to_all": (2, "all_to_all"),
         "dp2-ep-allgather_reducescatter": (2, "allgather_reducescatter")}


def moe_config(args):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=49152, hidden_size=args.hidden, num_hidden_layers=args.layers,
                          num_attention_heads=16, num_key_value_heads=4, head_dim=args.hidden // 16,
                          num_experts=64, num_experts_per_tok=8, moe_intermediate_size=args.moe_intermediate,
                          intermediate_size=4 * args.hidden, norm_topk_prob=True, max_position_embeddings=4096,
                          tie_word_embeddings=True, initializer_range=0.02)


def model_dir(args) -> Path:
    """The random-weight checkpoint, written once (a cache keyed by the shape)."""
    key = f"{args.hidden}-{args.moe_intermediate}-{args.layers}"
    root = Path(os.environ.get("DEEPINFER_DP_CACHE") or Path.home() / ".cache" / "deepinfer_dp")
    path = root / f"moe-bench-{hashlib.sha1(key.encode()).hexdigest()[:8]}"
    if (path / "config.json").is_file():
        return path
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from deepinfer_dp.models import convert_gguf, default_model_path

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(moe_config(args), dtype=torch.float32)
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(convert_gguf(default_model_path())).save_pretrained(tmp)
    tmp.rename(path)
    return path


def peak_rss_gb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def run_side(name: str, path: str, prompts: int, max_tokens: int) -> dict:
    from deepinfer_dp import LLM, SamplingParams

    dp_size, backend = SIDES[name]
    ep = {"enable_expert_parallel": True, "all2all_backend": backend} if backend else {}
    # a generous group timeout: the ranks' loads of a few GB may end far apart on a busy machine
    dp = {"dp_options": {"collective_timeout_s": 300}} if dp_size > 1 else {}
    llm = LLM(path, decode_sequence=False, dp_size=dp_size, torch_threads=1, kv_cache_memory_gb=0.5, **ep, **dp)
    warm = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    llm.generate(prompt_token_ids=[[1, 2, 3]] * dp_size, sampling_params=warm, use_tqdm=False)
    before = llm.rank_stats()
    ids = chat_prompts(llm.get_tokenizer(), prompts)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    results = llm.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    after = llm.rank_stats()
    pids = [info["pid"] for info in llm.llm_engine.ranks.infos] if dp_size > 1 else [os.getpid()]
    ranks = [{"peak_rss_gb": peak_rss_gb(pid), "expert_gb": a["moe_expert_bytes"] / 2**30,
              "collective_s": a["moe_collective_s"] - b["moe_collective_s"],
              "busy_s": a["device_busy_s"] - b["device_busy_s"],
              "placeholder_steps": a["placeholder_steps"] - b["placeholder_steps"]}
             for a, b, pid in zip(after, before, pids, strict=True)]
    llm.shutdown()
    tokens = sum(len(o.token_ids) for outs in results for o in outs)
    return {"name": name, "tokens": tokens, "seconds": elapsed, "tok_per_s": tokens / elapsed, "ranks": ranks}


def run_in_subprocess(name: str, path: Path, args) -> dict:
    cmd = self_command(__file__, "--side", name, "--model-dir", str(path), "--prompts", str(args.prompts),
                       "--max-tokens", str(args.max_tokens))
    return run_child(cmd, name, ONE_THREAD_NO_RAY_AUTH)


def engine_report(sides: dict, args) -> None:
    base = sides.get("dp1", next(iter(sides.values())))["tok_per_s"]
    print(f"workload: {args.prompts} prompts x {args.max_tokens} new tokens, greedy, one torch thread per rank; "
          f"{args.layers} MoE layers, hidden {args.hidden}, 64 experts of {args.moe_intermediate}, top-8")
    for name, s in sides.items():
        print(f"{name:32s} {s['tok_per_s']:7.1f} tok/s  {s['tok_per_s'] / base:.2f}x DP=1")
        for i, r in enumerate(s["ranks"]):
            share = 100 * r["collective_s"] / r["busy_s"] if r["busy_s"] else 0.0
            print(f"    rank {i}: peak RSS {r['peak_rss_gb']:.2f} GB, routed experts {r['expert_gb']:.2f} GB, "
                  f"MoE collectives {r['collective_s']:.2f} s = {share:.1f}% of compute, "
                  f"placeholder steps {r['placeholder_steps']}")


# ---- the layer against transformers' sparse MoE block ---------------------------------------
def layer_benchmark(args) -> None:
    import torch
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from deepinfer_dp.layers.linear import replace_linears
    from deepinfer_dp.models.moe_models import SparseMoeBlock

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = moe_config(args)
    theirs = {}
    for impl in ("grouped_mm", "eager"):
        config._experts_implementation = impl
        block = Qwen3MoeSparseMoeBlock(config).eval()
        if impl == "grouped_mm":
            with torch.no_grad():
                for p in block.parameters():
                    p.normal_(0.0, 0.02)
            weights = block.state_dict()
        block.load_state_dict(weights)
        theirs[impl] = block
    ours = SparseMoeBlock(config, 0, (0, 1))
    with torch.no_grad():
        ours.gate.weight.copy_(weights["gate.weight"])
        ours.experts.w13.copy_(weights["experts.gate_up_proj"])
        ours.experts.w2.copy_(weights["experts.down_proj"])
    replace_linears(ours)
    x = torch.randn(args.layer_batch, args.hidden)
    runs = {"ours": lambda: ours(x), **{f"transformers ({k})": (lambda b=b: b(x[None])) for k, b in theirs.items()}}
    with torch.inference_mode():
        diff = (runs["ours"]() - runs["transformers (grouped_mm)"]()[0]).abs().max().item()
        best = dict.fromkeys(runs, float("inf"))
        for _ in range(args.layer_reps):  # interleaved: the machine's speed drifts
            for name, fn in runs.items():
                t = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t)
    print(f"MoE layer at batch {args.layer_batch} (one thread, best of {args.layer_reps}; max |diff| {diff:.1e}):")
    for name, sec in best.items():
        print(f"    {name:32s} {1000 * sec:8.2f} ms   ours {sec / best['ours']:.2f}x faster" if name != "ours"
              else f"    {name:32s} {1000 * sec:8.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--moe-intermediate", type=int, default=512)
    ap.add_argument("--layer-batch", type=int, default=64)
    ap.add_argument("--layer-reps", type=int, default=20)
    ap.add_argument("--sides", nargs="*", default=list(SIDES), choices=list(SIDES))
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--skip-layer", action="store_true")
    ap.add_argument("--side", default=None, help=argparse.SUPPRESS)  # child process
    ap.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side is not None:
        emit(run_side(args.side, args.model_dir, args.prompts, args.max_tokens))
        return
    if not args.skip_engine:
        path = model_dir(args)
        sides = best_of_rounds(args.rounds, args.sides, lambda name: run_in_subprocess(name, path, args),
                               "tok_per_s")
        engine_report(sides, args)
    if not args.skip_layer:
        layer_benchmark(args)


if __name__ == "__main__":
    main()
