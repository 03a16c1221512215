"""Turn one step's logits into token ids.

The model runner builds a `SamplingBatch` once per step and calls `Sampler` on
the logits of the rows that sample. Order of work, as in vLLM: grammar bitmask (structured
output, constrained rows only) -> min-tokens mask -> logit bias -> penalties -> (greedy argmax |
temperature -> top-k/top-p -> min-p -> exponential race); logprobs always describe the raw logits.

The all-greedy batch is the benchmark's hot path: `build` detects it with one
pass over the params and the sampler does a single argmax. A greedy batch with grammar masks
stays on it: on CPU the C++ masked argmax skips each constrained row's forbidden tokens in
place (no copy of the logits), with the ties of masking to -inf and then taking argmax.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from deepinfer_dp import _C
from deepinfer_dp.layers.cpu_threads import kernel_threads
from deepinfer_dp.layers.rejection_sampler import DraftRows, verify
from deepinfer_dp.layers.sampling_filters import apply_min_p, apply_top_k_top_p
from deepinfer_dp.sampling_params import SamplingParams

if TYPE_CHECKING:
    from deepinfer_dp.structured_output.manager import GrammarMask

# Exponential noise of exactly 0 would turn a 0-probability token into 0/0=NaN,
# which argmax would pick; the clamp keeps filtered tokens at 0.
_MIN_NOISE = 1e-20


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A generator for a seeded request, or None to use the global RNG."""
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


