"""A GGUF file mixing formats as a Q4_K_M / Q5_K_M file does (Q4_K, Q5_K, Q6_K, Q5_0, Q5_1,
Q4_0, Q8_0, with an F16 matrix no packed kernel runs): its matrices stay packed in their stored format,
fused projections whose parts differ too (each part in its own), the F16 one is widened with a
log line naming it, and greedy output equals transformers on the same file's tensors as gguf
dequantizes them."""

from __future__ import annotations

import logging

import pytest
import torch
from gguf_dense import build_kquant_llama, write_gguf
from model_utils import prompts_of_lengths, token_ids
from transformers import AutoModelForCausalLM

from deepinfer_dp import LLM, SamplingParams
from deepinfer_dp.layers.packed import PackedEmbedding, PackedLinear
from deepinfer_dp.layers.packed_parts import PackedPartsLinear
from deepinfer_dp.models import convert_gguf, load_model

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
# Layer 0 as Q4_K_M lays out a "more bits" layer (v and down in Q6_K), layer 1 the other formats.
FORMATS = {
    "token_embd.weight": "q4_k", "output.weight": "q6_k",
    "blk.0.attn_q.weight": "q4_k", "blk.0.attn_k.weight": "q4_k", "blk.0.attn_v.weight": "q6_k",
    "blk.0.attn_output.weight": "q5_0", "blk.0.ffn_gate.weight": "q4_k", "blk.0.ffn_up.weight": "q4_k",
    "blk.0.ffn_down.weight": "q6_k",
    "blk.1.attn_q.weight": "q5_0", "blk.1.attn_k.weight": "q4_0", "blk.1.attn_v.weight": "q8_0",
    "blk.1.attn_output.weight": "q5_1", "blk.1.ffn_gate.weight": "q5_k", "blk.1.ffn_up.weight": "q4_k",
    "blk.1.ffn_down.weight": "f16",
}


@pytest.fixture
def kquant_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_DP_CACHE", str(tmp_path / "cache"))
    return write_gguf(build_kquant_llama(tmp_path / "hf"), tmp_path / "tiny-q4_k_m.gguf", FORMATS)


def test_k_quant_gguf_runs_packed_and_matches_transformers(kquant_gguf, caplog):
    with caplog.at_level(logging.WARNING, logger="deepinfer_dp.models.default_model"):
        model = load_model(str(kquant_gguf), torch.float32, "cpu").model
    widened = [r.getMessage() for r in caplog.records if "widened to fp32" in r.getMessage()]
    assert len(widened) == 1 and "F16" in widened[0] and "blk.1.ffn_down.weight" in widened[0], widened
    formats = {name: m.weight_packed.format for name, m in model.named_modules()
               if isinstance(m, (PackedLinear, PackedEmbedding))}
    assert formats == {
        "model.embed_tokens": "q4_k", "lm_head": "q6_k",
        # layer 0's Q4_K q and k and Q6_K v: one matrix of two parts, each as stored
        "model.layers.0.self_attn.qkv_proj": "q4_k+q6_k",
        "model.layers.0.self_attn.o_proj": "q5_0", "model.layers.0.mlp.gate_up_proj": "q4_k",
        "model.layers.0.mlp.down_proj": "q6_k",
        # Q5_0 q, Q4_0 k and Q8_0 v (as Gemma 3's Q4_K_M file mixes them) run as one exact Q8_0 matrix
        "model.layers.1.self_attn.qkv_proj": "q8_0", "model.layers.1.self_attn.o_proj": "q5_1",
        "model.layers.1.mlp.gate_up_proj": "q5_k+q4_k",
    }
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, PackedPartsLinear)
    # nothing widened but the F16 matrix
    assert [name for name, m in model.named_modules()
            if name.endswith("_proj") and not isinstance(m, PackedLinear)] == ["model.layers.1.mlp.down_proj"]
    prompts = prompts_of_lengths([3, 17, 70, 9])
    llm = LLM(str(kquant_gguf), decode_sequence=False, max_num_batched_tokens=32, num_kv_blocks=64)
    ours = token_ids(llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False))
    # transformers on the converted directory: the GGUF tensors as gguf's dequantize gives them
    oracle = AutoModelForCausalLM.from_pretrained(convert_gguf(kquant_gguf), dtype=torch.float32).eval()
    oracle.generation_config.eos_token_id = None
    theirs = []
    with torch.inference_mode():
        for p in prompts:
            out = oracle.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                  max_new_tokens=GREEDY.max_tokens, do_sample=False, pad_token_id=0)
            theirs.append(out[0, len(p):].tolist())
    assert ours == theirs
