"""Speculative decoding is lossless under sampling: on a tiny model, the joint distribution of
the first three sampled tokens with speculation on equals the one without it (chi-square
test over many seeded requests). Drafts come from an oracle that always proposes the greedy
continuation, so drafts are offered, and often accepted, at all three positions; a
verification that kept drafts too eagerly would pile mass on that one continuation."""

from __future__ import annotations

from collections import Counter

import torch
from model_utils import token_ids

from deepinfer_dp import LLM, SamplingParams

NUM = 600
PROMPT = [5, 17, 42, 99, 7]
# top_k 3 keeps 27 possible 3-token outcomes, so every cell is well filled
SAMPLED = dict(temperature=0.8, top_k=3, max_tokens=3, ignore_eos=True)


class GreedyOracle:
    def __init__(self, continuation: list[int]) -> None:
        self.continuation = continuation
        self.offered = 0

    def propose(self, scheduler, k: int) -> int:
        cands = scheduler.draft_candidates()
        for seq in cands:
            n = seq.data.get_output_len()
            scheduler.set_drafts(seq, self.continuation[n: n + k])
            self.offered += 1
        return len(cands)


def chi_square_p(a: Counter, b: Counter) -> float:
    """p-value of the two-sample chi-square test of homogeneity (cells under 5 expected
    counts pooled into one), via the regularised upper incomplete gamma function."""
    keys = sorted(set(a) | set(b))
    na, nb = sum(a.values()), sum(b.values())
    cells, rest = [], [0, 0]
    for key in keys:
        if (a[key] + b[key]) * min(na, nb) / (na + nb) >= 5:
            cells.append((a[key], b[key]))
        else:
            rest[0] += a[key]
            rest[1] += b[key]
    if sum(rest):
        cells.append(tuple(rest))
    stat = 0.0
    for x, y in cells:
        total = x + y
        for observed, n in ((x, na), (y, nb)):
            expected = total * n / (na + nb)
            stat += (observed - expected) ** 2 / expected
    dof = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def first_three(llm: LLM, seed_base: int) -> Counter:
    params = [SamplingParams(seed=seed_base + i, **SAMPLED) for i in range(NUM)]
    outs = token_ids(llm.generate(prompt_token_ids=[PROMPT] * NUM, sampling_params=params, use_tqdm=False))
    assert all(len(o) == 3 for o in outs)
    return Counter(tuple(o) for o in outs)


def test_sampling_distribution_is_the_same_with_speculation(tiny_model_dir):
    engine = dict(decode_sequence=False, max_num_seqs=256, enable_prefix_caching=True)
    off = LLM(tiny_model_dir, **engine)
    greedy = token_ids(off.generate(prompt_token_ids=[PROMPT], use_tqdm=False,
                                    sampling_params=SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)))[0]
    spec = {"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": None,
            "disable_by_acceptance": None}
    on = LLM(tiny_model_dir, speculative_config=spec, **engine)
    oracle = GreedyOracle(greedy)
    on.llm_engine.speculator.proposer = oracle
    # different seeds on the two sides: two independent samples of each distribution
    with_spec, without = first_three(on, 0), first_three(off, 10**6)
    stats = on.rank_stats()[0]
    assert oracle.offered > 0 and stats["spec_decode_num_accepted_tokens"] > NUM // 10
    assert chi_square_p(with_spec, without) > 1e-3, (with_spec.most_common(5), without.most_common(5))
    # the test can see a biased verification: always keeping the drafts shifts the mass
    biased = Counter(with_spec)
    biased[tuple(greedy)] += NUM // 4
    assert chi_square_p(biased, without) < 1e-3
