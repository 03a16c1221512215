"""What the expert load balancing tests share: tiny MoE models whose router is skewed onto a
few hot experts (all on rank 0 at start), the balancer settings, and the fixtures of the
skewed tiny Mixtral and its DP=1 greedy tokens that the torchrun and the Ray tests compare
against."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dp_utils import EP_ENGINE, GREEDY, PROMPTS, run_torchrun, token_ids
from model_utils import write_tiny_model
from moe_utils import build_tiny_moe, tiny_moe_config

HOT = (2, 3)
EPLB = {"window_size": 6, "step_interval": 5, "num_redundant_experts": 2}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "disable_by_batch_size": 8}
# A rank's first prompt: prefilled in several chunks of EP_ENGINE's 12-token step budget.
LONG = ("Expert parallel load balancing moves the hot experts of a mixture of experts model between the ranks "
        "while every rank keeps serving its requests")


def skew_router(model_dir: Path, hot: tuple[int, ...], scale: float, bias: float = 0.0) -> None:
    """Scales the router rows of the `hot` experts in every MoE layer (Mixtral's
    block_sparse_moe.gate, Qwen's and DeepSeek's mlp.gate) and adds `bias` to their DeepSeek-V3
    score correction: they take most tokens."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    for name, tensor in tensors.items():
        if name.endswith(".gate.weight"):
            tensor[list(hot)] *= scale
        elif name.endswith(".gate.e_score_correction_bias"):
            tensor[list(hot)] += bias
    save_file(tensors, path, metadata={"format": "pt"})


def build_skewed_mixtral(path: Path, num_experts: int = 8) -> Path:
    """The tiny Mixtral of moe_utils (top-2) with `num_experts` experts, router skewed onto HOT."""
    if (path / "config.json").exists():
        return path

    def config(vocab_size: int):
        cfg = tiny_moe_config("mixtral", vocab_size)
        cfg.num_local_experts = num_experts
        return cfg

    model_dir = build_tiny_moe("mixtral", path) if num_experts == 8 else write_tiny_model(config, path)
    skew_router(model_dir, HOT, 6.0)
    return model_dir


def dp1_ids(model_dir: Path, prompts: list[str] = PROMPTS, max_tokens: int = GREEDY.max_tokens) -> list[list[int]]:
    """The greedy token ids of `prompts` from one engine (no DP, all experts local)."""
    from deepinfer_dp.entrypoints.llm import LLM
    from deepinfer_dp.sampling_params import SamplingParams

    llm = LLM(str(model_dir), decode_sequence=False, **EP_ENGINE)
    try:
        return token_ids(llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                                      use_tqdm=False))
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def skewed_dir(tmp_path_factory) -> Path:
    return build_skewed_mixtral(tmp_path_factory.mktemp("eplb") / "mixtral")


@pytest.fixture(scope="module")
def dp1_token_ids(skewed_dir) -> list[list[int]]:
    return dp1_ids(skewed_dir)


def torchrun_traced(model_dir: Path, out: Path, prompts: list[str], shard_sizes: str, options: dict,
                    max_tokens: int, nproc: int, timeout_s: float = 420) -> dict:
    """distributed/eplb_trace_rank.py in `nproc` ranks, each greedy over its contiguous shard of
    `prompts` with the engine `options`: {token_ids, rank_stats, traces (per rank, per step)}."""
    out.with_suffix(".txt").write_text("\n".join(prompts) + "\n")
    script = Path(__file__).parent / "distributed" / "eplb_trace_rank.py"
    done = run_torchrun([str(script), str(model_dir), str(out.with_suffix(".txt")), str(out), shard_sizes,
                     str(max_tokens), json.dumps(options)], nproc, timeout_s=timeout_s)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def step_kinds(trace: list[dict]) -> dict[int, set[str]]:
    """What one rank's steps computed, from its trace: "chunk" when a prompt chunk that is not
    its prompt's last ran (its row is not sampled), "verify" when a decoding sequence (sampled
    at an earlier step) ran more than one query token (its drafts)."""
    kinds: dict[int, set[str]] = {}
    sampled_before: set[str] = set()
    for step in trace:
        kind = kinds.setdefault(step["step"], set())
        for rid, query_len, _ in step["rows"]:
            if rid not in step["sampled"]:
                kind.add("chunk")
            elif rid in sampled_before and query_len > 1:
                kind.add("verify")
        sampled_before |= set(step["sampled"])
    return kinds
