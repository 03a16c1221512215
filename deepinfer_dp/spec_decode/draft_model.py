"""The draft-model proposer: a smaller model of the same tokenizer drafts K tokens per
candidate sequence, one forward per draft position, between two target steps, in the
target's worker (on its device thread).

Its KV cache is its own tensors (its layers, heads and head size) laid out block for block
like the target's: draft K/V of token t sits in the target's block block_table[t //
block_size], in the draft's tensors. So the C++ scheduler's block bookkeeping serves both
caches and nothing is mirrored or kept in sync by hand: allocation, the rollback of rejected
slots, freeing, preemption (recompute) and prefix-cache sharing all act on both at once. To
fill it, the draft runs over every speculative target pass (`observe_target`: same tokens,
positions, slots), so there the draft gets K/V of the same tokens as the target. Accepted
drafts thus get their draft K/V from the verification pass; rejected ones are rolled back
with the target's slots and overwritten later.

Steps with speculation off (the auto-off above disable_by_batch_size, ZOS-deferred) skip the
draft, so a large batch pays nothing for it. Per sequence the proposer keeps how many leading
positions hold valid draft K/V (`_valid`, from each step's positions in `after_target`); a
candidate with fewer than its computed length first gets a catch-up pass of the draft over
the missing tokens. A prefix-cache hit counts as missing (the draft may not have seen the
pass that filled those blocks), and so does everything after a preemption.

Drafting writes the K/V of positions the scheduler has not given slots yet (the drafts
themselves): where the sequence's last block has room they go there (it is the sequence's
own, and the next target pass rewrites those positions), past it into one scratch block
per candidate after the target's blocks. Stale or scratch K/V can only make drafts worse,
never outputs wrong: every draft is verified by the target.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers import AutoTokenizer

from deepinfer_dp import _C
from deepinfer_dp.layers.attention import AttentionMetadata
from deepinfer_dp.layers.linear import replace_linears
from deepinfer_dp.layers.rejection_sampler import draft_distribution, exponential_race
from deepinfer_dp.models import LoadedModel, allocate_kv_cache, load_model
from deepinfer_dp.spec_decode.proposer import DraftTarget, ProposerContext, TargetStep


class DraftModelProposer:
    observes_every_pass = False  # speculative passes only: it catches up on the others itself
    drafts_every_step = False

    def __init__(self, loaded: LoadedModel, ctx: ProposerContext) -> None:
        self.model = loaded.model
        self.block_size = ctx.block_size
        self.scratch_start = ctx.num_blocks  # blocks num_blocks.. are the drafting scratch blocks
        self.requests = ctx.requests
        self.run_on_device = ctx.run_on_device
        self.thread_plan = ctx.thread_plan
        param = next(self.model.parameters())
        self.device, dtype = param.device, param.dtype
        if self.device.type == "cpu" and dtype == torch.float32 and ctx.cpu_linear_kernel:
            replace_linears(self.model)
        self.kv_caches = allocate_kv_cache(loaded.hf_config, ctx.num_blocks + ctx.max_num_seqs, ctx.block_size,
                                           dtype, self.device)
        self.model.bind_kv_cache(self.kv_caches)
        self._probs: dict[str, torch.Tensor] = {}
        self._drafts: list[tuple[_C.Sequence, list[int]]] = []  # the latest propose()'s, until taken
        # request id -> (its preemption count, leading positions with valid draft K/V)
        self._valid: dict[str, tuple[int, int]] = {}

    def draft_padding(self, k: int) -> None:
        """Nothing: a draft model's passes are its own, no peer waits on them."""

    def stats(self) -> dict[str, Any]:
        return {}

    # ---- the target's passes: fill the draft cache ----------------------------------------
    @torch.inference_mode()
    def observe_target(self, step: TargetStep) -> None:
        self.model(step.input_ids, step.positions, step.attn_metadata)

    def after_target(self, sched_out: _C.SchedulerOutput, observed: bool) -> None:
        """Advances each sequence's valid draft positions over a step: an observed step
        extends a contiguous prefix; an unobserved one invalidates what it rewrote."""
        seq_lens, qsl = sched_out.seq_lens, sched_out.query_start_loc
        for i, rid in enumerate(sched_out.request_ids):
            end = int(seq_lens[i])
            start = end - int(qsl[i + 1] - qsl[i])
            epoch, valid = self._valid.get(rid, (0, 0))  # (a preemption is noticed in _missing)
            self._valid[rid] = (epoch, (end if valid >= start else valid) if observed else min(valid, start))
        if len(self._valid) > 2 * len(self.requests) + 64:  # finished requests, under a long auto-off
            self._valid = {r: v for r, v in self._valid.items() if r in self.requests}

    # ---- between steps: draft ------------------------------------------------------------
    def propose(self, scheduler: _C.Scheduler, k: int) -> int:
        """Drafts for the scheduler's draft candidates on the device; the engine takes them
        (take_draft_token_ids) and hands them to the scheduler. Returns how many got drafts."""
        self._probs = {}
        self._drafts = []
        seqs, lens, lasts, tables, ks = [], [], [], [], []
        for seq in scheduler.draft_candidates():
            n = scheduler.draft_limit(seq, k)  # its back-off's length; no drafts the scheduler would drop
            if n <= 0:
                continue
            seqs.append(seq)
            lens.append(seq.data.get_len())
            lasts.append(seq.data.get_last_token_id())
            tables.append(seq.block_table)
            ks.append(n)
        if not seqs:
            return 0
        states = [self.requests.get(s.request_id) for s in seqs]
        missing = self._missing(seqs)
        drafts, probs = self.run_on_device(self._planned_draft, lens, lasts, tables, max(ks), states, missing)
        for i, seq in enumerate(seqs):
            self._drafts.append((seq, drafts[i, : ks[i]].tolist()))
            if probs is not None and probs[i] is not None:
                self._probs[seq.request_id] = probs[i][: ks[i]]
        return len(seqs)

    def take_draft_token_ids(self) -> list[tuple[_C.Sequence, list[int]]]:
        drafts, self._drafts = self._drafts, []
        return drafts

    def draft_probs(self, request_id: str) -> torch.Tensor | None:
        return self._probs.get(request_id)

    def _missing(self, seqs: list) -> list[tuple[int, list[int], list[int]]]:
        """Per candidate lacking draft K/V: (its index, the tokens, their positions' start)."""
        out = []
        for i, seq in enumerate(seqs):
            computed = seq.data.get_len() - 1
            epoch, valid = self._valid.get(seq.request_id, (seq.num_preemptions, 0))
            if epoch != seq.num_preemptions:  # recomputed since, maybe into other blocks
                valid = 0
            if valid < computed:
                out.append((i, seq.data.get_token_ids()[valid:computed], valid))
            self._valid[seq.request_id] = (seq.num_preemptions, computed)  # after the catch-up below
        return out

    def _planned_draft(self, lens: list[int], lasts: list[int], tables: list[list[int]], k: int,
                       states: list[Any], missing: list) -> tuple[np.ndarray, list[torch.Tensor | None] | None]:
        """_draft under the target's thread plan: outside one, torch's own threads spin after each
        parallel op and take a core from the kernels' pool (a 16-token catch-up pass of an
        8-layer draft took ~37 ms instead of a few)."""
        with self.thread_plan(max(len(lens), sum(len(tokens) for _, tokens, _ in missing))):
            return self._draft(lens, lasts, tables, k, states, missing)

    @torch.inference_mode()
    def _draft(self, lens: list[int], lasts: list[int], tables: list[list[int]], k: int, states: list[Any],
               missing: list) -> tuple[np.ndarray, list[torch.Tensor | None] | None]:
        """k draft tokens per sequence [n, k], and per sampled sequence q [k, vocab]."""
        if missing:
            self._catch_up(missing, tables)
        n, bs = len(lens), self.block_size
        table = np.zeros((n, max(len(t) for t in tables) + 1), dtype=np.int32)
        for i, t in enumerate(tables):
            table[i, : len(t)] = t
            table[i, len(t)] = self.scratch_start + i
        width = np.asarray([len(t) for t in tables])
        pos = np.asarray(lens, dtype=np.int64) - 1  # the last token, fed first
        if np.any((pos + k - 1) // bs > width):
            raise RuntimeError("draft model: a draft position falls past the sequence's blocks and its scratch "
                               "block (num_speculative_tokens + 1 must fit one block)")
        sampler = _DraftSampler(states, self.device)
        tokens = torch.tensor(lasts, dtype=torch.int64, device=self.device)
        block_tables = torch.from_numpy(table).to(self.device)
        out, probs = [], []
        for _ in range(k):
            logits = self._step(tokens, pos, table, block_tables)
            tokens, q = sampler.choose(logits)
            out.append(tokens)
            probs.append(q)
            pos = pos + 1
        drafts = torch.stack(out, dim=1).cpu().numpy()
        return drafts, sampler.per_row(probs, n)

    def _catch_up(self, missing: list, tables: list[list[int]]) -> None:
        """One draft pass over the tokens whose draft K/V is missing (all within blocks the
        target already computed, so all in the sequences' own block tables)."""
        bs = self.block_size
        width = max(len(tables[i]) for i, _, _ in missing)
        table = np.zeros((len(missing), width), dtype=np.int32)
        ids, pos, slots, qlens, slens = [], [], [], [], []
        for row, (i, tokens, start) in enumerate(missing):
            table[row, : len(tables[i])] = tables[i]
            p = np.arange(start, start + len(tokens), dtype=np.int64)
            ids += tokens
            pos.append(p)
            slots.append(table[row, p // bs].astype(np.int64) * bs + p % bs)
            qlens.append(len(tokens))
            slens.append(start + len(tokens))
        qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
        md = AttentionMetadata(
            is_prefill=True, slot_mapping=torch.from_numpy(np.concatenate(slots)).to(self.device),
            block_tables=torch.from_numpy(table).to(self.device), query_start_loc=torch.from_numpy(qsl).to(self.device),
            seq_lens=torch.tensor(slens, dtype=torch.int32, device=self.device),
            query_lens_host=qlens, seq_lens_host=slens, max_query_len=max(qlens), max_seq_len=max(slens))
        self.model(torch.tensor(ids, dtype=torch.int64, device=self.device),
                   torch.from_numpy(np.concatenate(pos)).to(self.device), md)

    def _step(self, tokens: torch.Tensor, pos: np.ndarray, table: np.ndarray,
              block_tables: torch.Tensor) -> torch.Tensor:
        n, bs = len(pos), self.block_size
        slots = table[np.arange(n), pos // bs].astype(np.int64) * bs + pos % bs
        seq_lens = (pos + 1).astype(np.int32)
        md = AttentionMetadata(
            is_prefill=False,
            slot_mapping=torch.from_numpy(slots).to(self.device),
            block_tables=block_tables,
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=self.device),
            seq_lens=torch.from_numpy(seq_lens).to(self.device),
            query_lens_host=[1] * n, seq_lens_host=seq_lens.tolist(),
            max_query_len=1, max_seq_len=int(seq_lens.max()))
        positions = torch.from_numpy(pos.copy()).to(self.device)
        return self.model.compute_logits(self.model(tokens, positions, md))


class _DraftSampler:
    """How drafts are chosen: the draft's argmax for greedy requests (greedy verification
    keeps a draft iff it is the target's argmax, so nothing else could be kept), and for
    sampled requests a draw from q, the draft's distribution under the request's own
    temperature and filters, kept for the min(1, p/q) test."""

    def __init__(self, states: list[Any], device: torch.device) -> None:
        params = [None if s is None else s.params for s in states]
        self.sampled = [i for i, p in enumerate(params) if p is not None and not p.is_greedy]
        if not self.sampled:
            return
        picked = [params[i] for i in self.sampled]
        self.rows = torch.tensor(self.sampled, dtype=torch.int64, device=device)
        self.generators = tuple(states[i].generator for i in self.sampled)
        self.temperature = torch.tensor([p.temperature for p in picked], dtype=torch.float32, device=device)
        self.top_k = self.top_p = self.min_p = None
        if any(p.top_k > 0 for p in picked):
            self.top_k = torch.tensor([p.top_k if p.top_k > 0 else 1 << 62 for p in picked], device=device)
        if any(p.top_p < 1.0 for p in picked):
            self.top_p = torch.tensor([p.top_p for p in picked], dtype=torch.float32, device=device)
        if any(p.min_p > 0.0 for p in picked):
            self.min_p = torch.tensor([p.min_p for p in picked], dtype=torch.float32, device=device)

    def choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        tokens = logits.argmax(dim=-1)
        if not self.sampled:
            return tokens, None
        q = draft_distribution(logits[self.rows], self.temperature, self.top_k, self.top_p, self.min_p)
        tokens[self.rows] = exponential_race(q, self.generators)
        return tokens, q

    def per_row(self, probs: list[torch.Tensor | None], n: int) -> list[torch.Tensor | None] | None:
        """Per sequence, q of its k drafts [k, vocab] (None for greedy ones)."""
        if not self.sampled:
            return None
        stacked = torch.stack(probs, dim=1)  # [sampled, k, vocab]
        rows: list[torch.Tensor | None] = [None] * n
        for j, i in enumerate(self.sampled):
            rows[i] = stacked[j]
        return rows


def load_draft_proposer(path: str, ctx: ProposerContext, target: DraftTarget) -> DraftModelProposer:
    """Loads the draft model at `path` and checks that it can draft for `target`: the same
    vocabulary, token for token, and positions enough."""
    loaded = load_model(path, target.dtype, target.device, target.packed_weights)
    where = f"speculative_config.model {path!r}"
    if loaded.hf_config.vocab_size != target.vocab_size:
        raise ValueError(f"{where}: the draft model's vocabulary has {loaded.hf_config.vocab_size} entries but "
                         f"the target's has {target.vocab_size}; a draft model must share the target's tokenizer")
    try:
        draft_vocab = AutoTokenizer.from_pretrained(loaded.tokenizer_dir).get_vocab()
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: no tokenizer to compare with the target's ({e})") from None
    target_vocab = target.vocab()
    if draft_vocab != target_vocab:
        differ = sorted(set(draft_vocab.items()) ^ set(target_vocab.items()), key=str)[:3]
        raise ValueError(f"{where}: the draft model's tokenizer differs from the target's (e.g. {differ}); "
                         "a draft model must share the target's tokenizer")
    positions = loaded.hf_config.max_position_embeddings
    if positions < target.max_model_len:
        raise ValueError(f"{where}: the draft model handles {positions} positions but max_model_len is "
                         f"{target.max_model_len}; lower max_model_len")
    return DraftModelProposer(loaded, ctx)
