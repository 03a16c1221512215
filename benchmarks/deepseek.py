"""DeepSeek-V3-shaped model: MLA's latent KV cache against a multi-head equivalent, and
offline throughput on DP=1 and on DP=2 with expert parallelism.

The model is random-weight DeepseekV3 scaled down to run in minutes on 2 cores: 4 layers
(the first dense), hidden 512, 8 heads with V3's head split (nope 64 + rope 32, v 64), q-LoRA
192, KV latent 128, 32 routed experts top-4 in 4 groups (2 kept), one shared expert, YaRN,
SmolLM2's tokenizer. The cache part also prints the real DeepSeek-V3 shape (transformers'
default DeepseekV3Config: 61 layers, 128 heads, latent 512 + rope 64), from the config alone.

"Sequences that fit": how many sequences of --context tokens a cache of --cache-gb holds,
with MLA's per-token latent row against per-head K and V of the same head sizes.

The MTP side is DP=1 with a random next-n layer drafting one token per step; its mean step
time against the plain DP=1 side is the MTP step's cost (random weights accept few drafts).

Throughput workload: N chat prompts (default 16), greedy, exactly --max-tokens new tokens
each, all submitted at once, one torch thread per rank. Each side runs in its own subprocess,
the sides alternate over --rounds rounds and the best run of each counts.

    python benchmarks/deepseek.py [--prompts 16] [--max-tokens 32] [--rounds 2] [--skip-engine]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from harness import ONE_THREAD_NO_RAY_AUTH, best_of_rounds, emit, run_child, self_command  # noqa: E402
from offline_throughput import chat_prompts  # noqa: E402

# name: (dp_size, expert parallel, MTP draft tokens)
SIDES = {"dp1": (1, False, 0), "dp2-ep": (2, True, 0), "dp1-mtp1": (1, False, 1)}


def bench_config():
    from transformers import DeepseekV3Config

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024,
            "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
    return DeepseekV3Config(vocab_size=49152, hidden_size=512, intermediate_size=1536, moe_intermediate_size=128,
                            num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=192,
                            kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
                            n_routed_experts=32, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
                            first_k_dense_replace=1, max_position_embeddings=4096, rope_parameters=rope,
                            tie_word_embeddings=False, initializer_range=0.02, bos_token_id=1, eos_token_id=2)


def model_dir() -> Path:
    """The random-weight checkpoint, written once."""
    root = Path(os.environ.get("DEEPINFER_DP_CACHE") or Path.home() / ".cache" / "deepinfer_dp")
    path = root / "deepseek-v3-bench-2"
    if (path / "config.json").is_file():
        return path
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from deepinfer_dp.models import convert_gguf, default_model_path

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(bench_config(), dtype=torch.float32)
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    add_nextn_layer(tmp, bench_config())
    AutoTokenizer.from_pretrained(convert_gguf(default_model_path())).save_pretrained(tmp)
    tmp.rename(path)
    return path


def add_nextn_layer(path: Path, config) -> None:
    """A random next-n (MTP) layer stored as DeepSeek stores it: model.layers.<num_hidden_layers>.*,
    routed experts one tensor per expert and projection."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    prefix, hidden = f"model.layers.{config.num_hidden_layers}.", config.hidden_size
    weights = load_file(path / "model.safetensors")
    for name, t in DeepseekV3DecoderLayer(config, config.num_hidden_layers).state_dict().items():
        t = 1.0 + 0.0 * t if "norm" in name else torch.randn_like(t) * 0.02
        if name.endswith("experts.gate_up_proj"):
            for e, w in enumerate(t):
                gate, up = w.chunk(2)
                weights[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = gate.contiguous()
                weights[f"{prefix}mlp.experts.{e}.up_proj.weight"] = up.contiguous()
        elif name.endswith("experts.down_proj"):
            for e, w in enumerate(t):
                weights[f"{prefix}mlp.experts.{e}.down_proj.weight"] = w.contiguous()
        else:
            weights[prefix + name] = t.contiguous()
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        weights[f"{prefix}{norm}.weight"] = torch.ones(hidden)
    weights[f"{prefix}eh_proj.weight"] = torch.randn(hidden, 2 * hidden) * 0.02
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})


