"""Few-row GEMV with a fused prologue (speculant.kernels.gemv): the Triton kernel (CUDA, or the
CPU interpreter with ``force_triton=True``) against the torch reference."""

from __future__ import annotations

import pytest
import torch

from speculant.kernels.gemv import (
    MAX_ROWS,
    GemvConfig,
    choose_config,
    few_rows_silu_mul_slower,
    gemv,
    gemv_partials,
    gemv_reference,
    gemv_split,
)
from speculant.models import fused

HAS_CUDA = torch.cuda.is_available()
# the Triton CPU interpreter misreads bf16 memory and has no half-precision dot: half dtypes
# are tested on CUDA only
DTYPES = [
    torch.float32,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")),
    pytest.param(torch.float16, marks=pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")),
]
# launch configs: the default choice; CUDA-core FMAs (one row only), also with the next tile
# prefetched and split-K (3 pieces of K, the last one short); tensor-core dots: plain, with the
# weight as first operand + prefetch + split-K, split-K alone, and on 16-row x tiles (masked
# rows instead of interleaved zero rows)
CONFIGS = {
    "default": None,
    "fma": GemvConfig(block_n=16, block_k=64, num_warps=4, use_dot=False),
    "fma_prefetch_split": GemvConfig(
        block_n=8, block_k=32, split_k=3, use_dot=False, prefetch=True
    ),
    "dot": GemvConfig(block_n=16, block_k=64, num_warps=4, use_dot=True),
    "dot_swap_prefetch_split": GemvConfig(
        block_n=32, block_k=32, split_k=3, use_dot=True, swap_ab=True, prefetch=True
    ),
    "split": GemvConfig(block_n=32, block_k=32, num_warps=4, split_k=3),
    # one row, each program's whole K range one tile loaded before the PDL wait (the deep
    # prefetch of choose_config's one-row 1B shapes): all of K, and K in two pieces
    "fma_deep": GemvConfig(block_n=2, block_k=256, num_warps=4, use_dot=False, prefetch=True),
    "fma_deep_split": GemvConfig(
        block_n=4, block_k=128, split_k=2, num_warps=4, use_dot=False, prefetch=True
    ),
    "dot_masked_rows": GemvConfig(block_n=16, block_k=32, use_dot=True, pad_rows=False),
}
WITH_BIAS = (
    "default",
    "fma_prefetch_split",
    "fma_deep_split",
    "dot_swap_prefetch_split",
    "dot_masked_rows",
)  # bias: a constexpr
# prologue cases: (prologue, with residual)
PROLOGUES = {
    "none": ("none", False),
    "rmsnorm": ("rmsnorm", False),
    "rmsnorm_res": ("rmsnorm", True),
    "silu_mul": ("silu_mul", False),
}


def _nz(*shape, dtype=torch.float32, scale=1.0):
    """Random values of magnitude in [0.25, 1.25) * scale with random signs: never zero."""
    mag = torch.rand(*shape) + 0.25
    sign = torch.where(torch.rand(*shape) < 0.5, -1.0, 1.0)
    return (mag * sign * scale).to(dtype)


def _inputs(case, M, N, K, dtype, device, bias=False):
    prologue, with_res = PROLOGUES[case]
    xk = 2 * K if prologue == "silu_mul" else K
    kw = {"prologue": prologue}
    if prologue == "rmsnorm":
        kw["norm_weight"] = _nz(K, dtype=dtype).to(device)
        kw["eps"] = 1e-5
        if with_res:
            kw["residual"] = _nz(M, K, dtype=dtype).to(device)
    x = _nz(M, xk, dtype=dtype, scale=2.0).to(device)
    w = _nz(N, K, dtype=dtype, scale=0.1).to(device)
    b = _nz(N, dtype=dtype).to(device) if bias else None
    return x, w, b, kw


def _tol(dtype, ref):
    """Absolute tolerance on y: fp32 accumulation order differences, plus up to ~2 ulps of the
    output rounding for half types (the reference is cuBLAS in that dtype)."""
    scale = max(1.0, float(ref.float().abs().max()))
    ulp = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    return scale * max(4 * ulp, 2e-5)


def _split(out, with_res):
    if with_res:
        assert isinstance(out, tuple) and len(out) == 2
        return out
    assert isinstance(out, torch.Tensor)
    return out, None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", list(CONFIGS))
# the default run: M = 1, 3, 8, 24; 12 is slow
@pytest.mark.parametrize("M", [1, 3, 8, pytest.param(12, marks=pytest.mark.slow), 24])
@pytest.mark.parametrize("case", list(PROLOGUES))
def test_gemv_matches_reference(device, case, M, config, dtype):
    N, K = 72, 200  # neither a multiple of the block sizes
    x, w, b, kw = _inputs(case, M, N, K, dtype, device, bias=config in WITH_BIAS)
    cfg = CONFIGS[config]
    if cfg is not None and cfg.use_dot is False and M > 1:
        with pytest.raises(ValueError, match="use_dot=False .* takes one row"):
            gemv(x, w, b, force_triton=True, config=cfg, **kw)
        return
    with_res = "residual" in kw
    got, got_res = _split(gemv(x, w, b, force_triton=True, config=cfg, **kw), with_res)
    ref, ref_res = _split(gemv_reference(x, w, b, **kw), with_res)
    assert got.shape == (M, N) and got.dtype == dtype
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, atol=_tol(dtype, ref), rtol=0)
    if with_res:  # x + residual, rounded like torch: exact
        assert got_res.shape == (M, K) and got_res.dtype == dtype
        assert torch.equal(got_res, x + kw["residual"])
        assert torch.equal(got_res, ref_res)


