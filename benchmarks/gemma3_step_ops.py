"""What a Gemma 3 decode step costs in torch calls through the module path: the top-level aten
ops of one batch-8 decode step of a tiny random Gemma 3 with 18 layers (Gemma 3 270M's
pattern: five local layers, then a global one), counted with torch's profiler, and the best
wall time of the same forward over the steps measured. The one-call C++ decode stack
(models/llama_cpu_decode.py) replaces all of them by one call for a Llama model; this counts
what a Gemma 3 stack would take away.

    .venv/bin/python benchmarks/gemma3_step_ops.py

prints one RESULT line: the ops per step, those of the most frequent kinds, and the best ms.
"""

from __future__ import annotations

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

LAYER_TYPES = (["sliding_attention"] * 5 + ["full_attention"]) * 3


def top_level_aten(prof) -> list[str]:
    return [e.name for e in prof.events() if e.name.startswith("aten::")
            and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]


def main() -> None:
    path = write_tiny_model(lambda v: gemma3_config(v, num_hidden_layers=18, layer_types=LAYER_TYPES),
                            Path(tempfile.mkdtemp()) / "gemma3-18")
    engine = LLM(str(path), decode_sequence=False, num_kv_blocks=6 * 128 + 1, block_size=4).llm_engine
    for i in range(8):
        engine.add_request(prompt_token_ids=list(range(3, 30 + i)),
                           sampling_params=SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
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
    kinds = Counter(ops[-1]).most_common(6)
    print("RESULT " + json.dumps({"layers": 18, "batch": 8, "aten_ops_per_step": len(ops[-1]),
                                  "most_frequent": kinds, "best_ms": round(min(times) * 1000, 2)}), flush=True)


if __name__ == "__main__":
    main()
