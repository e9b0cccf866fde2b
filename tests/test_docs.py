"""The documentation runs as written: every ```python block of README.md and docs/*.md is
executed with the project's python (SPECULANT_DEVICE=cpu, from the repository root, offline), on
the embedded default model. A block that loads a model runs in its own interpreter; blocks that
load none share one, each in a fresh namespace. Blocks that talk to the OpenAI-compatible server
(they create an ``OpenAI(base_url=...)`` client) run against one ``speculant serve`` (default
model, n-gram) started here for the module; the only edit made to any block is that server's
port in its ``base_url``. The default selection runs README.md's first block that loads a model
(the Python API example) and every block that loads none; the other blocks that load a model
and the client blocks are marked slow.

Also here: the contract the README's plugin example relies on (a strategy class's
``num_speculative_tokens`` attribute is its default k, which speculative_config overrides), and
the tutorial's listing of the example plugin equals the plugin's source."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from speculant import LLM, Proposal, SamplingParams, hookimpl
from speculant.plugin_manager import register, unregister
from speculant.spec_registry import StrategyError

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# ```python (or py, python3) fences, indented ones (in a list item) included
FENCE = re.compile(r"^([ \t]*)```(?:python3?|py)[ \t]*\n(.*?)^\1```[ \t]*$", re.M | re.S)
BLOCK_TIMEOUT = 300  # s, one block (a model load is ~10-20 s on a busy 2-core machine)


def _blocks() -> list[tuple[str, str]]:
    out = []
    for path in DOCS:
        text = path.read_text()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            out.append((f"{path.relative_to(ROOT)}:{line}", textwrap.dedent(m.group(2))))
    return out


BLOCKS = _blocks()


def _uses_server(code: str) -> bool:
    return "OpenAI(" in code


def _env() -> dict[str, str]:
    env = {**os.environ, "SPECULANT_DEVICE": "cpu", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    env.pop("SPECULANT_PLUGINS", None)
    env.pop("SPECULANT_DISABLE_PLUGINS", None)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    """``speculant serve`` on the default model with n-gram speculation, on a free port."""
    port = _free_port()
    cmd = [str(Path(sys.executable).parent / "speculant"), "serve", "--host", "127.0.0.1",
           "--port", str(port), "--speculative-config",
           '{"method": "ngram", "num_speculative_tokens": 5}']
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 240
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"speculant serve exited with {proc.returncode}:\n{proc.stdout.read()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                pytest.fail("speculant serve did not become healthy in 240 s")
            time.sleep(0.5)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _run(where: str, code: str) -> None:
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=BLOCK_TIMEOUT)
    assert proc.returncode == 0, (
        f"the python block at {where} fails as written (exit {proc.returncode}):\n{code}\n"
        f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}")


def test_the_docs_have_python_blocks():
    where = {w.split(":")[0] for w, _ in BLOCKS}
    assert {"README.md", "docs/plugin_tutorial.md", "docs/hooks.md"} <= where, where


def _light(code: str) -> bool:
    """A block that loads no model, starts no server and does not register its own module:
    these share one interpreter (each in a fresh namespace), which saves ~3 s of imports each."""
    return "LLM(" not in code and not _uses_server(code) and "__name__" not in code


# runs each block of a JSON list [[where, code], ...] in a fresh namespace; writes
# {where: [ok, output]} to the file named by argv[1]
_BATCH = """
import contextlib, io, json, sys, traceback
blocks, results = json.load(sys.stdin), {}
for where, code in blocks:
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            exec(compile(code, where, "exec"), {"__name__": "__main__"})
        ok = True
    except SystemExit as e:
        ok = e.code in (None, 0)
    except BaseException:
        ok = False
        out.write(traceback.format_exc())
    results[where] = [ok, out.getvalue()]
with open(sys.argv[1], "w") as f:
    json.dump(results, f)