@pytest.mark.parametrize("case", list(PROLOGUES))
def test_gemv_against_float64(device, case):
    """fp32 kernel against the product computed in float64 from the reference prologue: checks
    the GEMV part with an independent accumulation (not F.linear)."""
    M, N, K = 5, 40, 300
    x, w, b, kw = _inputs(case, M, N, K, torch.float32, device, bias=True)
    got, _ = _split(gemv(x, w, b, force_triton=True, **kw), "residual" in kw)
    xs = x.cpu()
    if case == "silu_mul":
        a = torch.nn.functional.silu(xs[:, :K]) * xs[:, K:]
    elif case.startswith("rmsnorm"):
        s = xs + kw["residual"].cpu() if "residual" in kw else xs
        a = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + kw["eps"]) * kw["norm_weight"].cpu()
    else:
        a = xs
    want = a.double() @ w.cpu().double().T + b.cpu().double()
    torch.testing.assert_close(got.cpu().double(), want, atol=2e-4, rtol=1e-5)


@pytest.mark.parametrize("case", ["none", "rmsnorm_res", "silu_mul"])
def test_gemv_strided_inputs(device, case):
    """Rows of x, residual and weight with row strides larger than their width (views)."""
    M, N, K = 4, 24, 96
    x, w, b, kw = _inputs(case, M, N, K, torch.float32, device)
    xb = torch.zeros(M, x.shape[1] + 40, device=device)
    xb[:, 8 : 8 + x.shape[1]] = x
    xv = xb[:, 8 : 8 + x.shape[1]]
    wb = torch.zeros(N, K + 24, device=device)
    wb[:, 16 : 16 + K] = w
    wv = wb[:, 16 : 16 + K]
    if "residual" in kw:
        rb = torch.zeros(M, 3 * K, device=device)
        rb[:, K : 2 * K] = kw["residual"]
        kw["residual"] = rb[:, K : 2 * K]
    assert xv.stride(0) != xv.shape[1] and wv.stride(0) != K
    for cfg in (CONFIGS["dot"], CONFIGS["dot_swap_prefetch_split"], CONFIGS["dot_masked_rows"]):
        got = gemv(xv, wv, force_triton=True, config=cfg, **kw)
        ref = gemv_reference(x, w, **kw)
        if "residual" in kw:
            assert torch.equal(got[1], ref[1])
            got, ref = got[0], ref[0]
        torch.testing.assert_close(got, ref, atol=_tol(torch.float32, ref), rtol=0)


@pytest.mark.slow  # ~8 s on the interpreter; test_gemv_int64_offsets stays
def test_gemv_many_output_rows(device):
    """N = 70000 weight rows (many programs, large row offsets), small K."""
    M, N, K = 2, 70000, 64
    x, w, b, kw = _inputs("rmsnorm_res", M, N, K, torch.float32, device, bias=True)
    cfg = GemvConfig(block_n=256, block_k=32, num_warps=4)  # few programs for the interpreter
    for c in (cfg, None) if HAS_CUDA else (cfg,):
        got, res = gemv(x, w, b, force_triton=True, config=c, **kw)
        ref, ref_res = gemv_reference(x, w, b, **kw)
        torch.testing.assert_close(got, ref, atol=_tol(torch.float32, ref), rtol=0)
        assert torch.equal(res, ref_res)


