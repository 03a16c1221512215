"""Tiny random vision-language models (Hugging Face directories with their processor) and
test images, built offline for the multimodal tests."""

from __future__ import annotations

import contextlib
import functools
import http.server
import io
import os
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from model_utils import build_tiny_tokenizer, randomize_biases_and_norms  # noqa: E402
from netns_utils import in_netns  # noqa: E402
from PIL import Image  # noqa: E402
from transformers import (  # noqa: E402
    CLIPImageProcessorPil,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
)

IMAGE_TOKEN = "<image>"
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'].upper() + ': ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<image>\n' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '\n' }}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


TINY_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)


def build_tiny_llava(path: str | os.PathLike, seed: int = 0, image_size: int = 56, text_shape: dict | None = None,
                     vision_shape: dict | None = None) -> Path:
    """A LLaVA-1.5-shaped model: CLIP tower (patch 14: (image_size/14)^2 image tokens), MLP
    projector, a Llama (2 layers unless `text_shape` says otherwise); written with its
    LlavaProcessor, once."""
    path = Path(path)
    if (path / "config.json").exists():
        return path
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    text = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=2048, rms_norm_eps=1e-5,
                       initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                       tie_word_embeddings=False, **(text_shape or TINY_TEXT))
    vision = CLIPVisionConfig(image_size=image_size, patch_size=14, projection_dim=32,
                              **(vision_shape or TINY_VISION))
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=image_token_id,
                         vision_feature_layer=-2, vision_feature_select_strategy="default")
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    randomize_biases_and_norms(model)
    model.save_pretrained(path)
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": image_size},
                                         crop_size={"height": image_size, "width": image_size})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=14,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=LLAVA_CHAT_TEMPLATE)
    processor.save_pretrained(path)
    return path


def make_image(seed: int, size: tuple[int, int] = (64, 48)) -> Image.Image:
    """A deterministic RGB image of `size` (width, height)."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


class HFReference:
    """transformers' model and processor of a checkpoint, for greedy reference tokens."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForImageTextToText

        from deepinfer_dp.multimodal.qwen_processor import load_processor

        self.processor = load_processor(model_dir)  # AutoProcessor, or Qwen VL's without video
        self.model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None  # exactly max_tokens, like ignore_eos

    def greedy(self, prompt: str, images: list[Image.Image], max_tokens: int) -> list[int]:
        inputs = self.processor(text=[prompt], images=images or None, return_tensors="pt")
        with torch.no_grad():
            out = self.model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
        return out[0, inputs["input_ids"].shape[1]:].tolist()


def build_tiny_idefics3(path: str | os.PathLike, seed: int = 0, tile: int = 56) -> Path:
    """An Idefics3/SmolVLM-shaped model: a 2-layer vision transformer (patch 14, `tile`-pixel
    tiles, scale factor 2: (tile/28)^2 tokens per tile), the pixel-shuffle connector and a
    2-layer Llama; its processor splits images up to twice the tile size. Written once."""
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
    )

    path = Path(path)
    if (path / "config.json").exists():
        return path
    tokenizer = build_tiny_tokenizer()
    specials = ["<fake_token_around_image>", IMAGE_TOKEN, "<end_of_utterance>", "<global-img>"]
    specials += [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    text = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=2048, rms_norm_eps=1e-5,
                       initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                       tie_word_embeddings=False, **TINY_TEXT)
    vision = dict(image_size=tile, patch_size=14, **TINY_VISION)
    config = Idefics3Config(vision_config=vision, text_config=text.to_dict(), scale_factor=2,
                            image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN))
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).eval()
    randomize_biases_and_norms(model)
    model.save_pretrained(path)
    image_processor = Idefics3ImageProcessorPil(size={"longest_edge": 2 * tile}, max_image_size={"longest_edge": tile})
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                  image_seq_len=(tile // 28) ** 2, chat_template=LLAVA_CHAT_TEMPLATE)
    processor.save_pretrained(path)
    return path


@contextlib.contextmanager
def slow_image_server(delay_s: float, image: Image.Image, netns: str | None = None):
    """A loopback HTTP server that answers every GET with `image` as PNG after `delay_s`;
    yields the image's URL and stops the server on exit. With `netns`, it listens on that
    network namespace's loopback (for ranks run there: tests/loopback_netns.py)."""
    body = png_bytes(image)

    class Slow(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            time.sleep(delay_s)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    make = functools.partial(http.server.ThreadingHTTPServer, ("127.0.0.1", 0), Slow)
    server = in_netns(netns, make) if netns else make()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/slow.png"
    finally:
        server.shutdown()
        server.server_close()
