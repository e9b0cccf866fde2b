"""Fused Triton kernels for the CUDA decode path of the model layers: RMSNorm (optionally fused
with the residual add), rotary embedding in place on the q/k views of the fused QKV output, and
SiLU(gate) * up. Each replaces 5 to 15 small PyTorch kernels per layer, which at batch 1 cost
more than the weights' own read time. CPU tensors never come here (the torch code in
layers.py / llama.py stays the CPU path)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from speculant.kernels._triton_utils import (
    lazy_jit,
    next_pow2,
    pdl_launch,
    tl,
    use_triton,
)
from speculant.kernels.gemv import gemv
from speculant.models import batch_invariant


def enabled(x: torch.Tensor) -> bool:
    return use_triton([x], False)


# Rows up to which the layers run as GEMVs (kernels/gemv.py) instead of cuBLAS; the figures
# that set them (bench/bench_gemv.py, H100, Llama-3-8B shapes) are in docs/kernels.md.
# One-row steps: all four projections, with their prologues (RMSNorm, SiLU * up) fused.
GEMV_MAX_ROWS = 1
# The multi-row CUDA layer path (``LlamaDecoderLayer.forward_fused``: verification steps, small
# batches): o_proj and down_proj (SiLU * up fused) as few-row GEMVs whose split-K reduce does the
# residual add and the next RMSNorm (down loses to cuBLAS above 16 rows).
GEMV_FEW_ROWS = 16
# qkv and gate/up (whose input arrives normed: no prologue) and the LM head of 3 or more rows.
GEMV_IN_ROWS = 32


# The GEMVs pick split-K from the row count: off in batch-invariant forwards
# (models/batch_invariant.py), whose linears are fixed-shape cuBLAS GEMMs instead.


def gemv_few_enabled(x: torch.Tensor) -> bool:
    """``forward_fused``'s o_proj / down_proj as GEMVs (see ``GEMV_FEW_ROWS``)."""
    return x.shape[0] <= GEMV_FEW_ROWS and enabled(x) and batch_invariant.active() is None


def gemv_in_enabled(x: torch.Tensor) -> bool:
    """``forward_fused``'s qkv and gate/up, and the LM head of 3 or more rows, as GEMVs (see
    ``GEMV_IN_ROWS``)."""
    return x.shape[0] <= GEMV_IN_ROWS and enabled(x) and batch_invariant.active() is None


def gemv_enabled(x: torch.Tensor) -> bool:
    """One-row steps on CUDA (batch-1 decode, a draft model's steps): the layers run as GEMVs with
    fused prologues (kernels/gemv.py: RMSNorm and the residual add inside the QKV and gate/up
    products, SiLU * up inside the down product). The row count is a shape, so a CUDA graph
    takes one path."""
    return x.shape[0] <= GEMV_MAX_ROWS and enabled(x) and batch_invariant.active() is None


