"""Fixtures the speculative-decoding tests share."""

from __future__ import annotations

import pytest
from model_utils import tiny_config, write_tiny_model


@pytest.fixture(scope="session")
def draft_dir(tmp_path_factory):
    """Another tiny random Llama of the same tokenizer: one layer, other weights (q != p)."""
    def config(vocab_size):
        c = tiny_config("llama-gqa", vocab_size)
        c.num_hidden_layers = 1
        return c
    return write_tiny_model(config, tmp_path_factory.getbasetemp() / "tiny-draft-1layer", seed=1)
