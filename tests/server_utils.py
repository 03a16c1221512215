"""Serving a tiny random model over loopback for the server and metrics tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from model_utils import build_tiny_model

from deepinfer_dp.entrypoints.openai.launcher import ServerThread, make_dp_client, make_local_client

MODEL_NAME = "tiny-llama"
ENGINE_OPTIONS = {"kv_cache_memory_gb": 0.02, "block_size": 16, "seed": 0}


def tiny_model_dir(root: Path) -> str:
    return str(build_tiny_model("llama-gqa", root / "llama-gqa"))


@contextlib.contextmanager
def served(model_dir: str, api_key: str | None = None, dp_size: int = 1, **options) -> Iterator[ServerThread]:
    """A real uvicorn server on a free 127.0.0.1 port over one in-process engine (dp_size 1) or
    the router process over dp_size Ray ranks (in the session's Ray: use the ray_cluster
    fixture); everything is stopped after."""
    options = {**ENGINE_OPTIONS, **options}
    if dp_size > 1:
        client = make_dp_client(model_dir, dp_size, MODEL_NAME, "round_robin", **options)
    else:
        client = make_local_client(model_dir, MODEL_NAME, **options)
    server = ServerThread(client, MODEL_NAME, api_key).start()
    server.client = client
    try:
        yield server
    finally:
        server.stop()
        client.shutdown()
