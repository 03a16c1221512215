"""Fixtures of the DP tests."""

from __future__ import annotations

import pytest
from dp_utils import ENGINE, GREEDY, PROMPTS, token_ids


@pytest.fixture(scope="module")
def dp1_token_ids(tiny_model_dir) -> list[list[int]]:
    """The reference: the DP prompts' greedy tokens from one engine at dp 1."""
    from deepinfer_dp.entrypoints.llm import LLM

    llm = LLM(str(tiny_model_dir), decode_sequence=False, **ENGINE)
    ids = token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    llm.shutdown()
    return ids


@pytest.fixture(scope="session")
def netns_cluster_ids():
    """The ids of the namespace clusters this session makes (tests/netns_utils.py): a test
    module appends its own. At the end of the session none of them may have left a namespace,
    a process or a Ray session directory behind."""
    from netns_utils import leftovers

    ids: list[str] = []
    yield ids
    assert leftovers(ids) == []


@pytest.fixture(scope="session")
def netns_model_dir(tmp_path_factory) -> str:
    """The multi-node tests' model: slow enough a step that long streams last seconds."""
    from netns_serve import build_step_heavy_model

    return build_step_heavy_model(tmp_path_factory.getbasetemp() / "netns-llama")
