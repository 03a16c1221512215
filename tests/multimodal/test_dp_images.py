"""DP=2 under torchrun with every image request on rank 0, one of whose images comes from a
slow source: rank 0 votes "unfinished" while its requests wait for the image worker, rank 1
runs placeholder steps meanwhile, both take the same number of steps, and every output
equals transformers' (as at DP=1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dp_utils import run_torchrun
from loopback_netns import loopback_netns
from mm_utils import HFReference, build_tiny_llava, make_image, slow_image_server

HERE = Path(__file__).resolve().parent
DELAY_S = 2.0
TOKENS = 5


@pytest.mark.slow
def test_a_rank_waiting_for_images_keeps_the_group_stepping(tmp_path_factory, tmp_path):
    model = build_tiny_llava(tmp_path_factory.getbasetemp() / "tiny-llava")
    out = tmp_path / "out.json"
    with loopback_netns() as ns, slow_image_server(DELAY_S, make_image(50), netns=ns) as slow_url:
        proc = run_torchrun([str(HERE / "dp_images_rank.py"), str(model), str(out), slow_url, str(TOKENS)],
                            netns=ns)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    hf = HFReference(model)
    expected = [[hf.greedy("USER: <image>\nwhat is it? ASSISTANT:", [make_image(50)], TOKENS),
                 hf.greedy("USER: <image>\nand this? ASSISTANT:", [make_image(7)], TOKENS)],
                [hf.greedy("USER: just text ASSISTANT:", [], TOKENS)]]
    assert result["tokens"] == expected
    rank0, rank1 = result["stats"]
    assert rank0["generate_step"] == rank1["generate_step"]
    assert rank0["images_processed"] == 2 and rank1["images_processed"] == 0
    assert rank0["image_wait_time_s"] >= DELAY_S * 0.9
    # rank 1 finished its short request, then stepped (placeholders) until rank 0's were done
    assert rank1["placeholder_steps"] > 0
