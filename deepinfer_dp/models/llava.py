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

from typing import ClassVar

import torch
from torch import nn
from transformers import AutoModel
from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

from deepinfer_dp.models.llama import LlamaForCausalLM

# checkpoint prefix -> (our module, its prefix there); longest prefixes first
_PREFIXES = (("model.language_model.", "text", "model."), ("language_model.model.", "text", "model."),
             ("language_model.lm_head.", "text", "lm_head."), ("lm_head.", "text", "lm_head."),
             ("model.vision_tower.", "vision", ""), ("vision_tower.", "vision", ""),
             ("model.multi_modal_projector.", "projector", ""), ("multi_modal_projector.", "projector", ""))


class VisionParts(nn.Module):
    """The vision tower and projector; they keep torch's own Linear (replace_linears skips
    them), so the image embeddings are the ones transformers computes."""

    keep_torch_linears: ClassVar[bool] = True

    def __init__(self, config) -> None:
        super().__init__()
        self.vision_tower = AutoModel.from_config(config.vision_config)
        self.multi_modal_projector = LlavaMultiModalProjector(config)


class LlavaForConditionalGeneration(LlamaForCausalLM):
    packable: ClassVar[bool] = False  # the vision weights stay in torch modules
    image_family: ClassVar[str] = "llava"

    def __init__(self, config) -> None:
        super().__init__(config.text_config)
        self.mm_config = config
        self.image_token_id = config.image_token_id
        self.vision = VisionParts(config)
        self.feature_layer = config.vision_feature_layer
        self.select_strategy = config.vision_feature_select_strategy

    @torch.inference_mode()
    def encode_image(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's embeddings [placeholder tokens, text hidden]."""
        tower = self.vision.vision_tower
        pixels = inputs["pixel_values"].to(device=self.lm_head.weight.device, dtype=self.lm_head.weight.dtype)
        out = tower(pixels, output_hidden_states=True, return_dict=True)
        layers = [self.feature_layer] if isinstance(self.feature_layer, int) else list(self.feature_layer)
        states = [out.hidden_states[i] for i in layers]
        if self.select_strategy == "default":  # drop the CLS token
            states = [s[:, 1:] for s in states]
        return self.vision.multi_modal_projector(torch.cat(states, dim=-1))[0]

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def load_weights(self, weights, loaded_elsewhere=()) -> None:
        text_params = dict(self.named_parameters())
        vision_params = dict(self.vision.vision_tower.named_parameters())
        projector_params = dict(self.vision.multi_modal_projector.named_parameters())
        loaded: set[str] = set(loaded_elsewhere)
        seen_vision: set[str] = set()
        for name, tensor in weights:
            where, ours = _route(name)
            if where == "text":
                self.load_weight(ours, tensor, text_params, loaded)
                continue
            params = vision_params if where == "vision" else projector_params
            if ours not in params:
                if "position_ids" in ours:
                    continue  # a buffer some checkpoints store; rebuilt below
                raise ValueError(f"checkpoint weight {name!r} has no place in {type(self).__name__}")
            _copy(name, params[ours], tensor)
            seen_vision.add(f"{where}.{ours}")
        missing = [f"vision.{n}" for n in vision_params if f"vision.{n}" not in seen_vision]
        missing += [f"projector.{n}" for n in projector_params if f"projector.{n}" not in seen_vision]
        if missing:
            raise ValueError(f"checkpoint is missing vision weights: {', '.join(sorted(missing)[:8])}")
        text_only = {n: p for n, p in text_params.items() if not n.startswith("vision.")}
        self._check_complete(text_only, loaded)
        _reset_position_ids(self.vision)


def _route(name: str) -> tuple[str, str]:
    for prefix, where, ours in _PREFIXES:
        if name.startswith(prefix):
            return where, ours + name[len(prefix):]
    return "text", name


def _copy(name: str, param: nn.Parameter, tensor: torch.Tensor) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"checkpoint weight {name!r} has shape {tuple(tensor.shape)}, the model expects "
                         f"{tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor)


def _reset_position_ids(module: nn.Module) -> None:
    """The vision embeddings' `position_ids` buffer is not in checkpoints and the loader builds
    the model on the meta device: fill it as its module's constructor does."""
    for sub in module.modules():
        buf = getattr(sub, "position_ids", None)
        if isinstance(buf, torch.Tensor):
            with torch.no_grad():
                buf.copy_(torch.arange(buf.shape[-1], device=buf.device).expand_as(buf))
