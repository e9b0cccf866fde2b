"""Building blocks of draft networks and verifiers, shared with the engine: the target's layers,
the paged-attention forward context, and the kernels' public launchers. Re-exported by
:mod:`speculant.drafting`; see docs/drafting.md for what each one is for."""

from __future__ import annotations

from speculant.kernels.gemv import gemv
from speculant.models.loader import load_config
from speculant.models.weights import WeightLoader, WeightLoadError

__all__ = [
    "WeightLoadError",
    "WeightLoader",
    "gemv",
    "load_config",
]
