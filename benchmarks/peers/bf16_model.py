"""A bf16 copy of a Hugging Face model directory (the peers benchmark's bf16 workloads):
every tensor rounded to bf16 as torch rounds, the tokenizer and generation config copied,
`architectures` set (vLLM reads it). Made once, into a fresh directory then renamed."""

from __future__ import annotations

import shutil
from pathlib import Path


def bf16_copy(model_dir: str | Path, dst: str | Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    src, dst = Path(model_dir), Path(dst)
    if (dst / "config.json").is_file():
        return dst
    tmp = dst.with_name(dst.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    config = AutoConfig.from_pretrained(src)
    config.architectures = config.architectures or ["LlamaForCausalLM"]
    model = AutoModelForCausalLM.from_pretrained(src, config=config, dtype=torch.float32).to(torch.bfloat16)
    model.save_pretrained(tmp)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and not (tmp / f.name).exists():
            shutil.copy(f, tmp / f.name)
    tmp.rename(dst)
    return dst
