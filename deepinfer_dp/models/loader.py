"""Load a model for serving: a Hugging Face directory, a .gguf file, or the default model.

GGUF files (the default model is one) are converted once into a Hugging Face-style cache
directory (see default_model.py) for the config, the tokenizer and fp32 weights. On CPU in
fp32 the weights are read packed instead (packed_loader.py): GGUF matrices straight from the
file in their quantized format, bf16 checkpoints kept bf16.
"""

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from deepinfer_dp.models.deepseek import DEEPSEEK_MODEL_TYPES, DeepseekForCausalLM
from deepinfer_dp.models.default_model import PACKED_FILE, convert_gguf, default_model_path
from deepinfer_dp.models.fp8_blocks import FP8_DTYPES, SCALE_SUFFIX, dequantize, fp8_block_size
from deepinfer_dp.models.llama import SUPPORTED_MODEL_TYPES, LlamaForCausalLM, check_supported
from deepinfer_dp.models.moe_models import MOE_MODEL_TYPES, MoeForCausalLM
from deepinfer_dp.models.packed_loader import build_packed_model, pack_bf16, read_packed_dir
from deepinfer_dp.utils.cpu_malloc import release_freed_memory

# model_type -> the class that serves it
MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    **dict.fromkeys(SUPPORTED_MODEL_TYPES, LlamaForCausalLM), **dict.fromkeys(MOE_MODEL_TYPES, MoeForCausalLM),
    **dict.fromkeys(DEEPSEEK_MODEL_TYPES, DeepseekForCausalLM)}


@dataclass
class LoadedModel:
    model: nn.Module  # eval mode, on the requested device and dtype
    hf_config: PretrainedConfig
    tokenizer_dir: str  # AutoTokenizer.from_pretrained(tokenizer_dir) works offline
    model_dir: str  # a Hugging Face directory: AutoModelForCausalLM can load it too


def resolve_model_dir(model: str | os.PathLike | None) -> Path:
    """The Hugging Face directory to load `model` from, converting a GGUF file if needed."""
    if model is None:
        model = default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {str(path)!r} is not a .gguf file; pass a GGUF file "
                             "or a Hugging Face model directory")
        return convert_gguf(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model directory {str(path)!r} has no config.json")
    return path


def load_hf_config(model_dir: str | os.PathLike) -> PretrainedConfig:
    config = AutoConfig.from_pretrained(model_dir)
    check_supported(config, tuple(MODEL_CLASSES))
    return config


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's shard files, from the index when the checkpoint is sharded."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / s for s in shards]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"shards listed in {index} are missing: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in model directory {str(model_dir)!r}")
    return files


def iterate_weights(model_dir: Path, keep=None) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) pairs, memory-mapped from the safetensors files; with
    `keep`, only the names it accepts are read at all (another EP rank's experts are not).
    Block-scaled fp8 matrices come out widened to fp32, their scales consumed (fp8_blocks.py)."""
    block = fp8_block_size(model_dir)
    files = safetensors_files(model_dir)
    where = {name: file for file in files for name in _names(file)} if block else {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if (block and name.endswith(SCALE_SUFFIX)) or (keep is not None and not keep(name)):
                    continue
                tensor = f.get_tensor(name)
                if block and tensor.dtype in FP8_DTYPES:
                    tensor = dequantize(name, tensor, _scale_of(name, where), block)
                yield name, tensor


def _names(file: Path) -> list[str]:
    with safe_open(file, framework="pt") as f:
        return list(f.keys())


def _scale_of(name: str, where: dict[str, Path]) -> torch.Tensor:
    scale = name + SCALE_SUFFIX
    if scale not in where:
        raise ValueError(f"checkpoint weight {name!r} is fp8 but the checkpoint has no {scale!r} for it")
    with safe_open(where[scale], framework="pt") as f:
        return f.get_tensor(scale)


def build_model(config: PretrainedConfig, dtype: torch.dtype, device: torch.device,
                expert_shard: tuple[int, int] = (0, 1)) -> LlamaForCausalLM:
    """An uninitialized model on `device`: built on the meta device so that no time goes
    into random initialization that the checkpoint overwrites anyway. A mixture-of-experts
    model holds only the routed experts of `expert_shard` (rank, size)."""
    cls = MODEL_CLASSES[config.model_type]
    with torch.device("meta"):
        model = cls(config, expert_shard) if issubclass(cls, MoeForCausalLM) else cls(config)
    model.to_empty(device=device)
    if model.tie_word_embeddings:  # to_empty breaks the sharing; restore it
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(dtype)


def load_model(model: str | os.PathLike | None, dtype: torch.dtype, device: torch.device | str,
               packed: bool = True, expert_shard: tuple[int, int] = (0, 1)) -> LoadedModel:
    """Loads `model` (HF directory, .gguf file, or None for the default model). With `packed`,
    a dense CPU fp32 model keeps GGUF-quantized and bf16 matrices in their stored format; a
    mixture-of-experts model loads only the routed experts of `expert_shard` (EP rank, EP size)
    and is always widened (the experts kernel reads fp32)."""
    model_dir = resolve_model_dir(model)
    config = load_hf_config(model_dir)
    device = torch.device(device)
    dense = config.model_type not in MOE_MODEL_TYPES + DEEPSEEK_MODEL_TYPES
    if packed and dense and device.type == "cpu" and dtype == torch.float32:
        if (model_dir / PACKED_FILE).is_file():  # a converted GGUF file
            weights = read_packed_dir(model_dir, safetensors_files(model_dir))
        else:
            weights = pack_bf16(iterate_weights(model_dir))
        net = build_packed_model(config, weights)
        del weights
        release_freed_memory()  # the parts of fused matrices, which glibc would keep resident
    else:
        net = build_model(config, dtype, device, expert_shard)
        net.load_weights(iterate_weights(model_dir, getattr(net, "wants_weight", None)))
    net.source_dir = str(model_dir)
    net.eval().requires_grad_(False)  # serving only: no autograd graph even outside inference_mode
    return LoadedModel(model=net, hf_config=config, tokenizer_dir=str(model_dir),
                       model_dir=str(model_dir))