@dataclass
class SamplingBatch:
    num_rows: int
    # True when every row is plain greedy: one argmax (under the grammar masks) and nothing else.
    fast_greedy: bool = False
    all_greedy: bool = False
    all_random: bool = False
    greedy_mask: torch.Tensor | None = None  # bool [N]; only for mixed batches
    temperature: torch.Tensor | None = None  # float32 [N]; 1.0 on greedy rows
    top_k: torch.Tensor | None = None  # int64 [N]; vocab_size where off
    top_p: torch.Tensor | None = None  # float32 [N]; 1.0 where off
    min_p: torch.Tensor | None = None  # float32 [N]; 0.0 where off
    # (row, generator) for the seeded rows that sample randomly.
    seeded_rows: tuple[tuple[int, torch.Generator], ...] = ()
    # Penalties apply to the subset `penalty_rows` only; the tensors below are [M] / [M, V].
    penalty_rows: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    presence_penalty: torch.Tensor | None = None
    seen_mask: torch.Tensor | None = None  # bool: token in prompt or output
    output_counts: torch.Tensor | None = None  # float32: occurrences in output
    # min_tokens: flat (row, token id) pairs forced to -inf.
    banned_rows: torch.Tensor | None = None
    banned_ids: torch.Tensor | None = None
    # logit_bias: flat (row, token id, bias) triples added to the logits.
    bias_rows: torch.Tensor | None = None
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    # Largest number of top logprobs asked; None when no row asked for logprobs.
    max_num_logprobs: int | None = None
    # Structured output: the bitmask of the constrained rows (None: no row is constrained).
    grammar: "GrammarMask | None" = None
    # Speculative decoding with a draft model: sampled rows that verify a draft drawn from q.
    draft: "DraftRows | None" = None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        prompt_token_ids: list[Sequence[int]] | None,
        output_token_ids: list[Sequence[int]] | None,
        num_output_tokens: list[int],
        eos_token_ids: list[int | None],
        vocab_size: int,
        device: torch.device,
    ) -> "SamplingBatch":
        """One step's sampling inputs, row i describing logits row i.

        Token histories are read only for rows with a penalty: outputs for any
        penalty, prompts for repetition_penalty; pass None when no row needs them.
        """
        n = len(params)
        if not (len(generators) == len(num_output_tokens) == len(eos_token_ids) == n):
            raise ValueError("SamplingBatch.build: per-row lists must all have len(params)")
        if all(
            p.is_greedy and p.logprobs is None and not p.needs_history and p.min_tokens <= k and not p.logit_bias
            for p, k in zip(params, num_output_tokens, strict=True)
        ):
            return cls(num_rows=n, fast_greedy=True, all_greedy=True)
        batch = cls(num_rows=n)
        batch._set_sampling(params, generators, vocab_size, device)
        batch._set_penalties(params, prompt_token_ids, output_token_ids, vocab_size, device)
        batch._set_min_tokens(params, num_output_tokens, eos_token_ids, vocab_size, device)
        batch._set_logit_bias(params, vocab_size, device)
        asked = [p.logprobs for p in params if p.logprobs is not None]
        batch.max_num_logprobs = min(max(asked), vocab_size) if asked else None
        return batch

    def with_grammar(self, mask: "GrammarMask | None") -> "SamplingBatch":
        """Adds the step's grammar mask (a plain greedy batch stays one masked argmax)."""
        self.grammar = mask
        return self

    def with_drafts(self, draft: "DraftRows | None") -> "SamplingBatch":
        """Adds the rows whose drafts need the min(1, p/q) test (rejection_sampler.py)."""
        if draft is not None and draft.rows.numel():
            self.draft = draft
        return self

    def _set_sampling(
        self,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        vocab_size: int,
        device: torch.device,
    ) -> None:
        greedy = [p.is_greedy for p in params]
        self.all_greedy = all(greedy)
        self.all_random = not any(greedy)
        if self.all_greedy:
            return
        if not self.all_random:
            self.greedy_mask = torch.tensor(greedy, dtype=torch.bool, device=device)
        # Greedy rows go through the random path too (result discarded), so give
        # them harmless values: temperature 1, no filters.
        temps = _random_rows(params, greedy, "temperature", 1.0)
        self.temperature = torch.tensor(temps, dtype=torch.float32, device=device)
        ks = [k if 0 < k < vocab_size else vocab_size for k in _random_rows(params, greedy, "top_k", -1)]
        if any(k < vocab_size for k in ks):
            self.top_k = torch.tensor(ks, dtype=torch.int64, device=device)
        ps = _random_rows(params, greedy, "top_p", 1.0)
        if any(p < 1.0 for p in ps):
            self.top_p = torch.tensor(ps, dtype=torch.float32, device=device)
        ms = _random_rows(params, greedy, "min_p", 0.0)
        if any(m > 0.0 for m in ms):
            self.min_p = torch.tensor(ms, dtype=torch.float32, device=device)
        self.seeded_rows = tuple(
            (i, gen)
            for i, (gen, g) in enumerate(zip(generators, greedy, strict=True))
            if gen is not None and not g
        )

    def _set_penalties(
        self,
        params: list[SamplingParams],
        prompt_token_ids: list[Sequence[int]] | None,
        output_token_ids: list[Sequence[int]] | None,
        vocab_size: int,
        device: torch.device,
    ) -> None:
        rows = [i for i, p in enumerate(params) if p.needs_history]
        if not rows:
            return
        if output_token_ids is None:
            raise ValueError("SamplingBatch.build: penalties need output_token_ids")
        picked = [params[i] for i in rows]
        self.penalty_rows = torch.tensor(rows, dtype=torch.int64, device=device)
        self.repetition_penalty = _column(picked, "repetition_penalty", device)
        self.frequency_penalty = _column(picked, "frequency_penalty", device)
        self.presence_penalty = _column(picked, "presence_penalty", device)
        outputs = _padded([output_token_ids[i] for i in rows], vocab_size, device)
        counts = torch.zeros(len(rows), vocab_size + 1, dtype=torch.float32, device=device)
        counts.scatter_add_(1, outputs, torch.ones_like(outputs, dtype=torch.float32))
        self.output_counts = counts[:, :vocab_size]
        if all(p.repetition_penalty == 1.0 for p in picked):
            return
        if prompt_token_ids is None:
            raise ValueError("SamplingBatch.build: repetition_penalty needs prompt_token_ids")
        prompts = _padded([prompt_token_ids[i] for i in rows], vocab_size, device)
        seen = torch.zeros(len(rows), vocab_size + 1, dtype=torch.bool, device=device)
        seen.scatter_(1, prompts, True)
        self.seen_mask = seen[:, :vocab_size] | (self.output_counts > 0)

    def _set_min_tokens(
        self,
        params: list[SamplingParams],
        num_output_tokens: list[int],
        eos_token_ids: list[int | None],
        vocab_size: int,
        device: torch.device,
    ) -> None:
        rows: list[int] = []
        ids: list[int] = []
        for i, (p, done, eos) in enumerate(zip(params, num_output_tokens, eos_token_ids, strict=True)):
            if done >= p.min_tokens:
                continue
            # As in vLLM, EOS is only banned when it would stop the request.
            stops = p.stop_token_ids if (eos is None or p.ignore_eos) else [*p.stop_token_ids, eos]
            for t in stops:
                if 0 <= t < vocab_size:
                    rows.append(i)
                    ids.append(t)
        if rows:
            self.banned_rows = torch.tensor(rows, dtype=torch.int64, device=device)
            self.banned_ids = torch.tensor(ids, dtype=torch.int64, device=device)


    def _set_logit_bias(self, params: list[SamplingParams], vocab_size: int, device: torch.device) -> None:
        triples = [(i, t, b) for i, p in enumerate(params) for t, b in (p.logit_bias or {}).items()]
        if not triples:
            return
        if any(t >= vocab_size for _, t, _ in triples):  # admission checks this; never index past the vocab
            raise ValueError(f"SamplingBatch.build: a logit_bias token id is outside the vocabulary [0, {vocab_size})")
        rows, ids, values = zip(*triples, strict=True)
        self.bias_rows = torch.tensor(rows, dtype=torch.int64, device=device)
        self.bias_ids = torch.tensor(ids, dtype=torch.int64, device=device)
        self.bias_values = torch.tensor(values, dtype=torch.float32, device=device)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # int64 [N]
    # Chosen token's log-prob under log_softmax of the raw logits; computed for
    # every row when any row asked, else None.
    logprobs: torch.Tensor | None = None  # float32 [N]
    # Top `max_num_logprobs` of the raw distribution (None if that is 0 or unset);
    # a row that asked for fewer reads a prefix.
    top_logprob_ids: torch.Tensor | None = None  # int64 [N, k]
    top_logprobs: torch.Tensor | None = None  # float32 [N, k]


