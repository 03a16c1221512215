"""Block-scaled fp8 checkpoints (DeepSeek-V3 as released): the matrices are stored as
float8_e4m3fn with one fp32 `<name>_scale_inv` per block and widened at load. A tiny V3 model
is quantized here (32 x 32 blocks, so some blocks are partial) and its dequantized copy saved
as plain fp32: loading the fp8 checkpoint must give exactly the dequantized weights, and the
same greedy outputs."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from deepseek_utils import build_tiny_deepseek
from safetensors.torch import load_file, save_file

from deepinfer_dp import LLM, SamplingParams
from deepinfer_dp.models.loader import load_model

BLOCK = (32, 32)
PROMPTS = [[1, 5, 9, 14, 3], [1, 22, 7, 40, 41, 42, 8]]


def _expand(scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    return scale.repeat_interleave(BLOCK[0], 0)[:shape[0]].repeat_interleave(BLOCK[1], 1)[:, :shape[1]]


def _quantized(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = -(-w.shape[0] // BLOCK[0]), -(-w.shape[1] // BLOCK[1])
    scale = torch.zeros(rows, cols)
    for i in range(rows):
        for j in range(cols):
            block = w[i * BLOCK[0]:(i + 1) * BLOCK[0], j * BLOCK[1]:(j + 1) * BLOCK[1]]
            scale[i, j] = block.abs().max().clamp_min(1e-8) / 448.0
    return (w / _expand(scale, w.shape)).to(torch.float8_e4m3fn), scale


def _is_matrix(name: str, t: torch.Tensor) -> bool:
    skip = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight")
    return t.dim() == 2 and name.endswith(".weight") and not any(s in name for s in skip)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    src = build_tiny_deepseek("v3", root / "src")
    fp8, ref = root / "fp8", root / "ref"
    for d in (fp8, ref):
        shutil.copytree(src, d)
    weights = load_file(src / "model.safetensors")
    stored, widened = {}, {}
    for name, t in weights.items():
        if _is_matrix(name, t):
            q, scale = _quantized(t)
            stored[name], stored[name + "_scale_inv"] = q, scale
            widened[name] = q.float() * _expand(scale, t.shape)
        else:
            stored[name] = widened[name] = t
    save_file(stored, fp8 / "model.safetensors", metadata={"format": "pt"})
    save_file(widened, ref / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(BLOCK)}
    (fp8 / "config.json").write_text(json.dumps(config))
    assert any(t.dtype == torch.float8_e4m3fn for t in stored.values())
    return fp8, ref


def test_fp8_checkpoint_loads_as_its_dequantized_weights(checkpoints):
    fp8, ref = (load_model(d, torch.float32, "cpu").model.state_dict() for d in checkpoints)
    assert fp8.keys() == ref.keys()
    for name in ref:
        assert torch.equal(fp8[name], ref[name]), name


def test_fp8_checkpoint_generates_like_its_dequantized_copy(checkpoints):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = []
    for d in checkpoints:
        llm = LLM(str(d), num_kv_blocks=64, block_size=16, decode_sequence=False)
        outs.append([[o.token_id for o in out] for out in llm.generate(prompt_token_ids=PROMPTS,
                                                                       sampling_params=params, use_tqdm=False)])
        llm.shutdown()
    assert outs[0] == outs[1]


def test_an_fp8_matrix_without_its_scale_is_refused(checkpoints, tmp_path):
    fp8 = checkpoints[0]
    broken = tmp_path / "broken"
    shutil.copytree(fp8, broken)
    weights = load_file(broken / "model.safetensors")
    name = next(n for n in weights if n.endswith("_scale_inv"))
    del weights[name]
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=name.removesuffix("_scale_inv")):
        load_model(broken, torch.float32, "cpu")
