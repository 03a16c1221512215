"""The scheduler's per-step encoder budget (max_num_encoder_input_tokens) with a fake model: a
prefill chunk ends before an image the step has no room for, so no step starts more image
tokens than the budget (unless one image alone is larger: it still runs, alone), and the
tokens equal the unbudgeted run's."""

from __future__ import annotations

import numpy as np
import pytest
from fake_model import FakeModel, make_scheduler

from deepinfer_dp import _C

# (prompt length, image spans (start, end, encoder tokens))
REQUESTS = {"A": (40, [(2, 10, 8), (12, 20, 8), (22, 30, 8)]),
            "B": (30, [(1, 13, 12)]),
            "C": (24, []),
            "D": (36, [(4, 12, 8), (20, 28, 8)])}


def run(budget: int, requests: dict = REQUESTS) -> tuple[dict, list[int], _C.Scheduler]:
    """Tokens per request, and per step the image tokens whose first row the step computed."""
    sched = make_scheduler(max_num_batched_tokens=48, max_num_encoder_input_tokens=budget)
    model = FakeModel(128, 4, 50)
    spans = {}
    for rid, (n, its) in requests.items():
        seq = _C.Sequence(rid, [1 + (i * 7 + ord(rid)) % 40 for i in range(n)], _C.SequenceLimits(max_tokens=4))
        seq.set_image_spans(its)
        sched.add_sequence(seq)
        spans[rid] = list(its)
    tokens: dict[str, list[int]] = {}
    per_step = []
    while sched.has_unfinished_seqs():
        out = sched.schedule()
        qsl, pos = np.asarray(out.query_start_loc), np.asarray(out.positions)
        started = 0
        for i, rid in enumerate(out.request_ids):
            rows = pos[qsl[i]:qsl[i + 1]]
            for span in [s for s in spans[rid] if rows[0] <= s[0] <= rows[-1]]:
                started += span[2]
        per_step.append(started)
        for o in sched.process_outputs(out, model.forward(out, None)):
            tokens.setdefault(o.request_id, []).extend(o.token_ids)
    return tokens, per_step, sched


def test_no_step_starts_more_image_tokens_than_the_budget():
    free, free_steps, _ = run(0)
    assert max(free_steps) > 16  # without a budget the first step starts every image
    tight, steps, sched = run(16)
    assert tight == free
    assert max(steps) <= 16 and sum(steps) == sum(free_steps)
    assert sched.stats["encoder_budget_cuts"] > 0


def test_an_image_larger_than_the_budget_still_runs_alone_in_its_step():
    tokens, steps, _ = run(5)
    assert tokens == run(0)[0]
    assert max(steps) == 12  # B's image, alone: every other step stays within 8 tokens (one image)
    assert all(s <= 8 for s in steps if s != 12)


def test_image_spans_are_checked():
    seq = _C.Sequence("x", list(range(1, 11)), _C.SequenceLimits(max_tokens=1))
    for bad in [[(4, 2, 1)], [(0, 4, 1), (3, 6, 1)], [(8, 12, 1)], [(0, 4, 0)]]:
        with pytest.raises(ValueError, match="set_image_spans"):
            seq.set_image_spans(bad)
