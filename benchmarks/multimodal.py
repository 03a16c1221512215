"""Images in, side by side in one run, on a random-weight model of a realistic shape scaled to
a few minutes on 2 cores: requests/s and TTFT at one image per request against transformers
`generate` (one padded batch) on the same model; the encoder cache's effect when every request
carries the same image (prefix caching off, so only the encoder cache can help); and the
share of the engine's step time spent in the vision encoder. Shapes (`--shape`):

- `llava-scaled` (default): CLIP tower 384 wide x 6 layers, 224x224 images = 256 image
  tokens; Llama 512 wide x 6 layers.
- `qwen2.5-vl-3b-scaled`: Qwen2.5-VL-3B's vision transformer at a quarter of its width and
  depth (320 wide, 4 heads of 80, SwiGLU 856, 8 blocks with window attention over 112-pixel
  windows, full attention in blocks 3 and 7), its text model at a quarter of its width with
  6 layers (512 wide, 4 heads of 128 with 2 KV heads, M-RoPE sections 16/24/24), and its
  processor's pixel range, so a 448x336 image is 192 image tokens.

    python benchmarks/multimodal.py [--shape llava-scaled] [--requests 8] [--max-tokens 16] [--threads 2]

Each side runs in a child process (harness.py). Results go to docs/multimodal.md with the
command and the commit.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from harness import emit, run_child, self_command  # noqa: E402

TEXT_SHAPE = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=6, num_attention_heads=8,
                  num_key_value_heads=2)
VISION_SHAPE = dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=6)
IMAGE_SIZE = 224
QWEN_TEXT = dict(hidden_size=512, intermediate_size=2752, num_hidden_layers=6, num_attention_heads=4,
                 num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                                         "mrope_section": [16, 24, 24]})
QWEN_VISION = dict(depth=8, hidden_size=320, intermediate_size=856, num_heads=4, out_hidden_size=512,
                   window_size=112, fullatt_block_indexes=[3, 7])
QWEN_PIXELS = (3136, 12845056)  # Qwen2.5-VL's min_pixels, max_pixels
SHAPES = {  # prompt with one image, the image's size
    "llava-scaled": ("USER: <image>\n{} ASSISTANT:", (320, 240)),
    "qwen2.5-vl-3b-scaled": ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n"
                             "<|im_start|>assistant\n", (448, 336)),
}


def prompts(shape: str, n: int, same_image: bool):
    from mm_utils import make_image

    template, size = SHAPES[shape]
    return [(template.format(f"Request {i}: describe the picture."), make_image(0 if same_image else i, size))
            for i in range(n)]


def warm_up_prompt(shape: str):
    from mm_utils import make_image

    template, size = SHAPES[shape]
    return template.format("warm-up"), make_image(10_000, size)


def build(shape: str, path: Path) -> str:
    if shape == "llava-scaled":
        from mm_utils import build_tiny_llava

        return str(build_tiny_llava(path, image_size=IMAGE_SIZE, text_shape=TEXT_SHAPE, vision_shape=VISION_SHAPE))
    from qwen_vl_utils import build_tiny_qwen_vl

    return str(build_tiny_qwen_vl(path, "qwen2_5_vl", text_shape=QWEN_TEXT, vision_shape=QWEN_VISION,
                                  pixels=QWEN_PIXELS))


def run_ours(shape: str, model: str, n: int, max_tokens: int, threads: int, same_image: bool,
             prefix_caching: bool) -> dict:
    from deepinfer_dp.config import EngineConfig
    from deepinfer_dp.engine.llm_engine import LLMEngine
    from deepinfer_dp.engine.step_loop import StepLoop
    from deepinfer_dp.multimodal.image_worker import MultiModalPrompt
    from deepinfer_dp.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=model, torch_threads=threads, max_model_len=1024,
                                    enable_prefix_caching=prefix_caching))
    loop = StepLoop(engine)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    def batch(items) -> tuple[float, list[float]]:
        first: dict[str, float] = {}

        def on_outputs(outs) -> None:
            now = time.perf_counter()
            for o in outs:
                first.setdefault(o.request_id, now)
        start = time.perf_counter()
        for text, image in items:
            ids = engine.tokenizer(text).input_ids
            engine.add_checked(ids, params.clone(), mm=MultiModalPrompt(text, [image]))
        loop.run(on_outputs)
        return time.perf_counter() - start, [t - start for t in first.values()]

    batch([warm_up_prompt(shape)])  # threads, kernels, processor
    before = loop.stats()
    wall, ttft = batch(prompts(shape, n, same_image))
    after = loop.stats()
    step_s = after["step_time_s"] - before["step_time_s"]
    encoder_s = after["encoder_time_s"] - before["encoder_time_s"]
    engine.shutdown()
    return {"requests_per_s": n / wall, "mean_ttft_s": sum(ttft) / len(ttft), "wall_s": wall,
            "encoder_s": encoder_s, "encoder_share_of_step": encoder_s / step_s if step_s else 0.0,
            "encoder_cache_hits": after["encoder_cache_hits"] - before["encoder_cache_hits"],
            "preprocess_s": after["image_preprocess_time_s"] - before["image_preprocess_time_s"]}


def run_transformers(shape: str, model: str, n: int, max_tokens: int, threads: int) -> dict:
    import torch
    from transformers import AutoModelForImageTextToText

    from deepinfer_dp.multimodal.qwen_processor import load_processor

    torch.set_num_threads(threads)
    processor = load_processor(model)  # AutoProcessor, or Qwen VL's without video
    processor.tokenizer.padding_side = "left"
    net = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32).eval()
    net.generation_config.eos_token_id = None

    def generate(items, tokens: int) -> float:
        start = time.perf_counter()
        inputs = processor(text=[t for t, _ in items], images=[i for _, i in items], return_tensors="pt",
                           padding=True)
        with torch.inference_mode():
            net.generate(**inputs, max_new_tokens=tokens, do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    generate([warm_up_prompt(shape)], 2)  # warm-up
    items = prompts(shape, n, False)
    ttft = generate(items, 1)  # the whole batch's first token (one padded batch: all at once)
    wall = generate(items, max_tokens)
    return {"requests_per_s": n / wall, "mean_ttft_s": ttft, "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="llava-scaled")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        n, tokens, threads = args.requests, args.max_tokens, args.threads
        if args.side == "transformers":
            emit(run_transformers(args.shape, args.model, n, tokens, threads))
        else:
            same, caching = {"ours": (False, True), "ours-distinct-no-prefix": (False, False),
                             "ours-same-image-no-prefix": (True, False)}[args.side]
            emit(run_ours(args.shape, args.model, n, tokens, threads, same, caching))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = build(args.shape, Path(tmp) / "bench-model")
        results = {}
        for side in ("ours", "transformers", "ours-distinct-no-prefix", "ours-same-image-no-prefix"):
            cmd = self_command(__file__, "--side", side, "--shape", args.shape, "--model", model,
                               "--requests", str(args.requests),
                               "--max-tokens", str(args.max_tokens), "--threads", str(args.threads))
            results[side] = run_child(cmd, side)
            print(side, json.dumps({k: round(v, 3) for k, v in results[side].items()}), flush=True)


if __name__ == "__main__":
    main()
