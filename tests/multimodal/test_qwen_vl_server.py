"""Qwen2.5-VL over the OpenAI chat API (dp 1): an image_url part is rendered by the
processor's chat template, expanded by the Qwen processor without video, and answered with
transformers' greedy text, streaming or not; the usage counts the expanded prompt."""

from __future__ import annotations

import base64
import json

import httpx
import pytest
from mm_utils import HFReference, make_image, png_bytes
from qwen_vl_utils import build_tiny_qwen_vl
from server_utils import MODEL_NAME, served

TOKENS = 5
PROMPT = "<|im_start|>user\nwhat is it?<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n<|im_start|>assistant\n"


def request(image, stream: bool) -> dict:
    url = "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()
    return {"model": MODEL_NAME, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "stream": stream,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"},
                                                      {"type": "image_url", "image_url": {"url": url}}]}]}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = build_tiny_qwen_vl(tmp_path_factory.getbasetemp() / "tiny-qwen2_5_vl", "qwen2_5_vl")
    with served(str(model), max_num_batched_tokens=24, max_model_len=256) as server:
        yield server, HFReference(model)


def test_image_url_answers_transformers_text(setup):
    server, hf = setup
    image = make_image(42, (112, 84))
    expected = hf.processor.tokenizer.decode(hf.greedy(PROMPT, [image], TOKENS))
    r = httpx.post(f"{server.url}/v1/chat/completions", json=request(image, False), timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == expected
    expanded = len(hf.processor(text=[PROMPT], images=[image], return_tensors="pt")["input_ids"][0])
    assert r.json()["usage"]["prompt_tokens"] == expanded
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=request(image, True), timeout=120) as s:
        assert s.status_code == 200
        events = [line[len("data: "):] for line in s.iter_lines() if line.startswith("data: ")]
    deltas = [json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events if e != "[DONE]"]
    assert "".join(deltas) == expected
