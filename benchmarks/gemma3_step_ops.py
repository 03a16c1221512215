"""What a Gemma 3 decode step costs in torch calls: the top-level aten ops of one batch-8
decode step of a tiny random Gemma 3 with 18 layers (Gemma 3 270M's pattern: five local
layers, then a global one, in KV groups), counted with torch's profiler, the best wall time of
the same forward over the steps measured, and the decode rate of the whole run. Decode steps
go through the one-call C++ decode stack (models/llama_cpu_decode.py); `--module-path` sends
them through the modules instead, as before the stack took Gemma 3.

    .venv/bin/python benchmarks/gemma3_step_ops.py [--module-path]

prints one RESULT line: the ops per step, those of the most frequent kinds, the best ms of a
step's forward, the stack steps run and the generated tokens per second of the run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "models")]

from model_utils import write_tiny_model  # noqa: E402
from test_gemma3 import gemma3_config  # noqa: E402

from deepinfer_dp import LLM, SamplingParams  # noqa: E402
from deepinfer_dp.models import llama_cpu_decode  # noqa: E402

LAYER_TYPES = (["sliding_attention"] * 5 + ["full_attention"]) * 3


def top_level_aten(prof) -> list[str]:
    return [e.name for e in prof.events() if e.name.startswith("aten::")
            and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--module-path", action="store_true", help="decode through the modules, not the stack")
    args = parser.parse_args()
    llama_cpu_decode.ENABLED = not args.module_path
    path = write_tiny_model(lambda v: gemma3_config(v, num_hidden_layers=18, layer_types=LAYER_TYPES),
                            Path(tempfile.mkdtemp()) / "gemma3-18")
    engine = LLM(str(path), decode_sequence=False, num_kv_blocks=6 * 128 + 1, block_size=4).llm_engine
    for i in range(8):
        engine.add_request(prompt_token_ids=list(range(3, 30 + i)),
                           sampling_params=SamplingParams(max_tokens=80, temperature=0, ignore_eos=True))
    runner = engine.worker.runner
    forward, ops, times = runner._forward, [], []

    def measured(inp):  # runs on the worker's device thread, where the profiler must start
        if inp.attn_metadata.is_prefill:
            return forward(inp)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = forward(inp)
        ops.append(top_level_aten(prof))
        start = time.perf_counter()
        forward(inp)  # the same step again (the same K/V rewritten), unprofiled
        times.append(time.perf_counter() - start)
        return out

    runner._forward = measured
    for _ in range(12):
        engine.step()
    runner._forward = forward
    generated, start = 0, time.perf_counter()  # the rest of the run, unprofiled
    while engine.has_unfinished_requests():
        generated += sum(len(out.token_ids) for out in engine.step())
    rate = generated / (time.perf_counter() - start)
    kinds = Counter(ops[-1]).most_common(6)
    print("RESULT " + json.dumps({"layers": 18, "batch": 8, "stack": not args.module_path,
                                  "aten_ops_per_step": len(ops[-1]), "most_frequent": kinds,
                                  "best_ms": round(min(times) * 1000, 2), "stack_steps": runner.decode_stack_steps,
                                  "decode_tok_s": round(rate, 1)}), flush=True)


if __name__ == "__main__":
    main()
