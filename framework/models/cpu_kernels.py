"""Our fp32 CPU kernels (``framework/csrc/cpu_kernels.c``, the optional extension
``speculant._cpu_kernels``): a GEMM for few rows, one sequence's causal attention and RMSNorm.

BLAS libraries pack the weight into panels on every call; with few rows that pass costs as much
as the product (2.2-2.6x the one-row time for a 6-row verification pass on SmolLM2-135M).
``gemm`` runs on a copy of the weight BLOCKED as ``[ceil(out / 16), in, 16]`` (``block_weight``):
it streams each block once and multiplies it with up to 6 rows in registers (6 rows ~1.6x of one
row). Products can share their blocks with a helper thread on a second CPU (``set_threads(2)``,
chosen by ``EngineConfig.cpu_threads``): two cores stream a one-row product faster than one
(24.8 against 18.5 GB/s here, ``bench/cpu_threads.py``), and one core does not overlap a
multi-row product's FMAs with its memory reads, two do (docs/perf.md, "CPU"). The results are bit for bit those of one thread.

All three are batch-invariant: a row's result is the same arithmetic whatever the other rows of
the call (each GEMM output is one FMA chain over ``in``; each attention row runs over its own
causal prefix), which makes the CPU forward batch-invariant (``cpu_forward._forward_flat``):
a verification pass reproduces the plain decode steps bit for bit, and a sequence's logits do not
depend on the other sequences of the batch (tests/test_batch_invariance.py).

``available()`` is False without the built extension or on a CPU without AVX2/FMA; callers then
keep BLAS / torch.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from speculant._extensions import import_extension

BLOCK = 16  # output columns per weight block (the C kernel's BW)

_ext = None


def _load():
    global _ext
    if _ext is None:
        ext = import_extension("speculant._cpu_kernels")
        _ext = ext if ext is not None and ext.supported() else False
    return _ext or None


def available() -> bool:
    return _load() is not None


def _require():
    ext = _ext or _load()
    if ext is None:
        raise RuntimeError(
            "speculant's CPU kernels are not available (the extension speculant._cpu_kernels was "
            "not built, or the CPU lacks AVX2/FMA); reinstall with a C "
            "compiler present (pip install -e .) or use the BLAS path"
        )
    return ext


def set_threads(n: int) -> int:
    """Threads of ``gemm`` (process-wide): 2 lets a helper thread take part of every product
    (but the smallest), 1 runs every product on the calling thread alone. The helper polls for
    the next product for 200 us after each one (a forward keeps it awake), then sleeps. Returns the count in force (1 where the helper thread could not be started). A helper
    that another process keeps from running costs only the unit of work it holds: the caller
    takes every unit the helper has not claimed and redoes one it is late with."""
    if n < 1:
        raise ValueError(f"set_threads({n}): the count must be >= 1")
    return _require().set_threads(min(int(n), 2))


def threads() -> int:
    """``gemm``'s thread count in force (``set_threads``; 1 without the kernels, and in a child
    process forked after ``set_threads(2)``: the helper thread does not survive the fork)."""
    ext = _ext or _load()
    return ext.get_threads() if ext is not None else 1


def block_weight(w: torch.Tensor, out: torch.Tensor | None = None) -> np.ndarray:
    """The fp32 weight ``w`` [out_features, in] as the kernel's blocked array
    [ceil(out_features / 16), in, 16] (zero-padded columns). ``out``: optional uint8 CPU tensor
    of exactly that many bytes to hold it (e.g. a huge-page arena slice)."""
    if w.dtype != torch.float32 or w.dim() != 2:
        raise ValueError(f"block_weight needs a 2-D float32 weight, got {tuple(w.shape)} {w.dtype}")
    o, i = w.shape
    nb = -(-o // BLOCK)
    if out is None:
        dst = torch.empty(nb, i, BLOCK, dtype=torch.float32)
    else:
        dst = out.view(torch.float32).view(nb, i, BLOCK)
    full = o // BLOCK
    w = w.detach()
    if full:
        dst[:full].copy_(w[: full * BLOCK].view(full, BLOCK, i).transpose(1, 2))
    if full < nb:
        dst[full].zero_()
        dst[full, :, : o - full * BLOCK].copy_(w[full * BLOCK :].t())
    arr = dst.numpy()
    if _ext or _load():  # freed only once the helper thread holds no unit that reads it
        weakref.finalize(arr, _ext.quiesce)
    return arr


def blocked_nbytes(w: torch.Tensor) -> int:
    return -(-w.shape[0] // BLOCK) * BLOCK * w.shape[1] * 4


def gemm(
    x: np.ndarray,  # [T, in] float32, unit stride along in
    wb: np.ndarray,  # [nb, in, 16] float32 (block_weight)
    out_features: int,
    bias: np.ndarray | None = None,  # [out_features] float32
    y: np.ndarray | None = None,  # [T, out_features] float32 to write into
) -> np.ndarray:  # [T, out_features]
    """y = x @ W.T (+ bias); the extension checks shapes, dtypes and strides."""
    if y is None:
        y = np.empty((x.shape[0], out_features), np.float32)
    (_ext or _require()).gemm(x, wb, bias, y)
    return y


def attend(
    q: np.ndarray,  # [T, nh * d] float32: the last T positions' queries
    k: np.ndarray,  # [ctx_len, nkv * d] float32: the sequence's cached keys (incl. these T)
    v: np.ndarray,  # [ctx_len, nkv * d] float32, same row stride as k
    nh: int,
    nkv: int,
    scale: float,
    o: np.ndarray | None = None,  # [T, nh * d] float32 to write into
) -> np.ndarray:  # [T, nh * d]
    """Causal GQA attention: row j attends to keys 0 .. ctx_len - T + j."""
    if o is None:
        o = np.empty(q.shape, np.float32)
    (_ext or _require()).attend(q, k, v, nh, nkv, scale, o)
    return o


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:  # x: [T, n], w: [n]
    y = np.empty(x.shape, np.float32)
    (_ext or _require()).rms_norm(x, w, eps, y)
    return y
