"""Model ids the way vLLM takes them: `org/name` found in the local Hugging Face cache, offline.

A model argument that is not a path on disk but reads as a Hugging Face repo id is looked up
in the hub cache (`HF_HUB_CACHE`, else `HF_HOME/hub`, else ~/.cache/huggingface/hub; read
when the model is resolved, not when huggingface_hub was imported) by huggingface_hub's own
resolution (`snapshot_download` with `local_files_only`): refs/<revision> names the snapshot,
and a commit hash names it directly. Nothing is ever downloaded; a model that is not there is
an error naming the cache it looked in and the command that fetches it.
"""

from __future__ import annotations

import os
from pathlib import Path


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, from the environment as huggingface_hub reads it."""
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if cache:
        return Path(cache).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def is_repo_id(name: str) -> bool:
    """Whether `name` reads as a Hugging Face repo id (`org/name` or `name`), not a path."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if name.startswith((".", "/", "~")) or name.endswith(".gguf"):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def fetch_hint(repo_id: str, revision: str | None) -> str:
    flag = f" --revision {revision}" if revision else ""
    return (f"fetch it with `hf download {repo_id}{flag}` (`huggingface-cli download` on older huggingface_hub), "
            "or pass a local directory or .gguf file")


def cached_snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The snapshot directory of `repo_id` at `revision` (default: main) in the local hub cache.
    FileNotFoundError naming the cache and how to fetch the model when it is not there."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache_dir()
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError):
        at = f" at revision {revision!r}" if revision else ""
        raise FileNotFoundError(
            f"model {repo_id!r}{at} is neither a local path nor in the Hugging Face cache {str(cache)!r} "
            f"(HF_HUB_CACHE / HF_HOME); this engine never downloads: {fetch_hint(repo_id, revision)}") from None


def snapshot_model(snapshot: Path, repo_id: str, markers: tuple[str, ...] = ("config.json",)) -> Path:
    """What to load from a snapshot: the snapshot itself (a Hugging Face directory, which holds
    one of `markers`), or its one .gguf file when it holds none (a repository of GGUF files)."""
    if any((snapshot / marker).is_file() for marker in markers):
        return snapshot
    ggufs = sorted(p for p in snapshot.rglob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        names = ", ".join(str(p.relative_to(snapshot)) for p in ggufs)
        raise ValueError(f"model {repo_id!r} holds several GGUF files ({names}); pass the path of the one to "
                         f"serve: {snapshot}/<file>")
    raise FileNotFoundError(f"model {repo_id!r} in the Hugging Face cache ({snapshot}) has none of "
                            f"{', '.join(markers)} and no .gguf file; the download may be incomplete: "
                            f"{fetch_hint(repo_id, None)}")
