"""DP=2 under torchrun with an injected slow grammar build: rank 1's only request waits 3 s
for its grammar while rank 0 finishes a short plain request. Rank 1 keeps voting "unfinished"
(a pending build counts), so both ranks keep stepping through the build (placeholder steps),
their step counts stay equal, and the constrained output is correct."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "engine"))
from dp_utils import run_torchrun  # noqa: E402
from so_cases import CODE_REGEX  # noqa: E402

DELAY_S = 3.0


def test_group_keeps_stepping_while_a_ranks_only_grammar_builds(tiny_model_dir, tmp_path):
    out = tmp_path / "out.json"
    proc = run_torchrun([str(HERE / "slow_grammar_rank.py"), str(tiny_model_dir), str(out), str(DELAY_S), CODE_REGEX])
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    plain, constrained = result["texts"][0][0], result["texts"][1][0]
    assert plain and re.fullmatch(CODE_REGEX, constrained), result["texts"]
    rank0, rank1 = result["stats"]
    assert rank0["generate_step"] == rank1["generate_step"]
    assert rank1["so_build_wait_s"] >= DELAY_S * 0.9 and rank1["so_constrained_requests"] == 1
    # Rank 0 was done after a few steps; it stepped on (placeholders) until rank 1's build was
    # ready and its request finished, and rank 1 stepped (placeholders) while it waited.
    assert rank0["placeholder_steps"] > 0 and rank1["placeholder_steps"] > 0
