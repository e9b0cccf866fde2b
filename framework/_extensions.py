"""speculant's optional C extensions (``framework/csrc``, built by ``pip install``): the CPU
kernels (``speculant._cpu_kernels``, models/cpu_kernels.py) and the host staging of the proposers'
CUDA-graph inputs (``speculant._staging``, engine/staging.py). Either may be missing (no C
compiler at install time); their callers keep a Python / BLAS path for that case, which the tests
force by setting the caller's cached module to ``False``."""

from __future__ import annotations

import importlib
from types import ModuleType


def import_extension(module: str) -> ModuleType | None:
    """The extension ``module`` (e.g. ``"speculant._staging"``), or None when it was not built.
    Callers cache the answer."""
    try:
        return importlib.import_module(module)
    except ImportError:
        return None
