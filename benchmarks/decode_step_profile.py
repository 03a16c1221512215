"""Where a batch-1 decode step's time goes: `LLMEngine.step` against the one-call decode
stack (`LlamaCpuDecode.__call__`, all decoder layers in C++) and the lm_head (`compute_logits`),
wall time, on the default model (SmolLM2 Q4_1), one chat-sized prompt, greedy, 128 new tokens.
What is outside the two is the step's Python: scheduling, metadata, sampling, outputs.

    python benchmarks/decode_step_profile.py [--rounds 3] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import collections
import time

from deepinfer_dp import LLM, SamplingParams
from deepinfer_dp.engine.llm_engine import LLMEngine
from deepinfer_dp.models import default_model_path, llama_cpu_decode
from deepinfer_dp.models.llama import LlamaForCausalLM

SPENT: collections.Counter = collections.Counter()
CALLS: collections.Counter = collections.Counter()


def timed(f, label: str):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            SPENT[label] += time.perf_counter() - t
            CALLS[label] += 1
    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    LLMEngine.step = timed(LLMEngine.step, "engine step")
    llama_cpu_decode.LlamaCpuDecode.__call__ = timed(llama_cpu_decode.LlamaCpuDecode.__call__, "decode stack")
    LlamaForCausalLM.compute_logits = timed(LlamaForCausalLM.compute_logits, "lm_head")
    llm = LLM(str(default_model_path()))
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "Write a short story about a robot number 0."}],
                                   add_generation_prompt=True, tokenize=False)
    prompt = tok.encode(text, add_special_tokens=False)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
    for r in range(args.rounds):
        SPENT.clear()
        CALLS.clear()
        t = time.perf_counter()
        llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
        wall = time.perf_counter() - t
        print(f"round {r + 1}: {args.max_tokens / wall:.1f} tok/s, {CALLS['engine step']} steps")
        for label in ("engine step", "decode stack", "lm_head"):
            print(f"  {label:<24} {1e3 * SPENT[label] / max(CALLS[label], 1):7.3f} ms a call x {CALLS[label]}"
                  f"  ({100 * SPENT[label] / wall:4.1f}% of the wall)")
        print(f"  outside the engine step: {1e3 * (wall - SPENT['engine step']):.1f} ms")


if __name__ == "__main__":
    main()
