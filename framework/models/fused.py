"""Fused Triton kernels for the CUDA decode path of the model layers: RMSNorm (optionally fused
with the residual add), rotary embedding in place on the q/k views of the fused QKV output, and
SiLU(gate) * up. Each replaces 5 to 15 small PyTorch kernels per layer, which at batch 1 cost
more than the weights' own read time. CPU tensors never come here (the torch code in
layers.py / llama.py stays the CPU path)."""

from __future__ import annotations

import torch

from speculant.kernels._triton_utils import lazy_jit, next_pow2, tl, use_triton


def enabled(x: torch.Tensor) -> bool:
    return use_triton([x], False)


@lazy_jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o,
                     stride_ro, N, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
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
                               BLOCK=block, num_warps=8 if block >= 4096 else 4)
    return out if residual is None else (out, res_out)


@lazy_jit
def _rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, pos_ptr, sq_t, sq_h, sk_t, sk_h, s_cos,
                 HQ, HK, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    d = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + pos * s_cos + d)[None, :]  # the cache is cat(freqs, freqs)
    sin = tl.load(sin_ptr + pos * s_cos + d)[None, :]
    h = tl.arange(0, BLOCK_H)[:, None]
    mq = h < HQ
    pq = q_ptr + t * sq_t + h * sq_h + d[None, :]
    q1 = tl.load(pq, mask=mq, other=0.0)
    q2 = tl.load(pq + HALF, mask=mq, other=0.0)
    f1, f2 = q1.to(tl.float32), q2.to(tl.float32)
    tl.store(pq, (f1 * cos - f2 * sin).to(q1.dtype), mask=mq)
    tl.store(pq + HALF, (f2 * cos + f1 * sin).to(q1.dtype), mask=mq)
    mk = h < HK
    pk = k_ptr + t * sk_t + h * sk_h + d[None, :]
    k1 = tl.load(pk, mask=mk, other=0.0)
    k2 = tl.load(pk + HALF, mask=mk, other=0.0)
    g1, g2 = k1.to(tl.float32), k2.to(tl.float32)
    tl.store(pk, (g1 * cos - g2 * sin).to(k1.dtype), mask=mk)
    tl.store(pk + HALF, (g2 * cos + g1 * sin).to(k1.dtype), mask=mk)


def rope_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
          sin: torch.Tensor) -> None:
    """In place. positions [T]; q [T, Hq, D], k [T, Hk, D] (any row/head strides, last dim
    contiguous); cos/sin [max_pos, D] float32 (rotate-half layout, full rotary)."""
    T, HQ, D = q.shape
    if T:
        _rope_kernel[(T,)](q, k, cos, sin, positions, q.stride(0), q.stride(1), k.stride(0),
                           k.stride(1), cos.stride(0), HQ, k.shape[1], HALF=D // 2,
                           BLOCK_H=next_pow2(max(HQ, k.shape[1])), num_warps=4)


@lazy_jit
def _silu_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_o, inter, BLOCK: tl.constexpr):
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
                                                  inter, BLOCK=block, num_warps=4)
    return out
