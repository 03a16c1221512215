"""Qwen2-VL (`Qwen2VLForConditionalGeneration`) and Qwen2.5-VL
(`Qwen2_5_VLForConditionalGeneration`): a vision transformer over dynamic-resolution patch
grids (2.5: window attention, RMSNorm and SwiGLU blocks) whose merger maps 2x2 patches to
one text embedding, and a Qwen2 text model on our paged KV cache with M-RoPE.

The vision transformer and merger are transformers' own modules (`encode_image` is its
`get_image_features` for one image). The text model is this package's Llama decoder (q/k/v
biases as Qwen2) with `MRotaryEmbedding`: a step's positions come in as [3, T] when a row is
an image token and as one row otherwise (multimodal/mrope.py), so decode steps run the C++
decode stack at the position plus the prompt's M-RoPE delta. Both checkpoint layouts load:
the published one (`visual.*`, `model.*`, `lm_head.*`) and transformers 5's in-memory names
(`model.visual.*`, `model.language_model.*`).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

from deepinfer_dp.models.vision_language import VisionLanguageModel, VisionParts


class QwenVLVision(VisionParts):
    def __init__(self, config, tower: type) -> None:
        super().__init__()
        self.visual = tower._from_config(config.vision_config)


class Qwen2VLForConditionalGeneration(VisionLanguageModel):
    image_family = "qwen2_vl"  # the processing and M-RoPE of both Qwen VL generations
    vision_tower: type = Qwen2VisionTransformerPretrainedModel
    prefixes = (("model.language_model.", "text", "model."), ("model.visual.", "visual", ""),
                ("visual.", "visual", ""))

    def __init__(self, config) -> None:
        super().__init__(config, QwenVLVision(config, self.vision_tower))

    @torch.inference_mode()
    def encode_image(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        weight = self.lm_head.weight
        pixels = inputs["pixel_values"].to(device=weight.device, dtype=weight.dtype)  # [patches, C*T*P*P]
        grid = inputs["image_grid_thw"].to(weight.device)
        return self.vision.visual(pixels, grid_thw=grid, return_dict=True).pooler_output

    def load_weights(self, weights, loaded_elsewhere=()) -> None:
        super().load_weights(weights, loaded_elsewhere)
        _reset_vision_rope(self.vision)


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):  # noqa: N801 - transformers' name
    vision_tower = Qwen2_5_VisionTransformerPretrainedModel


def _reset_vision_rope(module: nn.Module) -> None:
    """The vision RoPE's inverse frequencies are a buffer no checkpoint holds, and the loader
    builds the model on the meta device: recompute them as the module's constructor does."""
    for sub in module.modules():
        if type(sub).__name__.endswith("VisionRotaryEmbedding"):
            fresh = type(sub)(sub.config)
            with torch.no_grad():
                sub.inv_freq.copy_(fresh.inv_freq)
                sub.original_inv_freq.copy_(fresh.original_inv_freq)
