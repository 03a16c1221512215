"""The tokenizer a model is served with, as vLLM picks it.

By default the model's own: its directory's tokenizer files, or, for a .gguf model, the
tokenizer and chat template of the file's metadata (the converted directory carries them,
default_model.py). `tokenizer` (vLLM's --tokenizer) names another source: a Hugging Face
directory, a repo id in the local hub cache, or a .gguf file whose metadata holds one.
"""

from __future__ import annotations

import os
from pathlib import Path

from deepinfer_dp.models.hub import cached_snapshot, is_repo_id, snapshot_model

# files of which one marks a snapshot as a tokenizer directory (else its one .gguf file is used)
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model")


def tokenizer_source(tokenizer: str | os.PathLike) -> Path:
    """The directory or .gguf file that `tokenizer` names; FileNotFoundError naming it if none."""
    path = Path(tokenizer).expanduser()
    if not path.exists() and is_repo_id(str(tokenizer)):
        path = snapshot_model(cached_snapshot(str(tokenizer)), str(tokenizer), TOKENIZER_FILES)
    if not path.exists():
        raise FileNotFoundError(f"tokenizer path {str(path)!r} does not exist")
    if path.is_file() and path.suffix != ".gguf":
        raise ValueError(f"tokenizer file {str(path)!r} is not a .gguf file; pass a GGUF file or a "
                         "directory holding the tokenizer's files")
    return path


def load_tokenizer(model_dir: str | os.PathLike, tokenizer: str | os.PathLike | None = None):
    """The tokenizer of the model in `model_dir` (a loadable Hugging Face directory), or the one
    `tokenizer` names (tokenizer_source)."""
    from transformers import AutoTokenizer

    if tokenizer is None:
        return AutoTokenizer.from_pretrained(model_dir)
    source = tokenizer_source(tokenizer)
    if source.is_file():  # transformers builds it, chat template included, from the GGUF metadata
        return AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    return AutoTokenizer.from_pretrained(source)
