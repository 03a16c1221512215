"""Images in, side by side in one run, on a random-weight LLaVA of a realistic shape scaled to
a few minutes on 2 cores (CLIP tower 384 wide x 6 layers, 224x224 images = 256 image tokens;
Llama 512 wide x 6 layers): requests/s and TTFT at one image per request against transformers
`generate` (one padded batch) on the same model; the encoder cache's effect when every request
carries the same image (prefix caching off, so only the encoder cache can help); and the
share of the engine's step time spent in the vision encoder.

    python benchmarks/multimodal.py [--requests 8] [--max-tokens 16] [--threads 2]

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


def prompts(n: int, same_image: bool):
    from mm_utils import make_image

    return [(f"USER: <image>\nRequest {i}: describe the picture. ASSISTANT:",
             make_image(0 if same_image else i, (320, 240))) for i in range(n)]


def run_ours(model: str, n: int, max_tokens: int, threads: int, same_image: bool, prefix_caching: bool) -> dict:
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

    from mm_utils import make_image

    batch([("USER: <image>\nwarm-up ASSISTANT:", make_image(10_000, (320, 240)))])  # threads, kernels, processor
    before = loop.stats()
    wall, ttft = batch(prompts(n, same_image))
    after = loop.stats()
    step_s = after["step_time_s"] - before["step_time_s"]
    encoder_s = after["encoder_time_s"] - before["encoder_time_s"]
    engine.shutdown()
    return {"requests_per_s": n / wall, "mean_ttft_s": sum(ttft) / len(ttft), "wall_s": wall,
            "encoder_s": encoder_s, "encoder_share_of_step": encoder_s / step_s if step_s else 0.0,
            "encoder_cache_hits": after["encoder_cache_hits"] - before["encoder_cache_hits"],
            "preprocess_s": after["image_preprocess_time_s"] - before["image_preprocess_time_s"]}


def run_transformers(model: str, n: int, max_tokens: int, threads: int) -> dict:
    import torch
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    torch.set_num_threads(threads)
    processor = AutoProcessor.from_pretrained(model)
    processor.tokenizer.padding_side = "left"
    net = LlavaForConditionalGeneration.from_pretrained(model, dtype=torch.float32).eval()
    net.generation_config.eos_token_id = None

    def generate(items, tokens: int) -> float:
        start = time.perf_counter()
        inputs = processor(text=[t for t, _ in items], images=[i for _, i in items], return_tensors="pt",
                           padding=True)
        with torch.inference_mode():
            net.generate(**inputs, max_new_tokens=tokens, do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    from mm_utils import make_image

    generate([("USER: <image>\nwarm-up ASSISTANT:", make_image(10_000, (320, 240)))], 2)  # warm-up
    items = prompts(n, False)
    ttft = generate(items, 1)  # the whole batch's first token (one padded batch: all at once)
    wall = generate(items, max_tokens)
    return {"requests_per_s": n / wall, "mean_ttft_s": ttft, "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        n, tokens, threads = args.requests, args.max_tokens, args.threads
        if args.side == "transformers":
            emit(run_transformers(args.model, n, tokens, threads))
        else:
            same, caching = {"ours": (False, True), "ours-distinct-no-prefix": (False, False),
                             "ours-same-image-no-prefix": (True, False)}[args.side]
            emit(run_ours(args.model, n, tokens, threads, same, caching))
        return
    from mm_utils import build_tiny_llava

    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_tiny_llava(Path(tmp) / "llava-bench", image_size=IMAGE_SIZE, text_shape=TEXT_SHAPE,
                                     vision_shape=VISION_SHAPE))
        results = {}
        for side in ("ours", "transformers", "ours-distinct-no-prefix", "ours-same-image-no-prefix"):
            cmd = self_command(__file__, "--side", side, "--model", model, "--requests", str(args.requests),
                               "--max-tokens", str(args.max_tokens), "--threads", str(args.threads))
            results[side] = run_child(cmd, side)
            print(side, json.dumps({k: round(v, 3) for k, v in results[side].items()}), flush=True)


if __name__ == "__main__":
    main()
