"""Shared helpers for the kernel modules: guarded Triton import, lazy JIT, dispatch, checks.

Triton is optional. Every kernel module imports ``triton`` / ``tl`` from here; when Triton is
not installed ``HAS_TRITON`` is False and the public functions fall back to their torch paths.

Kernels are wrapped with :func:`lazy_jit` instead of ``triton.jit``: ``triton.jit`` decides at
decoration time whether to build an interpreted function (``TRITON_INTERPRET=1``) or a compiled
one. Deferring that decision to the first launch means the interpreter setting only has to be in
place before a kernel runs, not before ``speculant.kernels`` is first imported (other test
packages may import it earlier).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from speculant.envs import env_flag

try:  # pragma: no cover - exercised implicitly by every kernel import
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - only without triton
    triton = None
    tl = None
    HAS_TRITON = False

__all__ = [
    "HAS_TRITON",
    "triton",
    "tl",
    "lazy_jit",
    "interpret_mode",
    "use_triton",
    "triton_enabled",
    "num_sms",
    "next_pow2",
    "cdiv",
    "check_tensor",
    "pdl_enabled",
    "pdl_launch",
]


def interpret_mode() -> bool:
    """True when the Triton CPU interpreter is requested (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


class LazyJit:
    """``triton.jit`` applied on first launch (and again if the interpreter setting changes).
    ``jit_kwargs`` go to ``triton.jit`` (e.g. ``do_not_specialize``)."""

    def __init__(self, fn: Callable[..., Any], **jit_kwargs: Any) -> None:
        self.fn = fn
        self.jit_kwargs = jit_kwargs
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__
        self._compiled: dict[bool, Any] = {}

    def jitted(self) -> Any:
        if not HAS_TRITON:
            raise RuntimeError("triton is not installed")
        mode = interpret_mode()
        kernel = self._compiled.get(mode)
        if kernel is None:
            kernel = triton.jit(self.fn, **self.jit_kwargs)
            self._compiled[mode] = kernel
        return kernel

    def __getitem__(self, grid: Any) -> Any:
        return self.jitted()[grid]


def lazy_jit(fn: Callable[..., Any] | None = None, **jit_kwargs: Any):
    """``@lazy_jit`` or ``@lazy_jit(do_not_specialize=("name", ...))``.

    Triton compiles a separate binary for every integer argument that equals 1 or is divisible
    by 16 (it specialises on them). An argument that takes such values only now and then at run
    time (a batch size, a block-table width, a split count) then triggers a compile in the
    middle of serving, the first time it does: list it in ``do_not_specialize``."""
    if fn is None:
        return lambda f: LazyJit(f, **jit_kwargs)
    return LazyJit(fn, **jit_kwargs)


def triton_enabled() -> bool:
    """False when the flag ``SPECULANT_DISABLE_TRITON`` is set (read at every call): CUDA tensors
    then take the torch paths too (debugging). ``force_triton=True`` ignores it."""
    return HAS_TRITON and not env_flag("SPECULANT_DISABLE_TRITON")


def use_triton(tensors: Sequence[torch.Tensor | None], force_triton: bool) -> bool:
    """Decide between the Triton kernel and the torch path.

    Triton is used when all tensors are on CUDA (and Triton is installed), or when
    ``force_triton=True`` and the interpreter is enabled (``TRITON_INTERPRET=1``; the tensors are
    then on the CPU). ``force_triton=True`` in any other situation is an error rather than a
    silent fallback, so a test asking for the kernel never checks the reference against itself.
    """
    ts = [t for t in tensors if t is not None]
    all_cuda = bool(ts) and all(t.is_cuda for t in ts)
    if force_triton:
        if not HAS_TRITON:
            raise RuntimeError("force_triton=True but triton is not installed")
        if all_cuda or interpret_mode():
            return True
        raise RuntimeError(
            "force_triton=True needs CUDA tensors or TRITON_INTERPRET=1 (Triton CPU interpreter)"
        )
    return all_cuda and triton_enabled()


@functools.cache
def _num_sms_cuda(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Multiprocessor count of ``device``; a small fixed number for the CPU interpreter."""
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        return _num_sms_cuda(idx)
    return 4


@functools.cache
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """True when kernels on ``device`` launch with programmatic dependent launch (PDL, Hopper and
    later): a CUDA device of compute capability >= 9, not the interpreter, and a Triton that has
    ``gdc_wait``.

    With PDL a kernel's programs may start while the kernel before it on the stream is still
    running: each kernel that takes part (a ``GDC`` constexpr) first does only work that depends
    on nothing written on the GPU (a GEMV's first weight tile), then ``gdc_wait()`` (the previous
    kernel has finished and its writes are visible), then ``gdc_launch_dependents()`` (the next
    kernel may start its own independent part), then the rest. What it saves: the launch of each
    kernel and the ramp of its first loads overlap the tail of the one before (hundreds of
    kernels per decode step)."""
    if device.type != "cuda" or interpret_mode() or not HAS_TRITON:
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return _sm90(idx) and hasattr(tl.extra.cuda, "gdc_wait")


def pdl_launch(device: torch.device) -> dict[str, bool]:
    """Launch keywords for a kernel with a ``GDC`` constexpr: ``{"GDC": True, "launch_pdl": True}``
    when :func:`pdl_enabled`, else ``{"GDC": False}``. The two always go together: a kernel
    launched with PDL that does not wait (``GDC`` False) could read its inputs too early."""
    return {"GDC": True, "launch_pdl": True} if pdl_enabled(device) else {"GDC": False}


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_tensor(
    name: str,
    t: Any,
    *,
    ndim: int | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
    shape: Sequence[int | None] | None = None,
    last_contiguous: bool = False,
) -> None:
    """Raise ``ValueError`` naming ``name`` if ``t`` does not match the description."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if shape is not None:
        if t.dim() != len(shape) or any(
            want is not None and got != want for got, want in zip(t.shape, shape)
        ):
            want_s = tuple("*" if w is None else w for w in shape)
            raise ValueError(f"{name} must have shape {want_s}, got {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name} must have dtype in ({names}), got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if last_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
