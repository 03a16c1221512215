"""`deepinfer-dp`: the command line. `generate` runs the offline job on a model (the
default SmolLM2-135M-Instruct unless --model is given) and prints the completions."""

from __future__ import annotations

import argparse
import sys


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="Hugging Face model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16")
    g.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget of one step; longer prompts are prefilled in chunks")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    g.add_argument("--kv-cache-memory-gb", type=float, default=1.0, help="memory for the paged KV cache")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    g.add_argument("--no-zos", action="store_true",
                   help="disable zero-overhead scheduling (post-process every step in place)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="most new tokens per prompt")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer-dp", description="Data-parallel LLM serving engine.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions offline and print them",
                         description="Generate completions offline with LLM.generate and print them.")
    gen.add_argument("--prompt", action="append", required=True,
                     help="a prompt (repeat for several; they are batched together)")
    gen.add_argument("--raw", action="store_true",
                     help="send the prompt as is instead of applying the model's chat template")
    gen.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    _add_engine_args(gen)
    _add_sampling_args(gen)
    return parser


def run_generate(args: argparse.Namespace) -> int:
    from deepinfer_dp import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
              kv_cache_memory_gb=args.kv_cache_memory_gb, enable_prefix_caching=not args.no_prefix_caching,
              zos=not args.no_zos)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop)
    use_tqdm = not args.no_progress
    if args.raw:
        texts = llm.generate(args.prompt, params, use_tqdm=use_tqdm)
    else:
        convs = [[{"role": "user", "content": p}] for p in args.prompt]
        texts = llm.chat(convs, params, use_tqdm=use_tqdm)
    for prompt, text in zip(args.prompt, texts, strict=True):
        if len(args.prompt) > 1:
            print(f"### {prompt}")
        print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return run_generate(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"deepinfer-dp: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
