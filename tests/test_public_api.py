"""The plugin boundary is real: every module under plugins/ and examples/ imports from speculant
only the public names (``speculant``, ``speculant.hookspecs``, ``speculant.spec_types``,
``speculant.drafting``), and no plugin imports another plugin."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PUBLIC = ("speculant", "speculant.hookspecs", "speculant.spec_types", "speculant.drafting")


def _modules() -> list[Path]:
    files = sorted((ROOT / "plugins").rglob("*.py")) + sorted((ROOT / "examples").rglob("*.py"))
    return [f for f in files if "build" not in f.parts and ".egg-info" not in str(f)]


def _public_names(module: str) -> set[str]:
    mod = importlib.import_module(module)
    names = getattr(mod, "__all__", None)
    if names is None:
        names = [n for n in vars(mod) if not n.startswith("_")]
    return set(names)


def violations(source: str, where: str) -> list[str]:
    """Every import of a non-public speculant name in ``source``."""
    bad: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "speculant" and alias.name not in PUBLIC:
                    bad.append(f"{where}:{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] != "speculant":
                continue
            if node.module not in PUBLIC:
                bad.append(f"{where}:{node.lineno}: from {node.module} import ...")
                continue
            public = _public_names(node.module)
            for alias in node.names:
                if alias.name == "*" or alias.name not in public:
                    bad.append(f"{where}:{node.lineno}: {alias.name} is not public in {node.module}")
    return bad


def test_the_rule_catches_internal_imports():
    src = (
        "from speculant.engine.attention import ForwardContext\n"
        "import speculant.plugins.ngram\n"
        "from speculant.drafting import _private\n"
        "from speculant.spec_types import Proposal\n"
        "from speculant import hookimpl\n"
    )
    bad = violations(src, "x.py")
    assert len(bad) == 3, bad
    assert "x.py:1" in bad[0] and "x.py:2" in bad[1] and "_private" in bad[2]


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_plugins_and_examples_import_only_public_names(path: Path):
    assert violations(path.read_text(), str(path.relative_to(ROOT))) == []


def test_there_are_modules_to_check():
    names = {p.name for p in _modules()}
    assert {"eagle.py", "mlp_speculator.py", "draft_model.py", "ngram.py"} <= names