def test_gemv_int64_offsets(device):
    """Weight and x rows more than 2**31 elements apart (strided views of one sparse buffer):
    the row offsets must be computed in int64. Only the touched pages are ever written."""
    K, S = 64, 2**30 + 64  # rows at element offsets 0, S, 2S > 2**31
    try:
        base = torch.empty(2 * S + 2 * K, dtype=torch.float32, device=device)
    except (RuntimeError, MemoryError):
        pytest.skip("cannot reserve an 8.6 GB buffer here")
    try:
        w = base.as_strided((3, K), (S, 1), 0)
        x = base.as_strided((3, K), (S, 1), K)
        w.copy_(_nz(3, K, scale=0.1))
        x.copy_(_nz(3, K))
        nw = _nz(K).to(device)
        x1 = base.as_strided((1, K), (S, 1), 2 * S + K)  # one row (FMA path), far from w's start
        for xs, cfg in ((x, CONFIGS["dot"]), (x, CONFIGS["split"]), (x1, CONFIGS["fma"])):
            want = gemv_reference(xs.clone(), w.clone())
            got = gemv(xs, w, force_triton=True, config=cfg)
            torch.testing.assert_close(got, want, atol=_tol(torch.float32, want), rtol=0)
            want = gemv_reference(xs.clone(), w.clone(), prologue="rmsnorm", norm_weight=nw)
            got = gemv(xs, w, force_triton=True, config=cfg, prologue="rmsnorm", norm_weight=nw)
            torch.testing.assert_close(got, want, atol=_tol(torch.float32, want), rtol=0)
    finally:
        del base


def test_gemv_more_rows_than_max(device):
    x, w, b, kw = _inputs("rmsnorm_res", MAX_ROWS + 1, 24, 32, torch.float32, device)
    with pytest.raises(ValueError, match=f"at most {MAX_ROWS} rows"):
        gemv(x, w, force_triton=True, **kw)
    got, res = gemv(x, w, **kw)  # torch path
    ref, ref_res = gemv_reference(x, w, **kw)
    assert torch.equal(got, ref) and torch.equal(res, ref_res)


def test_gemv_zero_rows(device):
    x, w, b, kw = _inputs("rmsnorm_res", 0, 24, 32, torch.float32, device)
    got, res = gemv(x, w, b, force_triton=True, **kw)
    assert got.shape == (0, 24) and res.shape == (0, 32)


