#!/usr/bin/env bash
# Offline DP on this machine through Ray, from one driver: LLM(dp_size=N) starts N rank
# actors in a placement group (a private Ray instance, address=local) behind the router
# process (a Ray actor of its own).
#   launch/local_cluster.sh [DP_SIZE] [MODEL]      (MODEL: HF dir or .gguf; default SmolLM2)
set -euo pipefail
cd "$(dirname "$0")/.."
# The project's venv (launch/setup.sh) unless PYTHON names another interpreter.
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
DP_SIZE="${1:-2}" MODEL="${2:-}" exec "$PY" - <<'PY'
import os

from deepinfer_dp import LLM, SamplingParams

llm = LLM(os.environ["MODEL"] or None, dp_size=int(os.environ["DP_SIZE"]), torch_threads=1)
prompts = ["Hello, my name is", "The capital of France is", "Write a haiku about the sea.", "Once upon a time"]
for prompt, text in zip(prompts, llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32)), strict=True):
    print(f"{prompt!r} -> {text!r}")
for s in llm.rank_stats():
    print(f"rank {s['dp_rank']}: generate_step={s['generate_step']} placeholder_steps={s['placeholder_steps']}")
llm.shutdown()
PY
