"""The Triton kernels of ``EngineConfig.batch_invariant`` (models/batch_invariant.py): paged
attention's batch-invariant launch (``split_tokens`` with a fixed ``num_splits``:
``kernels/paged_attention._invariant_config``) and ``triton_linear``: a row's output bit for bit
independent of the rest of the step. On CUDA when present, else under the Triton interpreter
(tests/kernels/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from speculant.kernels.paged_attention import paged_attention, paged_attention_ref
from speculant.models.batch_invariant import triton_linear

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def _row_by_row_interpreter_dot(monkeypatch):
    """Under the CPU interpreter ``tl.dot`` is numpy's ``matmul``, whose BLAS may compute the
    rows of a block with different micro-kernels: OpenBLAS on an AVX2 CPU rounds rows 6-11 of
    every 12 differently from rows 0-5, so there a row's bits depend on its place in the tile,
    which a GPU's dot does not do. Here the interpreter's dot multiplies one row at a time (the
    same BLAS call for every row), so these tests check the kernels' own row independence."""
    if DEVICE.type != "cpu":
        return
    import numpy as np
    from triton.runtime import interpreter

    def matmul(a, b, *args, **kwargs):
        if a.ndim < 2 or a.shape[-2] <= 1:
            return np.matmul(a, b, *args, **kwargs)
        rows = [np.matmul(a[..., i : i + 1, :], b, *args, **kwargs) for i in range(a.shape[-2])]
        return np.concatenate(rows, axis=-2)

    class _NumPy:  # numpy, with the row-by-row matmul
        def __getattr__(self, name):
            return matmul if name == "matmul" else getattr(np, name)

    monkeypatch.setattr(interpreter, "np", _NumPy())


def _paged(seqs, nh=4, nkv=2, d=32, bs=8, width=None, seed=0):
    """seqs: [(context_len, q_len)] -> q, k_cache, v_cache, block_tables, context_lens, qsl.
    A sequence's cache and queries depend on its context length alone (the same whatever else is
    batched); its blocks are scattered (reversed)."""
    per = [-(-c // bs) for c, _ in seqs]
    width = width or max(per)
    kc = torch.zeros(sum(per) + 1, bs, nkv, d)
    vc = torch.zeros_like(kc)
    bt = torch.zeros(len(seqs), width, dtype=torch.int32)
    qs, first = [], 1
    for i, ((c, ql), n) in enumerate(zip(seqs, per)):
        g = torch.Generator().manual_seed(seed + c)  # equal contexts: equal sequences
        blocks = list(range(first, first + n))[::-1]
        kc[blocks] = torch.randn(n, bs, nkv, d, generator=g)
        vc[blocks] = torch.randn(n, bs, nkv, d, generator=g)
        bt[i, :n] = torch.tensor(blocks, dtype=torch.int32)
        qs.append(torch.randn(c, nh, d, generator=g)[c - ql :])  # the queries of positions c-ql..
        first += n
    qsl = torch.tensor([0] + [q for _, q in seqs], dtype=torch.int32).cumsum(0).to(torch.int32)
    cl = torch.tensor([c for c, _ in seqs], dtype=torch.int32)
    return [t.to(DEVICE) for t in (torch.cat(qs), kc, vc, bt, cl, qsl)]


def _invariant(q, kc, vc, bt, cl, qsl, splits=4, split_tokens=64):
    return paged_attention(q, kc, vc, bt, cl, qsl, 0.3, num_splits=splits,
                           split_tokens=split_tokens, force_triton=True)


def test_invariant_attention_rows_do_not_depend_on_the_step():
    """A query row of a sequence (context 200: 4 splits of 64 positions, the last partial) gives
    the same bits as a decode row alone, as row 4 of a 5-row verification, next to other
    sequences (longer, shorter, with verification rows), and over a wider block table; and
    matches the reference."""
    ctx = 200
    alone = _invariant(*_paged([(ctx, 1)]))  # [1, nh, d]
    verify = _invariant(*_paged([(ctx, 5)]))  # [5, nh, d]: its last row is that same position
    assert torch.equal(verify[-1], alone[0])
    batch = [(37, 3), (ctx, 1), (250, 1), (9, 2), (ctx, 5)]
    out = _invariant(*_paged(batch, width=40))
    assert torch.equal(out[3], alone[0])  # the decode row among others
    assert torch.equal(out[-5:], verify)  # the verification rows among others
    args = _paged(batch)
    ref = paged_attention_ref(*args, 0.3)
    torch.testing.assert_close(_invariant(*args), ref, rtol=1e-4, atol=1e-4)


def test_invariant_attention_checks_its_arguments():
    args = _paged([(20, 1)])
    with pytest.raises(ValueError, match="multiple of the 64-token chunk"):
        _invariant(*args, split_tokens=100)
    with pytest.raises(ValueError, match="fixed num_splits"):
        paged_attention(*args, 0.3, split_tokens=64, force_triton=True)


# ------------------------------------------------------------------------------ GEMM
@pytest.mark.parametrize("bias", [False, True])
def test_triton_linear_is_linear_and_row_invariant(bias):
    """``batch_invariant.triton_linear`` (the ``GEMM = "triton"`` choice): ``F.linear``, and each
    row bit for bit the same alone, in any batch, at any place in it (70 x 45 by 100: a partial
    second row tile, partial column and K tiles)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(70, 100, generator=g).to(DEVICE)
    w = torch.randn(45, 100, generator=g).to(DEVICE)
    b = torch.randn(45, generator=g).to(DEVICE) if bias else None
    y = triton_linear(x, w, b, force_triton=True)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w, b), rtol=1e-4, atol=1e-4)
    for i in (0, 1, 63, 64, 69):
        assert torch.equal(triton_linear(x[i : i + 1], w, b, force_triton=True), y[i : i + 1])
    assert torch.equal(triton_linear(x.flip(0), w, b, force_triton=True).flip(0), y)
    assert torch.equal(triton_linear(x[5:12], w, b, force_triton=True), y[5:12])
