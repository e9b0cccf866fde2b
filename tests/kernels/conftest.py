"""Kernel tests: run the Triton kernels on CUDA when present, else under the CPU interpreter.

``TRITON_INTERPRET=1`` is set here, before any kernel is launched (the kernels are jitted lazily
at their first launch, so an earlier import of ``speculant.kernels`` does not matter). The
tests pass ``force_triton=True`` so the kernel path, not the torch path, is exercised.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _ensure_kernels_importable() -> None:
    """Make ``speculant.kernels`` importable from the checkout if the package isn't installed."""
    try:
        importlib.import_module("speculant.kernels")
        return
    except ImportError:
        pass
    repo = Path(__file__).resolve().parents[2]
    try:
        pkg = importlib.import_module("speculant")
    except ImportError:
        pkg = types.ModuleType("speculant")
        pkg.__path__ = []
        sys.modules["speculant"] = pkg
    # the folder kernels/ is the package speculant.kernels (see pyproject's package-dir)
    pkg.__path__.append(str(repo))
    importlib.import_module("speculant.kernels")


_ensure_kernels_importable()

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(1234)