"""


@pytest.fixture(scope="module")
def light_results(tmp_path_factory) -> dict[str, list]:
    import json

    blocks = [[w, c] for w, c in BLOCKS if _light(c)]
    out = tmp_path_factory.mktemp("docs") / "results.json"
    proc = subprocess.run([sys.executable, "-c", _BATCH, str(out)], input=json.dumps(blocks),
                          cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=BLOCK_TIMEOUT)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


def _params(server: bool) -> list:
    """The blocks. Slow: those that load a model (~10-15 s each on 2 busy cores), but for
    README.md's first one (the Python API example), and the client blocks (they share one
    ``speculant serve``, ~13 s to start; test_server.py covers the server in the default run)."""
    first = next((w for w, c in BLOCKS if w.startswith("README.md:") and "LLM(" in c), None)
    out = []
    for where, code in BLOCKS:
        if _uses_server(code) != server:
            continue
        slow = server or ("LLM(" in code and where != first)
        out.append(pytest.param(where, code, id=where, marks=[pytest.mark.slow] if slow else []))
    return out


@pytest.mark.parametrize("where,code", _params(server=False))
def test_python_block_runs_as_written(where, code, request):
    if not _light(code):
        _run(where, code)
        return
    ok, output = request.getfixturevalue("light_results")[where]
    assert ok, f"the python block at {where} fails as written:\n{code}\n--- output ---\n" \
               f"{output[-4000:]}"


@pytest.mark.parametrize("where,code", _params(server=True))
def test_openai_client_block_runs_against_speculant_serve(where, code, server):
    url = re.compile(r"http://(127\.0\.0\.1|localhost):\d+/v1")
    assert url.search(code), f"{where}: expected a base_url http://127.0.0.1:PORT/v1"
    _run(where, url.sub(f"http://127.0.0.1:{server}/v1", code))


def test_tutorial_listing_is_the_example_plugin():
    text = (ROOT / "docs" / "plugin_tutorial.md").read_text()
    source = (ROOT / "examples" / "speculant-bigram" / "speculant_bigram" / "__init__.py").read_text()
    assert source in [m.group(2) for m in FENCE.finditer(text)], \
        "docs/plugin_tutorial.md must list speculant_bigram/__init__.py in full, as it is"


# ----------------------------------------------------------------- a strategy's default k
class _Module:
    def __init__(self, cls):
        self.cls = cls

    @hookimpl
    def register_strategies(self, register):
        register(self.cls)


class _RepeatLast:
    name = "docs_repeat_last"
    num_speculative_tokens = 3  # the default k

    def __init__(self, config, ctx):
        assert config is None  # no Config class

    @hookimpl
    def propose(self, batch):
        return Proposal(token_ids=[[s.token_ids[-1]] * s.max_draft for s in batch.seqs])


class _NoDefault(_RepeatLast):
    name = "docs_no_default"
    num_speculative_tokens = None


@pytest.fixture
def registered():
    names = [register(_Module(c), name=f"test-{c.name}") for c in (_RepeatLast, _NoDefault)]
    yield
    for n in names:
        unregister(n)


@pytest.mark.slow
def test_class_attribute_is_the_default_k_and_the_user_overrides_it(registered, tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(model=str(tiny_llama), speculative_config={"method": "docs_repeat_last"})
    assert llm.engine.spec.k == 3
    out = llm.generate([[5, 6, 7]], params, use_tqdm=False)
    assert len(out[0].metrics.spec.proposed_per_position) == 3  # drafts of 3 tokens
    llm = LLM(model=str(tiny_llama),
              speculative_config={"method": "docs_repeat_last", "num_speculative_tokens": 5})
    assert llm.engine.spec.k == 5
    with pytest.raises(StrategyError, match="needs num_speculative_tokens"):
        LLM(model=str(tiny_llama), speculative_config={"method": "docs_no_default"})
    assert LLM(model=str(tiny_llama), speculative_config={
        "method": "docs_no_default", "num_speculative_tokens": 2}).engine.spec.k == 2
