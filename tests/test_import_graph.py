"""The import graph of speculant has no cycles and keeps its layers.

Every module of the package (framework/, plugins/, kernels/, spec_registry/; the folder of each
import name is pyproject.toml's ``package-dir``) is parsed with ``ast``; every ``import`` and
``from ... import`` of a speculant module counts, at module level and inside functions alike,
except those under ``if TYPE_CHECKING:`` (they never run). ``from speculant.x import y`` is an
edge to the module ``speculant.x.y`` when that is a module, else to ``speculant.x``. Importing a
module also runs its packages' ``__init__``; those implicit edges are left out (every module
would otherwise depend on ``speculant/__init__.py``), the explicit ones count.

Layering rules: models/ and kernels/ never import engine/; engine/ never imports plugins/; no
plugin imports another plugin.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = None

ROOT = Path(__file__).resolve().parents[1]


def package_dirs() -> dict[str, Path]:
    """Import name -> folder, from pyproject.toml's [tool.setuptools] package-dir."""
    text = (ROOT / "pyproject.toml").read_text()
    if tomllib is not None:
        mapping = tomllib.loads(text)["tool"]["setuptools"]["package-dir"]
    else:  # pragma: no cover
        line = re.search(r"^package-dir\s*=\s*\{(.*)\}", text, re.M).group(1)
        mapping = dict(re.findall(r'"([\w.]+)"\s*=\s*"([\w/.-]+)"', line))
    return {name: ROOT / folder for name, folder in mapping.items()}


def modules() -> dict[str, Path]:
    """Every module of the package: dotted name -> file. A folder mapped to its own import name
    (speculant.plugins -> plugins/) wins over the same folder reached through its parent."""
    found: dict[str, Path] = {}
    # longest names last, so an explicit mapping overrides the one derived from its parent
    for name, folder in sorted(package_dirs().items(), key=lambda kv: kv[0].count(".")):
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            if any(p in ("build", "__pycache__") or p.endswith(".egg-info") for p in rel.parts):
                continue
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([name, *parts])] = path
    # a module that is reachable under two names keeps the one its mapping gives it
    by_path: dict[Path, str] = {}
    for mod, path in found.items():
        if path not in by_path or mod.count(".") < by_path[path].count("."):
            by_path[path] = mod
    return {mod: path for path, mod in by_path.items()}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, module: str, is_package: bool) -> list[tuple[str, list[str], int]]:
    """(imported module, names, line) of every import that runs (``if TYPE_CHECKING`` left out).
    Relative imports are made absolute against ``module``."""
    out: list[tuple[str, list[str], int]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.append((alias.name, [], node.lineno))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".") if is_package else module.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join([*pkg, base] if base else pkg)
            out.append((base, [a.name for a in node.names], node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported speculant module: first line importing it}."""
    mods = modules()
    graph: dict[str, dict[str, int]] = {}
    for mod, path in mods.items():
        edges: dict[str, int] = {}
        tree = ast.parse(path.read_text(), str(path))
        for target, names, line in _imports(tree, mod, path.name == "__init__.py"):
            if target.split(".")[0] != "speculant":
                continue
            hits = [f"{target}.{n}" for n in names if f"{target}.{n}" in mods]
            if len(hits) < len(names) or not names:  # some names are attributes of target
                hits.append(target)
            for h in hits:
                if h not in mods:
                    raise AssertionError(f"{path}:{line}: imports {h}, which is no module here")
                if h != mod:
                    edges.setdefault(h, line)
        graph[mod] = edges
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in sorted(graph):
        if v not in index:
            strong(v)
    return sorted(out)


def _describe(comp: list[str], graph: dict[str, dict[str, int]], mods: dict[str, Path]) -> str:
    edges = [f"  {a} -> {b} ({mods[a].relative_to(ROOT)}:{line})"
             for a in comp for b, line in sorted(graph[a].items()) if b in comp]
    return "cycle among " + ", ".join(comp) + ":\n" + "\n".join(edges)


def test_every_package_folder_is_parsed():
    mods = modules()
    assert {"speculant.engine.spec_decode", "speculant.plugins.ngram", "speculant.kernels.gemv",
            "speculant.spec_registry", "speculant.drafting", "speculant.hookspecs"} <= set(mods)
    assert mods["speculant.plugins.ngram"] == ROOT / "plugins" / "ngram.py"


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}, "e": {"e": 1}}
    assert cycles(graph) == [["a", "b", "c"]]
    src = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import speculant.llm\n"
           "def f():\n    from speculant.engine import sampler\n"
           "from . import hookspecs\n")
    found = _imports(ast.parse(src), "speculant.spec_types", False)
    assert [(m, n) for m, n, _ in found] == [("typing", ["TYPE_CHECKING"]),
                                             ("speculant.engine", ["sampler"]),
                                             ("speculant", ["hookspecs"])]


def test_no_import_cycles():
    graph, mods = import_graph(), modules()
    found = cycles(graph)
    assert not found, "\n".join(_describe(c, graph, mods) for c in found)


def _layer_violations(graph: dict[str, dict[str, int]], mods: dict[str, Path]) -> list[str]:
    def under(mod: str, pkg: str) -> bool:
        return mod == pkg or mod.startswith(pkg + ".")

    rules = [
        ("speculant.models", "speculant.engine"),
        ("speculant.kernels", "speculant.engine"),
        ("speculant.engine", "speculant.plugins"),
    ]
    bad = []
    for a, targets in sorted(graph.items()):
        for b, line in sorted(targets.items()):
            where = f"{mods[a].relative_to(ROOT)}:{line}"
            for src, dst in rules:
                if under(a, src) and under(b, dst):
                    bad.append(f"{where}: {a} imports {b} ({src} must not import {dst})")
            if (under(a, "speculant.plugins") and under(b, "speculant.plugins")
                    and a != "speculant.plugins" and b != "speculant.plugins"):
                bad.append(f"{where}: plugin {a} imports plugin {b}")
    return bad


def test_layers():
    graph, mods = import_graph(), modules()
    assert _layer_violations(graph, mods) == []


def test_the_layer_rules_catch_violations():
    mods = {m: ROOT / "x.py" for m in ("speculant.models.llama", "speculant.engine.sampler",
                                       "speculant.plugins.eagle", "speculant.plugins.ngram")}
    graph = {"speculant.models.llama": {"speculant.engine.sampler": 3},
             "speculant.engine.sampler": {"speculant.plugins.ngram": 4},
             "speculant.plugins.eagle": {"speculant.plugins.ngram": 5},
             "speculant.plugins.ngram": {}}
    bad = _layer_violations(graph, mods)
    assert len(bad) == 3, bad


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])