def _graph_replay_on_new_x(fn, x, new_x):
    """Warm ``fn`` up on a side stream, capture it in a CUDA graph, write ``new_x`` into the
    captured input buffer ``x`` and replay: returns the captured outputs after the replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    x.copy_(new_x)  # new inputs, same buffers
    g.replay()
    torch.cuda.synchronize()
    return out


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gemv_cuda_graph_and_mixed_norm_weight(device):
    """Captured in a CUDA graph (no host sync in the launcher); bf16 activations with an fp32
    norm weight; the default config of the Llama-3-8B qkv shape."""
    M, N, K = 2, 6144, 4096
    dt = torch.bfloat16
    x = _nz(M, K, dtype=dt).to(device)
    r = _nz(M, K, dtype=dt).to(device)
    w = _nz(N, K, dtype=dt, scale=0.02).to(device)
    nw = _nz(K).to(device)  # fp32
    kw = {"prologue": "rmsnorm", "norm_weight": nw, "residual": r}
    y, res = _graph_replay_on_new_x(lambda: gemv(x, w, **kw), x, _nz(M, K, dtype=dt).to(device))
    ref, ref_res = gemv_reference(x, w, **kw)
    assert torch.equal(res, ref_res)
    torch.testing.assert_close(y, ref, atol=_tol(dt, ref), rtol=0)


def test_choose_config_valid():
    dev = torch.device("cpu")
    for M in range(1, MAX_ROWS + 1):
        for N, K, p in (
            (6144, 4096, "rmsnorm"),
            (4096, 4096, "none"),
            (28672, 4096, "rmsnorm"),
            (4096, 14336, "silu_mul"),
            (128256, 4096, "rmsnorm"),
            (72, 200, "none"),
            # Llama-3.2-1B shapes (a draft model): qkv, o_proj, gate/up, down, token-map head
            (3072, 2048, "rmsnorm"),
            (3072, 2048, "none"),
            (2048, 2048, "none"),
            (16384, 2048, "none"),
            (2048, 8192, "silu_mul"),
            (32768, 2048, "none"),
            # tensor-parallel shards: 8B TP 2 and 70B TP 4 qkv, o_proj, gate/up, down
            (3072, 4096, "none"),
            (4096, 2048, "none"),
            (14336, 4096, "none"),
            (4096, 7168, "silu_mul"),
            (2560, 8192, "none"),
            (8192, 2048, "none"),
            (14336, 8192, "none"),
            (8192, 7168, "silu_mul"),
        ):
            cfg = choose_config(M, N, K, p, dev)
            cfg.validate(M)
            assert cfg.split_k >= 1 and cfg.block_n >= 1


def test_choose_config_deep_prefetch():
    """One row, K <= 2048: the whole K range of a program is one prefetched tile; a longer K
    (the 8B gate/up) keeps the 512-wide tiles."""
    dev = torch.device("cpu")
    cfg = choose_config(1, 3072, 2048, "rmsnorm", dev)
    assert cfg.prefetch and cfg.block_k == 2048 and cfg.split_k == 1
    cfg = choose_config(1, 28672, 4096, "rmsnorm", dev)
    assert not cfg.prefetch and cfg.block_k == 512


def test_choose_config_tensor_parallel_shards():
    """The regimes of the tensor-parallel shards (H200 sweep, docs/kernels.md): a narrow qkv
    with a long K splits K in two at one row; a plain gate/up takes 16 x 256 tiles and a wide
    SiLU * up 32 x 512 at one row, an 8B down (whole or TP 2) 4 x 512 with 8 warps; 2-8 plain
    rows take masked 16-row x tiles; the other 8B TP 1 shapes keep their configurations."""
    dev = torch.device("cpu")
    cfg = choose_config(1, 2560, 8192, "none", dev)
    assert (cfg.block_n, cfg.block_k, cfg.split_k) == (4, 512, 2)
    cfg = choose_config(1, 14336, 8192, "none", dev)
    assert (cfg.block_n, cfg.block_k) == (16, 256)
    cfg = choose_config(1, 8192, 7168, "silu_mul", dev)
    assert (cfg.block_n, cfg.block_k) == (32, 512)
    assert not choose_config(6, 2560, 8192, "none", dev).pad_rows
    assert not choose_config(2, 2560, 8192, "none", dev).pad_rows
    assert choose_config(16, 2560, 8192, "none", dev).pad_rows  # not swept: as before
    assert choose_config(4, 8192, 7168, "silu_mul", dev).pad_rows
    assert choose_config(4, 14336, 8192, "none", dev).block_k == 128
    assert choose_config(16, 14336, 8192, "none", dev).block_k == 256  # not swept: as before
    assert choose_config(6, 8192, 2048, "none", dev).block_k == 256
    assert choose_config(6, 16384, 2048, "none", dev).block_k == 128  # the 1B gate/up
    for N, K, p in ((28672, 4096, "rmsnorm"), (6144, 4096, "rmsnorm")):
        cfg = choose_config(1, N, K, p, dev)
        assert (cfg.block_n, cfg.block_k, cfg.split_k) == (8, 512, 1)
    for K in (14336, 7168):  # the 8B down, whole and its TP 2 shard
        cfg = choose_config(1, 4096, K, "silu_mul", dev)
        assert (cfg.block_n, cfg.block_k, cfg.num_warps, cfg.split_k) == (4, 512, 8, 1)
    assert few_rows_silu_mul_slower(6, 8192) and not few_rows_silu_mul_slower(4, 8192)
    assert not few_rows_silu_mul_slower(6, 4096)


def test_gemv_wide_fma_tile_fp32(device):
    """A one-row tile of 32 x 2048 fp32 elements (256 a thread at 4 warps) is narrowed by the
    launcher to at most 64 four-byte elements a thread; the result is still the reference's."""
    x, w, b, kw = _inputs("rmsnorm_res", 1, 72, 2048, torch.float32, device, bias=True)
    cfg = GemvConfig(block_n=32, block_k=2048, num_warps=4, use_dot=False, prefetch=True)
    got, got_res = gemv(x, w, b, force_triton=True, config=cfg, **kw)
    ref, ref_res = gemv_reference(x, w, b, **kw)
    torch.testing.assert_close(got, ref, atol=_tol(torch.float32, ref), rtol=0)
    assert torch.equal(got_res, ref_res)


