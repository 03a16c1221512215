"""A fake Hugging Face hub cache in a folder, laid out as huggingface_hub writes it:
models--org--name/blobs/<sha256>, snapshots/<commit>/<file> (relative links to the blobs) and
refs/<branch> holding the commit hash, so that the engine finds models in it the way it
finds downloaded ones."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def add_snapshot(cache: Path, repo_id: str, source: Path, commit: str, refs: tuple[str, ...] = ("main",)) -> Path:
    """Puts the files of `source` (a folder, or one file) into `cache` as the snapshot `commit`
    (40 hex digits) of model `repo_id`, which `refs` (branch or tag names) point at."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    files = [source] if source.is_file() else sorted(p for p in source.rglob("*") if p.is_file())
    for file in files:
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / (file.name if source.is_file() else file.relative_to(source))
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot
