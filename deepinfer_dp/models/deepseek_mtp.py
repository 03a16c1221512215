"""DeepSeek-V3's next-n (multi-token prediction, MTP) layer, for drafting.

A checkpoint stores it after the last decoder layer, as model.layers.<num_hidden_layers>.*:
enorm and hnorm (RMSNorms), eh_proj (Linear 2H -> H), one decoder block (MLA + DeepSeekMoE)
and shared_head.norm; the embedding and the output head are the main model's (a copy the
checkpoint may carry under the layer, shared_head.head / embed_tokens, is not read). For the
target's hidden state h_t at position t and the token x_{t+1}:

    out = block(eh_proj([enorm(embed(x_{t+1})), hnorm(h_t)]))   at position t
    logits = head(shared_head.norm(out))                          (predicts x_{t+2})

As vLLM does, the embedding at position 0 is zeroed. K > 1 drafts feed `out` back as the next
step's h. Under expert parallelism the block holds the target's share of its routed experts
(expert_shard) and dispatches through the target's dispatcher (bind_dispatcher), so its MoE
is a collective like every target MoE layer: every rank must run the same passes in the same
order, an idle rank on padding rows (attn_metadata.is_placeholder: not counted in the expert
load) -- spec_decode/mtp.py keeps that count.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from deepinfer_dp.layers.attention import AttentionMetadata, ForwardContext
from deepinfer_dp.layers.moe import expert_range
from deepinfer_dp.layers.norm import RMSNorm
from deepinfer_dp.layers.rotary import RotaryEmbedding, rope_parameters
from deepinfer_dp.models.deepseek import DeepseekDecoderLayer, interleaved_rope, rope_rows_to_rotate_half
from deepinfer_dp.models.llama import head_dim
from deepinfer_dp.models.weights import iterate_weights

_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = {"gate_proj": 0, "up_proj": 1}
_SHARED_WITH_MAIN = ("embed_tokens.weight", "shared_head.head.weight")


def check_mtp_config(config) -> None:
    if config.model_type != "deepseek_v3" or not getattr(config, "num_nextn_predict_layers", 0):
        raise ValueError("speculative_config method 'mtp' needs a DeepSeek-V3 model whose config has "
                         "num_nextn_predict_layers >= 1 (its checkpoint stores the next-n layer)")


class DeepseekMTP(nn.Module):
    def __init__(self, config, target: nn.Module, expert_shard: tuple[int, int] = (0, 1)) -> None:
        super().__init__()
        check_mtp_config(config)
        self.config = config
        self.layer_index = config.num_hidden_layers
        self.context = ForwardContext()
        hidden = config.hidden_size
        self.enorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        rotary = RotaryEmbedding(head_dim(config), config.max_position_embeddings, rope_parameters(config))
        self.block = DeepseekDecoderLayer(config, self.context, rotary, self.layer_index, expert_shard)
        self.shared_head_norm = RMSNorm(hidden, config.rms_norm_eps)
        # The target's embedding and head, shared (not loaded twice), not a submodule: read
        # where used, since the runner swaps the target's head for the CPU kernel's after loading.
        self._target = (target,)

    def bind_kv_cache(self, cache: torch.Tensor) -> None:
        self.block.self_attn.cache = cache

    @property
    def experts(self):
        """The block's routed experts (FusedMoE: this rank's range under EP); None if dense."""
        return getattr(self.block.mlp, "experts", None)

    @property
    def dispatcher(self):
        return None if self.experts is None else self.experts.dispatcher

    def bind_dispatcher(self, dispatcher, shard: tuple[int, int], source_dir: str | None) -> None:
        """Dispatches over the target's `dispatcher` (None: local experts); a group of another
        (rank, size) than the experts held -- re-formed after a rank died -- reloads them
        from the checkpoint in `source_dir` first."""
        experts = self.experts
        if experts is None:
            return
        if (experts.first_expert, experts.end_expert) != expert_range(*shard, experts.num_experts):
            if source_dir is None:
                raise RuntimeError("the MTP layer's experts need reloading for a new group, but the checkpoint "
                                   "directory is unknown")
            experts.reshard(shard)
            prefix = f"model.layers.{self.layer_index}.mlp.experts."
            wanted = iterate_weights(Path(source_dir), lambda n: n.startswith(prefix) and self.wants_weight(n))
            self.load_weights(wanted, experts_only=True)
        experts.dispatcher = dispatcher

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                previous_hidden: torch.Tensor) -> torch.Tensor:
        """The block's output [T, H] (before shared_head.norm): the next step's h."""
        if self.experts is not None:  # padding rows do not count in the expert load
            self.block.mlp.counted = not attn_metadata.is_placeholder
        if self.dispatcher is not None:
            self.dispatcher.begin_step(input_ids.shape[0])
        embeds = self._target[0].model.embed_tokens(input_ids)
        embeds = torch.where(positions[:, None] == 0, torch.zeros_like(embeds), embeds)
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(previous_hidden)], dim=-1))
        self.context.attn_metadata = attn_metadata
        try:
            mlp_out, residual = self.block(positions, x)
            return residual + mlp_out
        finally:
            self.context.attn_metadata = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._target[0].lm_head(self.shared_head_norm(hidden)).float()

    # ---- loading -----------------------------------------------------------------------
    def wants_weight(self, name: str) -> bool:
        """False for another EP rank's routed experts of the layer: the loader never reads them."""
        expert = _EXPERT.match(name[len(f"model.layers.{self.layer_index}."):])
        moe = self.experts
        return expert is None or moe is None or moe.first_expert <= int(expert.group(1)) < moe.end_expert

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], experts_only: bool = False) -> None:
        """Reads model.layers.<num_hidden_layers>.* from the checkpoint's (name, tensor) pairs
        (only this rank's routed experts; `experts_only`: nothing else); raises ValueError
        naming what is missing."""
        prefix = f"model.layers.{self.layer_index}."
        loaded: set[str] = set()  # our parameter names, "#piece" for parts of fused ones
        for name, tensor in weights:
            if name.startswith(prefix) and name[len(prefix):] not in _SHARED_WITH_MAIN:
                self._load(name, name[len(prefix):], tensor, loaded)
        expected = self._expected_pieces()
        if experts_only:
            expected = {p for p in expected if ".experts." in p}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"speculative_config method 'mtp': the checkpoint's next-n layer ({prefix}*) is "
                             f"missing {', '.join(missing[:6])}" + (" and more" if len(missing) > 6 else ""))

    def _expected_pieces(self) -> set[str]:
        pieces = set()
        for name, _ in self.named_parameters():
            if name.endswith("gate_up_proj.weight"):
                pieces |= {f"{name}#gate_proj", f"{name}#up_proj"}
            elif name.endswith(("experts.w13", "experts.w2")):
                projs = ("gate_proj", "up_proj") if name.endswith("w13") else ("down_proj",)
                moe = self.experts
                pieces |= {f"{name}#{e}.{p}" for e in range(moe.first_expert, moe.end_expert) for p in projs}
            else:
                pieces.add(name)
        return pieces

    def _load(self, full: str, name: str, tensor: torch.Tensor, loaded: set[str]) -> None:
        params = dict(self.named_parameters())
        expert = _EXPERT.match(name)
        fused = next((p for p in _FUSED if f".{p}." in f".{name}"), None)
        if expert:
            moe, (e, proj) = self.block.mlp.experts, (int(expert.group(1)), expert.group(2))
            if not 0 <= e < moe.num_experts:
                raise ValueError(f"checkpoint weight {full!r}: expert {e} outside the layer's {moe.num_experts}")
            if not moe.first_expert <= e < moe.end_expert:
                return  # another EP rank's expert
            inter, local = moe.intermediate_size, e - moe.first_expert
            dst = moe.w2[local] if proj == "down_proj" else moe.w13[local].narrow(0, _FUSED[proj] * inter, inter)
            piece = f"block.mlp.experts.{'w2' if proj == 'down_proj' else 'w13'}#{e}.{proj}"
        else:
            target = name.replace(fused, "gate_up_proj") if fused else name
            target = {"shared_head.norm.weight": "shared_head_norm.weight"}.get(target, target)
            if target.split(".")[0] not in ("enorm", "hnorm", "eh_proj", "shared_head_norm"):
                target = "block." + target
            if target not in params:
                raise ValueError(f"checkpoint weight {full!r} has no place in the MTP layer")
            dst, piece = params[target], target
            if fused:
                half = dst.shape[0] // 2
                dst, piece = dst.narrow(0, _FUSED[fused] * half, half), f"{target}#{fused}"
            elif ".self_attn." in f".{name}" and interleaved_rope(self.config):
                tensor = rope_rows_to_rotate_half(self.config, full, tensor)
        if dst.shape != tensor.shape:
            raise ValueError(f"checkpoint weight {full!r} has shape {tuple(tensor.shape)}, "
                             f"the MTP layer expects {tuple(dst.shape)}")
        with torch.no_grad():
            dst.copy_(tensor)
        loaded.add(piece)


def attach_mtp_layer(target: nn.Module) -> DeepseekMTP:
    """The next-n layer of `target` (a loaded DeepSeek-V3; the registry's hook for
    load_model(mtp=True)) on the target's device and dtype, sharing its embedding and head,
    read from its checkpoint and attached as target.nextn, so that the target's
    bind_ep_group hands it the EP dispatcher."""
    config = target.config
    check_mtp_config(config)
    prefix = f"model.layers.{config.num_hidden_layers}."
    param = next(target.parameters())
    with torch.device("meta"):  # under EP, with the target's share of the layer's routed experts
        mtp = DeepseekMTP(config, target, target.expert_shard[:2])  # no load balancing: its experts stay
    mtp.to_empty(device=param.device)
    mtp = mtp.to(param.dtype)
    mtp.load_weights(iterate_weights(Path(target.source_dir),
                                     lambda name: name.startswith(prefix) and mtp.wants_weight(name)))
    mtp = mtp.eval().requires_grad_(False)
    target.nextn = (mtp,)
    return mtp
