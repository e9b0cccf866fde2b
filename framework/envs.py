"""The environment variables speculant reads, and the one parser they go through.

Options live in :class:`speculant.config.EngineConfig`; an environment variable exists only where a
setting must reach code that no engine configures (the plugin loader, the model cache, the kernel
dispatch) or a whole process at once (``SPECULANT_DEVICE`` for a test suite). ``VARIABLES`` is
the complete list: :func:`env_str`, :func:`env_flag` and :func:`env_list` refuse any other name,
and ``tests/test_env_vars.py`` fails on a ``SPECULANT_*`` name in the source that is not here or
not documented (docs/architecture.md, "Environment variables").

Flags have one truthiness rule: ``1`` / ``true`` / ``yes`` / ``on`` (any case, spaces trimmed) are
true; unset, empty, ``0`` / ``false`` / ``no`` / ``off`` are false; anything else is an error that
names the variable.
"""

from __future__ import annotations

import os

__all__ = ["VARIABLES", "env_flag", "env_list", "env_str"]

VARIABLES: dict[str, str] = {
    "SPECULANT_DEVICE": "the device of engines built with device='auto' (cpu, cuda or cuda:N); "
    "unset: cuda when available, else cpu. The test suite sets cpu",
    "SPECULANT_CACHE": "the folder for downloaded and converted models (default "
    "$XDG_CACHE_HOME/speculant, i.e. ~/.cache/speculant)",
    "SPECULANT_PLUGINS": "comma-separated entry-point names: load only these strategy plugins",
    "SPECULANT_DISABLE_PLUGINS": "comma-separated entry-point names: never load these strategy "
    "plugins (e.g. a broken third-party one)",
    "SPECULANT_DISABLE_TRITON": "flag: CUDA tensors take the torch reference paths instead of "
    "the Triton kernels (debugging a suspected kernel fault; the engine's torch attention cannot "
    "be captured in CUDA graphs, so use it with enforce_eager=True)",
}

_TRUE = frozenset(("1", "true", "yes", "on"))
_FALSE = frozenset(("", "0", "false", "no", "off"))


def _check(name: str) -> None:
    if name not in VARIABLES:
        raise KeyError(f"{name} is not one of speculant's environment variables "
                       f"(speculant.envs.VARIABLES: {', '.join(VARIABLES)})")


def env_str(name: str) -> str:
    """The value of the variable ``name`` with surrounding spaces trimmed, ``""`` when unset."""
    _check(name)
    return os.environ.get(name, "").strip()


def env_flag(name: str) -> bool:
    """The flag ``name`` (read at every call): see the module doc for the values; any other value
    raises ``ValueError`` naming the variable."""
    _check(name)
    v = os.environ.get(name)
    if v is None:
        return False
    v = v.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"{name}={os.environ[name]!r} is not a flag; set it to 1 / true / yes / on "
                     "or 0 / false / no / off, or unset it")


def env_list(name: str) -> list[str] | None:
    """The comma-separated entries of ``name`` (spaces trimmed, empty ones dropped), or None
    when it is unset (an empty value is an empty list)."""
    _check(name)
    v = os.environ.get(name)
    if v is None:
        return None
    return [x.strip() for x in v.split(",") if x.strip()]
