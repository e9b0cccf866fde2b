"""Our CPU C kernels (framework/csrc/cpu_kernels.c via speculant.models.cpu_kernels) against
float64 torch references on random (never zero) inputs, their batch invariance (a row's result
bit for bit independent of the other rows of the call), their shape checks, and the engine
property they give: on the CPU a verification pass reproduces the plain decode steps' logits bit
for bit."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from speculant.models import cpu_kernels as ck

pytestmark = pytest.mark.skipif(
    not ck.available() and not os.environ.get("CI"), reason="CPU kernels not built / no AVX2"
)


def test_kernels_are_built_in_ci():
    """CI installs the project from source: the extension must be there, never silently off."""
    assert ck.available(), "speculant._cpu_kernels missing or unsupported CPU"


def _rand(rng, *shape):
    x = rng.standard_normal(shape).astype(np.float32)
    x[x == 0] = 0.5  # never zero
    return x


@pytest.mark.parametrize("out_f,in_f", [(16, 8), (37, 19), (960, 576), (100, 1536), (49, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_matches_reference_and_is_batch_invariant(out_f, in_f, bias):
    rng = np.random.default_rng(out_f * 1000 + in_f)
    w = _rand(rng, out_f, in_f)
    b = _rand(rng, out_f) if bias else None
    wb = ck.block_weight(torch.from_numpy(w))
    assert wb.shape == (-(-out_f // 16), in_f, 16)
    for T in (1, 2, 3, 5, 6, 7, 13, 20):
        x = _rand(rng, T, in_f)
        y = ck.gemm(x, wb, out_f, b)
        ref = x.astype(np.float64) @ w.T.astype(np.float64) + (0 if b is None else b)
        tol = 1e-5 * np.sqrt(in_f) * np.abs(ref).max()
        assert np.abs(y - ref).max() < tol, (T, np.abs(y - ref).max())
        for t in range(T):  # each row alone: the same bits
            assert np.array_equal(ck.gemm(x[t : t + 1], wb, out_f, b)[0], y[t])


def test_gemm_strided_rows_and_output_buffer():
    rng = np.random.default_rng(1)
    w = _rand(rng, 48, 32)
    wb = ck.block_weight(torch.from_numpy(w))
    big = _rand(rng, 4, 50)
    x = big[:, 5:37]  # row stride 50, unit column stride
    y = np.full((4, 60), np.nan, np.float32)[:, :48]
    ck.gemm(x, wb, 48, None, y)
    np.testing.assert_allclose(y, x @ w.T, rtol=1e-5, atol=1e-4)


def test_gemm_of_no_rows_writes_nothing():
    """A 0-row product (e.g. the LM head of a step where no sequence drafts) returns an empty
    result and leaves the memory around it alone (the few-row tiles once wrote 3 rows there)."""
    w = torch.randn(40, 24)
    wb = ck.block_weight(w)
    for _ in range(3):
        y = ck.gemm(np.zeros((0, 24), np.float32), wb, 40)
        assert y.shape == (0, 40)
    guard = np.full((4, 40), 7.0, np.float32)
    ck.gemm(np.zeros((0, 24), np.float32), wb, 40, y=guard[:0])
    assert (guard == 7.0).all()


@pytest.mark.slow  # a 128256 x 512 weight (~4 s)
def test_gemm_large_index():
    """The LM-head shape of Llama 3 (128256 x 512 here): offsets beyond 2**26 floats."""
    rng = np.random.default_rng(2)
    w = _rand(rng, 128256, 512)
    wb = ck.block_weight(torch.from_numpy(w))
    x = _rand(rng, 2, 512)
    y = ck.gemm(x, wb, w.shape[0])
    cols = np.array([0, 1, 77777, 128240, 128255])
    ref = x.astype(np.float64) @ w[cols].T.astype(np.float64)
    np.testing.assert_allclose(y[:, cols], ref, rtol=1e-4, atol=1e-3)


def test_gemm_shape_errors_name_the_problem():
    wb = ck.block_weight(torch.randn(32, 8))
    with pytest.raises(ValueError, match="shapes do not match"):
        ck.gemm(np.ones((2, 9), np.float32), wb, 32)
    with pytest.raises(ValueError, match="float32"):
        ck.gemm(np.ones((2, 8), np.float64), wb, 32)
    with pytest.raises(ValueError, match="shapes do not match"):
        ck.gemm(np.ones((2, 8), np.float32), wb, 32, np.ones(31, np.float32))
    with pytest.raises(ValueError, match="2-D float32"):
        ck.block_weight(torch.randn(4, 4, dtype=torch.float64))


@pytest.fixture
def gemm_threads():
    """Restore the kernels' thread count and the helper's test delay."""
    before = ck.threads()
    yield ck.set_threads
    ck._require()._helper_delay(0)
    ck.set_threads(before)


def _products(rng, shapes, rows):
    """(x, wb, out_f, bias) cases: strided x rows, with and without bias."""
    for out_f, in_f in shapes:
        w = torch.from_numpy(_rand(rng, out_f, in_f))
        wb, b = ck.block_weight(w), _rand(rng, out_f)
        for T in rows:
            x = _rand(rng, T, in_f + 3)[:, 1 : in_f + 1]  # row stride in_f + 3
            yield x, wb, out_f, None
            yield x, wb, out_f, b


def test_gemm_with_a_helper_thread_is_bit_for_bit_one_threads(gemm_threads):
    """set_threads(2): products (one row too) share their units with a helper thread; every output
    is the same FMA chain whoever computes it, so the result is one thread's bit for bit (and
    the helper did take part)."""
    rng = np.random.default_rng(3)
    cases = list(_products(rng, [(16, 8), (37, 19), (960, 576), (100, 1536), (3000, 64)],
                           (1, 2, 3, 4, 5, 6, 7, 13, 40)))
    assert gemm_threads(1) == 1
    ref = [ck.gemm(x, wb, o, b) for x, wb, o, b in cases]
    assert gemm_threads(2) == 2 and ck.threads() == 2
    before = ck._require()._helper_stats()[0]
    for _ in range(3):
        for (x, wb, o, b), r in zip(cases, ref):
            y = np.full((x.shape[0], o + 4), np.nan, np.float32)  # row stride o + 4
            ck.gemm(x, wb, o, b, y[:, :o])
            assert np.array_equal(y[:, :o], r) and np.isnan(y[:, o:]).all()
    assert ck._require()._helper_stats()[0] > before  # units computed by the helper


def test_a_late_helper_costs_only_its_unit(gemm_threads):
    """A helper that is descheduled while it holds a unit (here: made to sleep 2 ms after each
    claim) never holds the caller up for long: the caller redoes that unit itself, and the
    result is still one thread's bit for bit, also in the calls after (the late helper writes
    only its own scratch)."""
    import time

    rng = np.random.default_rng(4)
    w = torch.from_numpy(_rand(rng, 4096, 256))
    wb = ck.block_weight(w)
    xs = [_rand(rng, T, 256) for T in (5, 2, 3, 6, 5)]
    gemm_threads(1)
    ref = [ck.gemm(x, wb, 4096) for x in xs]
    gemm_threads(2)
    ext = ck._require()
    ext._helper_delay(2_000_000)
    redone = ext._helper_stats()[1]
    t0 = time.perf_counter()
    for _ in range(4):
        for x, r in zip(xs, ref):
            assert np.array_equal(ck.gemm(x, wb, 4096), r)
    late = time.perf_counter() - t0
    assert ext._helper_stats()[1] > redone  # the caller did redo units the helper held
    # 20 calls: were the caller waiting for the sleeping helper, that alone would take 40 ms
    assert late < 0.5, late
    ext._helper_delay(0)
    for x, r in zip(xs, ref):
        assert np.array_equal(ck.gemm(x, wb, 4096), r)


@pytest.mark.slow
def test_freeing_a_weight_waits_for_a_late_helper(gemm_threads):
    """A helper late with a unit still reads that call's weight: freeing a blocked weight first
    waits until the helper holds no unit (``quiesce``, a finalizer of ``block_weight``'s array),
    so a model can be dropped right after a product."""
    import gc

    gemm_threads(2)
    ext = ck._require()
    rng = np.random.default_rng(6)
    for _ in range(10):
        w = torch.from_numpy(_rand(rng, 2048, 576))
        wb = ck.block_weight(w)
        ext._helper_delay(3_000_000)  # the helper sleeps 3 ms holding a unit of this weight
        x = _rand(rng, 5, 576)
        y = ck.gemm(x, wb, 2048)
        ref = x.astype(np.float64) @ w.numpy().T.astype(np.float64)
        del wb, w
        gc.collect()  # the finalizer waits for the helper: no read of freed memory
        ext._helper_delay(0)
        np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-3)
    ext.quiesce()  # returns at once: the helper holds nothing now


def test_a_forked_child_runs_on_one_thread(gemm_threads):
    """The helper thread does not survive fork(): the child's products run on its one thread,
    with the same results."""
    import multiprocessing as mp

    rng = np.random.default_rng(5)
    w = torch.from_numpy(_rand(rng, 300, 64))
    wb, x = ck.block_weight(w), _rand(rng, 5, 64)
    gemm_threads(1)
    ref = ck.gemm(x, wb, 300)
    gemm_threads(2)
    with mp.get_context("fork").Pool(1) as pool:
        threads, y = pool.apply(_child_product, (x, wb))
    assert threads == 1 and np.array_equal(y, ref)


def _child_product(x, wb):
    return ck.threads(), ck.gemm(x, wb, 300)


def test_set_threads_rejects_a_bad_count():
    with pytest.raises(ValueError, match="must be >= 1"):
        ck.set_threads(0)


def _attention_ref(q, k, v, nh, nkv, scale):  # float64, causal over the last T positions
    T, ctx = q.shape[0], k.shape[0]
    d = q.shape[1] // nh
    qh = torch.from_numpy(q).double().view(T, nh, d).transpose(0, 1)  # [nh, T, d]
    kh = torch.from_numpy(k).double().view(ctx, nkv, d).transpose(0, 1)  # [nkv, ctx, d]
    vh = torch.from_numpy(v).double().view(ctx, nkv, d).transpose(0, 1)
    g = nh // nkv
    kh, vh = kh.repeat_interleave(g, 0), vh.repeat_interleave(g, 0)
    s = qh @ kh.transpose(1, 2) * scale  # [nh, T, ctx]
    qpos = torch.arange(ctx - T, ctx)[:, None]
    s = s.masked_fill(torch.arange(ctx)[None, :] > qpos, float("-inf"))
    return (torch.softmax(s, -1) @ vh).transpose(0, 1).reshape(T, nh * d).numpy()


@pytest.mark.parametrize(
    "nh,nkv,d", [(9, 3, 64), (4, 4, 32), (8, 1, 16), (32, 8, 128), (6, 2, 24), (2, 1, 200)]
)
@pytest.mark.parametrize("ctx", [1, 7, 300])
def test_attend_matches_reference_and_is_row_invariant(nh, nkv, d, ctx):
    rng = np.random.default_rng(nh * 100 + ctx)
    kv = _rand(rng, ctx + 3, 2 * nkv * d)  # rows with a stride wider than nkv * d
    k, v = kv[:ctx, : nkv * d], kv[:ctx, nkv * d :]
    for T in sorted({1, min(ctx, 6), min(ctx, 16)}):
        q = _rand(rng, T, nh * d)
        o = ck.attend(q, k, v, nh, nkv, 0.125)
        ref = _attention_ref(q, k, v, nh, nkv, 0.125)
        np.testing.assert_allclose(o, ref, rtol=2e-5, atol=2e-5)
        for j in range(T):  # row j alone, at its own position (context ctx - T + j + 1)
            cl = ctx - T + j + 1
            alone = ck.attend(q[j : j + 1], k[:cl], v[:cl], nh, nkv, 0.125)
            assert np.array_equal(alone[0], o[j])


def test_attend_shape_errors():
    q = np.ones((2, 64), np.float32)
    k = np.ones((5, 32), np.float32)
    with pytest.raises(ValueError, match="shapes do not match"):
        ck.attend(q, k, k, 3, 1, 1.0)  # 64 not divisible by 3 heads
    with pytest.raises(ValueError, match="shapes do not match"):
        ck.attend(np.ones((6, 64), np.float32), k[:4], k[:4], 2, 1, 1.0)  # T > ctx


def test_rms_norm_matches_reference_and_is_row_invariant():
    rng = np.random.default_rng(3)
    for n in (8, 19, 576):
        x, w = _rand(rng, 7, n), _rand(rng, n)
        y = ck.rms_norm(x, w, 1e-5)
        xd = x.astype(np.float64)
        ref = xd / np.sqrt((xd * xd).mean(-1, keepdims=True) + 1e-5) * w
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
        for t in range(7):
            assert np.array_equal(ck.rms_norm(x[t : t + 1], w, 1e-5)[0], y[t])


def test_verification_pass_reproduces_decode_logits_bit_for_bit(tiny_llama):
    """The engine property: with the kernels on, one sequence's k+1-row forward gives exactly the
    logits of k+1 one-token steps, so greedy speculation equals plain decoding even at ties."""
    from speculant import LLM, SamplingParams
    from speculant.engine.sequence import Sequence
    from speculant.outputs import RequestMetrics

    llm = LLM(model=str(tiny_llama), max_num_seqs=2)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.engine.model._cpu_plan.kernels is not None  # the C kernels are in use
    runner = llm.engine.runner
    prompt = list(range(10, 60))
    s = Sequence("x", 0, prompt, SamplingParams(), RequestMetrics(arrival_time=0.0), None)
    s.block_table = list(range(8))  # consecutive blocks, free again after the request above
    runner.forward([s], [prompt])
    base = s.num_cached_tokens
    toks = [5, 77, 123, 9, 42, 300]
    single = []
    for t in toks:
        h, _ = runner.forward([s], [[t]])
        single.append(runner.logits(h))
    s.num_cached_tokens = base
    h, _ = runner.forward([s], [toks])
    assert torch.equal(torch.cat(single), runner.logits(h))
