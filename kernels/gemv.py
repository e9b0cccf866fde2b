"""GEMV with a fused prologue for few rows: ``y[M, N] = f(x) @ weight.T (+ bias)``, M <= 8.

Batch-1 (and small-batch / short-verification) decoding reads every weight matrix once per step
with only a handful of activation rows, so each projection is bound by the weight read. cuBLAS's
GEMV reaches only part of the HBM bandwidth for the square 4096 x 4096 ``o_proj`` shape, and the
small elementwise kernels around the projections (RMSNorm, residual add, SiLU * up) cost ~2 us
each even inside a CUDA graph. This kernel reads ``weight`` ([N, K], the ``nn.Linear`` layout,
row-major) once and computes the activation transform ``f`` on the fly, per program:

* ``prologue="none"``: ``f(x) = x`` with ``x`` [M, K].
* ``prologue="rmsnorm"``: ``f(x) = rmsnorm(x (+ residual)) * norm_weight`` with exactly the
  rounding of ``speculant.models.fused.rms_norm``: ``s = x + residual`` in x's dtype,
  ``inv = rsqrt(sum(s.float() ** 2) / K + eps)``, ``((s.float() * inv).to(dtype) * norm_weight)``
  rounded to x's dtype. With a residual, ``s`` is also written to a residual-out buffer [M, K]
  (by the programs of the first output block only; every program only *reads* x and residual,
  so there is no race) and returned.
* ``prologue="silu_mul"``: ``x`` is ``gate_up`` [M, 2K]; ``f(x) = silu(gate.float()).to(dtype)
  * up``, as ``speculant.models.fused.silu_mul``.

Output epilogue (``out_norm_weight`` with ``out_residual``): the residual add and RMSNorm that
follow a projection (``o_proj`` / ``down_proj`` then the next norm) run in the split-K reduce
kernel instead of a separate ``fused.rms_norm`` launch: one kernel less (~2 us each even in a
CUDA graph, two per layer in the 2-8 row verification steps). ``gemv`` then returns
``(normed, s)`` with ``s = y + out_residual`` rounded to x's dtype and ``normed =
(s.float() * rsqrt(sum(s.float() ** 2) / N + out_eps)).to(dtype) * out_norm_weight`` in x's
dtype: bit-identical to ``fused.rms_norm(y, out_norm_weight, out_eps, residual=out_residual)``.
The norm needs whole rows of y, so the main kernel always writes fp32 partials (even with
``split_k=1``) and the reduce runs one program per row over all N columns (BLOCK =
next_pow2(N) and the warps of ``fused.rms_norm``, so its sum of squares is reduced in the same
order). Meant for N = the hidden size (a few thousand columns), as ``fused.rms_norm``.

Triton kernel design
--------------------
* Program ``(n, s)`` owns ``BLOCK_N`` output columns (weight rows) and the ``s``-th of
  ``split_k`` equal pieces of K (whole ``BLOCK_K`` chunks). It loops over its K range in
  ``BLOCK_K`` chunks: loads the x chunk of all M rows, applies the prologue in registers, loads
  the ``[BLOCK_N, BLOCK_K]`` weight tile and accumulates in fp32. The prologue is recomputed by
  every program: x is at most 8 x 2 x ~16k elements, read from L2, while the weight is streamed
  from HBM once.
* rmsnorm needs the row's sum of squares over all of K before the first product: a first loop
  over x (and the residual) computes it in wide chunks (~32 elements a thread: its loads are
  not overlapped, so few chunks), then the main loop re-reads x. With ``prefetch`` the first
  weight tile is already in flight during that pass.
* Products: one row (``use_dot=False``): CUDA-core FMAs into a ``[BLOCK_N, BLOCK_K]`` fp32
  accumulator, reduced once at the end. Several rows (``use_dot``): ``tl.dot`` on tensor cores
  with the rows padded to 16, the minimum dot size (32 for 17-32 rows): by default the prologue runs on
  next_pow2(M) rows and zero rows are interleaved in registers (x row m -> dot row
  m * 16 / next_pow2(M)); ``pad_rows=False`` instead loads 16-row x tiles with the rows past M
  masked (the prologue then runs on 16 rows). ``swap_ab`` makes the weight tile the first
  operand (``dot(W, f(x).T)``: on Hopper a 64-row weight tile gives a wgmma). The M = 1 FMA
  path has no wasted work; the dot path wastes only tensor-core cycles, which are idle anyway.
* The loop's offsets and masks are 2D ``[1, BLOCK_K]`` tensors: 1D ones were moved between
  layouts (through shared memory, with barriers) every iteration.
* ``split_k > 1``: each program writes an fp32 partial ``[split_k, M, N]`` and a small second
  kernel sums the pieces, adds the bias and casts. Gives more programs when N has few blocks
  (N = 4096) at the price of one more launch. With the output epilogue the partials are always
  written and the second kernel (``_split_reduce_norm_kernel``) also adds the residual and
  normalises; its half-precision adds and products are computed in fp32 and rounded once,
  which is the correctly rounded half result (fp32 has at least 2p + 2 bits), i.e. what
  ``fused.rms_norm`` computes on a GPU, and what the CPU interpreter (which cannot do bf16
  arithmetic) computes too.
* Programmatic dependent launch (Hopper; ``_triton_utils.pdl_launch``): with ``GDC`` the
  program waits (``gdc_wait``) after the optional first-tile prefetch (the weight is never
  written on the GPU) and before anything else, then lets the next kernel launch: at once on
  the one-row path and before a split-K reduce, after its stores on the few-row tensor-core
  path without one (``GDC_LATE``: an early-launched kernel would wait on the multiprocessors
  this one needs; docs/kernels.md, "Programmatic dependent launch", has the measurements).
* The launch configuration depends on the shapes only (never on tensor contents): the call is
  CUDA-graph capturable (no host sync, no ``.item()``). Weight row offsets are int64 (N * K may
  exceed 2**31 elements, e.g. a large vocabulary).

More than ``MAX_ROWS`` (32) rows take the torch path (``gemv_reference``: the separate ops);
``force_triton=True`` then raises. The torch path is also used for CPU tensors and with
``SPECULANT_DISABLE_TRITON`` set.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from ._triton_utils import (
    cdiv,
    check_tensor,
    interpret_mode,
    lazy_jit,
    next_pow2,
    num_sms,
    pdl_launch,
    tl,
    use_triton,
)

__all__ = [
    "gemv",
    "GemvPush",
    "gemv_reference",
    "gemv_partials",
    "gemv_split",
    "GemvConfig",
    "choose_config",
    "MAX_ROWS",
    "PROLOGUES",
]

MAX_ROWS = 32
_SMEM = 200 * 1024  # shared memory the pipelined tiles of a 32-row dot may take (H100: 227 KB)
PROLOGUES = ("none", "rmsnorm", "silu_mul")
_PROLOGUE_ID = {"none": 0, "rmsnorm": 1, "silu_mul": 2}
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class GemvPush:
    """Where ``gemv(..., push=...)`` stores y instead of a new tensor: row ``m`` at ``[slot,
    rank, m]`` of every rank's symmetric buffer, slot ``counters[m, 0]``, ``-0.0`` stored as
    ``+0.0`` (``-0.0`` marks an empty element). The fused all-reduce's Lamport form
    (kernels/tp_allreduce.py ``SymmetricAllReduce.gemv_all_reduce``) makes it and polls the
    rows as they land: the exchange starts in the GEMV's own programs."""

    bufs: torch.Tensor  # [world] int64: every rank's buffer address
    own: torch.Tensor  # this rank's buffer, [3, world, max_rows, N] ints as wide as y's dtype
    counters: torch.Tensor  # [max_rows, fc] int32: each row's slot (its first column)
    rank: int
    world: int
    sent: int  # -0.0's bits as a signed int

    def constexprs(self) -> dict:
        return {"PUSH": True, "PUSH_RANK": self.rank, "PUSH_WORLD": self.world,
                "PUSH_FC": self.counters.shape[1], "PUSH_SENT": self.sent}


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------
def _prologue_ref(
    x: torch.Tensor,  # [M, K] or [M, 2K] (silu_mul)
    prologue: str,
    norm_weight: torch.Tensor | None,  # [K]
    residual: torch.Tensor | None,  # [M, K]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(f(x) [M, K] in x's dtype, x + residual [M, K] or None)."""
    dtype = x.dtype
    if prologue == "silu_mul":
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate.float()).to(dtype) * up, None
    if prologue == "rmsnorm":
        s = x if residual is None else x + residual  # rounded to dtype, as torch adds
        sf = s.float()
        normed = (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
        return (normed * norm_weight).to(dtype), (None if residual is None else s)
    return x, None


def gemv_reference(
    x: torch.Tensor,  # [M, K]; [M, 2K] gate_up for prologue="silu_mul"
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    *,
    prologue: str = "none",
    norm_weight: torch.Tensor | None = None,  # [K], prologue="rmsnorm"
    residual: torch.Tensor | None = None,  # [M, K], prologue="rmsnorm"
    eps: float = 1e-6,
    out_norm_weight: torch.Tensor | None = None,  # [N], output epilogue
    out_residual: torch.Tensor | None = None,  # [M, N], output epilogue
    out_eps: float = 1e-6,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain torch: the prologue as separate ops, then ``F.linear`` in x's dtype, then the
    output epilogue as separate ops (the rounding of ``fused.rms_norm``). Also the fallback
    path. Returns y [M, N]; (y, x + residual) when ``residual`` is given; (rmsnorm(y +
    out_residual) * out_norm_weight, y + out_residual) when ``out_norm_weight`` is given."""
    if prologue not in PROLOGUES:
        raise ValueError(f"prologue must be one of {PROLOGUES}, got {prologue!r}")
    a, res_out = _prologue_ref(x, prologue, norm_weight, residual, eps)
    y = F.linear(a, weight, bias)
    if out_norm_weight is not None:  # s = y + out_residual, then its RMSNorm: as the prologue's
        return _prologue_ref(y, "rmsnorm", out_norm_weight, out_residual, out_eps)
    return y if residual is None else (y, res_out)


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------
if tl is not None:

    @lazy_jit
    def _gemv_kernel(
        x_ptr,  # [M, K] (none / rmsnorm) or [M, 2K] gate_up (silu_mul); last dim contiguous
        w_ptr,  # [N, K] weight, last dim contiguous
        b_ptr,  # [N] bias; read when HAS_BIAS and not PARTIAL
        nw_ptr,  # [K] RMSNorm weight; read when PROLOGUE == 1
        r_ptr,  # [M, K] residual; read when HAS_RES
        ro_ptr,  # [M, K] residual out = x + residual; written when HAS_RES (pid (0, 0) only)
        y_ptr,  # [M, N] output, or [split_k, M, N] fp32 partials when PARTIAL
        push_bufs_ptr,  # [world] int64: every rank's all-reduce buffer (PUSH)
        push_own_ptr,  # this rank's buffer as ints as wide as y's dtype (PUSH)
        push_cnt_ptr,  # [push_max_rows, PUSH_FC] int32: the buffer slot of each row (PUSH)
        push_max_rows,
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_rm,
        stride_rom,
        stride_ys,  # split stride of the partials (PARTIAL)
        stride_ym,
        k_per_split,  # K elements per split: a multiple of BLOCK_K
        eps,
        PROLOGUE: tl.constexpr,  # 0 none, 1 rmsnorm, 2 silu_mul
        HAS_BIAS: tl.constexpr,
        HAS_RES: tl.constexpr,
        PARTIAL: tl.constexpr,  # split-K: write fp32 partials, bias and cast in the reduce
        USE_DOT: tl.constexpr,  # tensor-core dots on the rows padded to DOT_M; else FMAs (1 row)
        SWAP_AB: tl.constexpr,  # dot(weight, f(x).T) instead of dot(f(x), weight.T)
        PREFETCH: tl.constexpr,  # load the next weight tile before using the current one
        IEEE_DOT: tl.constexpr,  # fp32 inputs: exact fp32 dots instead of tf32
        UPCAST_DOT: tl.constexpr,  # interpreter + bf16: numpy has no bf16 dot
        BLOCK_M: tl.constexpr,  # rows of x tiles: next_pow2(M)
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_KS: tl.constexpr,  # chunk of the rmsnorm sum-of-squares pass (>= BLOCK_K)
        PAD_STEPS: tl.constexpr,  # log2(DOT_M // BLOCK_M): row doublings up to the dot's rows
        DOT_M: tl.constexpr,  # rows of the dot: 16, or 32 for 17-32 rows of x
        GDC: tl.constexpr,  # launched with PDL: wait for the previous kernel (after the prefetch)
        GDC_LATE: tl.constexpr,  # with GDC: let the next kernel launch at the end, not the start
        PUSH: tl.constexpr = False,  # store y into every rank's all-reduce buffer (GemvPush)
        PUSH_RANK: tl.constexpr = 0,
        PUSH_WORLD: tl.constexpr = 1,
        PUSH_FC: tl.constexpr = 1,  # counters a row
        PUSH_SENT: tl.constexpr = 0,  # the empty marker (-0.0's bits), stored as +0.0
    ):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
        mask_m = offs_m < M
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        rk = tl.arange(0, BLOCK_K)[None, :]  # [1, BLOCK_K]: 2D offsets, no 1D layout moves
        x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
        w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
        if HAS_RES:
            r_rows = r_ptr + offs_m.to(tl.int64)[:, None] * stride_rm  # [BLOCK_M, 1]
            ro_rows = ro_ptr + offs_m.to(tl.int64)[:, None] * stride_rom  # [BLOCK_M, 1]
        k_start = pid_k * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)  # this program's K range: [k_start, k_end)
        if PREFETCH:  # the first weight tile is in flight during the sum-of-squares pass
            offs_k0 = k_start + rk
            mask_k0 = mask_n[:, None] & (offs_k0 < k_end)
            w_next = tl.load(w_rows + offs_k0, mask=mask_k0, other=0.0)
        if GDC:  # only the weight (never written on the GPU) is read above this line
            tl.extra.cuda.gdc_wait()
            if not GDC_LATE:
                tl.extra.cuda.gdc_launch_dependents()

        # ---- rmsnorm: sum of squares of the whole row (x + residual) first ----
        if PROLOGUE == 1:
            # rows written to the residual out: all M by program (0, 0), none by the others
            ro_rows_lim = tl.where((pid_n + pid_k) == 0, M, 0)
            rks = tl.arange(0, BLOCK_KS)[None, :]  # [1, BLOCK_KS]
            ss = tl.zeros([BLOCK_M], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_KS):
                offs_ks = k0 + rks
                mks = mask_m[:, None] & (offs_ks < K)
                s = tl.load(x_rows + offs_ks, mask=mks, other=0.0)
                if HAS_RES:
                    s = s + tl.load(r_rows + offs_ks, mask=mks, other=0.0)
                    mro = (offs_m[:, None] < ro_rows_lim) & (offs_ks < K)
                    tl.store(ro_rows + offs_ks, s, mask=mro)
                sf = s.to(tl.float32)
                ss += tl.sum(sf * sf, axis=1)
            inv = tl.rsqrt(ss / K + eps)  # [BLOCK_M]

        # ---- main loop over this program's K range ----
        if USE_DOT:
            if SWAP_AB:
                acc = tl.zeros([BLOCK_N, DOT_M], dtype=tl.float32)
            else:
                acc = tl.zeros([DOT_M, BLOCK_N], dtype=tl.float32)
        else:
            acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)  # BLOCK_M == 1
        for kk in range(0, k_per_split, BLOCK_K):
            offs_k = k_start + kk + rk  # [1, BLOCK_K]
            mask_k = offs_k < k_end
            mk = mask_m[:, None] & mask_k
            if PREFETCH:
                w = w_next
                offs_k_next = offs_k + BLOCK_K
                mask_next = mask_n[:, None] & (offs_k_next < k_end)
                w_next = tl.load(w_rows + offs_k_next, mask=mask_next, other=0.0)
            else:
                w = tl.load(w_rows + offs_k, mask=mask_n[:, None] & mask_k, other=0.0)
            # the prologue, on the BLOCK_M rows of x only
            if PROLOGUE == 2:
                g = tl.load(x_rows + offs_k, mask=mk, other=0.0)
                u = tl.load(x_rows + K + offs_k, mask=mk, other=0.0)
                gf = g.to(tl.float32)
                a = (gf / (1.0 + tl.exp(-gf))).to(g.dtype) * u
            elif PROLOGUE == 1:
                s = tl.load(x_rows + offs_k, mask=mk, other=0.0)
                if HAS_RES:
                    s = s + tl.load(r_rows + offs_k, mask=mk, other=0.0)
                nw = tl.load(nw_ptr + offs_k, mask=mask_k, other=0.0)  # [1, BLOCK_K]
                a = ((s.to(tl.float32) * inv[:, None]).to(s.dtype) * nw).to(s.dtype)
            else:
                a = tl.load(x_rows + offs_k, mask=mk, other=0.0)
            if USE_DOT:
                # rows padded to 16 with zero rows: x row m becomes row m * 2**PAD_STEPS
                for _ in tl.static_range(PAD_STEPS):
                    a = tl.join(a, tl.zeros_like(a))  # [R, BLOCK_K, 2]
                    a = tl.reshape(tl.permute(a, (0, 2, 1)), (2 * a.shape[0], BLOCK_K))
                if UPCAST_DOT:
                    a = a.to(tl.float32)
                    w = w.to(tl.float32)
                if SWAP_AB:
                    if IEEE_DOT:
                        acc += tl.dot(w, tl.trans(a), input_precision="ieee")
                    else:
                        acc += tl.dot(w, tl.trans(a))
                else:
                    if IEEE_DOT:
                        acc += tl.dot(a, tl.trans(w), input_precision="ieee")
                    else:
                        acc += tl.dot(a, tl.trans(w))
            else:
                acc2 += w.to(tl.float32) * a.to(tl.float32)  # [BLOCK_N, BLOCK_K] * [1, BLOCK_K]

        # ---- epilogue ----
        if USE_DOT:
            if SWAP_AB:
                acc = tl.trans(acc)  # [DOT_M, BLOCK_N]
            p = tl.arange(0, DOT_M)
            rows_y = p >> PAD_STEPS  # acc row p holds x row p / 2**PAD_STEPS ...
            mask_rows = ((p & ((1 << PAD_STEPS) - 1)) == 0) & (rows_y < M)  # ... when exact
        else:
            acc = tl.sum(acc2, axis=1)[None, :]  # [1, BLOCK_N]
            rows_y = offs_m
            mask_rows = mask_m
        mask_y = mask_rows[:, None] & mask_n[None, :]
        if not PARTIAL:
            if HAS_BIAS:
                acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            if PUSH:  # y's rows at [slot, PUSH_RANK, row] of every rank's buffer (own included)
                it = push_own_ptr.dtype.element_ty
                v = acc.to(y_ptr.dtype.element_ty).to(it, bitcast=True)
                v = tl.where(v == PUSH_SENT, tl.zeros_like(v), v)
                slot = tl.load(push_cnt_ptr + rows_y * PUSH_FC, mask=mask_rows, other=0,
                               cache_modifier=".cg")
                dst = (((slot * PUSH_WORLD + PUSH_RANK) * push_max_rows + rows_y)[:, None] * N
                       + offs_n[None, :])
                for p in tl.static_range(PUSH_WORLD):
                    if p == PUSH_RANK:
                        tl.store(push_own_ptr + dst, v, mask=mask_y)
                    else:
                        peer = tl.load(push_bufs_ptr + p).to(tl.pointer_type(it), bitcast=True)
                        tl.store(peer + dst, v, mask=mask_y)
            else:
                y_offs = rows_y[:, None] * stride_ym + offs_n[None, :]
                tl.store(y_ptr + y_offs, acc.to(y_ptr.dtype.element_ty), mask=mask_y)
        else:
            y_offs = pid_k * stride_ys + rows_y[:, None] * stride_ym + offs_n[None, :]
            tl.store(y_ptr + y_offs, acc, mask=mask_y)
        if GDC and GDC_LATE:
            tl.extra.cuda.gdc_launch_dependents()

    @lazy_jit
    def _split_reduce_kernel(
        p_ptr,  # [SPLIT_K, M, N] fp32 partials
        b_ptr,  # [N] bias; read when HAS_BIAS
        y_ptr,  # [M, N] output
        N,
        stride_ps,
        stride_pm,
        stride_ym,
        HAS_BIAS: tl.constexpr,
        SPLIT_K: tl.constexpr,
        BLOCK: tl.constexpr,
        GDC: tl.constexpr,  # launched with PDL: wait for the partials first
        TRIGGER_FIRST: tl.constexpr,  # with GDC: let the next kernel launch before the wait
    ):
        if GDC:
            if TRIGGER_FIRST:
                tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
            if not TRIGGER_FIRST:
                tl.extra.cuda.gdc_launch_dependents()
        m = tl.program_id(1)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            acc += tl.load(p_ptr + s * stride_ps + m * stride_pm + offs, mask=mask, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + m * stride_ym + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)

    @lazy_jit
    def _split_reduce_norm_kernel(
        p_ptr,  # [SPLIT_K, M, N] fp32 partials
        b_ptr,  # [N] bias; read when HAS_BIAS
        r_ptr,  # [M, N] residual (out_residual), y's dtype, last dim contiguous
        w_ptr,  # [N] RMSNorm weight (out_norm_weight), any float dtype
        s_ptr,  # [M, N] out: s = y + residual, in y's dtype
        o_ptr,  # [M, N] out: rmsnorm(s) * w, in y's dtype
        N,
        stride_ps,
        stride_pm,
        stride_rm,
        stride_sm,
        stride_om,
        eps,
        HAS_BIAS: tl.constexpr,
        SPLIT_K: tl.constexpr,
        BLOCK: tl.constexpr,  # next_pow2(N): the whole row, as fused._rms_norm_kernel
        GDC: tl.constexpr,  # launched with PDL: wait for the partials first
        TRIGGER_FIRST: tl.constexpr,  # with GDC: let the next kernel launch before the wait
    ):
        if GDC:
            if TRIGGER_FIRST:
                tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
            if not TRIGGER_FIRST:
                tl.extra.cuda.gdc_launch_dependents()
        # one program per row: y = sum of the partials + bias, rounded to y's dtype as
        # _split_reduce_kernel (and the single-split store) does; then fused._rms_norm_kernel's
        # arithmetic on s = y + residual
        m = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        p_row = p_ptr + m * stride_pm + cols  # [BLOCK] pointers into split 0
        acc = tl.load(p_row, mask=mask, other=0.0)
        for k in tl.static_range(1, SPLIT_K):
            acc += tl.load(p_row + k * stride_ps, mask=mask, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        dt = s_ptr.dtype.element_ty
        y = acc.to(dt)
        r = tl.load(r_ptr + m * stride_rm + cols, mask=mask, other=0.0)
        # half adds and products in fp32, rounded once: the correctly rounded half results
        # (bit-identical to native half arithmetic; the interpreter has no bf16 arithmetic)
        x = (y.to(tl.float32) + r.to(tl.float32)).to(dt)
        tl.store(s_ptr + m * stride_sm + cols, x, mask=mask)
        xf = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        normed = (xf * inv).to(dt)  # then * w, as fused._rms_norm_kernel
        tl.store(
            o_ptr + m * stride_om + cols,
            (normed.to(tl.float32) * w.to(tl.float32)).to(dt),
            mask=mask,
        )


# --------------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GemvConfig:
    """Launch parameters of the Triton path.

    ``use_dot``: tensor-core dots on the rows padded to 16 (needs ``block_n, block_k >= 16``);
    ``False``: CUDA-core FMAs, one row only; ``None``: dots for M >= 2. ``swap_ab``: the weight
    tile is the dot's first operand. ``pad_rows`` (dots): the prologue runs on next_pow2(M) rows,
    zero rows are interleaved up to 16 in registers; ``False``: x tiles of 16 rows, those past M
    masked (the prologue then runs on all 16). ``prefetch``: the next weight tile is loaded before
    the current one is used (two tiles in flight per program). ``num_stages=None``: Triton's
    default.
    """

    block_n: int
    block_k: int
    num_warps: int = 4
    split_k: int = 1
    use_dot: bool | None = None
    swap_ab: bool = False
    pad_rows: bool = True
    prefetch: bool = False
    num_stages: int | None = None

    def validate(self, M: int | None = None) -> None:
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ValueError(f"config.{name} must be a power of two, got {v!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"config.num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps!r}")
        if not isinstance(self.split_k, int) or not 1 <= self.split_k <= 64:
            raise ValueError(f"config.split_k must be an int in [1, 64], got {self.split_k!r}")
        if self.use_dot and (self.block_n < 16 or self.block_k < 16):
            raise ValueError(
                f"config with use_dot needs block_n and block_k >= 16, got {self.block_n}, "
                f"{self.block_k}"
            )
        if self.use_dot is False and M is not None and M > 1:
            raise ValueError(f"config with use_dot=False (CUDA-core FMAs) takes one row, got {M}")
        if self.num_stages is not None and not 1 <= self.num_stages <= 8:
            raise ValueError(f"config.num_stages must be in [1, 8], got {self.num_stages!r}")


def _deep_prefetch_config(N: int, K: int, prologue: str) -> GemvConfig | None:
    """One row, K <= 2048 (a Llama-3.2-1B draft's qkv, o_proj, gate/up, token-map head) or a
    4096 x 4096 o_proj: each program's whole K range is one weight tile, loaded before the PDL
    wait (``prefetch``), so the weight streams while the kernel before finishes (4-20% faster
    on those shapes, none on the others: docs/kernels.md, "Deep prefetch")."""
    if K <= 2048:
        if N <= 2048:
            return GemvConfig(block_n=8, block_k=2048, num_warps=8, use_dot=False, prefetch=True)
        bn = 2 if prologue == "none" else 4
        return GemvConfig(block_n=bn, block_k=2048, num_warps=4, use_dot=False, prefetch=True)
    if K <= 4096 and N <= 4096:
        return GemvConfig(block_n=2, block_k=4096, num_warps=8, use_dot=False, prefetch=True)
    return None


def few_rows_silu_mul_slower(M: int, N: int) -> bool:
    """Whether a SiLU * up product of ``M`` rows and ``N`` outputs is faster as the separate
    ``silu_mul`` kernel and cuBLAS than as this GEMV: 5 or more rows from N = 8192 (a
    Llama-3-70B TP 4 down shard, 8192 x 7168 on an H200, 6 rows: 40.5 us here, 31.7 us
    separately, the 16-row masked dot path streaming at ~70% of the copy bandwidth against
    cuBLAS's ~89%; 2-4 rows: 30.8-33.0 against 31.9-32.2, even). Shapes only, so a CUDA graph
    takes one path."""
    return M > 4 and N >= 8192


def choose_config(M: int, N: int, K: int, prologue: str, device: torch.device) -> GemvConfig:
    """Default launch parameters from the shapes only (CUDA-graph safe). Each regime takes the
    fastest configuration of bench/bench_gemv.py's H100 sweeps (Llama-3-8B and Llama-3.2-1B
    shapes, bf16); the figures are in docs/kernels.md ("GEMV") and bench/results/gemv_h100*.json.

    * one row: CUDA-core FMAs over 8 x 512 weight tiles (16 x 256 for a vocabulary-sized N), no
      split; N <= 2048 (a 1B draft's o_proj and down): 4 x 512 tiles, K split in two where
      K >= 4 N (and for N <= 3072 with K >= 3 N, a 70B TP 4 qkv shard: H200, 16.1 -> 13.2 us);
      a plain product (no prologue) with N >= 8192 (a tensor-parallel gate/up shard): 16 x 256
      tiles (H200: 70B TP 4 61.1 -> 57.0 us, 8B TP 2 32.5 -> 30.6), SiLU * up with N >= 8192
      (a 70B TP 4 down shard): 32 x 512 (H200: 34.6 -> 31.3 us), SiLU * up with N <= 4096 and
      K >= 7168 (an 8B down, whole or a TP 2 shard): 4 x 512 with 8 warps (H200: 34.6 -> 32.3,
      18.7 -> 17.7 us); K <= 2048, or the 8B
      o_proj: one prefetched tile per program (``_deep_prefetch_config``).
    * 3+ rows, rmsnorm: dots on 16-row masked x tiles, 64 x 256 (64 x 128 with 8 warps for a
      vocabulary-sized N). The prologue on interleaved rows was 1.5-2x slower there.
    * 2-32 rows, no prologue, N >= 4096 (3+ rows) or a 1B shape (K <= 2048, N >= 2048): dots
      with the weight first, 64-wide output tiles, K in two where the output blocks fill at most
      half the multiprocessors (in four for the 1B shapes where they fill at most a quarter).
    * otherwise (2 rows with rmsnorm, silu_mul, smaller shapes): dots with the weight first,
      64 x 128 tiles, split-K up to 4 until there are two programs per multiprocessor, 8 warps
      with rmsnorm; a 1B down_proj (N <= 2048, K >= 8192) on 256-wide K chunks; plain
      products of 2-8 rows, and silu_mul above 4 rows, on 16-row masked x tiles instead of
      interleaved rows.
    * 2-8 rows of a plain tensor-parallel gate/up shard (8192 < N <= 16384, K >= 4096): dots
      with the weight first over 64 x 128 tiles (H200 sweep).
    """
    big_n = N >= 65536
    if M <= 1:
        if big_n:
            return GemvConfig(block_n=16, block_k=256, num_warps=4, use_dot=False)
        deep = _deep_prefetch_config(N, K, prologue)
        if deep is not None:
            return deep
        if N <= 2048:  # few output blocks: narrower tiles, and split K when it is long
            split = 2 if K >= 4 * N else 1
            return GemvConfig(block_n=4, block_k=512, num_warps=4, split_k=split, use_dot=False)
        if N <= 3072 and K >= 3 * N:  # a 70B TP 4 shard's qkv (2560 x 8192): as above, in two
            return GemvConfig(block_n=4, block_k=512, num_warps=4, split_k=2, use_dot=False)
        if N >= 8192 and prologue == "none":  # a tensor-parallel shard's gate/up (normed input)
            return GemvConfig(block_n=16, block_k=256, num_warps=4, use_dot=False)
        if N >= 8192 and prologue == "silu_mul":  # a 70B TP 4 shard's down (8192 x 7168)
            return GemvConfig(block_n=32, block_k=512, num_warps=4, use_dot=False)
        if N <= 4096 and K >= 7168 and prologue == "silu_mul":  # an 8B down, whole or TP 2 shard
            return GemvConfig(block_n=4, block_k=512, num_warps=8, use_dot=False)
        return GemvConfig(block_n=8, block_k=512, num_warps=4, use_dot=False)
    if prologue == "rmsnorm" and M > 2:
        if big_n:
            return GemvConfig(block_n=64, block_k=128, num_warps=8, use_dot=True, pad_rows=False)
        return GemvConfig(block_n=64, block_k=256, num_warps=4, use_dot=True, pad_rows=False)
    if prologue == "none" and M <= 8 and 8192 < N <= 16384 and K >= 4096:
        # a tensor-parallel gate/up shard (14336 x 4096 / 8192) at 2-8 rows: 128-wide K
        # chunks (H200: 8B TP 2 30.7-31.2 -> 29.2-29.4 us, 70B TP 4 56.5-58.5 -> 55.1-55.6)
        return GemvConfig(block_n=64, block_k=128, num_warps=4, use_dot=True, swap_ab=True,
                          pad_rows=False)
    # a Llama-3.2-1B draft's qkv, o_proj, gate/up and token-map head in its multi-row forwards
    small = K <= 2048 and N >= 2048
    if prologue == "none" and 2 <= M <= 32 and ((4096 <= N and M >= 3) or small):
        # K in two where the output blocks alone fill at most half the multiprocessors (o_proj
        # 4096 x 4096: 64 blocks)
        blocks = cdiv(N, 64)
        split = 2 if 2 * blocks <= num_sms(device) and K >= 2048 else 1
        # 1B shapes: o_proj 2048 x 2048 in four (10-16% faster than the generic configuration
        # below), qkv 3072 x 2048 in two, gate/up 16384 x 2048 on 128-wide K chunks
        if small and 4 * blocks <= num_sms(device):
            split = 4
        return GemvConfig(
            block_n=64,
            # 128-wide K chunks for the 1B gate/up (16384 x 2048); a 70B TP 4 o_proj shard
            # (8192 x 2048) is faster on 256 (H200, 6 rows: 11.3 -> 10.1 us)
            block_k=128 if small and split == 1 and 8192 < N <= 16384 else 256,
            num_warps=4,
            split_k=split,
            use_dot=True,
            swap_ab=True,
            pad_rows=False,
        )
    block_n, block_k = 64, 128
    n_blocks = cdiv(N, block_n)
    split = 1
    while split < 4 and n_blocks * split < 2 * num_sms(device) and cdiv(K, block_k) >= 8 * split:
        split *= 2
    num_warps = 8 if prologue == "rmsnorm" else 4
    if prologue == "silu_mul" and N <= 2048 and K >= 8192:
        # a 1B draft's down_proj 2048 x 8192: 256-wide K chunks, 8 warps above 2 rows (4-11%
        # faster at 2-16 rows)
        block_k, num_warps = 256, 8 if M > 2 else 4
    return GemvConfig(
        block_n=block_n,
        block_k=block_k,
        num_warps=num_warps,
        split_k=split,
        use_dot=True,
        swap_ab=True,
        # 16-row masked x tiles, not rows interleaved with zero rows: plain products of 2-8
        # rows (the qkv shards of 8B TP 2 / 70B TP 4 on an H200: 1.07-1.5x at 2-6 rows), SiLU *
        # up above 4 rows (7% faster for the 8B down at 6 rows on an H100; at 4 rows the
        # interleaved rows stay ahead)
        pad_rows=not ((prologue == "none" and M <= 8) or (prologue == "silu_mul" and M > 4)),
    )


def _as_config(config: GemvConfig | Mapping | None, M, N, K, prologue, device) -> GemvConfig:
    if config is None:
        cfg = choose_config(M, N, K, prologue, device)
    elif isinstance(config, GemvConfig):
        cfg = config
    elif isinstance(config, Mapping):
        try:
            cfg = GemvConfig(**{k.lower(): v for k, v in config.items()})
        except TypeError as e:
            raise ValueError(f"bad gemv config {dict(config)!r}: {e}") from None
    else:
        raise ValueError(f"config must be a GemvConfig or a mapping, got {type(config).__name__}")
    if cfg.use_dot is None:
        cfg = replace(cfg, use_dot=M >= 2)
    cfg.validate(M)
    return cfg


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------
def _check_norm(prefix: str, weight, residual, eps, res_shape, dtype, dev) -> None:
    """An RMSNorm's arguments: ``{prefix}norm_weight`` [n] (any float dtype), ``{prefix}residual``
    ``res_shape`` in x's dtype (or None), ``{prefix}eps`` >= 0."""
    n = res_shape[1]
    check_tensor(f"{prefix}norm_weight", weight, shape=(n,), dtypes=_FLOAT_DTYPES, device=dev)
    if residual is not None:
        check_tensor(
            f"{prefix}residual",
            residual,
            shape=res_shape,
            dtypes=(dtype,),
            device=dev,
            last_contiguous=True,
        )
    if not isinstance(eps, (int, float)) or not eps >= 0.0:
        raise ValueError(f"{prefix}eps must be a non-negative float, got {eps!r}")


def _check_args(
    x, weight, bias, prologue, norm_weight, residual, eps, out_norm_weight, out_residual, out_eps
) -> tuple[int, int, int]:
    if prologue not in PROLOGUES:
        raise ValueError(f"prologue must be one of {PROLOGUES}, got {prologue!r}")
    check_tensor("x", x, ndim=2, dtypes=_FLOAT_DTYPES, last_contiguous=True)
    dev = x.device
    check_tensor("weight", weight, ndim=2, dtypes=(x.dtype,), device=dev, last_contiguous=True)
    M = x.shape[0]
    N, K = weight.shape
    if K == 0:
        raise ValueError(f"weight must have at least one column, got shape {tuple(weight.shape)}")
    want_xk = 2 * K if prologue == "silu_mul" else K
    if x.shape[1] != want_xk:
        what = "2 * weight.shape[1] (gate_up)" if prologue == "silu_mul" else "weight.shape[1]"
        raise ValueError(
            f"x must have shape (*, {want_xk}) = {what} for prologue={prologue!r}, got "
            f"{tuple(x.shape)} with weight {tuple(weight.shape)}"
        )
    if bias is not None:
        check_tensor("bias", bias, shape=(N,), dtypes=(x.dtype,), device=dev)
    if prologue == "rmsnorm":
        if norm_weight is None:
            raise ValueError("prologue='rmsnorm' needs norm_weight")
        _check_norm("", norm_weight, residual, eps, (M, K), x.dtype, dev)
    else:
        if norm_weight is not None:
            raise ValueError(f"norm_weight is only used with prologue='rmsnorm', not {prologue!r}")
        if residual is not None:
            raise ValueError(f"residual is only used with prologue='rmsnorm', not {prologue!r}")
    if out_norm_weight is not None:
        if out_residual is None:
            raise ValueError(
                "out_norm_weight (the output RMSNorm) needs out_residual [M, N] (the residual "
                "added to y before the norm)"
            )
        _check_norm("out_", out_norm_weight, out_residual, out_eps, (M, N), x.dtype, dev)
        if residual is not None:
            raise ValueError(
                "residual (the rmsnorm prologue's input residual) and out_residual (the "
                "output epilogue's) are not supported in one call: add the input residual "
                "beforehand, or drop out_norm_weight / out_residual and run fused.rms_norm after"
            )
    elif out_residual is not None:
        raise ValueError("out_residual is only used with out_norm_weight (the output RMSNorm)")
    return M, N, K


def _geometry(cfg: GemvConfig, M: int, K: int, itemsize: int) -> tuple[int, int, int, int]:
    """(block_k, dot_m, split, k_per_split) of a launch: the tiles ``cfg`` asks for, fitted to
    K, the registers (FMA tiles) and the shared memory (32-row dots); no empty split."""
    block_k = min(cfg.block_k, max(16, next_pow2(K)))  # no chunk far larger than K
    if not cfg.use_dot:  # FMA tiles: at most 64 four-byte elements a thread (fp32: halve)
        while block_k > 16 and cfg.block_n * block_k * itemsize > 256 * 32 * cfg.num_warps:
            block_k //= 2
    dot_m = max(16, next_pow2(M))  # rows of the dot (tensor-core tiles: 16 or 32)
    if cfg.use_dot and dot_m > 16:  # 32-row x tiles: keep the pipelined tiles in shared memory
        stages = cfg.num_stages or 3  # (fp32 at 32 x 256 + 64 x 256 needs 290 KB at 3 stages)
        while block_k > 16 and stages * (dot_m + cfg.block_n) * block_k * itemsize > _SMEM:
            block_k //= 2
    k_chunks = cdiv(K, block_k)
    chunks_per_split = cdiv(k_chunks, cfg.split_k)
    split = cdiv(k_chunks, chunks_per_split)  # no empty split
    return block_k, dot_m, split, chunks_per_split * block_k


def _gemv_triton(
    x,
    weight,
    bias,
    prologue,
    norm_weight,
    residual,
    eps,
    cfg: GemvConfig,
    out_norm_weight=None,
    out_residual=None,
    out_eps=1e-6,
    partials_only: bool = False,
    push: GemvPush | None = None,
):
    """(y, x + residual or None); with the output epilogue: (normed, y + out_residual);
    ``partials_only``: (the fp32 partials [split, M, N] unreduced, None), no bias; ``push``:
    (None, None), y stored into the all-reduce buffers."""
    M = x.shape[0]
    N, K = weight.shape
    dev = x.device
    epilogue = out_norm_weight is not None
    # normed with the epilogue; with partials_only or push one element (only its dtype is used)
    y = torch.empty((1, 1) if partials_only or push is not None else (M, N), dtype=x.dtype,
                    device=dev)
    res_out = torch.empty(M, K, dtype=x.dtype, device=dev) if residual is not None else None
    if epilogue:
        res_out = torch.empty(M, N, dtype=x.dtype, device=dev)  # s = y + out_residual
    if M == 0 or N == 0:
        if partials_only:
            return torch.zeros(1, M, N, dtype=torch.float32, device=dev), None
        return y, res_out
    block_k, dot_m, split, k_per_split = _geometry(cfg, M, K, x.element_size())
    block_m = dot_m if cfg.use_dot and not cfg.pad_rows else next_pow2(M)
    # sum-of-squares pass: ~32 elements of x a thread per chunk (few chunks: its loads wait)
    block_ks = min(next_pow2(K), max(block_k, 1024 * cfg.num_warps // block_m))
    # the epilogue needs whole rows, gemv_partials' caller reduces them: always partials
    partial = split > 1 or epilogue or partials_only
    if push is not None and (partial or residual is not None):
        raise ValueError("gemv(push=...) takes an unsplit product without an output epilogue "
                         "or an input residual: check gemv_split(x, weight, prologue) == 1")
    if partial:
        out = torch.empty(split, M, N, dtype=torch.float32, device=dev)
        stride_ys, stride_ym = out.stride(0), out.stride(1)
    else:
        out = y
        stride_ys, stride_ym = 0, y.stride(0)
    dummy = y  # pointer for unused arguments (never dereferenced)
    r = residual if residual is not None else dummy
    ro = res_out if residual is not None else dummy
    extra = {} if cfg.num_stages is None else {"num_stages": cfg.num_stages}
    pdl = pdl_launch(dev)
    # few rows (dots): the next kernel launches after this one's stores, unless it is the
    # split-K reduce, whose few programs wait on the multiprocessors this kernel leaves free
    late = bool(cfg.use_dot) and pdl["GDC"] and not partial
    grid = (cdiv(N, cfg.block_n), split)
    _gemv_kernel[grid](
        x,
        weight,
        bias if bias is not None else dummy,
        norm_weight if norm_weight is not None else dummy,
        r,
        ro,
        out,
        push.bufs if push is not None else dummy,
        push.own if push is not None else dummy,
        push.counters if push is not None else dummy,
        push.counters.shape[0] if push is not None else 0,
        M,
        N,
        K,
        x.stride(0),
        weight.stride(0),
        r.stride(0),
        ro.stride(0),
        stride_ys,
        stride_ym,
        k_per_split,
        float(eps),
        PROLOGUE=_PROLOGUE_ID[prologue],
        HAS_BIAS=bias is not None,
        HAS_RES=residual is not None,
        PARTIAL=partial,
        USE_DOT=bool(cfg.use_dot),
        SWAP_AB=bool(cfg.swap_ab),
        PREFETCH=bool(cfg.prefetch),
        IEEE_DOT=x.dtype == torch.float32,
        UPCAST_DOT=interpret_mode() and x.dtype == torch.bfloat16,
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=block_k,
        BLOCK_KS=block_ks,
        PAD_STEPS=(dot_m // block_m).bit_length() - 1 if cfg.use_dot else 0,
        DOT_M=dot_m,
        num_warps=cfg.num_warps,
        **extra,
        **pdl,
        GDC_LATE=late,
        **(push.constexprs() if push is not None else {}),
    )
    # one row: the next kernel (a one-row GEMV that prefetches its weight before its wait) may
    # launch before this reduce waits; after a few-row dot GEMV it may not (an early-launched
    # dot kernel waits on multiprocessors the running one needs)
    first = not cfg.use_dot
    if push is not None:
        return None, None
    if partials_only:
        return out, None
    if epilogue:
        block = next_pow2(N)
        _split_reduce_norm_kernel[(M,)](
            out,
            bias if bias is not None else dummy,
            out_residual,
            out_norm_weight,
            res_out,
            y,
            N,
            out.stride(0),
            out.stride(1),
            out_residual.stride(0),
            res_out.stride(0),
            y.stride(0),
            float(out_eps),
            HAS_BIAS=bias is not None,
            SPLIT_K=split,
            BLOCK=block,
            num_warps=8 if block >= 4096 else 4,  # as fused.rms_norm: same reduction order
            **pdl,
            TRIGGER_FIRST=first,
        )
    elif split > 1:
        block = min(1024, next_pow2(N))
        _split_reduce_kernel[(cdiv(N, block), M)](
            out,
            bias if bias is not None else dummy,
            y,
            N,
            out.stride(0),
            out.stride(1),
            y.stride(0),
            HAS_BIAS=bias is not None,
            SPLIT_K=split,
            BLOCK=block,
            num_warps=4,
            **pdl,
            TRIGGER_FIRST=first,
        )
    return y, res_out


def gemv(
    x: torch.Tensor,  # [M, K]; [M, 2K] gate_up for prologue="silu_mul"
    weight: torch.Tensor,  # [N, K] (nn.Linear layout)
    bias: torch.Tensor | None = None,  # [N]
    *,
    prologue: str = "none",
    norm_weight: torch.Tensor | None = None,  # [K], prologue="rmsnorm"
    residual: torch.Tensor | None = None,  # [M, K], prologue="rmsnorm"
    eps: float = 1e-6,
    out_norm_weight: torch.Tensor | None = None,  # [N], output epilogue
    out_residual: torch.Tensor | None = None,  # [M, N], output epilogue
    out_eps: float = 1e-6,
    force_triton: bool = False,
    config: GemvConfig | Mapping | None = None,
    push: GemvPush | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """``y = f(x) @ weight.T + bias`` for M <= ``MAX_ROWS`` rows, the prologue ``f`` fused.

    Returns y [M, N] in x's dtype, or ``(y, x + residual)`` when ``residual`` is given (a new
    [M, K] tensor; rmsnorm only). x, weight, bias and residual share one dtype (fp16, bf16 or
    fp32); ``norm_weight`` may be any float dtype (the product is rounded to x's dtype). Rows
    and the weight may be strided, their last dim must be contiguous.

    Output epilogue: with ``out_norm_weight`` ([N], any float dtype) and ``out_residual``
    ([M, N], x's dtype, last dim contiguous; required with it), returns ``(normed, s)``, two
    new [M, N] tensors in x's dtype: ``s = y + out_residual`` and ``normed = rmsnorm(s,
    out_eps) * out_norm_weight``, bit-identical to ``fused.rms_norm(y, out_norm_weight,
    out_eps, residual=out_residual)`` (the residual add and the norm run in the reduce kernel,
    one launch less). Works with every prologue, but not together with the rmsnorm prologue's
    ``residual`` (ValueError).

    ``config`` (a :class:`GemvConfig` or a mapping of its fields) overrides the shape-based
    launch parameters (benchmarks). ``force_triton`` runs the Triton kernel under
    ``TRITON_INTERPRET=1`` on CPU tensors (tests). More than ``MAX_ROWS`` rows take the torch
    path (``force_triton=True`` then raises).

    ``push`` (:class:`GemvPush`): y goes into a fused all-reduce's buffers and None is returned;
    the Triton path only, unsplit (``gemv_split(x, weight, prologue) == 1``) and without an
    output epilogue or input residual (ValueError otherwise).
    """
    kw = dict(
        prologue=prologue,
        norm_weight=norm_weight,
        residual=residual,
        eps=eps,
        out_norm_weight=out_norm_weight,
        out_residual=out_residual,
        out_eps=out_eps,
    )
    M, N, K = _check_args(x, weight, bias, **kw)
    tensors = [x, weight, bias, norm_weight, residual, out_norm_weight, out_residual]
    if M > MAX_ROWS:
        if force_triton:
            raise ValueError(f"the Triton gemv takes at most {MAX_ROWS} rows, got {M}")
        triton_path = False
    else:
        triton_path = use_triton(tensors, force_triton)
    if not triton_path:
        if push is not None:
            raise ValueError("gemv(push=...) needs the Triton path (CUDA tensors, at most "
                             f"{MAX_ROWS} rows)")
        return gemv_reference(x, weight, bias, **kw)
    cfg = _as_config(config, M, N, K, prologue, x.device)
    y, res_out = _gemv_triton(x, weight, bias, cfg=cfg, push=push, **kw)
    return y if res_out is None else (y, res_out)


def gemv_split(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    config: GemvConfig | Mapping | None = None,
    prologue: str = "none",
) -> int:
    """The number of K pieces (split-K) the Triton ``gemv`` of ``x`` by ``weight`` (with
    ``prologue``) launches with, from the shapes only (no device read): 1 means no partials and
    no reduce kernel. 0 where the call would not take the Triton kernel (more than ``MAX_ROWS``
    rows, CPU tensors without ``force_triton``)."""
    M, (N, K) = x.shape[0], weight.shape
    if not 0 < M <= MAX_ROWS or not use_triton([x, weight], False):
        return 0
    cfg = _as_config(config, M, N, K, prologue, x.device)
    return _geometry(cfg, M, K, x.element_size())[2]


def gemv_partials(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] (nn.Linear layout)
    *,
    force_triton: bool = False,
    config: GemvConfig | Mapping | None = None,
) -> torch.Tensor:  # [split, M, N] float32
    """``x @ weight.T`` as the fp32 split-K partials of the Triton ``gemv`` (no prologue, no
    bias), left for the caller's own reduce kernel to sum: ``y = (p[0] + p[1] + ... + bias)``
    rounded to x's dtype is bit-identical to ``gemv(x, weight, bias)`` with the same launch
    configuration (its reduce adds the pieces in this order, starting from 0). One piece when
    the configuration does not split K (the kernel then still writes fp32). ``models/fused.
    reduce_rope_store_`` reduces the QKV projection's partials and applies RoPE in one kernel.

    The torch path (CPU tensors, more than ``MAX_ROWS`` rows, ``SPECULANT_DISABLE_TRITON=1``):
    one piece, ``F.linear(x, weight)`` in x's dtype, as float32."""
    M, N, K = _check_args(x, weight, None, "none", None, None, 1e-6, None, None, 1e-6)
    if M > MAX_ROWS:
        if force_triton:
            raise ValueError(f"the Triton gemv takes at most {MAX_ROWS} rows, got {M}")
        triton_path = False
    else:
        triton_path = use_triton([x, weight], force_triton)
    if not triton_path:
        return F.linear(x, weight).float().unsqueeze(0)
    cfg = _as_config(config, M, N, K, "none", x.device)
    return _gemv_triton(x, weight, None, "none", None, None, 1e-6, cfg, partials_only=True)[0]
