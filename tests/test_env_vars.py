"""speculant's environment variables: only those in ``speculant.envs.VARIABLES`` appear in the
source (framework/, plugins/, kernels/, spec_registry/, examples/), the tests, the benchmarks and
the docs; every read goes through ``speculant.envs``; each allowed one is documented in
docs/architecture.md; flags have one truthiness rule."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from speculant import envs

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ("framework", "plugins", "kernels", "spec_registry", "examples")
NAME = re.compile(r"\bSPECULANT_[A-Z][A-Z0-9_]*")
# a read that bypasses speculant.envs: os.environ.get("SPECULANT_..."), os.environ["..."],
# os.getenv("...")
DIRECT_READ = re.compile(r"""(?:os\.environ(?:\.get)?|getenv)\s*[(\[]\s*["']SPECULANT_""")


def _files(folders, suffixes=(".py",)):
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*")):
            if (path.suffix in suffixes and path.is_file()
                    and not {".venv", "build", "seed_examples", "__pycache__"} & set(path.parts)):
                yield path


def _names(paths) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in paths:
        for name in NAME.findall(path.read_text(encoding="utf-8", errors="replace")):
            found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


def test_source_names_only_allowed_variables():
    unknown = {n: sorted(set(p)) for n, p in _names(_files(SOURCE)).items()
               if n not in envs.VARIABLES}
    assert not unknown, (f"environment variables not in speculant.envs.VARIABLES: {unknown}; "
                         "make the option an EngineConfig field, or add it to the table and "
                         "docs/architecture.md")


def test_tests_benchmarks_and_docs_name_only_allowed_variables():
    """A test or benchmark that sets a variable nothing reads, or a doc that tells a user to,
    is stale."""
    me = Path(__file__).resolve()
    paths = [p for p in _files(("tests", "bench")) if p.resolve() != me]
    paths += list(_files(("docs",), (".md",))) + [ROOT / "README.md"]
    unknown = {n: sorted(set(p)) for n, p in _names(paths).items() if n not in envs.VARIABLES}
    assert not unknown, f"variables speculant does not read: {unknown}"


def test_every_read_goes_through_envs():
    direct = []
    for path in _files(SOURCE):
        if path.name == "envs.py":
            continue
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if DIRECT_READ.search(line):
                direct.append(f"{path.relative_to(ROOT)}:{i}")
    assert not direct, f"read these with speculant.envs (env_str / env_flag / env_list): {direct}"


def test_every_allowed_variable_is_documented():
    arch = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = arch.partition("## Environment variables")[2].partition("\n## ")[0]
    assert section, "docs/architecture.md has no 'Environment variables' section"
    for name, doc in envs.VARIABLES.items():
        assert len(doc) > 20, f"{name}: envs.VARIABLES needs a description"
        assert f"`{name}`" in section, f"{name} is not in docs/architecture.md's table"
    listed = set(re.findall(r"^\| `(SPECULANT_[A-Z0-9_]+)`", section, re.M))
    assert listed == set(envs.VARIABLES), "the docs table and envs.VARIABLES differ"


@pytest.mark.parametrize("value", ["1", "true", "YES", " on ", "True"])
def test_flag_true(monkeypatch, value):
    monkeypatch.setenv("SPECULANT_DISABLE_TRITON", value)
    assert envs.env_flag("SPECULANT_DISABLE_TRITON") is True


@pytest.mark.parametrize("value", [None, "", "0", "false", "No", " OFF "])
def test_flag_false(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("SPECULANT_DISABLE_TRITON", raising=False)
    else:
        monkeypatch.setenv("SPECULANT_DISABLE_TRITON", value)
    assert envs.env_flag("SPECULANT_DISABLE_TRITON") is False


@pytest.mark.parametrize("value", ["2", "enable", "y"])
def test_flag_other_value_is_an_error_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("SPECULANT_DISABLE_TRITON", value)
    with pytest.raises(ValueError, match=f"SPECULANT_DISABLE_TRITON='{value}' is not a flag"):
        envs.env_flag("SPECULANT_DISABLE_TRITON")


def test_str_and_list(monkeypatch):
    monkeypatch.setenv("SPECULANT_DEVICE", " cuda:1 ")
    assert envs.env_str("SPECULANT_DEVICE") == "cuda:1"
    monkeypatch.delenv("SPECULANT_DEVICE")
    assert envs.env_str("SPECULANT_DEVICE") == ""
    monkeypatch.delenv("SPECULANT_PLUGINS", raising=False)
    assert envs.env_list("SPECULANT_PLUGINS") is None  # unset: no allow-list
    monkeypatch.setenv("SPECULANT_PLUGINS", " ngram, ,bigram ")
    assert envs.env_list("SPECULANT_PLUGINS") == ["ngram", "bigram"]
    monkeypatch.setenv("SPECULANT_PLUGINS", "")
    assert envs.env_list("SPECULANT_PLUGINS") == []  # set but empty: load none


def test_unknown_name_is_refused():
    name = "SPECULANT_" + "NOT_A_VARIABLE"  # built here so the source scan never sees it
    for read in (envs.env_str, envs.env_flag, envs.env_list):
        with pytest.raises(KeyError, match="not one of speculant's environment variables"):
            read(name)
