"""Each dense family the engine serves, token-identical to transformers on the same weights:
Llama (GQA; tied with Llama 3.1 rope scaling), Qwen2 (q/k/v biases), Qwen3 (q/k norms, a head
size that is not hidden / heads) and Mistral (no sliding window), each from its safetensors
directory and from a GGUF file written with the `gguf` package (Q4_0, Q4_1, Q8_0, BF16, F16
and F32 matrices, tests/gguf_utils.py), run through LLM.generate with chunked prefill and prefix hits.

The GGUF oracle is transformers reading the same file: its config and its dequantized, renamed
tensors (`load_gguf_checkpoint`, what `from_pretrained(gguf_file=...)` loads; that call itself
needs `accelerate` for device placement, which this project does not install)."""

from __future__ import annotations

import pytest
import torch
from gguf import GGUFReader
from gguf_utils import MIXED_FORMATS, write_dense_gguf
from model_utils import build_tiny_model
from moe_utils import load_oracle, oracle_logits, random_prompts
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from deepinfer_dp import LLM, SamplingParams
from deepinfer_dp.layers.packed import PackedEmbedding, PackedLinear

KINDS = ["llama-gqa", "llama-tied", "qwen2-bias", "qwen3-qknorm", "mistral"]
LENGTHS = [1, 3, 90, 5, 17, 2, 64, 8, 33, 4, 45, 11, 6, 27, 70, 9]  # 90, 70, 64, 45, 33 exceed the budget
MAX_TOKENS = 12


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_DP_CACHE", str(tmp_path / "cache"))


def gguf_oracle(path):
    """transformers' model of a GGUF file: config and tensors as transformers reads them."""
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    arch = GGUFReader(path).fields["general.architecture"].contents()
    # transformers' GGUF config reader skips attention.key_length (Qwen3's head size)
    config.head_dim = int(GGUFReader(path).fields[f"{arch}.attention.key_length"].contents())
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"} and model.config.tie_word_embeddings == bool(missing)
    if missing:
        model.tie_weights()
    return model.eval()


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_matches_transformers(kind, fmt, tmp_path_factory):
    """16 prompts of 1 to 90 tokens with a 32-token step budget (long prompts prefilled in
    chunks beside decode steps), then the same prompts again, which hit the prefix cache. Greedy
    output equals transformers' if at every position transformers' argmax is our next token."""
    root = tmp_path_factory.getbasetemp() / "families"
    hf_dir = build_tiny_model(kind, root / kind)
    if fmt == "gguf":
        path = root / f"{kind}-mixed.gguf"
        if not path.exists():
            write_dense_gguf(hf_dir, path, MIXED_FORMATS)
        model, oracle = str(path), gguf_oracle(path)
    else:
        model, oracle = str(hf_dir), load_oracle(hf_dir)
    prompts = random_prompts(oracle.config.vocab_size, LENGTHS, seed=7)
    llm = LLM(model, decode_sequence=False, max_num_batched_tokens=32, max_num_seqs=8, num_kv_blocks=256,
              block_size=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert llm.llm_engine.hf_config.model_type == oracle.config.model_type
    if fmt == "gguf":  # the quantized matrices run packed (the untied head too), the rest widened
        packed = {m.weight_packed.format for m in llm.llm_engine.worker.runner.model.modules()
                  if isinstance(m, (PackedLinear, PackedEmbedding))}
        assert packed == {"q4_0", "q4_1", "q8_0"} | (set() if oracle.config.tie_word_embeddings else {"bf16"})
    first = llm.generate(prompt_token_ids=prompts, use_tqdm=False, sampling_params=greedy)
    hits_before = llm.rank_stats()[0]["prefix_hit_tokens"]
    again = llm.generate(prompt_token_ids=prompts, use_tqdm=False, sampling_params=greedy)
    assert llm.rank_stats()[0]["prefix_hit_tokens"] > hits_before
    for prompt, outs, outs_again in zip(prompts, first, again, strict=True):
        output = [t for o in outs for t in o.token_ids]
        assert [t for o in outs_again for t in o.token_ids] == output
        assert len(output) == MAX_TOKENS
        ref = oracle_logits(oracle, prompt + output)[len(prompt) - 1:-1].argmax(-1)
        assert ref.tolist() == output
