"""Images over the OpenAI chat API behind the Ray router (`serve --dp-size 2`): the API server
renders the chat and checks each image reference's shape without fetching it; the rank
fetches it. A bad image answers 400 naming its field before any token, streaming or not,
whether the API server (scheme, allowed folder) or the rank (bytes that are not an image)
finds it, and the server stays healthy."""

from __future__ import annotations

import base64

import httpx
import pytest
from mm_utils import HFReference, build_tiny_llava, make_image, png_bytes
from server_utils import MODEL_NAME, served

# A DP=2 deployment, an HTTP server and transformers' reference: about a minute on 2 busy cores
pytestmark = pytest.mark.slow
TOKENS = 5
FIELD = "messages.0.content.1.image_url"


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def chat(url: str, stream: bool = False) -> dict:
    return {"model": MODEL_NAME, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "stream": stream,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"},
                                                      {"type": "image_url", "image_url": {"url": url}}]}]}


@pytest.fixture(scope="module")
def setup(tmp_path_factory, ray_cluster):
    root = tmp_path_factory.getbasetemp()
    model = build_tiny_llava(root / "tiny-llava")
    media = root / "router-server-media"
    media.mkdir(exist_ok=True)
    (media / "cat.png").write_bytes(png_bytes(make_image(81)))
    with served(str(model), dp_size=2, max_num_batched_tokens=24, max_model_len=256, torch_threads=1,
                allowed_local_media_path=str(media)) as server:
        yield server, HFReference(model), media


def expected_text(hf: HFReference, image) -> str:
    text = hf.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, {"type": "image"}]}],
        add_generation_prompt=True, tokenize=False)
    return hf.processor.tokenizer.decode(hf.greedy(text, [image], TOKENS))


def post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)


def test_data_and_file_urls_over_the_router_answer_transformers_tokens(setup):
    server, hf, media = setup
    for url, image in [(data_url(png_bytes(make_image(82))), make_image(82)),
                       (f"file://{media / 'cat.png'}", make_image(81))]:
        r = post(server, chat(url))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == expected_text(hf, image)
    stats = server.client.rank_stats()
    assert sum(s["images_processed"] for s in stats) >= 2


@pytest.mark.parametrize("stream", [False, True])
def test_bad_images_over_the_router_are_a_400_naming_the_field(setup, stream):
    server, _, _ = setup
    cases = [(data_url(b"not a png"), "not an image"),  # found by the rank's image worker
             ("file:///etc/hostname", "not under the allowed"),  # found by the API server
             ("ftp://example.com/a.png", "unsupported image URL scheme")]
    for url, what in cases:
        r = post(server, chat(url, stream=stream))
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == FIELD and what in error["message"], error
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    r = post(server, chat(data_url(png_bytes(make_image(83))), stream=stream))
    assert r.status_code == 200, r.text
