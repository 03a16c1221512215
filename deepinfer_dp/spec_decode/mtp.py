"""The MTP proposer: DeepSeek-V3's next-n layer (models/deepseek_mtp.py) drafts K tokens per
candidate from the target's last hidden state and the sampled token, K > 1 reusing the layer
on its own output.

It is the draft-model proposer (spec_decode/draft_model.py) with the MTP layer as the draft:
the same scratch blocks, the same drafting loop on the device thread, the same draft
sampling. The MTP layer's latent cache is one more layer laid out on the target's block ids,
so the C++ block bookkeeping (rollback, preemption, prefix caching) serves it too.

Unlike the draft model, it cannot catch up on passes it did not see (the target's hidden
states are gone), so it sees every target pass, speculative or not (observes_every_pass; the
placeholder's only to run its padding under EP, below); it has no catch-up pass and
nothing to track per step.

Its cache entry at position t is MTP(h_t, x_{t+1}). Every target pass (`observe_target`)
writes the entries of its rows whose next token it fed (within each sequence); the first
drafting step of a sequence of length L writes position L - 2 (h_{L-2} and the newest token,
x_{L-1}) -- the entry the pass could not, its next token not being sampled yet. Entries a
pass wrote from a draft that was then rejected sit at L - 2 and are rewritten the same way.
Two kinds stay stale: the last position of a prefill chunk and of a prefix-cache hit, written
with another next token. They only cost acceptance, never correctness: every draft is
verified by the target.

Under expert parallelism the MTP layer's MoE is a collective over the DP ranks (each holds
its share of the layer's routed experts), so every rank runs the same MTP passes per step,
whether it drafts or not: K drafting passes before the schedule (padding rows for the rows it
lacks: a rank with no candidates, in the auto-off, or drafting fewer than K tokens) and one
pass over the target's forward, the placeholder step's 1 + K padding tokens included. Padding
rows sit in the reserved block 0, are not counted in the expert load, and are counted in
`padding_passes`.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
import torch

from deepinfer_dp.layers.attention import AttentionMetadata
from deepinfer_dp.layers.linear import replace_linears
from deepinfer_dp.layers.mla import allocate_mla_cache
from deepinfer_dp.models.deepseek_mtp import DeepseekMTP
from deepinfer_dp.spec_decode.draft_model import DraftModelProposer, _DraftSampler
from deepinfer_dp.spec_decode.proposer import ProposerContext, TargetStep

RECENT_STEPS = 4  # target passes whose hidden states are kept for finding h_{L-2}


class MTPProposer(DraftModelProposer):
    observes_every_pass = True  # the target's hidden states cannot be recomputed: it sees every pass
    drafts_every_step = True  # under EP every rank makes the same MTP passes (collectives)

    def __init__(self, mtp: DeepseekMTP, ctx: ProposerContext) -> None:
        """`mtp`: the next-n layer the loader attached to the target (models/deepseek_mtp.py)."""
        self.model = mtp
        self.block_size = ctx.block_size
        self.scratch_start = ctx.num_blocks
        self.requests = ctx.requests
        self.run_on_device = ctx.run_on_device
        self.thread_plan = ctx.thread_plan
        param = next(mtp.parameters())
        self.device, dtype = param.device, param.dtype
        if self.device.type == "cpu" and dtype == torch.float32 and ctx.cpu_linear_kernel:
            replace_linears(mtp)
        config = mtp.config
        one_layer = type("OneLayer", (), {"num_hidden_layers": 1, "kv_lora_rank": config.kv_lora_rank,
                                          "qk_rope_head_dim": config.qk_rope_head_dim})
        self.cache = allocate_mla_cache(one_layer, ctx.num_blocks + ctx.max_num_seqs, ctx.block_size, dtype,
                                        self.device)[0]
        mtp.bind_kv_cache(self.cache)
        self._probs: dict[str, torch.Tensor] = {}
        self._drafts: list[tuple[Any, list[int]]] = []  # the latest propose()'s, until taken
        # (slot_mapping, hidden_states) of the latest target passes, newest first
        self._recent: deque[tuple[torch.Tensor, torch.Tensor]] = deque(maxlen=RECENT_STEPS)
        self.forward_time_s = 0.0
        self.num_passes = 0  # drafting passes each step must make (K under EP: collectives); 0 alone
        self.padding_passes = 0  # MTP passes on padding rows only (under EP)

    # ---- the target's passes ---------------------------------------------------------------
    @torch.inference_mode()
    def observe_target(self, step: TargetStep) -> None:
        md = step.attn_metadata
        if md.is_placeholder:  # the next-n padding: only there to match the peers' collectives
            if self.model.dispatcher is not None:
                self.model(step.input_ids, step.positions, md, step.hidden_states)
                self.padding_passes += 1
            return
        ids = step.input_ids
        last = md.query_start_loc[1:].long() - 1  # each sequence's last row: next token not sampled yet
        nxt = torch.roll(ids, -1)
        nxt[last] = ids[last]  # a stand-in; the first drafting step rewrites that entry
        self.model(nxt, step.positions, md, step.hidden_states)
        self._recent.appendleft((md.slot_mapping, step.hidden_states))

    def _hidden_at(self, slots: torch.Tensor) -> torch.Tensor:
        """The target's hidden state at each slot, from the newest pass that wrote it (zeros
        if none kept has: those drafts are just poor)."""
        dtype = next(self.model.parameters()).dtype
        out = torch.zeros(slots.shape[0], self.model.config.hidden_size, dtype=dtype, device=self.device)
        found = torch.zeros(slots.shape[0], dtype=torch.bool, device=self.device)
        for slot_mapping, hidden in self._recent:
            match = slots[:, None] == slot_mapping[None, :]
            hit = match.any(dim=1) & ~found
            if hit.any():
                out[hit] = hidden[match[hit].float().argmax(dim=1)].to(out.dtype)
                found |= hit
        return out

    def stats(self) -> dict[str, Any]:
        """For the rank's stats: MTP passes on padding only, the layer's routed experts this
        rank holds ([first, end); a share under EP) and their load (real tokens' slots, by
        expert, whichever rank sent them)."""
        moe = self.model.experts
        if moe is None:
            return {"mtp_padding_passes": self.padding_passes, "mtp_local_experts": [0, 0], "mtp_expert_tokens": []}
        return {"mtp_padding_passes": self.padding_passes, "mtp_local_experts": [moe.first_expert, moe.end_expert],
                "mtp_expert_tokens": moe.expert_tokens.tolist()}

    def after_target(self, sched_out: Any, observed: bool) -> None:
        """Nothing to track: the MTP layer sees every pass (observes_every_pass)."""

    def _missing(self, seqs: list) -> list:
        return []  # no catch-up passes: the target's hidden states cannot be recomputed here

    # ---- between steps: draft ------------------------------------------------------------
    def propose(self, scheduler: Any, k: int) -> int:
        self.num_passes = k if self.model.dispatcher is not None else 0
        drafted = super().propose(scheduler, k)
        if not drafted:
            self.draft_padding(k)
        return drafted

    def draft_padding(self, k: int) -> None:
        """A step this rank drafts nothing in: under EP, its k drafting passes on padding rows,
        which its peers' drafting collectives wait on; alone, nothing."""
        if self.model.dispatcher is not None:
            self.run_on_device(self._padding_passes, k)

    @torch.inference_mode()
    def _padding_passes(self, k: int) -> None:
        md = AttentionMetadata(
            is_prefill=False, slot_mapping=torch.zeros(1, dtype=torch.int64, device=self.device),
            block_tables=torch.zeros((1, 1), dtype=torch.int32, device=self.device),
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=self.device),
            seq_lens=torch.ones(1, dtype=torch.int32, device=self.device), query_lens_host=[1], seq_lens_host=[1],
            max_query_len=1, max_seq_len=1, is_placeholder=True)
        zeros = torch.zeros(1, dtype=torch.int64, device=self.device)
        hidden = torch.zeros(1, self.model.config.hidden_size, dtype=self.cache.dtype, device=self.device)
        for _ in range(k):
            self.model(zeros, zeros, md, hidden)
            self.padding_passes += 1

    @torch.inference_mode()
    def _draft(self, lens: list[int], lasts: list[int], tables: list[list[int]], k: int, states: list[Any],
               missing: list | None = None) -> tuple[np.ndarray, list[torch.Tensor | None] | None]:
        n, bs = len(lens), self.block_size
        table = np.zeros((n, max(len(t) for t in tables) + 1), dtype=np.int32)
        for i, t in enumerate(tables):
            table[i, : len(t)] = t
            table[i, len(t)] = self.scratch_start + i
        pos = np.asarray(lens, dtype=np.int64) - 2  # h_{L-2} with the newest token x_{L-1}
        block_tables = torch.from_numpy(table).to(self.device)
        first_slots = table[np.arange(n), pos // bs].astype(np.int64) * bs + pos % bs
        hidden = self._hidden_at(torch.from_numpy(first_slots).to(self.device))
        sampler = _DraftSampler(states, self.device)
        tokens = torch.tensor(lasts, dtype=torch.int64, device=self.device)
        out, probs = [], []
        for _ in range(k):
            hidden = self._mtp_step(tokens, hidden, pos, table, block_tables)
            tokens, q = sampler.choose(self.model.compute_logits(hidden))
            out.append(tokens)
            probs.append(q)
            pos = pos + 1
        if self.num_passes > k:  # under EP every rank makes num_passes: the rest on padding
            self._padding_passes(self.num_passes - k)
        return torch.stack(out, dim=1).cpu().numpy(), sampler.per_row(probs, n)

    def _mtp_step(self, tokens: torch.Tensor, hidden: torch.Tensor, pos: np.ndarray, table: np.ndarray,
                  block_tables: torch.Tensor) -> torch.Tensor:
        n, bs = len(pos), self.block_size
        slots = table[np.arange(n), pos // bs].astype(np.int64) * bs + pos % bs
        seq_lens = (pos + 1).astype(np.int32)
        md = AttentionMetadata(
            is_prefill=False, slot_mapping=torch.from_numpy(slots).to(self.device), block_tables=block_tables,
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=self.device),
            seq_lens=torch.from_numpy(seq_lens).to(self.device), query_lens_host=[1] * n,
            seq_lens_host=seq_lens.tolist(), max_query_len=1, max_seq_len=int(seq_lens.max()))
        return self.model(tokens, torch.from_numpy(pos.copy()).to(self.device), md, hidden)
