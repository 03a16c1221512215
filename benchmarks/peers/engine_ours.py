"""deepinfer-dp on the peers workload (runs in the project's environment)."""

from __future__ import annotations

import time

T0 = time.perf_counter()

from peer_common import PeakRss, emit, load_workloads, parse_args, run_workloads  # noqa: E402


def main() -> None:
    args = parse_args(__doc__)
    rss = PeakRss()
    spec = load_workloads(args)
    from deepinfer_dp import LLM, SamplingParams

    options = {} if args.kv_gb is None else {"kv_cache_memory_gb": args.kv_gb}
    llm = LLM(spec[args.model_key or "gguf"], dtype=args.dtype, decode_sequence=False, **options)
    llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=1, temperature=0),
                 use_tqdm=False)
    cold_start = time.perf_counter() - T0

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        return [[o.token_id for o in out] for out in outs]

    emit(args.label or "deepinfer-dp", cold_start, rss, run_workloads(spec, generate))


if __name__ == "__main__":
    main()
