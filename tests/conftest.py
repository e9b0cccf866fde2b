"""Shared fixtures: tiny random checkpoints written in the real Hugging Face on-disk layout
(config.json + model.safetensors with the real key names, plus a tokenizer), so the real loading
code is what the tests exercise. Nothing is downloaded."""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path

import pytest

# One thread for the test process: torch's ops and numpy's OpenBLAS (the Triton interpreter's
# dots). The suite is many small ops; on a 2-core machine that something else is using, an OpenMP
# region waits for its descheduled thread and a test can take 30x longer (engine/cpu_threads.py
# measured the same). Set before torch is imported, so this is torch's default count here
# (cpu_threads=None still reads as "automatic"); child processes inherit OpenBLAS's setting only.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import torch  # noqa: E402

torch.set_num_threads(1)

from checkpoints import make_tiny_checkpoint  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# engines with device="auto" run on the CPU even on a GPU machine (the CPU suite's assumptions,
# and one process holding dozens of engines); the GPU tests ask for device="cuda"
os.environ.setdefault("SPECULANT_DEVICE", "cpu")


# ---- GPU tests, slow tests, and one line per reason for what did not run --------------------
# A test needs CUDA when it is marked `gpu`, or when a skipif of it says so by its reason ("needs
# CUDA", "needs a CUDA device ..."): those are marked `gpu` here too, so `pytest -m gpu` on a GPU
# machine selects all of them. Without a CUDA device they are skipped (pytest's closing line counts
# them) and the summary says so in one line instead of one line per test; other skips are summed
# up by reason, one line each. `-rfE` (pyproject) still lists every failure and error.
_NEEDS_CUDA = re.compile(r"\bneeds\b.*\bCUDA\b", re.I)
_GPU_IDS: set[str] = set()
_SLOW_DESELECTED: list[int] = [0]


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _needs_cuda(item) -> bool:
    if item.get_closest_marker("gpu") is not None:
        return True
    reasons = (str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif"))
    return any(_NEEDS_CUDA.search(r) for r in reasons)


@pytest.hookimpl(tryfirst=True)  # before `-m` selects: the added `gpu` marks count for it
def pytest_collection_modifyitems(config, items):
    has_cuda = _cuda_available()
    for item in items:
        if _needs_cuda(item):
            if item.get_closest_marker("gpu") is None:
                item.add_marker(pytest.mark.gpu)
            if not has_cuda:
                item.add_marker(pytest.mark.skip(reason="no CUDA device"))
                _GPU_IDS.add(item.nodeid)


def pytest_deselected(items):
    _SLOW_DESELECTED[0] += sum(1 for i in items if i.get_closest_marker("slow") is not None)


def _skip_reason(report) -> str:
    lr = report.longrepr
    reason = lr[2] if isinstance(lr, tuple) and len(lr) == 3 else str(lr)
    return reason.removeprefix("Skipped: ")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    tr = terminalreporter
    skipped = tr.stats.get("skipped", [])
    gpu = sum(1 for r in skipped if r.nodeid in _GPU_IDS)
    lines = []
    if gpu:
        lines.append(f"{gpu} GPU tests skipped: no CUDA device (on a GPU machine the default run "
                     "includes them; `-m gpu` runs only them)")
    others = Counter(_skip_reason(r) for r in skipped if r.nodeid not in _GPU_IDS)
    lines += [f"{n} skipped: {reason}" for reason, n in others.most_common()]
    if _SLOW_DESELECTED[0] and config.option.markexpr == "not slow":
        lines.append(f"{_SLOW_DESELECTED[0]} slow tests not run (`pytest -m slow` runs them; CI does)")
    for line in lines:
        tr.write_line(line)


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    from speculant.models.loader import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def tiny_factory(tmp_path_factory):
    cache: dict = {}

    def make(arch: str = "llama", **kw) -> Path:
        key = (arch, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = make_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, **kw)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama(tiny_factory) -> Path:
    return tiny_factory("llama")


@pytest.fixture(scope="session")
def smollm(default_model_path):
    """One shared LLM on the embedded default model (CPU fp32)."""
    from speculant import LLM

    return LLM(model=str(default_model_path), max_num_seqs=16)
