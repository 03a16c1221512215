"""Model ids the way vLLM takes them: `org/name` (and `revision`) resolved in the local Hugging
Face cache (HF_HUB_CACHE, HF_HOME) offline, a repository of one GGUF file, and the error that
names where the engine looked and how to fetch a model that is not there."""

from __future__ import annotations

import argparse

import pytest
from gguf_utils import write_dense_gguf
from hub_cache import add_snapshot
from model_utils import build_tiny_model, prompts_of_lengths, token_ids

from deepinfer_dp import LLM, SamplingParams
from deepinfer_dp.config_file import load_config
from deepinfer_dp.entrypoints import cli
from deepinfer_dp.entrypoints.openai.launcher import add_serve_args
from deepinfer_dp.models.loader import resolve_model_dir

COMMIT_A, COMMIT_B = "a" * 40, "b" * 40
REPO = "tiny-org/tiny-llama"
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
OPTIONS = {"num_kv_blocks": 64, "decode_sequence": False}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub_models")
    return {"a": build_tiny_model("llama-gqa", root / "a"), "b": build_tiny_model("qwen2-bias", root / "b")}


@pytest.fixture
def hub(tmp_path, monkeypatch, tiny):
    """A hub cache in HF_HUB_CACHE holding REPO: main at COMMIT_A (a tiny Llama), the tag v2 at
    COMMIT_B (a tiny Qwen2)."""
    cache = tmp_path / "hub"
    add_snapshot(cache, REPO, tiny["a"], COMMIT_A, refs=("main",))
    add_snapshot(cache, REPO, tiny["b"], COMMIT_B, refs=("v2",))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("DEEPINFER_DP_CACHE", str(tmp_path / "converted"))
    return cache


def _generate(model: str, **options) -> list[list[int]]:
    llm = LLM(model, **OPTIONS, **options)
    return token_ids(llm.generate(prompt_token_ids=prompts_of_lengths([5, 19]), sampling_params=GREEDY,
                                  use_tqdm=False))


def test_repo_id_runs_from_the_hub_cache(hub, tiny):
    assert _generate(REPO) == _generate(str(tiny["a"]))


def test_revision_names_a_branch_tag_or_commit(hub):
    snapshots = hub / f"models--{REPO.replace('/', '--')}" / "snapshots"
    assert resolve_model_dir(REPO) == snapshots / COMMIT_A
    assert resolve_model_dir(REPO, "v2") == snapshots / COMMIT_B
    assert resolve_model_dir(REPO, COMMIT_B) == snapshots / COMMIT_B
    with pytest.raises(FileNotFoundError, match=r"revision 'v3'.*hf download tiny-org/tiny-llama --revision v3"):
        resolve_model_dir(REPO, "v3")


def test_revision_reaches_the_engine(hub, tiny):
    llm = LLM(REPO, revision="v2", **OPTIONS)
    assert llm.llm_engine.hf_config.model_type == "qwen2"


def test_hf_home_holds_the_cache(tmp_path, monkeypatch, tiny):
    add_snapshot(tmp_path / "home" / "hub", REPO, tiny["a"], COMMIT_A)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert resolve_model_dir(REPO) == tmp_path / "home" / "hub" / f"models--{REPO.replace('/', '--')}" / \
        "snapshots" / COMMIT_A


def test_a_local_path_wins_over_the_cache(hub, tiny, tmp_path, monkeypatch):
    """As in vLLM: a folder spelled like the repo id, where the model argument points, is loaded."""
    (tmp_path / "local" / REPO).parent.mkdir(parents=True)
    (tmp_path / "local" / REPO).symlink_to(tiny["b"], target_is_directory=True)
    monkeypatch.chdir(tmp_path / "local")
    assert resolve_model_dir(REPO).resolve() == tiny["b"].resolve()


def test_missing_model_names_the_cache_and_the_fetch_command(hub):
    with pytest.raises(FileNotFoundError) as e:
        LLM("tiny-org/not-downloaded", **OPTIONS)
    assert str(hub) in str(e.value) and "hf download tiny-org/not-downloaded" in str(e.value)


def test_missing_model_on_the_command_line(hub, capsys):
    assert cli.main(["generate", "--model", "tiny-org/not-downloaded", "--prompt", "Hi"]) == 2
    err = capsys.readouterr().err
    assert "Hugging Face cache" in err and str(hub) in err and "hf download tiny-org/not-downloaded" in err


def test_a_repository_of_one_gguf_file_serves_it(hub, tiny, tmp_path):
    gguf_file = write_dense_gguf(tiny["a"], tmp_path / "tiny-llama-F32.gguf")
    add_snapshot(hub, "tiny-org/tiny-llama-GGUF", gguf_file, COMMIT_A)
    assert _generate("tiny-org/tiny-llama-GGUF") == _generate(str(gguf_file))
    add_snapshot(hub, "tiny-org/two-ggufs", gguf_file, COMMIT_A)
    other = write_dense_gguf(tiny["a"], tmp_path / "tiny-llama-Q8_0.gguf", default="Q8_0")
    add_snapshot(hub, "tiny-org/two-ggufs", other, COMMIT_A)
    with pytest.raises(ValueError, match=r"several GGUF files \(tiny-llama-F32.gguf, tiny-llama-Q8_0.gguf\)"):
        resolve_model_dir("tiny-org/two-ggufs")


def test_serve_flags_take_a_repo_id_and_its_revision():
    args = add_serve_args(argparse.ArgumentParser()).parse_args(
        [REPO, "--revision", "v2", "--tokenizer", "tiny-org/tok"])
    deployment = load_config(args, model=args.model_path)
    config = deployment.engine_config()
    assert (config.model, config.revision, config.tokenizer) == (REPO, "v2", "tiny-org/tok")
