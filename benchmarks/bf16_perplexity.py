"""Perplexity of held-out text through our own prompt logprobs: the bf16 path against the
fp32 path on the same bf16 checkpoint (a bf16 copy of the default SmolLM2 unless --model).

    .venv/bin/python benchmarks/bf16_perplexity.py [--model DIR] [--text FILE ...] [--window 512]

The texts (default: the GPL-3 and Apache-2.0 licence texts that Debian ships, English prose
that is in no file of this project) are cut into windows of `window` tokens; each window is a
prompt whose tokens after the first are scored (prompt_logprobs=0). Perplexity is
exp(mean negative log-likelihood) over every scored token.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))

from bf16_model import bf16_copy  # noqa: E402

TEXTS = ["/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0"]


def windows(model_dir: str, texts: list[str], window: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from deepinfer_dp.models.loader import resolve_model_dir

    tok = AutoTokenizer.from_pretrained(resolve_model_dir(model_dir))  # a .gguf file too
    out = []
    for path in texts:
        ids = tok(Path(path).read_text(), add_special_tokens=False).input_ids
        out += [ids[i:i + window] for i in range(0, len(ids) - window + 1, window)]
    return out


def perplexity(model_dir: str, dtype: str, prompts: list[list[int]]) -> tuple[float, int]:
    from deepinfer_dp import LLM, SamplingParams

    llm = LLM(model_dir, dtype=dtype, decode_sequence=False, max_model_len=max(map(len, prompts)) + 1)
    try:
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    finally:
        llm.shutdown()
    scored = [lp for out in outs for lp in out[0].prompt_logprobs[1:]]
    return math.exp(-sum(scored) / len(scored)), len(scored)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a Hugging Face directory or .gguf file (default: SmolLM2 "
                    "in bf16); GGUF blocks are rounded to bf16 on the bf16 path")
    ap.add_argument("--text", nargs="+", default=TEXTS)
    ap.add_argument("--window", type=int, default=512)
    args = ap.parse_args()
    model = args.model
    if model is None:
        from deepinfer_dp.models import default_model_path
        from deepinfer_dp.models.loader import resolve_model_dir

        model = str(bf16_copy(resolve_model_dir(default_model_path()), "/tmp/peers/smollm2-bf16"))
    prompts = windows(model, args.text, args.window)
    ppl32, n = perplexity(model, "float32", prompts)
    ppl16, _ = perplexity(model, "bfloat16", prompts)
    print(f"{model}: {n} tokens in {len(prompts)} windows of {args.window}")
    print(f"perplexity fp32 path {ppl32:.4f}, bf16 path {ppl16:.4f}: bf16 {(ppl16 / ppl32 - 1) * 100:+.2f}%")


if __name__ == "__main__":
    main()
