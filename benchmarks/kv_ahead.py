"""What asking for the next layer's K/V blocks during the down projection
(`csrc/kernels/side_lines.h`) does to a decode step: the one-call decode stack
(`LlamaCpuDecode.__call__`) timed with it on and off (`DEEPINFER_DP_KV_AHEAD=0`, read at every
call) on alternate decode steps of the same runs, so both see the same batch, contexts and
machine load; between two runs on this shared machine the step time moves by more than the
difference. Greedy, EOS ignored.

Workloads: `chat64` / `chat8`: 64 / 8 chat prompts (~40 tokens), 128 new tokens; `long16`: 16
prompts of 2,000 random token ids, 32 new. Models as in decode_step_profile.py (default: the
bf16 SmolLM2 copy computed in bf16; `smollm2`: the default Q4_1 model, fp32 compute; `gemma3`:
the real Gemma 3 270M Q4_K_M, fp32 compute). Only the bf16 tiles ask ahead, so on the fp32 models
on and off run the same code: their ratio is this benchmark's own noise.

    python benchmarks/kv_ahead.py [--model smollm2-bf16|smollm2|gemma3] [--workloads chat64 chat8 long16]
        [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from decode_step_profile import _engine_and_prompts

from deepinfer_dp import SamplingParams
from deepinfer_dp.models import llama_cpu_decode

WORKLOADS = {"chat64": (64, 0, 128), "chat8": (8, 0, 128), "long16": (16, 2000, 32)}  # prompts, tokens, new


class Alternate:
    """Wraps the decode stack's call: every other call with asking ahead off, each timed."""

    def __init__(self) -> None:
        self.spent = {"on": 0.0, "off": 0.0}
        self.calls = {"on": 0, "off": 0}
        self.active = self.skip = False
        self._original = llama_cpu_decode.LlamaCpuDecode.__call__
        outer = self

        def call(decode, *args, **kwargs):
            if not outer.active or outer.skip:
                outer.skip = False
                return outer._original(decode, *args, **kwargs)
            side = "off" if (outer.calls["on"] + outer.calls["off"]) % 2 else "on"
            os.environ["DEEPINFER_DP_KV_AHEAD"] = "1" if side == "on" else "0"
            start = time.perf_counter()
            try:
                return outer._original(decode, *args, **kwargs)
            finally:
                outer.spent[side] += time.perf_counter() - start
                outer.calls[side] += 1
                os.environ.pop("DEEPINFER_DP_KV_AHEAD")

        llama_cpu_decode.LlamaCpuDecode.__call__ = call

    def reset(self) -> None:
        """Counts from the run's second decode call (its first follows the prefill's steps)."""
        self.skip = True
        self.spent = {"on": 0.0, "off": 0.0}
        self.calls = {"on": 0, "off": 0}

    def ms(self, side: str) -> float:
        return 1e3 * self.spent[side] / max(self.calls[side], 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("smollm2-bf16", "smollm2", "gemma3"), default="smollm2-bf16")
    ap.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=["chat64", "chat8", "long16"])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    alternate = Alternate()
    llm, chat = _engine_and_prompts(args.model, max(WORKLOADS[w][0] for w in args.workloads))
    rng = np.random.default_rng(0)
    for name in args.workloads:
        count, tokens, new = WORKLOADS[name]
        prompts = [rng.integers(100, 40000, tokens).tolist() for _ in range(count)] if tokens else chat[:count]
        params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
        alternate.active = False
        llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)  # warm
        alternate.active = True
        for r in range(args.rounds):
            alternate.reset()
            llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
            on, off = alternate.ms("on"), alternate.ms("off")
            print(f"{args.model} {name} round {r + 1}: asking ahead {on:.2f} ms a decode call, off {off:.2f} "
                  f"({alternate.calls['on']} + {alternate.calls['off']} calls): on / off {on / off:.3f}", flush=True)


if __name__ == "__main__":
    main()
