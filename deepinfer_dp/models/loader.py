"""Load a model for serving: a Hugging Face directory, a .gguf file, or the default model.

The class that serves a checkpoint comes from the registry (registry.py: model_type -> family),
its weights from the checkpoint's files (weights.py).

GGUF files (the default model is one) are converted once into a Hugging Face-style cache
directory (see default_model.py) for the config, the tokenizer and fp32 weights. On CPU in
fp32 the weights are read packed instead (packed_loader.py): GGUF matrices straight from the
file in their quantized format, bf16 checkpoints kept bf16. On CPU in bf16 the same packed
model computes its products in bf16 arithmetic (bf16_compute.py).
"""

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from deepinfer_dp.models.bf16_compute import to_bf16_compute
from deepinfer_dp.models.default_model import PACKED_FILE, convert_gguf, default_model_path
from deepinfer_dp.models.hub import cached_snapshot, is_repo_id, snapshot_model
from deepinfer_dp.models.huge_pages import move_to_huge_pages
from deepinfer_dp.models.packed_loader import build_packed_model, pack_bf16, read_packed_dir
from deepinfer_dp.models.registry import attach_nextn_layer, check_supported, model_class
from deepinfer_dp.models.weights import iterate_weights, safetensors_files
from deepinfer_dp.utils.cpu_malloc import release_freed_memory


@dataclass
class LoadedModel:
    model: nn.Module  # eval mode, on the requested device and dtype
    hf_config: PretrainedConfig
    tokenizer_dir: str  # AutoTokenizer.from_pretrained(tokenizer_dir) works offline
    model_dir: str  # a Hugging Face directory: AutoModelForCausalLM can load it too
    mtp: nn.Module | None = None  # the next-n (MTP) layer, when asked for (load_model(mtp=True))
    # A vision-language model's whole config; hf_config is then its text model's (KV cache, vocabulary).
    mm_config: PretrainedConfig | None = None


def resolve_model_dir(model: str | os.PathLike | None, revision: str | None = None) -> Path:
    """The Hugging Face directory to load `model` from (a directory, a .gguf file, or a
    Hugging Face repo id in the local hub cache at `revision`), converting a GGUF file if needed."""
    if model is None:
        model = default_model_path()
    path = Path(model).expanduser()
    if not path.exists() and is_repo_id(str(model)):
        path = snapshot_model(cached_snapshot(str(model), revision), str(model))
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
    check_supported(config)
    return config


def build_model(config: PretrainedConfig, dtype: torch.dtype, device: torch.device,
                expert_shard: tuple[int, ...] = (0, 1)) -> nn.Module:
    """An uninitialized model on `device`: built on the meta device so that no time goes
    into random initialization that the checkpoint overwrites anyway. A mixture-of-experts
    model holds only the routed experts of `expert_shard` (rank, size), or the physical
    slots of (rank, size, redundant experts) under expert-parallel load balancing."""
    cls = model_class(config)
    with torch.device("meta"):
        model = cls(config, expert_shard) if cls.mixture_of_experts else cls(config)
    model.to_empty(device=device)
    if model.tie_word_embeddings:  # to_empty breaks the sharing; restore it
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(dtype)


def load_model(model: str | os.PathLike | None, dtype: torch.dtype, device: torch.device | str,
               packed: bool = True, expert_shard: tuple[int, ...] = (0, 1), mtp: bool = False,
               revision: str | None = None) -> LoadedModel:
    """Loads `model` (HF directory, .gguf file, a repo id in the local Hugging Face cache at
    `revision`, or None for the default model). With `packed`,
    a dense CPU fp32 model keeps GGUF-quantized and bf16 matrices in their stored format (in
    bf16, the same model with its products in bf16 arithmetic: bf16_compute.py); a
    mixture-of-experts model loads only the routed experts of `expert_shard` (EP rank, EP size)
    and is always widened (the experts kernel reads fp32). With `mtp`, a DeepSeek-V3's next-n
    layer too (LoadedModel.mtp), for speculative decoding."""
    model_dir = resolve_model_dir(model, revision)
    config = load_hf_config(model_dir)
    device = torch.device(device)
    cls = model_class(config)
    packable = getattr(cls, "packable", True) and not cls.mixture_of_experts  # (a vision tower is not)
    if packed and packable and device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
        if (model_dir / PACKED_FILE).is_file():  # a converted GGUF file
            weights = read_packed_dir(model_dir, safetensors_files(model_dir))
        else:
            weights = pack_bf16(iterate_weights(model_dir))
        net = build_packed_model(cls, config, weights)
        del weights
        if dtype == torch.bfloat16:
            to_bf16_compute(net)
        move_to_huge_pages(net)
        release_freed_memory()  # the parts of fused matrices, which glibc would keep resident
    else:
        net = build_model(config, dtype, device, expert_shard)
        net.load_weights(iterate_weights(model_dir, getattr(net, "wants_weight", None)))
    net.source_dir = str(model_dir)
    net.eval().requires_grad_(False)  # serving only: no autograd graph even outside inference_mode
    # speculative_config method 'mtp': the checkpoint's next-n layer, attached to the model
    nextn = attach_nextn_layer(net) if mtp else None
    vision = getattr(cls, "image_family", None) is not None
    return LoadedModel(model=net, hf_config=config.get_text_config() if vision else config,
                       tokenizer_dir=str(model_dir), model_dir=str(model_dir), mtp=nextn,
                       mm_config=config if vision else None)

