"""The model's own sampling defaults, from its generation_config.json (vLLM's
`--generation-config`): what a request gets for each sampling field it does not set.

EngineConfig.generation_config says where they come from:
  - "auto": the model directory's generation_config.json;
  - "vllm": none, so every request gets vLLM's neutral defaults (SamplingParams' own);
  - a folder path: the generation_config.json in that folder.
Only fields the file sets are taken (vLLM's `get_diff_sampling_param`): temperature, top_p,
top_k, min_p, repetition_penalty, and max_new_tokens as max_tokens. A file that sets none of
them, or no file at all, means neutral defaults. A GGUF file's converted directory holds the
file's own general.sampling.* values; the default model (SmolLM2-135M-Instruct as a GGUF
file) carries none in its metadata, so the converter writes its model card's settings
(temperature 0.2, top_p 0.9) instead (models/default_model.py).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from deepinfer_dp.sampling_params import InvalidRequest, SamplingParams

logger = logging.getLogger(__name__)

# generation_config.json key -> SamplingParams field
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
FILE = "generation_config.json"


def sampling_defaults(generation_config: str, model_dir: str | Path) -> dict[str, Any]:
    """SamplingParams field -> value, for the fields the chosen generation config sets."""
    if generation_config == "vllm":
        return {}
    folder = Path(model_dir) if generation_config == "auto" else Path(generation_config)
    path = folder / FILE
    if not path.is_file():
        if generation_config != "auto":
            raise ValueError(f"generation_config: no {FILE} in {folder}")
        return {}
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"generation_config: cannot read {path}: {e}") from None
    if not isinstance(values, dict):
        raise ValueError(f"generation_config: {path} does not hold a JSON object")
    return {field: values[key] for key, field in FIELDS.items() if values.get(key) is not None}


def checked_sampling_defaults(generation_config: str, model_dir: str | Path) -> dict[str, Any]:
    """sampling_defaults, checked once, at engine start: a value no request may have would
    otherwise fail every request that leaves its field unset."""
    defaults = sampling_defaults(generation_config, model_dir)
    try:
        SamplingParams(**defaults).verify()
    except InvalidRequest as e:
        raise ValueError(f"generation_config ({generation_config}): {e}") from None
    if defaults:
        logger.info("sampling defaults from the model's generation config: %s", defaults)
    return defaults