# ---- the KV cache ----------------------------------------------------------------------------
def cache_report(args) -> None:
    import torch
    from transformers import DeepseekV3Config

    from deepinfer_dp.layers.mla import mha_equivalent_bytes_per_token, mla_bytes_per_block

    budget = int(args.cache_gb * 2**30)
    print(f"KV cache per token, and sequences of {args.context} tokens that fit in {args.cache_gb:g} GiB:")
    for name, config, dtype in (("bench model", bench_config(), torch.float32),
                                ("DeepSeek-V3 shape", DeepseekV3Config(), torch.bfloat16)):
        mla = mla_bytes_per_block(config, 1, dtype)
        mha = mha_equivalent_bytes_per_token(config, dtype)
        fit_mla, fit_mha = budget // (mla * args.context), budget // (mha * args.context)
        print(f"  {name:18s} ({str(dtype).removeprefix('torch.')}): MLA {mla:,} B/token, multi-head equivalent "
              f"{mha:,} B/token ({mha / mla:.1f}x); fit {fit_mla:,} vs {fit_mha:,} sequences")


# ---- throughput ------------------------------------------------------------------------------
def run_side(name: str, path: str, prompts: int, max_tokens: int) -> dict:
    from deepinfer_dp import LLM, SamplingParams

    dp_size, ep, mtp = SIDES[name]
    extra = {"enable_expert_parallel": True, "dp_options": {"collective_timeout_s": 300}} if ep else {}
    if mtp:
        extra["speculative_config"] = {"method": "mtp", "num_speculative_tokens": mtp, "disable_by_batch_size": None}
    llm = LLM(path, decode_sequence=False, dp_size=dp_size, torch_threads=1, kv_cache_memory_gb=0.25, **extra)
    warm = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    llm.generate(prompt_token_ids=[[1, 2, 3]] * dp_size, sampling_params=warm, use_tqdm=False)
    ids = chat_prompts(llm.get_tokenizer(), prompts)
    before = llm.rank_stats()[0]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    results = llm.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    stats = llm.rank_stats()
    llm.shutdown()
    tokens = sum(len(o.token_ids) for outs in results for o in outs)
    steps = stats[0]["generate_step"] - before["generate_step"]
    return {"name": name, "tok_per_s": tokens / elapsed, "seconds": elapsed, "step_s": elapsed / steps,
            "acceptance": stats[0].get("spec_decode_acceptance_rate"),
            "local_experts": [s.get("moe_local_experts") for s in stats]}


def run_in_subprocess(name: str, path: Path, args) -> dict:
    cmd = self_command(__file__, "--side", name, "--model-dir", str(path), "--prompts", str(args.prompts),
                       "--max-tokens", str(args.max_tokens))
    return run_child(cmd, name, ONE_THREAD_NO_RAY_AUTH)


def engine_report(args) -> None:
    path = model_dir()
    best = best_of_rounds(args.rounds, SIDES, lambda name: run_in_subprocess(name, path, args), "tok_per_s")
    print(f"throughput: {args.prompts} prompts x {args.max_tokens} new tokens, greedy, one torch thread per rank, "
          f"best of {args.rounds} alternating rounds")
    base = best["dp1"]["tok_per_s"]
    for name, r in best.items():
        print(f"  {name:8s} {r['tok_per_s']:7.1f} tok/s  {r['tok_per_s'] / base:.2f}x DP=1  "
              f"mean step {1000 * r['step_s']:.1f} ms  routed experts per rank {r['local_experts']}")
    mtp, plain = best["dp1-mtp1"], best["dp1"]
    print(f"MTP (K=1) step cost over a plain step: {mtp['step_s'] / plain['step_s']:.2f}x "
          f"({1000 * mtp['step_s']:.1f} vs {1000 * plain['step_s']:.1f} ms, DP=1: observe pass + draft + verify row); "
          f"acceptance {mtp['acceptance'] or 0:.1%} -- random weights accept few drafts, so this is the cost side only")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--context", type=int, default=4096, help="tokens per sequence for 'sequences that fit'")
    ap.add_argument("--cache-gb", type=float, default=16.0, help="KV cache size for 'sequences that fit'")
    ap.add_argument("--skip-engine", action="store_true", help="only the KV cache numbers")
    ap.add_argument("--side", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side:
        emit(run_side(args.side, args.model_dir, args.prompts, args.max_tokens))
        return
    cache_report(args)
    if not args.skip_engine:
        engine_report(args)


if __name__ == "__main__":
    main()
