"""Switch the host staging between the C extension ``speculant._staging`` and its Python
fallback, for tests that must pass with either (the one-graph proposes' ``fused_ints``, the
engine's ``CudaGraphRunner._fill_small``)."""

from __future__ import annotations

import pytest

import speculant.engine.staging as staging_mod
from speculant.engine.staging import staging_ext

STAGING = staging_ext()  # the extension as loaded at collection (None: not built)


def use_staging(monkeypatch, which: str) -> None:
    """Stage with ``which``: "c" (the extension; skips the test where it was not built) or
    "python" (the fallback)."""
    if which == "python":
        monkeypatch.setattr(staging_mod, "_ext", False)
    elif STAGING is None:
        pytest.skip("speculant._staging not built")
    else:
        monkeypatch.setattr(staging_mod, "_ext", STAGING)
