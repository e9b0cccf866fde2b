"""The fused Triton kernels of the CUDA model path (RMSNorm + residual, in-place RoPE, SiLU*up)
against the torch code the CPU path runs. On CPU they run under the Triton interpreter."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported (as tests/kernels/conftest.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from speculant.models import fused  # noqa: E402
from speculant.models.layers import RMSNorm, _apply_rope  # noqa: E402

pytest.importorskip("triton")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the Triton CPU interpreter misreads bf16 memory"))])
def test_rms_norm_and_residual(dtype):
    g = torch.Generator().manual_seed(1)
    T, N = 7, 192
    x = torch.randn(T, N, generator=g).to(DEV, dtype)
    r = torch.randn(T, N, generator=g).to(DEV, dtype)
    norm = RMSNorm(N, eps=1e-5).to(DEV, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(N, generator=g) + 0.5)
    if DEV == "cpu":  # the module's own (torch) path on CPU is the reference
        torch.testing.assert_close(norm(x), _ref_norm(x, norm.weight), atol=0, rtol=0)
    ref = _ref_norm(x, norm.weight)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fused.rms_norm(x, norm.weight, 1e-5), ref, atol=tol, rtol=tol)
    out, res = fused.rms_norm(x, norm.weight, 1e-5, residual=r)
    torch.testing.assert_close(res, x + r, atol=0, rtol=0)
    torch.testing.assert_close(out, _ref_norm(x + r, norm.weight), atol=tol, rtol=tol)


def _ref_norm(x, w):
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)


def test_rope_in_place_on_qkv_views():
    g = torch.Generator().manual_seed(2)
    T, Hq, Hk, D = 5, 8, 2, 32
    qkv = torch.randn(T, (Hq + 2 * Hk) * D, generator=g).to(DEV)
    q, k, v = qkv.split([Hq * D, Hk * D, Hk * D], dim=-1)
    q, k, v = q.view(T, Hq, D), k.view(T, Hk, D), v.view(T, Hk, D)  # strided views, like llama.py
    pos = torch.tensor([0, 9, 3, 31, 17], device=DEV)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    freqs = torch.arange(32).float()[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().to(DEV), emb.sin().to(DEV)
    want_q = _apply_rope(q.clone(), cos[pos].unsqueeze(1), sin[pos].unsqueeze(1))
    want_k = _apply_rope(k.clone(), cos[pos].unsqueeze(1), sin[pos].unsqueeze(1))
    v_before = v.clone()
    fused.rope_(pos, q, k, cos, sin)
    torch.testing.assert_close(q, want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k, want_k, atol=1e-5, rtol=1e-5)
    assert torch.equal(v, v_before)


def test_silu_mul():
    g = torch.Generator().manual_seed(3)
    gu = torch.randn(4, 2 * 1100, generator=g).to(DEV)  # inter not a multiple of the block
    want = torch.nn.functional.silu(gu[:, :1100]) * gu[:, 1100:]
    torch.testing.assert_close(fused.silu_mul(gu), want, atol=1e-5, rtol=1e-5)
