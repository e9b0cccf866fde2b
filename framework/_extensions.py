"""speculant's optional C extensions (``framework/csrc``, built by ``pip install``): the CPU
kernels (``speculant._cpu_kernels``, models/cpu_kernels.py) and the host staging of the proposers'
CUDA-graph inputs (``speculant._staging``, engine/staging.py). Either may be missing (no C
compiler at install time); each has an environment switch to run without it, and its callers
keep a Python / BLAS path for both cases."""

from __future__ import annotations

import importlib
from types import ModuleType

from speculant.kernels._triton_utils import env_switch


def import_extension(module: str, switch: str) -> ModuleType | None:
    """The extension ``module`` (e.g. ``"speculant._staging"``), or None when the environment
    switch ``switch`` is off (``0`` / ``false`` / ``no`` / ``off``, read by ``env_switch``) or the
    extension was not built. Callers cache the answer."""
    if not env_switch(switch):
        return None
    try:
        return importlib.import_module(module)
    except ImportError:
        return None
