"""Idefics3 / SmolVLM (`Idefics3ForConditionalGeneration`): a SigLIP-style vision transformer,
the pixel-shuffle connector and a Llama-family text model (SmolLM2 for SmolVLM) on our paged
KV cache. The processor splits a large image into tiles plus a global view; each tile gives
image_seq_len embeddings, and an image's placeholders are its tiles' rows in order.

The vision transformer and the connector are transformers' own modules; `encode_image` is
transformers' `Idefics3Model.get_image_features` for one image's tiles.
"""

from __future__ import annotations

import torch
from transformers.models.idefics3.modeling_idefics3 import Idefics3Connector, Idefics3VisionTransformer

from deepinfer_dp.models.vision_language import VisionLanguageModel, VisionParts


class Idefics3Vision(VisionParts):
    def __init__(self, config) -> None:
        super().__init__()
        self.vision_model = Idefics3VisionTransformer._from_config(config.vision_config)
        self.connector = Idefics3Connector(config)


class Idefics3ForConditionalGeneration(VisionLanguageModel):
    image_family = "idefics3"
    prefixes = (("model.text_model.", "text", "model."), ("lm_head.", "text", "lm_head."),
                ("model.vision_model.", "vision_model", ""), ("model.connector.", "connector", ""))

    def __init__(self, config) -> None:
        super().__init__(config, Idefics3Vision(config))
        self.patch_size = config.vision_config.patch_size

    @torch.inference_mode()
    def encode_image(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        weight = self.lm_head.weight
        pixels = inputs["pixel_values"].to(device=weight.device, dtype=weight.dtype)  # [tiles, 3, H, W]
        mask = inputs.get("pixel_attention_mask")
        mask = (torch.ones(pixels.shape[0], *pixels.shape[2:], dtype=torch.bool, device=pixels.device)
                if mask is None else mask.to(pixels.device))
        p = self.patch_size
        subgrid = mask.unfold(dimension=1, size=p, step=p).unfold(dimension=2, size=p, step=p)
        patch_mask = (subgrid.sum(dim=(-1, -2)) > 0).bool()
        states = self.vision.vision_model(pixel_values=pixels, patch_attention_mask=patch_mask,
                                          return_dict=True).last_hidden_state
        features = self.vision.connector(states)  # [tiles, image_seq_len, text hidden]
        return features.reshape(-1, features.shape[-1])