def linear(
    x: torch.Tensor,  # [rows, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [rows, N]
    """``F.linear``, as the one-row GEMV kernel where ``gemv_enabled`` (a proposer head's
    one-row draft step on CUDA: cuBLAS reads a 128k-row head at ~91-94% of the copy bandwidth,
    the GEMV at ~100%, and it launches with PDL)."""
    if gemv_enabled(x) and x.dtype == weight.dtype and x.stride(-1) == 1:
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


@lazy_jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o,
                     stride_ro, N, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
                     GDC: tl.constexpr):
    if GDC:  # launched with PDL: everything here reads what the previous kernel wrote
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        x = x + tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)  # rounded like torch
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = (xf * inv).to(x.dtype) * w  # weight * normed.to(dtype), as the torch path
    tl.store(out_ptr + row * stride_o + cols, y, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """x: [T, N]. Returns norm(x) [T, N]; with ``residual``: (norm(x + residual), x + residual)."""
    T, N = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else out
    r = residual if residual is not None else x
    if T:
        block = next_pow2(N)
        _rms_norm_kernel[(T,)](x, r, weight, out, res_out, x.stride(0), r.stride(0), out.stride(0),
                               res_out.stride(0), N, eps, HAS_RES=residual is not None,
                               BLOCK=block, num_warps=8 if block >= 4096 else 4,
                               **pdl_launch(x.device))
    return out if residual is None else (out, res_out)


@lazy_jit
def _rope_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, kc_ptr, vc_ptr,
                 sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, s_cos, skc_b, skc_s, skc_h, svc_b, svc_s,
                 svc_h, HQ, HK, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, STORE: tl.constexpr, GDC: tl.constexpr):
    # q [T, HQ, 2 * HALF] (rotated in place); k [T, HK, 2 * HALF]; cos, sin [max_pos, 2 * HALF]
    # f32 (the cache is cat(freqs, freqs)); pos [T]. STORE: the rotated k and v [T, HK, 2 * HALF]
    # go to kc, vc [num_blocks, BLOCK_SIZE, HK, 2 * HALF] at slot [T] (-1: padding, not stored)
    # and k is left as it was; else k is rotated in place (v, slot, kc, vc unused).
    # Every load is issued before the first store: q, k (and v) may alias for all the compiler
    # knows, so a load written after a store waits for it. Loads first, one round trip to memory
    # instead of three: 2.1 -> 1.5 us per call on an H100 (batch-1 decode, 8B and 1B heads).
    if GDC:  # launched with PDL: everything here reads what the previous kernel wrote
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    d = tl.arange(0, HALF)
    h = tl.arange(0, BLOCK_H)[:, None]
    mq = h < HQ
    mk = h < HK
    pq = q_ptr + t * sq_t + h * sq_h + d[None, :]
    pk = k_ptr + t * sk_t + h * sk_h + d[None, :]
    q1 = tl.load(pq, mask=mq, other=0.0)
    q2 = tl.load(pq + HALF, mask=mq, other=0.0)
    k1 = tl.load(pk, mask=mk, other=0.0)
    k2 = tl.load(pk + HALF, mask=mk, other=0.0)
    if STORE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        pv = v_ptr + t * sv_t + h * sv_h + d[None, :]
        v1 = tl.load(pv, mask=mk, other=0.0)
        v2 = tl.load(pv + HALF, mask=mk, other=0.0)
    cos = tl.load(cos_ptr + pos * s_cos + d)[None, :]
    sin = tl.load(sin_ptr + pos * s_cos + d)[None, :]
    f1, f2 = q1.to(tl.float32), q2.to(tl.float32)
    tl.store(pq, (f1 * cos - f2 * sin).to(q1.dtype), mask=mq)
    tl.store(pq + HALF, (f2 * cos + f1 * sin).to(q1.dtype), mask=mq)
    g1, g2 = k1.to(tl.float32), k2.to(tl.float32)
    r1 = (g1 * cos - g2 * sin).to(k1.dtype)
    r2 = (g2 * cos + g1 * sin).to(k1.dtype)
    if STORE:
        ms = mk & (h * 0 + slot >= 0)  # [BLOCK_H, 1]
        blk, off = slot // BLOCK_SIZE, slot % BLOCK_SIZE
        cty = kc_ptr.dtype.element_ty
        ck = kc_ptr + blk * skc_b + off * skc_s + h * skc_h + d[None, :]
        tl.store(ck, r1.to(cty), mask=ms)
        tl.store(ck + HALF, r2.to(cty), mask=ms)
        cv = vc_ptr + blk * svc_b + off * svc_s + h * svc_h + d[None, :]
        tl.store(cv, v1.to(cty), mask=ms)
        tl.store(cv + HALF, v2.to(cty), mask=ms)
    else:
        tl.store(pk, r1, mask=mk)
        tl.store(pk + HALF, r2, mask=mk)


def rope_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
          sin: torch.Tensor) -> None:
    """In place. positions [T]; q [T, Hq, D], k [T, Hk, D] (any row/head strides, last dim
    contiguous); cos/sin [max_pos, D] float32 (rotate-half layout, full rotary)."""
    T, HQ, D = q.shape
    if T:  # STORE=False: v, slot and the caches are not read (q / positions stand in)
        _rope_kernel[(T,)](q, k, q, cos, sin, positions, positions, q, q, q.stride(0),
                           q.stride(1), k.stride(0), k.stride(1), 0, 0, cos.stride(0), 0, 0, 0,
                           0, 0, 0, HQ, k.shape[1], HALF=D // 2,
                           BLOCK_H=next_pow2(max(HQ, k.shape[1])), BLOCK_SIZE=1, STORE=False,
                           num_warps=4, **pdl_launch(q.device))


def rope_store_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """``rope_`` on q (in place) and k, with the rotated k and v written straight to their cache
    slots (``kernels/kv_cache.store_kv``'s job) in the same kernel; k itself is left as it was.
    positions, slots [T] (slot -1: not stored); q [T, Hq, D]; k, v [T, Hk, D] (any row/head
    strides, last dim contiguous); cos/sin [max_pos, D] float32; k_cache, v_cache
    [num_blocks, block_size, Hk, D] with a contiguous last dim."""
    T, HQ, D = q.shape
    HK = k.shape[1]
    if k_cache.shape[2:] != (HK, D) or v_cache.shape != k_cache.shape or k_cache.stride(-1) != 1:
        raise ValueError(f"rope_store_: caches of shape {tuple(k_cache.shape)} / "
                         f"{tuple(v_cache.shape)} do not hold k of shape {tuple(k.shape)}")
    if T:
        _rope_kernel[(T,)](
            q, k, v, cos, sin, positions, slots, k_cache, v_cache, q.stride(0), q.stride(1),
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0),
            v_cache.stride(1), v_cache.stride(2), HQ, HK, HALF=D // 2,
            BLOCK_H=next_pow2(max(HQ, HK)), BLOCK_SIZE=k_cache.shape[1], STORE=True, num_warps=4,
            **pdl_launch(q.device))


