"""llama.cpp (through llama-cpp-python) on the peers workload, from the same GGUF file.

Runs in its own virtualenv (`pip install llama-cpp-python` builds llama.cpp from source).
One sequence at a time: llama-cpp-python has no batched generation, so the runner gives it
the batch-1 workload only. Greedy (top_k=1), EOS ignored: exactly max_tokens tokens.
"""

from __future__ import annotations

import os
import time

T0 = time.perf_counter()

from peer_common import PeakRss, emit, load_workloads, parse_args, run_workloads  # noqa: E402


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    rss = PeakRss()
    spec = load_workloads(args)
    from llama_cpp import Llama

    if spec.get("llamacpp_no_repack") or has_amx():
        no_repack()
    longest = max(len(p) + w["max_tokens"] for w in spec["workloads"].values() for p in w["prompts"])
    threads = len(os.sched_getaffinity(0))
    llm = Llama(model_path=spec["gguf"], n_ctx=max(512, longest), n_threads=threads, n_threads_batch=threads,
                n_batch=512, logits_all=False, verbose=False, seed=0)
    list(one_sequence(llm, [1, 2, 3], 1))
    cold_start = time.perf_counter() - T0

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        return [list(one_sequence(llm, p, max_tokens)) for p in prompts]

    emit("llama.cpp", cold_start, rss, run_workloads(spec, generate))


def has_amx() -> bool:
    with open("/proc/cpuinfo") as f:
        return "amx_tile" in f.read()


def no_repack() -> None:
    """Loads weights without llama.cpp's extra (repacking) buffer types. On a CPU with AMX its
    AMX matmul (`ggml_backend_amx_mul_mat`, llama-cpp-python 0.3.36) crashes the first decode
    with SIGSEGV, on the Gemma 3 270M file and on SmolLM2's Q4_1 file alike."""
    import llama_cpp
    from llama_cpp import llama

    default = llama_cpp.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    llama.llama_cpp.llama_model_default_params = params


def one_sequence(llm, prompt: list[int], max_tokens: int):
    llm.reset()
    for i, token in enumerate(llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                           reset=True)):
        yield token
        if i + 1 == max_tokens:
            return


if __name__ == "__main__":
    main()
