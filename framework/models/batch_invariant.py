"""Batch-invariant CUDA forwards (``EngineConfig.batch_invariant``).

On the GPU a sequence's logits normally depend, in their last bits, on the step they are
computed in: cuBLAS and the few-row GEMVs (kernels/gemv.py) pick their kernel, tiling and
split-K from the step's row count, and the paged-attention launch picks its tiles and KV splits
from the batch and query lengths. A near tie can then flip between a batch of 1 and a batch of
64, or between a plain decode step and the k+1 rows of a verification pass. In this mode every
piece of a forward computes a row with arithmetic that depends on that row (and its own
sequence's cache) alone:

* every linear layer (QKV, o_proj, gate/up, down, the LM head; OPT's too) is
  ``chunked_linear``: the rows are cut into chunks of ``ROWS`` (the last one zero-padded) and
  each chunk is one cuBLAS GEMM of the same shape ``[ROWS, K] x [K, N]``, whatever the step's
  row count: one shape per weight, so one kernel and one reduction order for every row. That
  holds if cuBLAS's kernel for the shape treats the chunk's rows alike (one tile of >= ``ROWS``
  rows, or the same K split in every row tile); ``GEMM = "triton"`` instead runs ``triton_linear``,
  our own kernel whose one 64-row tile per chunk and whole-K loop guarantee it by construction
  (tests/test_batch_invariance_gpu.py checks both on the device);
* the GEMV paths (``fused.gemv_enabled`` / ``gemv_few_enabled`` / ``gemv_in_enabled``) are off;
* paged attention launches with one configuration for every step and ``num_splits`` KV splits
  at fixed absolute position ranges (``kernels/paged_attention._invariant_config``);
* RMSNorm, RoPE with the K/V store, SiLU * up, the embedding gather, the greedy choice and the
  log-probabilities are row-wise kernels already (one program per row, a configuration from the
  width alone).

So greedy output does not depend on the batch, on CUDA-graph padding, or on whether a token was
decoded or verified: speculation cannot flip a near tie. The model's ``forward`` and
``compute_logits`` set the mode (``scope``) for everything they call, CUDA-graph captures
included; nothing else (a proposer's own forwards) is affected. The CPU path (fp32 with the C
kernels) is batch-invariant without this module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from speculant.kernels._triton_utils import cdiv, lazy_jit, tl, use_triton

# rows of every GEMM of a batch-invariant linear: 64 keeps a decode step's GEMMs bandwidth-bound
# (the weight read dominates up to a few hundred rows on an H100) and makes each chunk's offset
# a multiple of 128 bytes for any width
ROWS = 64
# the GEMMs of ``chunked_linear`` on CUDA: "cublas" (torch.mm per chunk) or "triton"
# (``triton_linear``)
GEMM = "cublas"
# attention: KV splits at fixed ranges of at least this many positions, at most MAX_SPLITS of
# them, covering the model's positions (the rotary cache's length: no step goes past it)
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 64


@dataclass(frozen=True)
class Settings:
    """What a batch-invariant forward launches with (fixed for the engine's life)."""

    num_splits: int  # paged attention's KV splits (the merge's reduction depends on the count)
    split_tokens: int  # KV positions of each split, at fixed absolute ranges


_ACTIVE: ContextVar[Settings | None] = ContextVar("speculant_batch_invariant", default=None)


def active() -> Settings | None:
    """The settings of the batch-invariant forward running now, None outside one."""
    return _ACTIVE.get()


@contextlib.contextmanager
def scope(settings: Settings) -> Iterator[None]:
    """Everything called inside runs batch-invariant (``fused`` and ``attention`` read it)."""
    token = _ACTIVE.set(settings)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def settings_for(max_positions: int) -> Settings:
    """Attention splits covering positions ``0 .. max_positions - 1``: ranges of a multiple of
    256 positions, at least ``MIN_SPLIT_TOKENS`` each, at most ``MAX_SPLITS`` of them."""
    if max_positions < 1:
        raise ValueError(f"max_positions={max_positions}: a model covers at least one position")
    per = max(MIN_SPLIT_TOKENS, -(-max_positions // MAX_SPLITS))
    per = -(-per // 256) * 256
    return Settings(num_splits=-(-max_positions // per), split_tokens=per)


def chunked_linear(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    rows: int = ROWS,
) -> torch.Tensor:  # [..., N]
    """``F.linear`` as GEMMs of ``rows`` rows each (the last chunk zero-padded): the same GEMM
    shape for any number of rows, so a row's result never depends on the others."""
    lead = x.shape[:-1]
    K, N = x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, K)  # [M, K]
    if GEMM == "triton" and rows == ROWS and use_triton([x2, weight], False):
        return triton_linear(x2, weight, bias).view(*lead, N)
    M = x2.shape[0]
    n = -(-M // rows)
    if n == 0:
        return x.new_empty(*lead, N)
    xp = F.pad(x2, (0, 0, 0, n * rows - M)) if M % rows else x2.contiguous()  # [n * rows, K]
    out = x.new_empty(n * rows, N)  # [n * rows, N]
    wt = weight.t()  # [K, N]
    for i in range(n):
        a, o = xp[i * rows : (i + 1) * rows], out[i * rows : (i + 1) * rows]  # [rows, K], [rows, N]
        if bias is None:
            torch.mm(a, wt, out=o)
        else:
            torch.addmm(bias, a, wt, out=o)
    return out[:M].view(*lead, N)


# one program: a 64-row tile of the input times a BLOCK_N-column tile of the weight over the whole
# K (no split-K): every row of every tile is computed alike, whatever the row count
_BLOCK_N = 32
_BLOCK_K = 64

if tl is not None:

    @lazy_jit(do_not_specialize=("M",))
    def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                       HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # x [M, K], w [N, K], b [N], y [M, N]
        rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
        rn = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            kk = k + rk
            a = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :],
                        mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)  # [BM, BK]
            w = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None],
                        mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)  # [BK, BN]
            if IEEE:  # fp32 weights: exact fp32 products, as cuBLAS without TF32
                acc = tl.dot(a, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))


def triton_linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    force_triton: bool = False,
) -> torch.Tensor:  # [M, N]
    """``F.linear`` as one Triton launch of ``ROWS``-row tiles over the whole K: a row's result
    depends on that row alone, for any M (``force_triton``: under the CPU interpreter)."""
    if not use_triton([x, weight], force_triton):
        return chunked_linear(x, weight, bias)
    M, K = x.shape
    N = weight.shape[0]
    if weight.stride(1) != 1 or weight.shape[1] != K:
        raise ValueError(f"triton_linear: a weight [{N}, {K}] with a contiguous last dim, got "
                         f"{tuple(weight.shape)} with strides {weight.stride()}")
    x = x if x.stride(1) == 1 else x.contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M:
        _linear_kernel[(cdiv(M, ROWS), cdiv(N, _BLOCK_N))](
            x, weight, bias if bias is not None else weight, y, M, N, K, x.stride(0),
            weight.stride(0), y.stride(0), HAS_BIAS=bias is not None,
            IEEE=x.dtype == torch.float32, BLOCK_M=ROWS,
            BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K, num_warps=4, num_stages=4)
    return y