@lazy_jit
def _reduce_rope_kernel(p_ptr, b_ptr, y_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, kc_ptr, vc_ptr,
                        stride_ps, stride_pm, stride_ym, s_cos, skc_b, skc_s, skc_h, svc_b, svc_s,
                        svc_h, HQ, HK, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                        BLOCK_SIZE: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                        GDC: tl.constexpr):
    # p [SPLIT_K, T, (HQ + 2 HK) * 2 HALF] fp32 partials of the QKV projection (heads q | k | v);
    # b [N] bias; y [T, N] out in the layer's dtype: q rotated, k and v as summed (k unrotated,
    # as rope_store_ leaves it); cos, sin [max_pos, 2 HALF] f32; pos, slot [T] (slot -1: not
    # stored); kc, vc [num_blocks, BLOCK_SIZE, HK, 2 HALF]. Program (t, j): token t, heads
    # j * BLOCK_H .. (j + 1) * BLOCK_H - 1 of the q | k | v row as the rows of one tile. Sums as
    # gemv's _split_reduce_kernel (from 0, piece by piece, then the bias), rounds to y's dtype,
    # then _rope_kernel's arithmetic: bit-identical to gemv + rope_store_.
    if GDC:  # launched with PDL: the partials are the previous kernel's
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF)[None, :]  # [1, HALF]
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]: q | k | v head
    mh = h < HQ + 2 * HK
    col = h * (2 * HALF) + d  # [BLOCK_H, HALF]: first half of each head
    a1 = tl.zeros([BLOCK_H, HALF], dtype=tl.float32)
    a2 = tl.zeros([BLOCK_H, HALF], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        ps = p_ptr + s * stride_ps + t * stride_pm + col
        a1 += tl.load(ps, mask=mh, other=0.0)
        a2 += tl.load(ps + HALF, mask=mh, other=0.0)
    if HAS_BIAS:
        a1 += tl.load(b_ptr + col, mask=mh, other=0.0).to(tl.float32)
        a2 += tl.load(b_ptr + col + HALF, mask=mh, other=0.0).to(tl.float32)
    dt = y_ptr.dtype.element_ty
    x1, x2 = a1.to(dt), a2.to(dt)
    cos = tl.load(cos_ptr + pos * s_cos + d)  # [1, HALF]
    sin = tl.load(sin_ptr + pos * s_cos + d)
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    r1 = (f1 * cos - f2 * sin).to(dt)  # q and k heads rotated (v rows unused)
    r2 = (f2 * cos + f1 * sin).to(dt)
    is_q = h < HQ
    py = y_ptr + t * stride_ym + col
    tl.store(py, tl.where(is_q, r1, x1), mask=mh)
    tl.store(py + HALF, tl.where(is_q, r2, x2), mask=mh)
    stored = h * 0 + slot >= 0  # [BLOCK_H, 1] (a scalar mask term upsets the interpreter)
    blk, off = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    hk = tl.maximum(h - HQ, 0)  # k head
    mk = (h >= HQ) & (h < HQ + HK) & stored
    ck = kc_ptr + blk * skc_b + off * skc_s + hk * skc_h + d
    cty = kc_ptr.dtype.element_ty
    tl.store(ck, r1.to(cty), mask=mk)
    tl.store(ck + HALF, r2.to(cty), mask=mk)
    hv = tl.maximum(h - HQ - HK, 0)  # v head
    mv = (h >= HQ + HK) & mh & stored
    cv = vc_ptr + blk * svc_b + off * svc_s + hv * svc_h + d
    tl.store(cv, x1.to(cty), mask=mv)
    tl.store(cv + HALF, x2.to(cty), mask=mv)


def reduce_rope_store_(partials: torch.Tensor, bias: torch.Tensor | None,
                       positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                       num_heads: int, num_kv_heads: int, dtype: torch.dtype | None = None,
                       force_triton: bool = False) -> torch.Tensor:
    """The QKV projection's split-K reduce, RoPE and K/V cache store in one kernel (one launch
    instead of gemv's reduce plus ``rope_store_``): ``partials`` [S, T, N] float32 from
    ``kernels.gemv.gemv_partials`` (N = (num_heads + 2 num_kv_heads) * D), ``bias`` [N] or
    None. Returns qkv [T, N] in ``dtype`` (the layer's; default the caches') with q rotated and k, v as summed; the rotated
    k and v go to their cache slots [T] (-1: not stored). positions [T]; cos / sin [max_pos, D]
    float32 (rotate-half layout); k_cache, v_cache [num_blocks, block_size, num_kv_heads, D].
    Bit-identical to ``gemv(x, w, bias)`` (same launch configuration) followed by
    ``rope_store_``. CPU tensors (without ``force_triton``) take the torch reference."""
    S, T, N = partials.shape
    D = k_cache.shape[-1]
    if (partials.dtype != torch.float32 or N != (num_heads + 2 * num_kv_heads) * D
            or k_cache.shape[2] != num_kv_heads or v_cache.shape != k_cache.shape
            or k_cache.stride(-1) != 1 or partials.stride(-1) != 1 or D % 2):
        raise ValueError(f"reduce_rope_store_: partials {tuple(partials.shape)} "
                         f"{partials.dtype} do not hold {num_heads} q and 2 x {num_kv_heads} "
                         f"kv heads of the caches' {tuple(k_cache.shape)}")
    dtype = dtype or k_cache.dtype
    if not use_triton([partials, k_cache], force_triton):
        return _reduce_rope_store_ref(partials, bias, positions, cos, sin, k_cache, v_cache,
                                      slots, num_heads, num_kv_heads, dtype)
    y = torch.empty(T, N, dtype=dtype, device=partials.device)
    heads = num_heads + 2 * num_kv_heads
    # 8 heads a program (T x 6 programs for Llama-3.2-1B / -3-8B heads): faster than all heads
    # in one program at batch 4-8 of the 1B draft's propose graph (docs/kernels.md)
    block_h = min(next_pow2(heads), 8)
    if T:
        _reduce_rope_kernel[(T, -(-heads // block_h))](
            partials, bias if bias is not None else y, y, cos, sin, positions, slots, k_cache,
            v_cache, partials.stride(0), partials.stride(1), y.stride(0), cos.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0),
            v_cache.stride(1), v_cache.stride(2), num_heads, num_kv_heads, HALF=D // 2,
            BLOCK_H=block_h, BLOCK_SIZE=k_cache.shape[1],
            SPLIT_K=S, HAS_BIAS=bias is not None, num_warps=4, **pdl_launch(partials.device))
    return y


def _reduce_rope_store_ref(partials, bias, positions, cos, sin, k_cache, v_cache, slots,
                           num_heads, num_kv_heads, dtype) -> torch.Tensor:
    """Torch reference of ``reduce_rope_store_`` (same sums, roundings and rotation)."""
    S, T, N = partials.shape
    D = k_cache.shape[-1]
    acc = torch.zeros(T, N, dtype=torch.float32, device=partials.device)
    for s in range(S):
        acc = acc + partials[s]
    if bias is not None:
        acc = acc + bias.float()
    y = acc.to(dtype)
    heads = y.view(T, num_heads + 2 * num_kv_heads, D)
    c = cos[positions, : D // 2].unsqueeze(1)  # [T, 1, D / 2]
    s_ = sin[positions, : D // 2].unsqueeze(1)
    f1, f2 = heads[..., : D // 2].float(), heads[..., D // 2:].float()
    rot = torch.cat([(f1 * c - f2 * s_).to(y.dtype), (f2 * c + f1 * s_).to(y.dtype)], dim=-1)
    out = heads.clone()
    out[:, :num_heads] = rot[:, :num_heads]
    keep = slots >= 0
    idx = slots[keep].long()
    bs = k_cache.shape[1]
    kv = num_heads + num_kv_heads
    k_cache[idx // bs, idx % bs] = rot[keep][:, num_heads:kv].to(k_cache.dtype)
    v_cache[idx // bs, idx % bs] = heads[keep][:, kv:].to(v_cache.dtype)
    return out.view(T, N)


@lazy_jit
def _silu_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_o, inter, BLOCK: tl.constexpr,
                     GDC: tl.constexpr):
    if GDC:  # launched with PDL: everything here reads what the previous kernel wrote
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < inter
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=m, other=0.0)
    u = tl.load(gu_ptr + row * stride_gu + inter + cols, mask=m, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(out_ptr + row * stride_o + cols, act * u, mask=m)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2 * inter] -> silu(gate) * up [T, inter]."""
    T, two = gate_up.shape
    inter = two // 2
    out = torch.empty(T, inter, dtype=gate_up.dtype, device=gate_up.device)
    if T:
        block = 1024
        _silu_mul_kernel[(T, -(-inter // block))](gate_up, out, gate_up.stride(0), out.stride(0),
                                                  inter, BLOCK=block, num_warps=4,
                                                  **pdl_launch(gate_up.device))
    return out
