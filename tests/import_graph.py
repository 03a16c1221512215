"""The package's import graph, read from its source with `ast` (nothing is imported), and the
layer order that docs/architecture.md declares. Used by tests/test_import_layers.py and
tests/models/test_registry.py; `python tests/import_graph.py` prints every edge.
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "deepinfer_dp"
ARCHITECTURE_DOC = ROOT / "docs" / "architecture.md"


@dataclass(frozen=True)
class Import:
    """One written import of a package module by another."""

    source: str
    target: str
    line: int
    in_function: bool  # inside a def: it runs late, which is how a circle hides
    type_only: bool  # under `if TYPE_CHECKING:`


def module_files(package_dir: Path, package: str) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its `__init__.py`)."""
    found = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join([package, *parts])] = path
    return found


def extension_modules(package_dir: Path, package: str) -> set[str]:
    """Compiled modules (the C++ core, `_C`): declared in CMakeLists.txt, built elsewhere."""
    cmake = package_dir.parent / "CMakeLists.txt"
    names = set(re.findall(r"pybind11_add_module\(\s*(\w+)", cmake.read_text())) if cmake.is_file() else set()
    return {f"{package}.{name}" for name in names}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _Visitor(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool, known: set[str], package: str) -> None:
        self.module, self.is_package, self.known, self.package = module, is_package, known, package
        self.functions = 0
        self.type_only = 0
        self.found: list[Import] = []
        self.dynamic: list[int] = []  # lines of importlib.import_module / __import__ calls

    def _function(self, node: ast.AST) -> None:
        self.functions += 1
        self.generic_visit(node)
        self.functions -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            return self.generic_visit(node)
        self.type_only += 1
        for child in node.body:
            self.visit(child)
        self.type_only -= 1
        for child in node.orelse:
            self.visit(child)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name in ("import_module", "__import__"):
            self.dynamic.append(node.lineno)
        self.generic_visit(node)

    def _base(self, node: ast.ImportFrom) -> str:
        """The absolute module an ImportFrom names, relative levels resolved."""
        if not node.level:
            return node.module or ""
        parts = self.module.split(".") if self.is_package else self.module.split(".")[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        return ".".join(parts + ([node.module] if node.module else []))

    def _import(self, node: ast.Import | ast.ImportFrom) -> None:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:  # `from a import b` loads module a.b when there is one, else a name of module a
            base = self._base(node)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in self.known else base for a in node.names]
        for target in dict.fromkeys(names):
            if (target == self.package or target.startswith(self.package + ".")) and target != self.module:
                self.found.append(Import(self.module, target, node.lineno, self.functions > 0, self.type_only > 0))

    visit_Import = visit_ImportFrom = _import


@dataclass
class PackageImports:
    imports: list[Import]
    dynamic: dict[str, list[int]]  # module -> lines that import by name at run time
    modules: list[str]


def read_imports(package_dir: Path | None = None, package: str = PACKAGE) -> PackageImports:
    """Every import of a package module written anywhere in the package: at the top, inside
    functions, under TYPE_CHECKING; relative imports resolved."""
    package_dir = package_dir or ROOT / package
    files = module_files(package_dir, package)
    known = set(files) | extension_modules(package_dir, package)
    imports, dynamic = [], {}
    for module, path in files.items():
        visitor = _Visitor(module, path.name == "__init__.py", known, package)
        visitor.visit(ast.parse(path.read_text(), filename=str(path)))
        imports += visitor.found
        if visitor.dynamic:
            dynamic[module] = visitor.dynamic
    return PackageImports(imports, dynamic, sorted(known))


def graph(imports: list[Import]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for imp in imports:
        edges.setdefault(imp.source, set()).add(imp.target)
    return edges


def find_cycle(edges: dict[str, set[str]], within: set[str] | None = None) -> list[str] | None:
    """One circle of the directed graph as [a, b, ..., a] (only through `within`, if given),
    or None; depth-first, iterative."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def successors(node: str):
        return iter(sorted(n for n in edges.get(node, ()) if within is None or n in within))

    for start in sorted(within if within is not None else edges):
        if state.get(start):
            continue
        path, stack = [start], [successors(start)]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(successors(nxt))
    return None


def all_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One circle per group of modules that reach each other (a strongly connected component
    of more than one module), so that every separate circle is reported at once."""
    groups: dict[frozenset[str], None] = {}
    for node in sorted(edges):
        group = frozenset(n for n in reachable(edges, node) if node in reachable(edges, n))
        if len(group) > 1:
            groups[group] = None
    return [find_cycle(edges, set(group)) for group in groups]


def reachable(edges: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in edges.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def parse_layers(text: str) -> list[list[str]]:
    """The layer order of the "## Layers" section: its ```text block, one layer a line, lowest
    first, the units of one layer separated by `|`."""
    if "\n## Layers\n" not in text:
        raise ValueError("docs/architecture.md has no '## Layers' section")
    block = re.search(r"```text\n(.*?)```", text.split("\n## Layers\n", 1)[1], re.S)
    if block is None:
        raise ValueError("docs/architecture.md: the Layers section has no ```text block")
    return [[unit.strip() for unit in line.split("|")] for line in block.group(1).splitlines() if line.strip()]


class Layering:
    """Which unit, and so which layer, a module belongs to: the longest unit that prefixes its
    name (`spec_decode.config` before `spec_decode`); the package's own name is the root."""

    def __init__(self, layers: list[list[str]], package: str = PACKAGE) -> None:
        self.package = package
        self.level = {unit: i for i, units in enumerate(layers) for unit in units}

    def unit(self, module: str) -> str | None:
        if module == self.package:
            return self.package if self.package in self.level else None
        parts = module[len(self.package) + 1:].split(".")
        for n in range(len(parts), 0, -1):
            if ".".join(parts[:n]) in self.level:
                return ".".join(parts[:n])
        return None

    def against_order(self, imp: Import) -> bool:
        """True for an import of a higher layer, or of another unit of the same layer."""
        src, dst = self.unit(imp.source), self.unit(imp.target)
        return src != dst and self.level[dst] >= self.level[src]


def declared_layering() -> Layering:
    return Layering(parse_layers(ARCHITECTURE_DOC.read_text()))


if __name__ == "__main__":
    layering, found = declared_layering(), read_imports()
    for imp in found.imports:
        where = ("def " if imp.in_function else "    ") + ("TYPE " if imp.type_only else "     ")
        bad = "  <-- against the layer order" if layering.against_order(imp) else ""
        print(f"{where}{imp.source}:{imp.line} -> {imp.target}{bad}", file=sys.stdout)
    print("circles:", all_cycles(graph(found.imports)))
