"""LLaVA-1.5 (`LlavaForConditionalGeneration`): a CLIP vision tower, an MLP projector and a
Llama-family text model on our paged KV cache and kernels.

The vision tower and the projector are transformers' own modules built from the checkpoint's
config (so their floats are transformers'); the text model is this package's Llama decoder.
An image's embeddings (`encode_image`) replace the placeholder rows of the prompt's
embeddings inside the step (multimodal/step_inputs.py). Both checkpoint layouts load: the
llava-hf one (`language_model.model.*`, `vision_tower.*`, `multi_modal_projector.*`) and
transformers 5's (`model.language_model.*`, `model.vision_tower.*`, ...).
"""

from __future__ import annotations

import torch
from transformers import AutoModel
from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

from deepinfer_dp.models.vision_language import VisionLanguageModel, VisionParts


class LlavaVision(VisionParts):
    def __init__(self, config) -> None:
        super().__init__()
        self.vision_tower = AutoModel.from_config(config.vision_config)
        self.multi_modal_projector = LlavaMultiModalProjector(config)


class LlavaForConditionalGeneration(VisionLanguageModel):
    image_family = "llava"
    prefixes = (("model.language_model.", "text", "model."), ("language_model.model.", "text", "model."),
                ("language_model.lm_head.", "text", "lm_head."), ("lm_head.", "text", "lm_head."),
                ("model.vision_tower.", "vision_tower", ""), ("vision_tower.", "vision_tower", ""),
                ("model.multi_modal_projector.", "multi_modal_projector", ""),
                ("multi_modal_projector.", "multi_modal_projector", ""))

    def __init__(self, config) -> None:
        super().__init__(config, LlavaVision(config))
        self.feature_layer = config.vision_feature_layer
        self.select_strategy = config.vision_feature_select_strategy

    @torch.inference_mode()
    def encode_image(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        weight = self.lm_head.weight
        pixels = inputs["pixel_values"].to(device=weight.device, dtype=weight.dtype)
        out = self.vision.vision_tower(pixels, output_hidden_states=True, return_dict=True)
        layers = [self.feature_layer] if isinstance(self.feature_layer, int) else list(self.feature_layer)
        states = [out.hidden_states[i] for i in layers]
        if self.select_strategy == "default":  # drop the CLS token
            states = [s[:, 1:] for s in states]
        return self.vision.multi_modal_projector(torch.cat(states, dim=-1))[0]
