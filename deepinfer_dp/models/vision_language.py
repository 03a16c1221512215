"""What the vision-language families share: a Llama-family text model on our paged KV cache
(the class itself) plus vision modules that are transformers' own (`VisionParts`), loaded
from the checkpoint's own tensor names through a family's prefix table."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from deepinfer_dp.models.llama import LlamaForCausalLM


class VisionParts(nn.Module):
    """A family's vision modules. They keep torch's own Linear (replace_linears skips them),
    so the image embeddings are the ones transformers computes."""

    keep_torch_linears: ClassVar[bool] = True


class VisionLanguageModel(LlamaForCausalLM):
    packable: ClassVar[bool] = False  # the vision weights stay in torch modules
    image_family: ClassVar[str]
    # checkpoint prefix -> ("text", our prefix) or (a VisionParts attribute, ""); longest first
    prefixes: ClassVar[tuple[tuple[str, str, str], ...]]

    def __init__(self, config, vision: VisionParts) -> None:
        super().__init__(config.text_config)
        self.mm_config = config
        self.image_token_id = config.image_token_id
        self.vision = vision

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def encode_image(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's embeddings [placeholder tokens, text hidden]."""
        raise NotImplementedError

    def load_weights(self, weights, loaded_elsewhere=()) -> None:
        text_params = dict(self.named_parameters())
        parts = {name: dict(module.named_parameters()) for name, module in self.vision.named_children()}
        loaded: set[str] = set(loaded_elsewhere)
        seen: set[str] = set()
        for name, tensor in weights:
            where, ours = self._route(name)
            if where == "text":
                self.load_weight(ours, tensor, text_params, loaded)
                continue
            if ours not in parts[where]:
                if "position_ids" in ours:
                    continue  # a buffer some checkpoints store; rebuilt below
                raise ValueError(f"checkpoint weight {name!r} has no place in {type(self).__name__}")
            _copy(name, parts[where][ours], tensor)
            seen.add(f"{where}.{ours}")
        missing = [f"{where}.{n}" for where, params in parts.items() for n in params if f"{where}.{n}" not in seen]
        if missing:
            raise ValueError(f"checkpoint is missing vision weights: {', '.join(sorted(missing)[:8])}")
        self._check_complete({n: p for n, p in text_params.items() if not n.startswith("vision.")}, loaded)
        _reset_position_ids(self.vision)

    def _route(self, name: str) -> tuple[str, str]:
        for prefix, where, ours in self.prefixes:
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