class BatchInvariantLinear(nn.Linear):
    """``nn.Linear`` computed by ``chunked_linear`` (installed in place by ``install``: the
    module keeps its parameters, names and every reference to it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return chunked_linear(x, self.weight, self.bias)


_CLASSES: dict[type, type] = {}


def _invariant_class(cls: type) -> type:
    """``cls`` with ``forward`` and ``compute_logits`` run inside ``scope`` (one subclass per
    model class)."""
    sub = _CLASSES.get(cls)
    if sub is None:
        def forward(self, *args, **kwargs):
            with scope(self.batch_invariant):
                return cls.forward(self, *args, **kwargs)

        def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
            with scope(self.batch_invariant):
                return cls.compute_logits(self, hidden)

        sub = _CLASSES[cls] = type(f"BatchInvariant{cls.__name__}", (cls,), {
            "forward": forward, "compute_logits": compute_logits, "__module__": __name__,
            "__doc__": f"{cls.__name__} whose forwards run batch-invariant (models/"
                       "batch_invariant.py)"})
    return sub


def install(model: nn.Module, max_positions: int | None = None) -> Settings:
    """Make ``model``'s forwards batch-invariant, in place: its ``nn.Linear`` modules become
    ``BatchInvariantLinear`` and its class a subclass whose ``forward`` / ``compute_logits`` run
    inside ``scope``. ``max_positions``: default the model's own. Returns the settings."""
    if max_positions is None:
        max_positions = getattr(model, "max_positions", None)
        if max_positions is None:
            raise ValueError(f"{type(model).__name__} has no max_positions: pass max_positions "
                             "to batch_invariant.install")
    if type(model) in _CLASSES.values():  # installed already
        return model.batch_invariant
    settings = settings_for(max_positions)
    for mod in model.modules():
        if type(mod) is nn.Linear:
            mod.__class__ = BatchInvariantLinear
        elif isinstance(mod, nn.Linear) and not isinstance(mod, BatchInvariantLinear):
            raise ValueError(f"batch_invariant: {type(mod).__name__} (a linear layer of "
                             f"{type(model).__name__}) has no batch-invariant form")
    model.batch_invariant = settings
    model.__class__ = _invariant_class(type(model))
    return settings


def enable(model: nn.Module, device: torch.device, dtype: torch.dtype,
           tensor_parallel_size: int = 1) -> Settings | None:
    """``EngineConfig.batch_invariant=True``: check that the mode can hold on ``device`` and
    install it (CUDA). The CPU path is batch-invariant by itself where it runs fp32 on our C
    kernels; elsewhere this raises, naming the fix. Returns the settings (None on the CPU)."""
    if tensor_parallel_size > 1:
        raise ValueError(f"batch_invariant=True with tensor_parallel_size="
                         f"{tensor_parallel_size}: the all-reduce of a sharded model is not "
                         "batch-invariant; use tensor_parallel_size=1 or batch_invariant=False")
    if device.type == "cpu":
        from speculant.models import cpu_kernels

        if dtype != torch.float32:
            raise ValueError(f"batch_invariant=True on the CPU needs dtype float32 (the C "
                             f"kernels' path), got {dtype}; use dtype='float32'")
        if not cpu_kernels.available():
            raise ValueError("batch_invariant=True on the CPU needs speculant's C kernels "
                             "(speculant._cpu_kernels: an AVX2/FMA CPU and a C compiler at "
                             "install); reinstall with a compiler or use batch_invariant=False")
        return None
    if device.type != "cuda":
        raise ValueError(f"batch_invariant=True is available on CPU and CUDA, not on "
                         f"{device.type}; use batch_invariant=False")
    from speculant.kernels._triton_utils import triton_enabled

    if not triton_enabled():
        raise ValueError("batch_invariant=True needs the Triton kernels (paged attention with "
                         "fixed splits) but SPECULANT_DISABLE_TRITON is set (or triton is not "
                         "installed); unset it or use batch_invariant=False")
    return install(model)
