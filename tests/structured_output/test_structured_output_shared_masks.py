"""Rows whose matchers are in the same state (the same grammar, the same consumed tokens)
share one filled mask row; every row's mask equals filling its own matcher alone, and a
digest collision between different token histories never merges their masks."""

from __future__ import annotations

import torch
from so_cases import PERSON
from transformers import AutoTokenizer

from deepinfer_dp import StructuredOutputsParams
from deepinfer_dp.structured_output.backend import GrammarBackend
from deepinfer_dp.structured_output.manager import StructuredOutputManager


def _allowed(bitmask_row: torch.Tensor, vocab: int) -> list[int]:
    bits = [(int(bitmask_row[t // 32]) >> (t % 32)) & 1 for t in range(vocab)]
    return [t for t, b in enumerate(bits) if b]


def _manager(tiny_model_dir) -> tuple[StructuredOutputManager, list[list[int]], int]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    vocab = len(tokenizer)
    manager = StructuredOutputManager(GrammarBackend(tokenizer, vocab, [tokenizer.eos_token_id]))
    fills: list[list[int]] = []  # rows each fill() call computed
    real_fill = manager.backend.fill
    manager.backend.fill = lambda matchers, bitmask: (fills.append(len(matchers)), real_fill(matchers, bitmask))
    person, digits = StructuredOutputsParams(json=PERSON), StructuredOutputsParams(regex=r"[0-9]{2,5}")
    for rid, params in [("a", person), ("b", person), ("c", digits), ("d", digits), ("e", digits)]:
        manager.submit(rid, params, None)
        manager.wait_for_build(30)
    while manager.has_pending():
        manager.wait_for_build(30)
        manager.take_ready()
    manager.take_ready()
    return manager, fills, vocab


def _own_masks(manager: StructuredOutputManager, rids: list[str]) -> torch.Tensor:
    """Each row filled from its own matcher, one at a time (what the step did before)."""
    rows = []
    for rid in rids:
        bitmask = manager.backend.allocate_bitmask(1)
        manager.backend.fill([manager._matchers[rid]], bitmask)
        rows.append(bitmask[0])
    return torch.stack(rows)


def test_equal_states_share_a_fill_and_masks_match_own_fills(tiny_model_dir):
    manager, fills, vocab = _manager(tiny_model_dir)
    try:
        rids = ["a", "b", "c", "d", "e"]
        first = manager.bitmask(rids, torch.device("cpu"))
        assert fills[-1] == 2  # two PERSON rows and three regex rows, all at their start
        assert torch.equal(first.bitmask, _own_masks(manager, rids))
        json_token = _allowed(first.bitmask[0], vocab)[0]
        digits = _allowed(first.bitmask[2], vocab)
        assert len(digits) > 1
        for rid, token in [("a", json_token), ("b", json_token), ("c", digits[0]), ("d", digits[-1]),
                           ("e", digits[0])]:
            manager.accept(rid, [token], 1, lambda: [])
        second = manager.bitmask(rids, torch.device("cpu"))
        assert fills[-1] == 3  # {a, b}, {c, e}, {d}
        assert torch.equal(second.bitmask, _own_masks(manager, rids))
        assert second.rows.tolist() == [0, 1, 2, 3, 4]
    finally:
        manager.shutdown()


def test_a_digest_collision_does_not_merge_different_tokens(tiny_model_dir):
    manager, fills, vocab = _manager(tiny_model_dir)
    try:
        first = manager.bitmask(["c", "d"], torch.device("cpu"))
        assert fills[-1] == 1
        digits = _allowed(first.bitmask[0], vocab)
        manager.accept("c", [digits[0]], 1, lambda: [])
        manager.accept("d", [digits[-1]], 1, lambda: [])
        manager._digest["d"] = manager._digest["c"]  # as if the two histories hashed alike
        mask = manager.bitmask(["c", "d"], torch.device("cpu"))
        assert fills[-1] == 2
        assert torch.equal(mask.bitmask, _own_masks(manager, ["c", "d"]))
    finally:
        manager.shutdown()
