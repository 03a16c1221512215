"""Images over the OpenAI chat API (dp 1): image_url parts as data, http and file URLs, a 400
naming the field for a bad image before any token (streaming too) with the server healthy
after, and a slow image source that does not hold back other requests."""

from __future__ import annotations

import base64
import json
import re
import threading
import time
from pathlib import Path

import httpx
import pytest
from mm_utils import HFReference, build_tiny_llava, make_image, png_bytes, slow_image_server
from server_utils import MODEL_NAME, served

TOKENS = 5
SLOW_S = 3.0


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def chat(url: str, text: str = "what is it?", stream: bool = False) -> dict:
    return {"model": MODEL_NAME, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "stream": stream,
            "messages": [{"role": "user", "content": [{"type": "text", "text": text},
                                                      {"type": "image_url", "image_url": {"url": url}}]}]}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.getbasetemp()
    model = build_tiny_llava(root / "tiny-llava")
    media = root / "media"
    media.mkdir(exist_ok=True)
    (media / "cat.png").write_bytes(png_bytes(make_image(41)))
    with slow_image_server(SLOW_S, make_image(40)) as slow_url, served(
            str(model), max_num_batched_tokens=24, max_model_len=256, allowed_local_media_path=str(media)) as server:
        yield server, HFReference(model), media, slow_url


def expected_text(hf: HFReference, image) -> str:
    text = hf.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, {"type": "image"}]}],
        add_generation_prompt=True, tokenize=False)
    return hf.processor.tokenizer.decode(hf.greedy(text, [image], TOKENS))


def test_data_and_file_urls_answer_transformers_tokens(setup):
    server, hf, media, _ = setup
    image = make_image(42)
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat(data_url(png_bytes(image))), timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == expected_text(hf, image)
    # the usage counts the prompt as the model ran it: each image as its 16 placeholder tokens
    text = hf.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, {"type": "image"}]}],
        add_generation_prompt=True, tokenize=False)
    expanded = len(hf.processor(text=[text], images=[image], return_tensors="pt")["input_ids"][0])
    assert r.json()["usage"]["prompt_tokens"] == expanded
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat(f"file://{media / 'cat.png'}"), timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == expected_text(hf, make_image(41))


def test_an_image_chat_continues_the_final_message(setup):
    """continue_final_message reaches the processor's template: the assistant's begun answer is
    continued, as transformers renders it."""
    server, hf, _, _ = setup
    image = make_image(43)
    body = chat(data_url(png_bytes(image)))
    body["messages"].append({"role": "assistant", "content": "It is"})
    r = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "continue_final_message": True}, timeout=120)
    assert r.status_code == 200, r.text
    text = hf.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, {"type": "image"}]},
         {"role": "assistant", "content": "It is"}], continue_final_message=True, tokenize=False)
    assert text.endswith("It is")
    want = hf.processor.tokenizer.decode(hf.greedy(text, [image], TOKENS))
    assert r.json()["choices"][0]["message"]["content"] == want
    expanded = len(hf.processor(text=[text], images=[image], return_tensors="pt")["input_ids"][0])
    assert r.json()["usage"]["prompt_tokens"] == expanded


@pytest.mark.parametrize("stream", [False, True])
def test_bad_image_is_a_400_naming_the_field_and_the_server_stays_healthy(setup, stream):
    server, _, media, _ = setup
    for url, what in [(data_url(b"not a png"), "not an image"), ("file:///etc/hostname", "not under the allowed")]:
        r = httpx.post(f"{server.url}/v1/chat/completions", json=chat(url, stream=stream), timeout=120)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "messages.0.content.1.image_url" and what in error["message"]
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat(data_url(png_bytes(make_image(43)))), timeout=120)
    assert r.status_code == 200


def test_more_images_than_the_limit_is_a_400(setup):
    server, _, _, _ = setup
    body = chat(data_url(png_bytes(make_image(44))))
    body["messages"][0]["content"] += [body["messages"][0]["content"][1]] * 4  # 5 images, limit 4
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content.5.image_url"


def test_a_slow_image_does_not_hold_back_text_requests(setup):
    server, _, _, slow_url = setup
    done: dict[str, float] = {}

    def run(name: str, body: dict) -> None:
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                # the first chunk: the server answers once the first token exists
                if line.startswith("data: {") and name not in done:
                    done[name] = time.monotonic()
    image = threading.Thread(target=run, args=("image", chat(slow_url, stream=True)))
    image.start()
    text_body = {"model": MODEL_NAME, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
                 "messages": [{"role": "user", "content": "just text"}]}
    run("text", text_body)
    image.join()
    # the text request got its first token while the image request was still waiting for its image
    assert done["text"] < done["image"]


def test_image_metrics_are_exported_and_the_dashboard_queries_them(setup):
    server, _, _, _ = setup
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    exported = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    dashboard = json.loads((Path(__file__).parents[2] / "monitoring" / "grafana-dashboard.json").read_text())
    queried = {name for p in dashboard["panels"] for t in p.get("targets", [])
               for name in re.findall(r"deepinfer:mm_[a-z_]+", t["expr"])}
    assert queried and not queried - exported
    processed = re.search(r'^deepinfer:mm_images_processed_total\{dp_rank="0"\} (\S+)$', text, re.M)
    assert processed and float(processed.group(1)) > 0


def test_prompt_logprobs_with_images_is_a_400(setup):
    server, _, _, _ = setup
    body = {**chat(data_url(png_bytes(make_image(45)))), "prompt_logprobs": 1}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and "prompt_logprobs" in r.json()["error"]["message"]