def test_gemv_validation(device):
    M, N, K = 2, 24, 32
    x = torch.randn(M, K, device=device)
    w = torch.randn(N, K, device=device)
    nw = torch.randn(K, device=device)
    r = torch.randn(M, K, device=device)
    with pytest.raises(ValueError, match="prologue must be one of"):
        gemv(x, w, prologue="gelu")
    with pytest.raises(ValueError, match="weight must have dtype"):
        gemv(x, w.half())
    with pytest.raises(ValueError, match="x must have 2 dims"):
        gemv(x[0], w)
    with pytest.raises(ValueError, match=r"x must have shape \(\*, 32\)"):
        gemv(torch.randn(M, K + 1, device=device), w)
    with pytest.raises(ValueError, match=r"x must have shape \(\*, 64\).*gate_up"):
        gemv(x, w, prologue="silu_mul")
    with pytest.raises(ValueError, match="x must have dtype"):
        gemv(x.to(torch.int32), w)
    with pytest.raises(ValueError, match="x must be contiguous in its last dim"):
        gemv(torch.randn(K, M, device=device).t(), w)
    with pytest.raises(ValueError, match="weight must be contiguous in its last dim"):
        gemv(x, torch.randn(K, N, device=device).t())
    with pytest.raises(ValueError, match="bias must have shape"):
        gemv(x, w, torch.randn(N + 1, device=device))
    with pytest.raises(ValueError, match="needs norm_weight"):
        gemv(x, w, prologue="rmsnorm")
    with pytest.raises(ValueError, match="norm_weight must have shape"):
        gemv(x, w, prologue="rmsnorm", norm_weight=nw[:-1])
    with pytest.raises(ValueError, match="residual must have shape"):
        gemv(x, w, prologue="rmsnorm", norm_weight=nw, residual=r[:1])
    with pytest.raises(ValueError, match="residual must have dtype"):
        gemv(x, w, prologue="rmsnorm", norm_weight=nw, residual=r.double())
    with pytest.raises(ValueError, match="residual is only used"):
        gemv(x, w, residual=r)
    with pytest.raises(ValueError, match="norm_weight is only used"):
        gemv(x, w, norm_weight=nw)
    with pytest.raises(ValueError, match="eps must be"):
        gemv(x, w, prologue="rmsnorm", norm_weight=nw, eps=-1.0)
    with pytest.raises(ValueError, match="at least one column"):
        gemv(x[:, :0], w[:, :0])
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        gemv(x, w, force_triton=True, config=GemvConfig(block_n=24, block_k=32))
    with pytest.raises(ValueError, match="use_dot needs block_n and block_k >= 16"):
        gemv(x, w, force_triton=True, config=GemvConfig(block_n=8, block_k=32, use_dot=True))
    with pytest.raises(ValueError, match="split_k"):
        gemv(x, w, force_triton=True, config={"block_n": 16, "block_k": 32, "split_k": 0})
    with pytest.raises(ValueError, match="bad gemv config"):
        gemv(x, w, force_triton=True, config={"block_n": 16, "bk": 32})


# --------------------------------------------------------------------------------------------
# Output epilogue: residual add + RMSNorm in the split-K reduce (out_norm_weight / out_residual)
# --------------------------------------------------------------------------------------------
# all three dtypes on the CPU too: the interpreter computes fp16 like a GPU; bf16 only without a
# prologue there (the prologues' bf16 arithmetic is misread) and with tolerances (its fp32 ->
# bf16 casts truncate instead of rounding to nearest)
EPI_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# the input-prologue cases (the rmsnorm prologue's own residual is rejected with out_residual)
EPI_PROLOGUES = ["none", "rmsnorm", "silu_mul"]
# (config, bias): one split (the partials path all the same), 3 splits (the last one short);
# dots for M >= 2, FMAs for M = 1 (use_dot=None)
EPI_CONFIGS = {
    "split1": (GemvConfig(block_n=32, block_k=32, num_warps=4), False),
    "split1_bias": (GemvConfig(block_n=32, block_k=32, num_warps=4), True),
    "split3_bias": (
        GemvConfig(block_n=32, block_k=32, split_k=3, swap_ab=True, prefetch=True),
        True,
    ),
}
OUT_EPS = 1e-3  # differs from the prologue's eps (1e-5): a kernel mixing them up fails