class Sampler:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample one token per row of `logits` (fp32 [N, vocab]); `logits` is not modified."""
        if batch.fast_greedy:
            return SamplerOutput(token_ids=greedy_token_ids(logits, batch.grammar))
        raw = logits
        logits = logits.clone()  # everything below works in place
        if batch.grammar is not None:
            batch.grammar.apply(logits)
        if batch.banned_rows is not None:
            logits[batch.banned_rows, batch.banned_ids] = float("-inf")
        if batch.bias_rows is not None:
            logits.index_put_((batch.bias_rows, batch.bias_ids), batch.bias_values, accumulate=True)
        if batch.penalty_rows is not None:
            apply_penalties(logits, batch)
        token_ids = self._choose(logits, raw, batch)
        return self._with_logprobs(raw, token_ids, batch)

    def _choose(self, logits: torch.Tensor, raw: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        greedy_ids = None if batch.all_random else logits.argmax(dim=-1)
        if batch.all_greedy:
            return greedy_ids
        random_ids = self._sample(logits, raw, batch)
        if batch.all_random:
            return random_ids
        return torch.where(batch.greedy_mask, greedy_ids, random_ids)

    def _sample(self, logits: torch.Tensor, raw: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        logits.div_(batch.temperature.unsqueeze(1))
        if batch.top_k is not None or batch.top_p is not None:
            apply_top_k_top_p(logits, batch.top_k, batch.top_p)
        probs = logits.softmax(dim=-1)
        if batch.min_p is not None:
            apply_min_p(probs, batch.min_p)
        # draft rows: the target's p before the race below overwrites `probs`
        draft_p = probs[batch.draft.rows] if batch.draft is not None else None
        noise = _exponential_noise(probs, batch.seeded_rows)
        # Exponential race: argmax(p / E) with E ~ Exp(1) picks i with prob p_i,
        # and needs no normalization, so filtered (zeroed) tokens never win.
        ids = probs.div_(noise).argmax(dim=-1)
        if draft_p is not None:
            ids[batch.draft.rows] = verify(draft_p, batch.draft)
        # A row whose logits were all -inf (or held NaN/inf) has NaN probs; fall
        # back to the raw top token rather than an arbitrary id. No `.any()`
        # check: it would cost a device sync every step.
        return torch.where(probs[:, 0].isnan(), raw.argmax(dim=-1), ids)

    def _with_logprobs(
        self, raw: torch.Tensor, token_ids: torch.Tensor, batch: SamplingBatch
    ) -> SamplerOutput:
        out = SamplerOutput(token_ids=token_ids)
        if batch.max_num_logprobs is None:
            return out
        logprobs = raw.float().log_softmax(dim=-1)
        out.logprobs = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        if batch.max_num_logprobs > 0:
            top = logprobs.topk(batch.max_num_logprobs, dim=-1)
            out.top_logprobs, out.top_logprob_ids = top.values, top.indices
        return out


def greedy_token_ids(logits: torch.Tensor, grammar: "GrammarMask | None" = None) -> torch.Tensor:
    """Each row's argmax (first index on ties); the grammar's rows only among the tokens their
    bitmask allows. CPU float32 logits go to the C++ kernels, which read them in place."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        threads = kernel_threads()
        if grammar is None:
            return torch.from_numpy(_C.argmax(logits.numpy(), threads))
        return torch.from_numpy(_C.masked_argmax(logits.numpy(), grammar.rows.numpy(), grammar.bitmask.numpy(),
                                                 threads))
    if grammar is not None:
        logits = logits.clone()
        grammar.apply(logits)
    return logits.argmax(dim=-1)


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """Repetition (HF/vLLM), then frequency and presence (OpenAI), in place."""
    rows = batch.penalty_rows
    sub = logits[rows]
    if batch.seen_mask is not None:
        rep = batch.repetition_penalty.unsqueeze(1)
        penalized = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(batch.seen_mask, penalized, sub)
    counts = batch.output_counts
    sub -= batch.frequency_penalty.unsqueeze(1) * counts
    sub -= batch.presence_penalty.unsqueeze(1) * (counts > 0).float()
    logits[rows] = sub


