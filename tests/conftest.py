"""Shared fixtures: tiny random models built once per test session, offline."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402
from model_utils import build_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama (GQA, untied) with a small tokenizer and a chat template."""
    return build_tiny_model("llama-gqa", tmp_path_factory.getbasetemp() / "tiny-llama-gqa")


@pytest.fixture(scope="session")
def model_dir(tiny_model_dir) -> str:
    """The same tiny Llama as a str, as the server helpers and command lines take it."""
    return str(tiny_model_dir)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.getbasetemp()
    kinds = ("llama-gqa", "llama-tied", "qwen2-bias", "qwen3-qknorm")
    return {k: build_tiny_model(k, root / f"tiny-{k}") for k in kinds}


@pytest.fixture(scope="session")
def ray_cluster():
    """One private Ray instance for every DP test of the session (starting Ray is the slow
    part): deployments started meanwhile join it instead of starting their own."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray

    from deepinfer_dp.cluster.ray_launcher import ensure_ray

    ensure_ray("local", os.cpu_count() or 1)
    yield
    ray.shutdown()
