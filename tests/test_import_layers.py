"""The package's imports keep to the layer order of docs/architecture.md ("Layers") and make
no circle: every import counts, at the top of a file, inside a function or under
TYPE_CHECKING, since an import moved into a function still ties the two modules together.
Imports of other packages (torch, llguidance, ...) are free to be lazy and are not edges."""

from __future__ import annotations

import textwrap
from itertools import pairwise
from pathlib import Path

import pytest
from import_graph import (
    PACKAGE,
    Import,
    Layering,
    all_cycles,
    declared_layering,
    find_cycle,
    graph,
    parse_layers,
    read_imports,
)

# Where the package loads its own modules by name at run time, out of sight of this test:
# the model registry's lazy import of the family a checkpoint needs is its job.
DYNAMIC_IMPORTS_ALLOWED = {f"{PACKAGE}.models.registry"}

# TODO(lead): remove this exception. api_servers.py and launcher.py import each other inside
# functions (run_server / run_api_servers); they were being rewritten for process resilience
# while this test was written. It is the only circle excused, and test_no_import_circles
# fails once it is gone, so that this entry goes with it.
KNOWN_CIRCLES = [frozenset({f"{PACKAGE}.entrypoints.openai.api_servers", f"{PACKAGE}.entrypoints.openai.launcher"})]


def _describe(imp: Import, layering: Layering) -> str:
    how = "inside a function" if imp.in_function else ("under TYPE_CHECKING" if imp.type_only else "at the top")
    src, dst = layering.unit(imp.source), layering.unit(imp.target)
    return (f"{imp.source} (line {imp.line}, {how}) imports {imp.target}: "
            f"unit {src!r} (layer {layering.level[src]}) -> {dst!r} (layer {layering.level[dst]})")


@pytest.fixture(scope="module")
def found():
    return read_imports()


def test_every_module_is_in_a_declared_layer(found):
    layering = declared_layering()
    homeless = [m for m in found.modules if layering.unit(m) is None]
    assert not homeless, f"modules in no layer of docs/architecture.md's Layers block: {homeless}"
    units = set(layering.level)
    used = {layering.unit(m) for m in found.modules}
    assert units <= used, f"the Layers block names units with no module: {sorted(units - used)}"


def test_no_import_circles(found):
    report, cycles = [], all_cycles(graph(found.imports))
    for known in KNOWN_CIRCLES:
        if known not in {frozenset(c) for c in cycles}:
            report.append(f"the known circle {sorted(known)} is gone: remove it from KNOWN_CIRCLES")
    for cycle in cycles:
        if frozenset(cycle) in KNOWN_CIRCLES:
            continue
        report.append("import circle: " + " -> ".join(cycle))
        report += [f"  {imp.source}:{imp.line} -> {imp.target}" + (" (inside a function)" if imp.in_function else "")
                   for a, b in pairwise(cycle) for imp in found.imports if (imp.source, imp.target) == (a, b)]
    assert not report, "\n".join(report)


def test_no_import_against_the_layer_order(found):
    layering = declared_layering()
    bad = [_describe(imp, layering) for imp in found.imports if layering.against_order(imp)]
    assert not bad, "imports against the layer order (docs/architecture.md, Layers):\n" + "\n".join(bad)


def test_modules_are_loaded_by_name_only_in_the_registry(found):
    hidden = {m: lines for m, lines in found.dynamic.items() if m not in DYNAMIC_IMPORTS_ALLOWED}
    assert not hidden, f"importlib.import_module / __import__ outside the model registry: {hidden}"


# ---- the checker itself: it must see what it exists to catch ------------------------------

def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_checker_catches_a_circle_hidden_in_a_function_and_an_upward_import(tmp_path):
    pkg = _write(tmp_path / PACKAGE, {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/a.py": """
            from __future__ import annotations
            import torch._dynamo  # another package: free to import anywhere

            def late():
                from ..high import b  # up a layer, closing a circle, out of sight until called
                return b
            """,
        "high/__init__.py": "",
        "high/b.py": "from deepinfer_dp.low import a\n",
        "high/c.py": """
            from typing import TYPE_CHECKING
            from . import b
            from .b import a as same_a
            if TYPE_CHECKING:
                from deepinfer_dp import _C
            """,
    })
    (tmp_path / "CMakeLists.txt").write_text("pybind11_add_module(_C csrc/bindings.cpp)\n")
    found = read_imports(pkg, PACKAGE)
    edges = {(i.source, i.target, i.in_function, i.type_only) for i in found.imports}
    assert edges == {
        (f"{PACKAGE}.low.a", f"{PACKAGE}.high.b", True, False),
        (f"{PACKAGE}.high.b", f"{PACKAGE}.low.a", False, False),
        (f"{PACKAGE}.high.c", f"{PACKAGE}.high.b", False, False),
        (f"{PACKAGE}.high.c", f"{PACKAGE}._C", False, True),
    }
    assert find_cycle(graph(found.imports)) == [f"{PACKAGE}.high.b", f"{PACKAGE}.low.a", f"{PACKAGE}.high.b"]
    layering = Layering(parse_layers("x\n## Layers\n\n```text\n_C\nlow\nhigh\n```\n"))
    upward = [(i.source, i.target) for i in found.imports if layering.against_order(i)]
    assert upward == [(f"{PACKAGE}.low.a", f"{PACKAGE}.high.b")]


def test_checker_refuses_imports_between_units_of_one_layer():
    layering = Layering([["_C"], ["engine", "metrics"]])
    sideways = Import(f"{PACKAGE}.metrics.x", f"{PACKAGE}.engine.y", 1, False, False)
    down = Import(f"{PACKAGE}.metrics.x", f"{PACKAGE}._C", 1, True, False)
    assert layering.against_order(sideways) and not layering.against_order(down)


def test_longest_unit_wins():
    layering = Layering([["spec_decode.config"], ["config"], ["spec_decode"]])
    assert layering.unit(f"{PACKAGE}.spec_decode.config") == "spec_decode.config"
    assert layering.unit(f"{PACKAGE}.spec_decode.speculator") == "spec_decode"
    assert layering.against_order(Import(f"{PACKAGE}.config", f"{PACKAGE}.spec_decode.config", 1, False, False)) \
        is False
