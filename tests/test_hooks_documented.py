"""Every hook is documented (docstring + docs/hooks.md section) and exercised by a test."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pluggy

from speculant import hookspecs

ROOT = Path(__file__).resolve().parents[1]


def _spec_names() -> list[str]:
    return [n for n, f in inspect.getmembers(hookspecs, inspect.isfunction)
            if hasattr(f, "speculant_spec")]


def test_hook_names_constant_matches_specs():
    assert sorted(_spec_names()) == sorted(hookspecs.HOOK_NAMES)
    assert {"propose", "score", "verify", "on_batch_size_change"} <= set(_spec_names())


def test_every_hook_has_a_contract_docstring():
    for name in _spec_names():
        doc = inspect.getdoc(getattr(hookspecs, name)) or ""
        assert ":return:" in doc, f"{name}: docstring must state the return"
        assert re.search(r"first-result|collect-all", doc, re.I), f"{name}: say first-result or not"
        params = [p for p in inspect.signature(getattr(hookspecs, name)).parameters]
        for p in params:
            assert f":param {p}:" in doc, f"{name}: document argument {p}"


def test_firstresult_flags_match_docs():
    pm = pluggy.PluginManager("speculant")
    pm.add_hookspecs(hookspecs)
    for name in _spec_names():
        opts = getattr(pm.hook, name).spec.opts
        doc = inspect.getdoc(getattr(hookspecs, name))
        assert opts.get("firstresult", False) == ("First-result" in doc), name


def test_every_hook_is_documented_in_docs():
    text = (ROOT / "docs" / "hooks.md").read_text()
    for name in _spec_names():
        assert re.search(rf"^## `{name}\(", text, re.M), f"docs/hooks.md needs a section for {name}"


def test_every_hook_is_exercised_by_a_test():
    sources = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py")
                        if p.name != Path(__file__).name)
    for name in _spec_names():
        assert re.search(rf"\b(def {name}\(|hook\.{name}\(|{name}\()", sources), \
            f"no test implements or calls hook {name}"


def test_hookimpl_is_reexported_at_top_level():
    import speculant

    assert speculant.hookimpl is hookspecs.hookimpl