def _epi_inputs(case, M, N, K, dtype, device, bias):
    """gemv inputs plus the epilogue's: out_norm_weight (fp32 with silu_mul: a mixed dtype)
    and out_residual [M, N]."""
    x, w, b, kw = _inputs(case, M, N, K, dtype, device, bias=bias)
    nw_dtype = torch.float32 if case == "silu_mul" else dtype
    onw = _nz(N, dtype=nw_dtype).to(device)
    ores = _nz(M, N, dtype=dtype, scale=2.0).to(device)
    return x, w, b, kw, onw, ores


def _interp_bf16(dtype):
    return not HAS_CUDA and dtype == torch.bfloat16


def _epi_tol(dtype, ref):
    """_tol, and 4x that for bf16 under the interpreter (truncating casts: y, s, normed)."""
    return _tol(dtype, ref) * (4 if _interp_bf16(dtype) else 1)


def _two_step(x, w, b, kw, onw, ores, cfg):
    """What the epilogue replaces: the Triton gemv, then fused.rms_norm's Triton kernel; for
    bf16 under the interpreter, the same in torch (fused.rms_norm's torch rounding)."""
    y = gemv(x, w, b, force_triton=True, config=cfg, **kw)
    if not _interp_bf16(y.dtype):
        normed, s = fused.rms_norm(y, onw, OUT_EPS, residual=ores)
        return y, normed, s
    s = y + ores
    sf = s.float()
    normed = (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + OUT_EPS)).to(s.dtype)
    return y, (normed * onw).to(s.dtype), s


def _check_epilogue(x, w, b, kw, onw, ores, cfg):
    M, N = ores.shape
    dtype = x.dtype
    ekw = {"out_norm_weight": onw, "out_residual": ores, "out_eps": OUT_EPS}
    got, got_s = gemv(x, w, b, force_triton=True, config=cfg, **ekw, **kw)
    assert got.shape == (M, N) and got_s.shape == (M, N)
    assert got.dtype == dtype and got_s.dtype == dtype
    assert torch.isfinite(got).all() and torch.isfinite(got_s).all()
    y, want, want_s = _two_step(x, w, b, kw, onw, ores, cfg)
    if _interp_bf16(dtype):  # the interpreter's bf16 casts truncate: close, not exact
        torch.testing.assert_close(got_s, want_s, atol=_epi_tol(dtype, want_s), rtol=0)
        torch.testing.assert_close(got, want, atol=_epi_tol(dtype, want), rtol=0)
    else:  # bit-exact: the residual add and the norm of fused.rms_norm
        assert torch.equal(got_s, want_s)
        assert torch.equal(got_s, y + ores)
        assert torch.equal(got, want)
    # the torch reference (F.linear, then the separate ops)
    ref, ref_s = gemv_reference(x, w, b, **ekw, **kw)
    torch.testing.assert_close(got_s, ref_s, atol=_epi_tol(dtype, ref_s), rtol=0)
    torch.testing.assert_close(got, ref, atol=_epi_tol(dtype, ref), rtol=0)


@pytest.mark.parametrize("dtype", EPI_DTYPES)
@pytest.mark.parametrize("config", list(EPI_CONFIGS))
# the default run: M = 1 (FMAs), 3 (odd), 32 (the most rows); 2, 6, 8, 16 are slow
@pytest.mark.parametrize("M", [1, pytest.param(2, marks=pytest.mark.slow), 3,
                               pytest.param(6, marks=pytest.mark.slow),
                               pytest.param(8, marks=pytest.mark.slow),
                               pytest.param(16, marks=pytest.mark.slow), 32])