def _exponential_noise(
    probs: torch.Tensor, seeded_rows: tuple[tuple[int, torch.Generator], ...]
) -> torch.Tensor:
    noise = torch.empty_like(probs)
    if len(seeded_rows) < probs.shape[0]:
        noise.exponential_()  # global RNG; seeded rows are overwritten below
    # A seeded row draws from its own generator only, so its tokens do not
    # depend on what else is in the batch.
    for row, gen in seeded_rows:
        noise[row].exponential_(generator=gen)
    return noise.clamp_(min=_MIN_NOISE)


def _random_rows(params: list[SamplingParams], greedy: list[bool], name: str, off: float) -> list:
    """Field `name` per row, with `off` on greedy rows."""
    return [off if g else getattr(p, name) for p, g in zip(params, greedy, strict=True)]


def _column(params: list[SamplingParams], name: str, device: torch.device) -> torch.Tensor:
    return torch.tensor([getattr(p, name) for p in params], dtype=torch.float32, device=device)


def _padded(seqs: list[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    """Right-pad token lists with `pad` (an extra column that is dropped later)."""
    width = max(1, max(len(s) for s in seqs))
    rows = [[*s, *([pad] * (width - len(s)))] for s in seqs]
    return torch.tensor(rows, dtype=torch.int64, device=device)
