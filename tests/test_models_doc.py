"""docs/models.md names, for every family and weight format, the test that proves it; each
named test must exist (its file, its function and, where given, a parameter id made of the
file's own strings), so the table cannot go on citing a test that was renamed or removed.
Read statically: collecting the model tests would cost more than the check is worth."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# `tests/x.py::name[id]`, or `::name` / `[id]` continuing the previous reference
REFERENCE = re.compile(r"`(tests/[\w/]+\.py)?(?:::(\w+))?(\[[\w-]+\])?`")


def cited_tests() -> set[tuple[str, str, str]]:
    """(file, function, parameter id or '') of every test docs/models.md names."""
    cited, file, name = set(), None, None
    for m in REFERENCE.finditer((ROOT / "docs" / "models.md").read_text()):
        if m[1]:
            file, name = m[1], None
        name = m[2] or name
        if name:
            cited.add((file, name, (m[3] or "").strip("[]")))
    return cited


def _is_id(param_id: str, strings: set[str]) -> bool:
    """Whether `param_id` is some of `strings` joined by '-' (pytest's id of stacked parameters)."""
    if param_id in strings:
        return True
    return any(param_id.startswith(s + "-") and _is_id(param_id[len(s) + 1:], strings) for s in strings if s)


def test_every_cited_test_exists():
    cited = cited_tests()
    assert len(cited) > 20
    missing = []
    for file, name, param_id in sorted(cited):
        tree = ast.parse((ROOT / file).read_text())
        functions = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        if name not in functions or (param_id and not _is_id(param_id, strings)):
            missing.append(f"{file}::{name}[{param_id}]")
    assert missing == []


def test_a_wrong_citation_is_caught():
    strings = {"qwen2-bias", "gguf", "safetensors"}
    assert _is_id("qwen2-bias-gguf", strings) and not _is_id("qwen2-gguf", strings)
