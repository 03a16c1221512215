"""Tiny random Qwen2-VL and Qwen2.5-VL models (Hugging Face directories with their image
processor, tokenizer and chat template), built offline for the multimodal tests."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from model_utils import build_tiny_tokenizer, randomize_biases_and_norms  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

QWEN_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen2-VL's chat template, trimmed to text and image parts
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5, initializer_range=0.2,
            tie_word_embeddings=False)
MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}  # head_dim 16
# 28-pixel units (patch 14, merge 2): images are resized to 2x2 .. 4x4 units, 4 to 16 tokens
MIN_PIXELS, MAX_PIXELS = 56 * 56, 112 * 112


def build_tiny_qwen_vl(path: str | os.PathLike, family: str = "qwen2_vl", seed: int = 0,
                       text_shape: dict | None = None, vision_shape: dict | None = None,
                       pixels: tuple[int, int] = (MIN_PIXELS, MAX_PIXELS)) -> Path:
    """A Qwen2-VL (`family` "qwen2_vl") or Qwen2.5-VL ("qwen2_5_vl") shaped model: a 2-block
    vision transformer (patch 14, merge 2; 2.5: 56-pixel windows, block 1 full attention), a
    2-layer Qwen2 text model with M-RoPE, unless the shapes say otherwise (`text_shape` may
    carry `rope_parameters`); images resized to `pixels` (min, max). Written once, with the
    published tensor names and config form."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
    )

    path = Path(path)
    if (path / "config.json").exists():
        return path
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_SPECIALS})
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    text = dict(vocab_size=len(tokenizer), bos_token_id=1, eos_token_id=2, pad_token_id=0,
                **{**TEXT, "rope_parameters": dict(MROPE), **(text_shape or {})})
    tokens = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    if family == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2)
        vision.update(vision_shape or {})
        config, cls = Qwen2VLConfig(text_config=text, vision_config=vision, **tokens), Qwen2VLForConditionalGeneration
    else:
        vision = dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=48, num_heads=2,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                      fullatt_block_indexes=[1])
        vision.update(vision_shape or {})
        config, cls = (Qwen2_5_VLConfig(text_config=text, vision_config=vision, **tokens),
                       Qwen2_5_VLForConditionalGeneration)
    torch.manual_seed(seed)
    model = cls(config).eval()
    randomize_biases_and_norms(model)
    model.save_pretrained(path)
    (path / "config.json").write_text(json.dumps(published_config(config), indent=2))
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    image_processor = Qwen2VLImageProcessorPil(min_pixels=pixels[0], max_pixels=pixels[1], patch_size=14,
                                               temporal_patch_size=2, merge_size=2)
    image_processor.save_pretrained(path)
    (path / "chat_template.jinja").write_text(QWEN_CHAT_TEMPLATE)
    return path


def published_config(config) -> dict:
    """`config` as the published Qwen2-VL / Qwen2.5-VL repositories write it (transformers 4):
    the text model's fields at the top, `rope_scaling` of type "mrope", no vision rope fields."""
    out = config.to_dict()
    text = out.pop("text_config")
    rope = text.pop("rope_parameters")
    for key in ("model_type", "layer_types", "dtype"):
        text.pop(key, None)
    out.update(text, rope_theta=rope["rope_theta"],
               rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]})
    out["vision_config"] = {k: v for k, v in out["vision_config"].items() if k not in ("rope_parameters", "model_type")}
    return out


def to_transformers5_layout(src: Path, dst: Path) -> Path:
    """The same checkpoint under transformers 5's module names (`model.visual.*`,
    `model.language_model.*`) and its config.json form (save_pretrained writes the published
    tensor names, `visual.*`, `model.*`; build_tiny_qwen_vl the published config)."""
    from transformers import AutoConfig

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            (dst / f.name).write_bytes(f.read_bytes())
    AutoConfig.from_pretrained(src).save_pretrained(dst)
    renamed = {}
    for name, tensor in load_file(src / "model.safetensors").items():
        if name.startswith("visual."):
            name = "model." + name
        elif name.startswith("model."):
            name = "model.language_model." + name[len("model."):]
        renamed[name] = tensor.contiguous()
    save_file(renamed, dst / "model.safetensors", metadata={"format": "pt"})
    return dst
