"""`deepinfer-dp`: the command line.

`generate` runs the offline job (the default SmolLM2-135M-Instruct unless --model is
given) and prints the completions; `serve` starts the OpenAI-compatible server. Both take
`--config FILE` (YAML, see configs/) with flags that override it."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from deepinfer_dp.config_file import add_config_args, load_config
from deepinfer_dp.entrypoints.openai.draining import exit_at_once
from deepinfer_dp.entrypoints.openai.launcher import add_serve_args, run_serve
from deepinfer_dp.sampling_params import SamplingParams

# generate's own length when neither the flag nor the model's generation config sets one
GENERATE_MAX_TOKENS = 128


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling", "unset: the model's defaults (--generation-config)")
    g.add_argument("--max-tokens", type=int, default=None,
                   help=f"most new tokens per prompt (default: the model's max_new_tokens, else {GENERATE_MAX_TOKENS})")
    g.add_argument("--temperature", type=float, default=None, help="0 is greedy")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--sampling-seed", type=int, default=None,
                   help="every request's own sampling seed (--seed seeds the engine's global RNG)")
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
    add_config_args(gen)
    _add_sampling_args(gen)
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API over DP ranks",
                           description="Serve /v1/completions, /v1/chat/completions, /health and /metrics.")
    add_serve_args(serve)
    return parser


def run_generate(args: argparse.Namespace) -> int:
    from deepinfer_dp.entrypoints.llm import LLM

    deployment = load_config(args)
    llm = LLM(model=deployment.model, dp_size=deployment.dp_size, dp_options=deployment.dp_settings(),
              **deployment.engine_options())
    params = _sampling_params(args, llm)
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


def _sampling_params(args: argparse.Namespace, llm) -> SamplingParams:
    """The model's defaults (LLM.get_default_sampling_params), with the flags given on top."""
    params = llm.get_default_sampling_params()
    if "max_tokens" not in llm.sampling_defaults:
        params.max_tokens = GENERATE_MAX_TOKENS
    given = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
             "top_k": args.top_k, "seed": args.sampling_seed, "stop": args.stop}
    return dataclasses.replace(params, **{k: v for k, v in given.items() if v is not None})


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return run_generate(args)
        if args.command == "serve":
            with exit_at_once():  # the process ends here, once everything it started has stopped
                run_serve(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"deepinfer-dp: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
