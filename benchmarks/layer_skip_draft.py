"""A layer-skip draft model: the first N decoder layers of a model, with its embeddings, final
norm and LM head, written as a model directory of its own. It shares the target's tokenizer,
so it can draft for it (speculative_config {"method": "draft_model", "model": DIR}); no smaller
model of SmolLM2's tokenizer is available offline, and this is a draft a deployment can make
from the target itself.

    python benchmarks/layer_skip_draft.py --layers 4 --out /tmp/smollm2-draft4   [--model PATH]

Works on a Hugging Face directory or a GGUF file (converted once, as the engine does); a
converted GGUF file's packed (quantized) matrices are kept packed, so the draft runs the
same kernels as the target.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import save_file

from deepinfer_dp.models.default_model import PACKED_FILE
from deepinfer_dp.models.loader import resolve_model_dir, safetensors_files

_LAYER = re.compile(r"\.layers\.(\d+)\.")


def _kept(name: str, layers: int) -> bool:
    m = _LAYER.search(name)
    return m is None or int(m.group(1)) < layers


def write_layer_skip_draft(model: str | None, out: Path, layers: int) -> Path:
    """Writes the draft (once: an existing `out` with a config is reused) and returns its path."""
    out = Path(out)
    if (out / "config.json").is_file():
        return out
    src = resolve_model_dir(model)
    config = json.loads((src / "config.json").read_text())
    if not 1 <= layers < config["num_hidden_layers"]:
        raise SystemExit(f"--layers must be in [1, {config['num_hidden_layers']}) for {src}")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in src.iterdir():  # tokenizer, generation config, chat template
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, tmp / f.name)
    config["num_hidden_layers"] = layers
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {}
    for file in safetensors_files(src):
        with safe_open(file, framework="pt") as f:
            tensors.update({n: f.get_tensor(n) for n in f.keys() if _kept(n, layers)})
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    if (src / PACKED_FILE).is_file():
        with safe_open(src / PACKED_FILE, framework="np") as f:
            layout = f.metadata()
            packed = {n: f.get_tensor(n) for n in f.keys() if _kept(n, layers)}
        (tmp / PACKED_FILE).parent.mkdir()
        kept_layout = {k: v for k, v in layout.items() if k in packed or k == "format"}
        save_numpy(packed, tmp / PACKED_FILE, metadata=kept_layout)
    tmp.rename(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="target (default: the default SmolLM2 model)")
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    print(write_layer_skip_draft(args.model, args.out, args.layers))


if __name__ == "__main__":
    main()