@pytest.mark.parametrize("case", EPI_PROLOGUES)
def test_gemv_out_norm_matches_two_step(device, case, M, config, dtype):
    """The epilogue against gemv + fused.rms_norm (bit-exact) and against gemv_reference."""
    if _interp_bf16(dtype) and case != "none":
        pytest.skip("the interpreter misreads the prologues' bf16 arithmetic")
    cfg, bias = EPI_CONFIGS[config]
    N, K = 200, 96  # N: not a power of two, nor a multiple of block_n
    _check_epilogue(*_epi_inputs(case, M, N, K, dtype, device, bias), cfg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemv_out_norm_hidden_size(device, dtype):
    """N = 4096 (a hidden size: one 4096-wide block a row, 8 warps); on CUDA also the default config."""
    M, N, K = 2, 4096, 32
    x, w, b, kw, onw, ores = _epi_inputs("silu_mul", M, N, K, dtype, device, bias=True)
    cfgs = [GemvConfig(block_n=256, block_k=16, split_k=2)]  # few programs for the interpreter
    for cfg in cfgs + [None] if HAS_CUDA else cfgs:
        _check_epilogue(x, w, b, kw, onw, ores, cfg)


def test_gemv_out_norm_strided_residual(device):
    """out_residual rows with a stride larger than N (a view), N = 96."""
    M, N, K = 3, 96, 64
    x, w, b, kw, onw, ores = _epi_inputs("rmsnorm", M, N, K, torch.float32, device, bias=True)
    rb = torch.zeros(M, 2 * N + 8, device=device)
    rb[:, 8 : 8 + N] = ores
    view = rb[:, 8 : 8 + N]
    assert view.stride(0) != N
    cfg = CONFIGS["split"]
    ekw = {"out_norm_weight": onw, "out_residual": view, "out_eps": OUT_EPS}
    got, got_s = gemv(x, w, b, force_triton=True, config=cfg, **ekw, **kw)
    _, want, want_s = _two_step(x, w, b, kw, onw, ores, cfg)
    assert torch.equal(got_s, want_s) and torch.equal(got, want)
    assert torch.equal(rb[:, 8 : 8 + N], ores)  # the residual is only read


def test_gemv_out_norm_torch_path(device):
    """Without force_triton on CPU tensors, and with more than MAX_ROWS rows: the torch path,
    i.e. gemv_reference with the epilogue (whose rounding is fused.rms_norm's torch one)."""
    for M in (3, MAX_ROWS + 1):
        x, w, b, kw, onw, ores = _epi_inputs("none", M, 40, 32, torch.float32, device, True)
        ekw = {"out_norm_weight": onw, "out_residual": ores, "out_eps": OUT_EPS}
        if M > MAX_ROWS:
            with pytest.raises(ValueError, match=f"at most {MAX_ROWS} rows"):
                gemv(x, w, b, force_triton=True, **ekw)
        elif HAS_CUDA:
            continue
        got, got_s = gemv(x, w, b, **ekw)
        ref, ref_s = gemv_reference(x, w, b, **ekw)
        assert torch.equal(got, ref) and torch.equal(got_s, ref_s)
        y = gemv_reference(x, w, b)
        assert torch.equal(ref_s, y + ores)
        sf = ref_s.float()
        want = (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + OUT_EPS)).to(y.dtype) * onw
        assert torch.equal(ref, want)


def test_gemv_out_norm_zero_rows(device):
    x, w, b, kw, onw, ores = _epi_inputs("none", 0, 24, 32, torch.float32, device, True)
    got, got_s = gemv(x, w, b, force_triton=True, out_norm_weight=onw, out_residual=ores)
    assert got.shape == (0, 24) and got_s.shape == (0, 24)


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gemv_out_norm_cuda_graph(device):
    """o_proj of Llama-3-8B for a 6-row verification step, default config, bf16 with an fp32
    norm weight, captured in a CUDA graph: bit-exact against gemv + fused.rms_norm."""
    M, N, K = 6, 4096, 4096
    dt = torch.bfloat16
    x = _nz(M, K, dtype=dt).to(device)
    w = _nz(N, K, dtype=dt, scale=0.02).to(device)
    ores = _nz(M, N, dtype=dt).to(device)
    onw = _nz(N).to(device)
    ekw = {"out_norm_weight": onw, "out_residual": ores, "out_eps": OUT_EPS}
    got, got_s = _graph_replay_on_new_x(lambda: gemv(x, w, **ekw), x,
                                        _nz(M, K, dtype=dt).to(device))
    want, want_s = fused.rms_norm(gemv(x, w), onw, OUT_EPS, residual=ores)
    assert torch.equal(got_s, want_s) and torch.equal(got, want)


