"""Fixtures the speculative-decoding tests share."""

from __future__ import annotations

import pytest
from model_utils import prompts_of_lengths, tiny_config, write_tiny_model

from deepinfer_dp import LLM


@pytest.fixture(scope="session")
def draft_dir(tmp_path_factory):
    """Another tiny random Llama of the same tokenizer: one layer, other weights (q != p)."""
    def config(vocab_size):
        c = tiny_config("llama-gqa", vocab_size)
        c.num_hidden_layers = 1
        return c
    return write_tiny_model(config, tmp_path_factory.getbasetemp() / "tiny-draft-1layer", seed=1)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Four prompts with repeated phrases (prompt lookup finds drafts in them) and three without."""
    base = prompts_of_lengths([6, 11, 17, 23], offset=7)
    return [p + p[:5] + p for p in base] + prompts_of_lengths([5, 9, 30], offset=90)


@pytest.fixture(scope="module")
def off(tiny_model_dir) -> LLM:
    """The tiny model with speculation off, the reference the speculative runs must equal."""
    return LLM(tiny_model_dir, decode_sequence=False)
