"""Mixture-of-experts decoders on the paged KV cache: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE.

Attention, norms and RoPE are the Llama family's (llama.py: attention_layout covers Qwen2's
q/k/v bias, Qwen3's per-head and OLMoE's whole-vector q/k norm, OLMoE's clip_qkv). The
feed-forward block of a sparse layer is a SparseMoeBlock: the router (`gate`), the routed
experts (layers/moe.py) and, in Qwen2-MoE, a shared expert scaled by sigmoid(shared_expert_gate).
Qwen-MoE's mlp_only_layers / decoder_sparse_step keep some layers dense.

Checkpoints load unchanged: Mixtral's block_sparse_moe.experts.E.w1/w3/w2 and the others'
mlp.experts.E.gate_proj/up_proj/down_proj are copied into each layer's fused w13/w2. Under
expert parallelism a rank is built with `expert_shard=(rank, size)`: it allocates and loads
only its range of routed experts (everything else is replicated), and bind_ep_group() later
gives its MoE layers the dispatcher over the DP group -- and, when the group it joins has
another size (a scale change, a re-formed group after a rank died), gives each rank its new
share: moved over the group from the members that hold it, read from the checkpoint only
where none does (models/expert_regroup.py).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from torch import nn

from deepinfer_dp.layers.attention import AttentionMetadata
from deepinfer_dp.layers.expert_map import fit_redundant
from deepinfer_dp.layers.moe import FusedMoE, select_experts
from deepinfer_dp.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel

logger = logging.getLogger(__name__)
# <prefix>.experts.<e>.<projection>.weight, in either family's names
_EXPERT_NAME = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_PIECE = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1, "w2": 2, "down_proj": 2}  # gate, up, down


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int
    top_k: int
    intermediate_size: int  # of one routed expert
    renormalize: bool  # divide the top-k weights by their sum
    shared_intermediate_size: int  # 0: no shared expert


def moe_spec(config) -> MoeSpec:
    if config.model_type in ("deepseek_v2", "deepseek_v3"):  # models/deepseek.py routes them itself
        shared = config.moe_intermediate_size * config.n_shared_experts
        return MoeSpec(config.n_routed_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                       bool(config.norm_topk_prob), shared)
    if config.model_type == "mixtral":
        return MoeSpec(config.num_local_experts, config.num_experts_per_tok, config.intermediate_size, True, 0)
    intermediate = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    shared = getattr(config, "shared_expert_intermediate_size", 0) if config.model_type == "qwen2_moe" else 0
    return MoeSpec(config.num_experts, config.num_experts_per_tok, intermediate,
                   bool(getattr(config, "norm_topk_prob", False)), shared or 0)


def is_sparse_layer(config, layer_index: int) -> bool:
    if config.model_type not in ("qwen2_moe", "qwen3_moe"):
        return True
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (layer_index not in (getattr(config, "mlp_only_layers", None) or [])
            and moe_spec(config).num_experts > 0 and (layer_index + 1) % step == 0)


class SparseMoeBlock(nn.Module):
    def __init__(self, config, layer_index: int, shard: tuple[int, ...]) -> None:
        super().__init__()
        spec = moe_spec(config)
        self.top_k, self.renormalize = spec.top_k, spec.renormalize
        self.gate = nn.Linear(config.hidden_size, spec.num_experts, bias=False)
        self.experts = FusedMoE(spec.num_experts, spec.top_k, config.hidden_size, spec.intermediate_size,
                                layer_index, shard)
        self.shared_expert = None
        if spec.shared_intermediate_size:
            self.shared_expert = LlamaMLP(config, spec.shared_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        self.counted = True  # set per step by the model: False for the placeholder's dummy token

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = select_experts(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, ids, weights, self.counted)
        if self.shared_expert is not None:  # Qwen2-MoE: routed + sigmoid(gate) * shared, in that order
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class MoeDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config, context, rotary_emb, layer_index: int, shard: tuple[int, ...]) -> None:
        self.shard = shard  # read by make_mlp, which the parent constructor calls
        super().__init__(config, context, rotary_emb, layer_index)

    def make_mlp(self, config, layer_index: int) -> nn.Module:
        if is_sparse_layer(config, layer_index):
            return SparseMoeBlock(config, layer_index, self.shard)
        return LlamaMLP(config)


class MoeForCausalLM(LlamaForCausalLM):
    mixture_of_experts = True

    def __init__(self, config, expert_shard: tuple[int, ...] = (0, 1)) -> None:
        self.expert_shard = expert_shard
        super().__init__(config)
        self.spec = moe_spec(config)
        # the feed-forward blocks with routed experts (SparseMoeBlock, DeepSeek's DeepseekMoE)
        self.moe_blocks = [layer.mlp for layer in self.model.layers
                           if isinstance(getattr(layer.mlp, "experts", None), FusedMoE)]
        self._bind_expert_tokens()
        self.balancer = None  # eplb.rebalancer.Rebalancer, under expert-parallel load balancing
        self.source_dir: str | None = None  # the checkpoint, for experts no member holds (set by the loader)
        self._past_collective_s = 0.0  # of dispatchers replaced by a re-formed group's
        self.regroups: list[dict] = []  # what each change of the EP group cost this rank (the last few)

    def make_model(self, config) -> nn.Module:
        return LlamaModel(config, self.context, partial(MoeDecoderLayer, shard=self.expert_shard))

    def _bind_expert_tokens(self) -> None:
        """Token-slots per (MoE layer, physical slot) this rank's slots computed: its load."""
        slots = self.moe_blocks[0].experts.num_slots if self.moe_blocks else self.spec.num_experts
        self.expert_tokens = np.zeros((len(self.moe_blocks), slots), dtype=np.int64)
        for row, block in zip(self.expert_tokens, self.moe_blocks, strict=True):
            block.experts.expert_tokens = row

    @property
    def moe_layer_indices(self) -> list[int]:
        return [block.experts.layer_index for block in self.moe_blocks]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        counted = not attn_metadata.is_placeholder
        for block in self.moe_blocks:
            block.counted = counted
        if self.balancer is not None:  # before the dispatcher: a rebalance may switch maps now
            self.balancer.begin_step()
        if self.dispatcher is not None:
            self.dispatcher.begin_step(input_ids.shape[0])
        return super().forward(input_ids, positions, attn_metadata)

    # ---- expert parallelism -----------------------------------------------------------------
    def bind_ep_group(self, ep, backend: str, eplb=None) -> None:
        """Makes the MoE layers dispatch over `ep` (an EPGroup; None or one rank: local
        experts only). If the group's (rank, size) is not the shard this model holds -- a
        group re-formed after a scale change or a lost rank -- the routed experts move for it
        first (in the initial placement under load balancing; models/expert_regroup.py).
        `eplb` (an EPLBConfig): balance the experts' load over the group from now on. A
        collective call when the group has peers."""
        from deepinfer_dp.distributed.moe_dispatch import make_dispatcher
        from deepinfer_dp.eplb.rebalancer import Rebalancer
        from deepinfer_dp.models.expert_regroup import regroup_experts

        shard = (ep.rank, ep.size) if ep is not None else (0, 1)
        if len(self.expert_shard) == 3:  # a group of another size may need another redundant count
            wanted = eplb.num_redundant_experts if eplb is not None else self.expert_shard[2]
            shard = (*shard, fit_redundant(self.spec.num_experts, wanted, shard[1]))
            if shard[2] != wanted:
                logger.warning("expert load balancing over %d ranks: %d redundant expert slots instead of %d "
                               "(the slots must divide evenly over the ranks)", shard[1], shard[2], wanted)
        dispatcher = make_dispatcher(backend, ep, self.spec.num_experts) if ep is not None and ep.size > 1 else None
        # every rank of a new group starts from the initial placement of its shard
        moved = any(b.experts.expert_map is not None and not b.experts.expert_map.is_initial() for b in self.moe_blocks)
        if dispatcher is not None or shard != self.expert_shard or moved:
            stats = regroup_experts(self, ep if dispatcher is not None else None, shard, dispatcher)
            if stats.kept + stats.received + stats.loaded:
                logger.warning("experts for EP rank %d of %d: %s", shard[0], shard[1], stats.as_dict())
                self.regroups = (self.regroups + [{"shard": list(shard), **stats.as_dict()}])[-8:]
        if self.dispatcher is not None:  # the time stays a counter across re-formed groups
            self._past_collective_s += self.dispatcher.collective_s
        for block in self.moe_blocks:
            block.experts.dispatcher = dispatcher
        past = self.balancer
        self.balancer = None
        if eplb is not None and dispatcher is not None:
            self.balancer = Rebalancer(eplb, [b.experts for b in self.moe_blocks], ep, past)

    @property
    def dispatcher(self):
        return self.moe_blocks[0].experts.dispatcher if self.moe_blocks else None

    def moe_stats(self, device_busy_s: float) -> dict:
        """What EP users watch, for the rank's stats. `moe_expert_tokens[i][p]`: token-slots of
        real tokens (not the placeholder's) physical slot p of MoE layer moe_layers[i] computed
        on this rank -- under EP only its own slots, whichever rank sent the tokens (without
        load balancing a slot is its expert)."""
        dispatcher, experts = self.dispatcher, self.moe_blocks[0].experts if self.moe_blocks else None
        collective_s = self._past_collective_s + (dispatcher.collective_s if dispatcher is not None else 0.0)
        return {"moe_layers": self.moe_layer_indices, "moe_expert_tokens": self.expert_tokens.tolist(),
                "moe_local_experts": [experts.first_expert, experts.end_expert] if experts else [0, 0],
                "moe_dispatcher": dispatcher.name if dispatcher is not None else "local",
                "moe_collective_s": collective_s,
                # collective calls of the current group's dispatcher (equal on every rank)
                "moe_collectives": dispatcher.num_collectives if dispatcher is not None else 0,
                "moe_expert_bytes": sum(b.experts.w13.nbytes + b.experts.w2.nbytes for b in self.moe_blocks),
                # CPU: a share of the compute thread's busy time (the collectives run on it)
                "moe_collective_share": collective_s / device_busy_s if device_busy_s > 0 else 0.0,
                "moe_regroups": self.regroups,
                **(self.balancer.stats() if self.balancer is not None else {})}

    def after_reshard(self) -> None:
        """The MoE layers hold another shard (models/expert_regroup.py resharded them)."""
        if self.moe_blocks and self.expert_tokens.shape[1] != self.moe_blocks[0].experts.num_slots:
            self._bind_expert_tokens()  # another slot count: the counters start again

    # ---- loading -----------------------------------------------------------------------
    def wants_weight(self, name: str) -> bool:
        """False for another EP rank's routed experts: the loader then never reads them."""
        match = _EXPERT_NAME.match(name.replace(".block_sparse_moe.", ".mlp."))
        if match is None or not self.moe_blocks:
            return True
        expert, experts = int(match.group(2)), self._experts_of(match.group(1))
        return experts is None or expert >= experts.num_experts or expert in experts.local_logical()

    def _experts_of(self, prefix: str) -> FusedMoE | None:
        """The routed experts of the block at `prefix` (model.layers.N.mlp), if it has any."""
        try:
            return getattr(self.get_submodule(prefix), "experts", None)
        except AttributeError:  # a layer this model does not build (DeepSeek's next-n layer)
            return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        experts: set[tuple[str, int, int]] = set()
        for name, tensor in weights:
            name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's name for the block
            match = _EXPERT_NAME.match(name)
            if match:
                self.load_expert(name, match, tensor, experts)
            else:
                self.load_weight(name, tensor, params, loaded)
        expert_params = {n for n in params if n.endswith((".experts.w13", ".experts.w2"))}
        self._check_experts(experts)
        self._check_complete({n: p for n, p in params.items() if n not in expert_params}, loaded)

    def load_expert(self, name: str, match: re.Match, tensor: torch.Tensor,
                     done: set[tuple[str, int, int]]) -> None:
        prefix, expert, piece = match.group(1), int(match.group(2)), _PIECE[match.group(3)]
        moe = self.get_submodule(prefix).experts
        if not 0 <= expert < moe.num_experts:
            raise ValueError(f"checkpoint weight {name!r}: expert {expert} outside the model's {moe.num_experts}")
        inter = moe.intermediate_size
        for local, held in enumerate(moe.local_logical()):  # every slot holding it (none: another rank's)
            if held != expert:
                continue
            dst = moe.w2[local] if piece == 2 else moe.w13[local].narrow(0, piece * inter, inter)
            if dst.shape != tensor.shape:
                raise ValueError(f"checkpoint weight {name!r} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(dst.shape)}")
            with torch.no_grad():
                dst.copy_(tensor)
            done.add((prefix, expert, piece))

    def _check_experts(self, done: set[tuple[str, int, int]]) -> None:
        missing = []
        for layer, block in zip(self.moe_layer_indices, self.moe_blocks, strict=True):
            moe = block.experts
            for e in sorted(set(moe.local_logical())):
                missing += [f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
                            for piece, proj in enumerate(("gate_proj", "up_proj", "down_proj"))
                            if (f"model.layers.{layer}.mlp", e, piece) not in done]
        if missing:
            raise ValueError(f"checkpoint is missing expert weights: {', '.join(missing[:8])}"
                             + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