def test_gemv_out_norm_validation(device):
    M, N, K = 2, 24, 32
    x = torch.randn(M, K, device=device)
    w = torch.randn(N, K, device=device)
    onw = torch.randn(N, device=device)
    ores = torch.randn(M, N, device=device)
    ekw = {"out_norm_weight": onw, "out_residual": ores}
    with pytest.raises(ValueError, match="out_norm_weight .* needs out_residual"):
        gemv(x, w, out_norm_weight=onw)
    with pytest.raises(ValueError, match="out_residual is only used with out_norm_weight"):
        gemv(x, w, out_residual=ores)
    with pytest.raises(ValueError, match=r"out_residual must have shape \(2, 24\)"):
        gemv(x, w, out_norm_weight=onw, out_residual=ores[:1])
    with pytest.raises(ValueError, match=r"out_residual must have shape \(2, 24\)"):
        gemv(x, w, out_norm_weight=onw, out_residual=torch.randn(M, K, device=device))
    with pytest.raises(ValueError, match="out_residual must have dtype"):
        gemv(x, w, out_norm_weight=onw, out_residual=ores.half())
    with pytest.raises(ValueError, match="out_residual must be contiguous in its last dim"):
        gemv(x, w, out_norm_weight=onw, out_residual=torch.randn(N, M, device=device).t())
    with pytest.raises(ValueError, match=r"out_norm_weight must have shape \(24,\)"):
        gemv(x, w, out_norm_weight=onw[:-1], out_residual=ores)
    with pytest.raises(ValueError, match="out_norm_weight must have dtype"):
        gemv(x, w, out_norm_weight=onw.to(torch.int32), out_residual=ores)
    with pytest.raises(ValueError, match="out_eps must be"):
        gemv(x, w, out_norm_weight=onw, out_residual=ores, out_eps=-1.0)
    nw = torch.randn(K, device=device)
    r = torch.randn(M, K, device=device)
    with pytest.raises(ValueError, match="residual .* and out_residual .* not supported"):
        gemv(x, w, prologue="rmsnorm", norm_weight=nw, residual=r, **ekw)


# ------------------------------------------------------------------------- gemv_partials
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 2, 5, 16])
@pytest.mark.parametrize(
    "config",
    [
        GemvConfig(block_n=32, block_k=32, split_k=3, use_dot=True, swap_ab=True, pad_rows=False),
        GemvConfig(block_n=16, block_k=64, split_k=2, use_dot=True),
        GemvConfig(block_n=16, block_k=64, use_dot=True),  # one piece
    ],
)
def test_gemv_partials_reduce_to_gemv(device, M, config, dtype):
    """The unreduced split-K pieces: summed from 0 in order (plus the bias) and rounded, they are
    bit-identical to gemv's output with the same configuration; the piece count is gemv_split's."""
    N, K = 72, 160  # K: 5 chunks of 32 (3 pieces, the last one short) or 3 of 64
    x, w, b, _ = _inputs("none", M, N, K, dtype, device, bias=True)
    p = gemv_partials(x, w, config=config, force_triton=True)
    want_split = {3: 3, 2: 2, 1: 1}[config.split_k]
    assert p.shape == (want_split, M, N) and p.dtype == torch.float32
    acc = torch.zeros(M, N, dtype=torch.float32, device=device)
    for piece in p:
        acc = acc + piece
    y = gemv(x, w, b, config=config, force_triton=True)
    assert torch.equal((acc + b.float()).to(dtype), y)
    if HAS_CUDA:
        assert gemv_split(x, w, config=config) == want_split
    else:  # CPU tensors: gemv takes the torch path unless forced
        assert gemv_split(x, w, config=config) == 0


def test_gemv_partials_torch_path_and_bounds(device):
    x, w, _, _ = _inputs("none", 3, 40, 64, torch.float32, device)
    if not HAS_CUDA:  # the torch path: one piece, F.linear
        p = gemv_partials(x, w)
        assert p.shape == (1, 3, 40)
        torch.testing.assert_close(p[0], x @ w.T, atol=1e-5, rtol=1e-5)
    big = _nz(MAX_ROWS + 1, 64).to(device)
    assert gemv_split(big, w) == 0
    assert gemv_partials(big, w).shape == (1, MAX_ROWS + 1, 40)  # torch path
    with pytest.raises(ValueError, match="at most"):
        gemv_partials(big, w, force_triton=True)
    assert gemv_partials(x[:0], w, force_triton=True).shape == (1, 0, 40)
    with pytest.raises(ValueError, match="weight"):
        gemv_partials(x, w[:, :10], force_triton=True)
