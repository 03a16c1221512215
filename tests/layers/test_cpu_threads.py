"""The thread plan of small CPU steps: small ops on one thread, matrix products on all."""

from __future__ import annotations

import pytest
import torch

from deepinfer_dp.layers import cpu_threads


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_small_step_narrows_and_wide_parts_get_all_threads(two_threads):
    with cpu_threads.narrow_step(2, num_tokens=64):
        assert torch.get_num_threads() == 1 and cpu_threads.wide_threads() == 2
        with cpu_threads.wide():
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2 and cpu_threads.wide_threads() == 0


@pytest.mark.parametrize("threads,tokens", [(1, 8), (2, cpu_threads.NARROW_MAX_TOKENS + 1)])
def test_big_steps_and_single_threads_are_left_alone(two_threads, threads, tokens):
    with cpu_threads.narrow_step(threads, tokens):
        assert torch.get_num_threads() == 2 and cpu_threads.wide_threads() == 0
        with cpu_threads.wide():
            assert torch.get_num_threads() == 2


def test_threads_come_back_after_an_error(two_threads):
    with pytest.raises(RuntimeError, match="boom"):
        with cpu_threads.narrow_step(2, 1):
            raise RuntimeError("boom")
    assert torch.get_num_threads() == 2 and cpu_threads.wide_threads() == 0
