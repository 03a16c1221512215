"""Images behind the Ray router, offline (`LLM(dp_size=2)`): the driver sends each image as a
reference (a URL, or a PIL image as PNG bytes) and the rank that takes the request fetches
and preprocesses it itself; greedy tokens equal DP=1's, and a broken image fails only its own
prompt, named by prompt and image index."""

from __future__ import annotations

import base64

import pytest
from mm_utils import build_tiny_llava, make_image, png_bytes

from deepinfer_dp.entrypoints.llm import LLM
from deepinfer_dp.sampling_params import SamplingParams

TOKENS = 5
OPTIONS = dict(max_num_batched_tokens=24, max_model_len=256, torch_threads=1, decode_sequence=False)
GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)


def mm(text: str, images) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": images}}


def tokens(results) -> list[list[int] | None]:
    return [None if r is None else [t for o in r for t in o.token_ids] for r in results]


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


@pytest.fixture(scope="module")
def setup(tmp_path_factory, ray_cluster):
    root = tmp_path_factory.getbasetemp()
    model = str(build_tiny_llava(root / "tiny-llava"))
    media = root / "router-media"
    media.mkdir(exist_ok=True)
    (media / "dog.png").write_bytes(png_bytes(make_image(71, (44, 70))))
    dp1 = LLM(model, allowed_local_media_path=str(media), **OPTIONS)
    dp2 = LLM(model, dp_size=2, allowed_local_media_path=str(media), dp_options={"collective_timeout_s": 20},
              **OPTIONS)
    yield dp1, dp2, media
    dp2.shutdown()
    dp1.shutdown()


def prompts(media) -> list[dict]:
    """Eight prompts over every kind of image reference, with 0, 1 and 2 images."""
    a, b = make_image(72), make_image(73, (90, 30))
    return [mm("USER: <image>\nwhat is it? ASSISTANT:", a),
            mm("USER: <image> and <image>\ncompare them ASSISTANT:", [b, png_bytes(a)]),
            mm("USER: <image>\na data URL ASSISTANT:", data_url(png_bytes(make_image(74)))),
            mm("USER: <image>\na file ASSISTANT:", f"file://{media / 'dog.png'}"),
            "USER: just text ASSISTANT:",
            mm("USER: <image>\nthe same image again ASSISTANT:", a),
            mm("USER: <image>\nanother one ASSISTANT:", make_image(75, (60, 60))),
            mm("USER: <image>\nlast ASSISTANT:", make_image(76, (30, 80)))]


def test_images_over_the_router_equal_dp1(setup):
    dp1, dp2, media = setup
    before = [s["images_processed"] for s in dp2.rank_stats()]
    ours = tokens(dp2.generate(prompts(media), GREEDY, use_tqdm=False))
    assert ours == tokens(dp1.generate(prompts(media), GREEDY, use_tqdm=False))
    processed = [s["images_processed"] - b for s, b in zip(dp2.rank_stats(), before, strict=True)]
    assert sum(processed) == 8 and min(processed) > 0  # each rank fetched its own requests' images


def test_a_broken_image_fails_only_its_prompt_over_the_router(setup):
    dp1, dp2, media = setup
    batch = prompts(media)
    broken = data_url(b"these bytes are not a png")
    batch[3] = mm("USER: <image> next to <image>\nwhat is it? ASSISTANT:", [make_image(77), broken])
    with pytest.raises(ValueError, match=r"^prompt 3: image 1: .*not an image") as err:
        dp2.generate(batch, GREEDY, use_tqdm=False)
    outputs = tokens(err.value.outputs)
    assert outputs[3] is None
    solo = [None if i == 3 else tokens(dp1.generate(batch[i], GREEDY, use_tqdm=False))[0] for i in range(8)]
    assert outputs == solo
    # the ranks go on serving
    assert tokens(dp2.generate(batch[0], GREEDY, use_tqdm=False)) == [solo[0]]


def test_chat_with_image_url_parts_over_the_router(setup):
    dp1, dp2, _ = setup
    url = data_url(png_bytes(make_image(78)))
    messages = [{"role": "user", "content": [{"type": "text", "text": "Look: "},
                                              {"type": "image_url", "image_url": {"url": url}}]}]
    assert tokens(dp2.chat(messages, GREEDY, use_tqdm=False)) == tokens(dp1.chat(messages, GREEDY, use_tqdm=False))


def test_bad_references_are_refused_before_anything_runs(setup):
    _, dp2, _ = setup
    with pytest.raises(ValueError, match=r"prompt 1: image 0: an image must be a PIL image"):
        dp2.generate(["USER: hi ASSISTANT:", mm("USER: <image> ASSISTANT:", 3.5)], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        dp2.generate(mm("<image>" * 5, [make_image(i) for i in range(5)]), GREEDY, use_tqdm=False)
