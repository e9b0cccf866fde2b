"""Make ``speculant`` importable for the bench scripts when it is not installed: the folders of
this checkout are the package (``kernels/`` is ``speculant.kernels``), so the package's path is
extended with the repository root. A no-op when speculant is installed."""

from __future__ import annotations

import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def use_checkout() -> None:
    try:
        import speculant.kernels  # noqa: F401
    except ImportError:
        try:
            import speculant as pkg
        except ImportError:
            pkg = types.ModuleType("speculant")
            pkg.__path__ = []
            sys.modules["speculant"] = pkg
        pkg.__path__.append(str(REPO))
