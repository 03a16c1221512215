"""Builds a CPU fp32 model whose matrices stay in their stored format (see layers/packed.py).

GGUF files: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants Q2_K-Q6_K and BF16 matrices
run from their blocks as stored (the default model: Q4_1 layers, a Q8_0 embedding tied to the
lm_head), read from the packed copy the converter keeps next to the fp32 one (parsing the GGUF
file itself takes seconds: its 49k-token vocabulary); other GGUF types (F16, the IQ and TQ
formats) are widened to fp32 at load, and the converter logs which.
Hugging Face directories: bf16 matrices stay bf16. Norms and biases are widened to fp32 (they are small).

A fused projection (q/k/v, gate/up) whose parts share one format is one packed matrix; one
whose parts differ keeps each part in its stored format as one PackedParts matrix (a Llama
Q4_K_M file's Q4_K q/k next to a Q6_K v; Gemma 3 270M's Q5_0 q/k next to a Q8_0 v). In a model
of plain Llama layers, parts that are all Q4_0/Q5_0/Q8_0 run as one Q8_0 matrix instead, which
holds their values exactly: a single format keeps the layer on the one-call decode stack. A
fused projection of Q5_0 parts alone becomes Q8_0 there too (faster to widen).

The embedding of a tied model is packed once and serves as the lm_head too, so the lm_head
runs from the stored embedding (Q8_0 in the default model): it is a fifth of a decode step's
arithmetic and a third of its weight bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from itertools import groupby
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from torch import nn

from deepinfer_dp.layers.packed import EXACT_IN_Q8_0, PackedEmbedding, PackedLinear, PackedWeight
from deepinfer_dp.layers.packed_parts import PackedParts, PackedPartsLinear
from deepinfer_dp.models.default_model import PACKED_FILE

if TYPE_CHECKING:
    from deepinfer_dp.models.llama import LlamaForCausalLM

Weights = dict[str, "torch.Tensor | PackedWeight"]
logger = logging.getLogger(__name__)


def read_packed_dir(model_dir: Path, files: list[Path]) -> Weights:
    """A converted GGUF file's tensors: the packed matrices of packed.safetensors, and from
    the checkpoint `files` (fp32) only the tensors that are not packed there."""
    weights: Weights = {}
    with safe_open(model_dir / PACKED_FILE, framework="np") as f:
        layout = f.metadata()
        for name in f.keys():
            fmt, cols = layout[name].split(":")
            weights[name] = PackedWeight(f.get_tensor(name), fmt, int(cols))
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if name not in weights:
                    weights[name] = f.get_tensor(name)
    return weights


def pack_bf16(named: Iterable[tuple[str, torch.Tensor]]) -> Weights:
    """A Hugging Face checkpoint's tensors, its bf16 matrices packed."""
    return {name: PackedWeight.from_bf16(t) if _is_matrix(name) and t.dtype == torch.bfloat16 else t
            for name, t in named}


def _is_matrix(name: str) -> bool:
    return name.endswith(("_proj.weight", "lm_head.weight", "embed_tokens.weight"))


def build_packed_model(model_class: type[LlamaForCausalLM], config, weights: Weights) -> LlamaForCausalLM:
    """A CPU fp32 model of `model_class` (a dense Llama-layout family): packed modules where
    `weights` has packed matrices, fp32 params (loaded the usual way) for the rest."""
    with torch.device("meta"):
        model = model_class(config)
    used = _install_packed(model, weights)
    model.to_empty(device="cpu")
    tied = model.tie_word_embeddings
    if tied and not isinstance(model.lm_head, PackedLinear):  # to_empty broke the sharing
        model.lm_head.weight = model.model.embed_tokens.weight
    rest = ((n, t.widen() if isinstance(t, PackedWeight) else t) for n, t in weights.items() if n not in used)
    model.load_weights(rest, loaded_elsewhere=used)
    return model


def _install_packed(model: LlamaForCausalLM, weights: Weights) -> set[str]:
    """Swaps in packed modules; returns the checkpoint names they consumed."""
    used: set[str] = set()
    # In the layers the one-call decode stack runs, Q4_0/Q5_0/Q8_0 parts become one Q8_0
    # matrix: one kernel call instead of two (the stack takes parts in other mixes).
    lift = model.stack_layers()
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = _packed(attn.qkv_proj, weights, used,
                                [p + f"self_attn.{x}_proj.weight" for x in "qkv"], lift)
        attn.o_proj = _packed(attn.o_proj, weights, used, [p + "self_attn.o_proj.weight"])
        mlp.gate_up_proj = _packed(mlp.gate_up_proj, weights, used,
                                   [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], lift)
        mlp.down_proj = _packed(mlp.down_proj, weights, used, [p + "mlp.down_proj.weight"])
    embed = weights.get("model.embed_tokens.weight")
    if isinstance(embed, PackedWeight):
        model.model.embed_tokens = PackedEmbedding(embed)
        used.add("model.embed_tokens.weight")
    if "lm_head.weight" not in weights:
        model.tie_word_embeddings = True  # a checkpoint without lm_head shares the embedding
    if model.tie_word_embeddings:
        if isinstance(embed, PackedWeight):
            model.lm_head = PackedLinear(embed)
    else:
        model.lm_head = _packed(model.lm_head, weights, used, ["lm_head.weight"])
    return used


def _packed(linear: nn.Module, weights: Weights, used: set[str], names: list[str],
            lift_to_q8_0: bool = False) -> nn.Module:
    """`linear` as a packed module over the checkpoint matrices `names` (its fused parts), or
    `linear` itself when they cannot all stay packed. `lift_to_q8_0`: parts that are all
    Q4_0/Q5_0/Q8_0 become one Q8_0 matrix rather than parts in their own formats (Q5_0 parts
    even when they share that one format)."""
    parts = [weights.get(n) for n in names]
    if not all(isinstance(w, PackedWeight) for w in parts) or len({w.cols for w in parts}) != 1:
        if len(parts) > 1 and any(isinstance(w, PackedWeight) for w in parts):
            logger.warning("%s widened to fp32 at load: not every part is a packed matrix of one width",
                           " + ".join(names))
        return linear  # widened at load, as an fp32 nn.Linear
    used.update(names)
    formats = {w.format for w in parts}
    if lift_to_q8_0 and (len(formats) > 1 or "q5_0" in formats) and formats <= EXACT_IN_Q8_0.keys():
        # Exact (Q4_0/Q5_0 values are Q8_0 values): more bytes than the parts as stored, but
        # one kernel call a step; and Q5_0 alone too, whose fifth bits cost more to widen at
        # one to eight rows than Q8_0's extra bytes cost to read.
        parts = [w.as_q8_0() for w in parts]
    # Adjacent parts of one format are one part (a Q4_K_M file's Q4_K q and k).
    runs = [_joined(list(run)) for _, run in groupby(parts, key=lambda w: w.format)]
    # The bias stays a (meta) parameter: load_weights fills it in like any other.
    if len(runs) == 1:
        return PackedLinear(runs[0], linear.bias)
    return PackedPartsLinear(PackedParts(tuple(runs)), linear.bias)


def _joined(parts: list[PackedWeight]) -> PackedWeight:
    return parts[0] if len(parts) == 1 else PackedWeight.concat(parts)
