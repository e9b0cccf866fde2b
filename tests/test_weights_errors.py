"""A broken checkpoint gets an error that names the file and says what is wrong (issue 34,
defect 5): a truncated or corrupt safetensors file (header unreadable, data shorter than the
header says), missing weights (what was looked for), missing tokenizer files (which), a GGUF that
cannot be parsed, a config.json or tokenizer.json that is not JSON; for the target, for a draft
model and for draft heads; and ``speculant generate`` / ``serve`` / ``demo`` print it as one line
(exit 2, no traceback). The broken checkpoints are copies of the tiny one (tests/checkpoints.py)
with a file cut, overwritten or removed."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from speculant import LLM
from speculant.drafting import StrategyError, read_tensors
from speculant.models.weights import safetensors_problem

ST = "model.safetensors"


def shallow(excinfo) -> None:
    """Raised from speculant with no library exception chained (as tests/test_bad_input.py)."""
    e = excinfo.value
    assert e.__cause__ is None and (e.__context__ is None or e.__suppress_context__)


def _cut(n: int) -> Callable[[Path], None]:
    def cut(folder: Path) -> None:
        f = folder / ST
        data = f.read_bytes()
        f.write_bytes(data[:n])

    return cut


def _half(folder: Path) -> None:
    f = folder / ST
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])


def _bad_header(folder: Path) -> None:
    f = folder / ST
    data = bytearray(f.read_bytes())
    data[8:40] = b"x" * 32  # the JSON header's start, its length field intact
    f.write_bytes(bytes(data))


def _remove(*names: str) -> Callable[[Path], None]:
    def remove(folder: Path) -> None:
        for p in list(folder.iterdir()):
            if any(p.match(n) for n in names):
                p.unlink()

    return remove


def _write(name: str, content: bytes) -> Callable[[Path], None]:
    def write(folder: Path) -> None:
        (folder / name).write_bytes(content)

    return write


def _bin_instead(folder: Path) -> None:
    (folder / ST).unlink()
    (folder / "pytorch_model.bin").write_bytes(b"PK\x03\x04 not a zip archive")


TOKENIZER = ("tokenizer*", "special_tokens_map.json", "chat_template.jinja", "vocab.json",
             "merges.txt")

# name -> (how to break the tiny checkpoint, exception type, the file named, phrases the message has)
BROKEN = {
    "truncated": (_half, ValueError, ST, ["cannot be read as safetensors", "truncated",
                                          "bytes missing", "download or save"]),
    "truncated_10_bytes": (_cut(-10), ValueError, ST, ["truncated", "(10 bytes missing)"]),
    "header_cut": (_cut(100), ValueError, ST, ["truncated or not a safetensors file",
                                               "only 92 bytes follow"]),
    "empty": (_cut(0), ValueError, ST, ["0 bytes, fewer than the 8-byte header length"]),
    "header_not_json": (_bad_header, ValueError, ST, ["corrupt", "header is not valid JSON"]),
    "no_weights": (_remove(ST), FileNotFoundError, "", [
        "no weights found", "looked for model.safetensors", "pytorch_model.bin",
        "the folder holds", "config.json"]),
    "bin_corrupt": (_bin_instead, ValueError, "pytorch_model.bin", [
        "cannot be read as a PyTorch state dict", "truncated or corrupt"]),
    "index_not_json": (_write("model.safetensors.index.json", b"{oops"), ValueError,
                       "model.safetensors.index.json", ["not a weight index"]),
    "no_tokenizer": (_remove(*TOKENIZER), ValueError, "", [
        "no tokenizer files", "tokenizer.json", "tokenizer.model", "vocab.json + merges.txt",
        "skip_tokenizer_init"]),
    "config_only": (_remove(ST, *TOKENIZER, "generation_config.json"), ValueError, "", [
        "holds config.json but no weights", "looked for model.safetensors",
        "no tokenizer files", "tokenizer.json", "complete checkpoint"]),
    "config_not_json": (_write("config.json", b"{not json"), ValueError, "config.json", [
        "cannot be read as a model config", "not valid JSON"]),
    "tokenizer_not_json": (_write("tokenizer.json", b"{oops"), ValueError, "tokenizer.json", [
        "corrupt tokenizer file", "not valid JSON"]),
}


@pytest.fixture(scope="module")
def broken(tiny_llama, tmp_path_factory) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in made:
            folder = tmp_path_factory.mktemp("broken") / name
            shutil.copytree(tiny_llama, folder)
            BROKEN[name][0](folder)
            made[name] = folder
        return made[name]

    return make


def _check(msg: str, folder: Path, file: str, phrases: list[str]) -> None:
    assert str(folder / file if file else folder) in msg, msg
    for p in phrases:
        assert p in msg, (p, msg)
    assert "\n" not in msg and "sentencepiece" not in msg and "Traceback" not in msg, msg


@pytest.mark.parametrize("name", list(BROKEN))
def test_target(broken, name):
    folder = broken(name)
    _, exc, file, phrases = BROKEN[name]
    with pytest.raises(exc) as e:
        LLM(model=str(folder), max_model_len=64)
    _check(str(e.value), folder, file, phrases)
    shallow(e)


@pytest.mark.parametrize("name", ["truncated", "header_not_json", "no_weights", "config_not_json",
                                  "tokenizer_not_json"])
@pytest.mark.slow
def test_draft_model(tiny_llama, broken, name):
    """The same errors for a draft model, prefixed with the method (a StrategyError)."""
    folder = broken(name)
    _, _, file, phrases = BROKEN[name]
    spec = {"method": "draft_model", "model": str(folder), "num_speculative_tokens": 2}
    with pytest.raises(StrategyError) as e:
        LLM(model=str(tiny_llama), max_model_len=64, speculative_config=spec)
    msg = str(e.value)
    assert msg.startswith("speculative method 'draft_model': "), msg
    _check(msg, folder, file, phrases)


@pytest.mark.parametrize("name", ["truncated", "header_cut", "header_not_json", "bin_corrupt"])
def test_draft_heads(broken, name):
    """Draft heads (EAGLE, Medusa, MLPSpeculator) read their weights through
    speculant.drafting.read_tensors: a broken file is named, with what is wrong."""
    folder = broken(name)
    _, _, file, phrases = BROKEN[name]
    with pytest.raises(StrategyError) as e:
        read_tensors(folder, {"lm_head.weight": (None, 64)}, strict=False)
    _check(str(e.value), folder, file, phrases)


def test_sound_file_has_no_problem(tiny_llama, broken):
    assert safetensors_problem(tiny_llama / ST) is None
    assert safetensors_problem(broken("truncated") / ST).startswith("truncated: its header")


@pytest.fixture
def gguf_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))


def _default_gguf() -> Path:
    from speculant.models.loader import default_gguf_path

    return default_gguf_path()


@pytest.mark.parametrize("case,phrases", [
    ("not_gguf", ["not a GGUF file", "magic bytes"]),
    ("header_only", ["truncated or corrupt GGUF file (3000 bytes)", "cannot be parsed",
                     "download it again"]),
    # half the default model's file (~14 s on a busy 2-core box): slow; header_only is the
    # same error in the default run
    pytest.param("half", ["truncated or corrupt GGUF file", "cannot be parsed"],
                 marks=pytest.mark.slow),
])
def test_gguf(tmp_path, gguf_cache, case, phrases):
    f = tmp_path / "model.gguf"
    if case == "not_gguf":
        f.write_bytes(b"hello, this is no model")
    else:
        src = _default_gguf()
        with open(src, "rb") as fh:
            f.write_bytes(fh.read(3000 if case == "header_only" else src.stat().st_size // 2))
    with pytest.raises(ValueError) as e:
        LLM(model=str(f))
    msg = str(e.value)
    assert msg.startswith(f"{f}: "), msg
    for p in phrases:
        assert p in msg, (p, msg)
    assert "architecture" not in msg, msg  # not blamed on the architecture any more
    shallow(e)


# ------------------------------------------------------------------------------------- the CLI
@pytest.mark.parametrize("argv", [
    ["generate", "--prompt", "hi", "--max-tokens", "2", "--model", "{target}"],
    ["generate", "--prompt", "hi", "--max-tokens", "2", "--model", "{good}",
     "--speculative-config", '{{"method": "draft_model", "model": "{target}", '
     '"num_speculative_tokens": 2}}'],
    ["serve", "{target}", "--port", "1"],
    ["demo", "--max-tokens", "2", "--model", "{target}"],
])
def test_cli_one_line(tiny_llama, broken, capsys, argv):
    """``speculant generate`` (target or draft model), ``serve`` and ``demo`` on a truncated
    checkpoint: one line on stderr naming the file, exit status 2."""
    from speculant.cli import main

    folder = broken("truncated")
    argv = [a.format(target=folder, good=tiny_llama) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("speculant: error: ") and "\n" not in err, err
    assert f"{folder / ST}: cannot be read as safetensors: truncated" in err, err


@pytest.mark.slow
def test_cli_subprocess_no_traceback(broken):
    folder = broken("header_not_json")
    r = subprocess.run([sys.executable, "-m", "speculant.cli", "generate", "--model", str(folder),
                        "--prompt", "hi", "--max-tokens", "2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines == [lines[0]] and lines[0].startswith("speculant: error: "), r.stderr
    assert str(folder / ST) in lines[0] and "header is not valid JSON" in lines[0]
    assert "Traceback" not in r.stderr and "SafetensorError" not in r.stderr

