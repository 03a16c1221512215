"""A .gguf model serves with the tokenizer and chat template of its own metadata, as vLLM does,
or with the one `tokenizer` names (vLLM's --tokenizer): a directory, a repo id in the local
Hugging Face cache, or another .gguf file; and with the sampling defaults its metadata
recommends (general.sampling.*), as the default model gets its model card's."""

from __future__ import annotations

import json
import shutil

import pytest
from gguf_utils import write_dense_gguf
from hub_cache import add_snapshot
from model_utils import CHAT_TEMPLATE, build_tiny_model

from deepinfer_dp import LLM, SamplingParams

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
OTHER_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_DP_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The tiny Qwen2 as a directory and as a GGUF file, and a copy of its tokenizer whose chat
    template differs (to tell which tokenizer the engine took)."""
    root = tmp_path_factory.mktemp("gguf_tok")
    hf_dir = build_tiny_model("qwen2-bias", root / "qwen2")
    other = root / "other-tokenizer"
    other.mkdir()
    for f in hf_dir.glob("tokenizer*"):
        shutil.copy(f, other / f.name)
    config = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": OTHER_TEMPLATE}))
    (other / "chat_template.jinja").unlink(missing_ok=True)
    return {"dir": hf_dir, "gguf": write_dense_gguf(hf_dir, root / "qwen2.gguf", default="Q8_0"), "other": other}


def test_gguf_model_brings_its_tokenizer_and_chat_template(files):
    from transformers import AutoTokenizer

    llm = LLM(str(files["gguf"]), num_kv_blocks=64)
    tok, reference = llm.get_tokenizer(), AutoTokenizer.from_pretrained(files["dir"])
    assert tok.chat_template == CHAT_TEMPLATE
    text = "Hello, world! The capital of France is Paris."
    assert tok(text).input_ids == reference(text).input_ids
    ids = [tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
           for tokenizer in (tok, reference)]
    assert ids[0] == ids[1]
    assert llm.chat(CHAT, GREEDY, use_tqdm=False) == llm.generate(prompt_token_ids=[ids[0]], sampling_params=GREEDY,
                                                                  use_tqdm=False)


def test_tokenizer_from_a_directory(files):
    tok = LLM(str(files["gguf"]), tokenizer=str(files["other"]), num_kv_blocks=64).get_tokenizer()
    assert tok.chat_template == OTHER_TEMPLATE


def test_tokenizer_from_another_gguf_file(files):
    tok = LLM(str(files["dir"]), tokenizer=str(files["gguf"]), num_kv_blocks=64).get_tokenizer()
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False).endswith(
        "<|im_start|>assistant\n")


def test_tokenizer_from_the_hub_cache(files, tmp_path, monkeypatch):
    add_snapshot(tmp_path / "hub", "tiny-org/other-tokenizer", files["other"], "c" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    tok = LLM(str(files["gguf"]), tokenizer="tiny-org/other-tokenizer", num_kv_blocks=64).get_tokenizer()
    assert tok.chat_template == OTHER_TEMPLATE


def test_missing_tokenizer_is_named(files, tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-tokenizer"):
        LLM(str(files["gguf"]), tokenizer=str(tmp_path / "no-such-tokenizer"), num_kv_blocks=64)


def test_gguf_sampling_metadata_is_the_models_defaults(files, tmp_path):
    sampling = {"temp": 0.6, "top_p": 0.95, "top_k": 20}  # stored as float32, read back as written
    path = write_dense_gguf(files["dir"], tmp_path / "sampling.gguf", sampling=sampling)
    defaults = LLM(str(path), num_kv_blocks=64).sampling_defaults
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert LLM(str(files["gguf"]), num_kv_blocks=64).sampling_defaults == {}  # a file without any: neutral
