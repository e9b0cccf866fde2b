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


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test of the CUDA code path; "
                    "on CUDA tests/test_gpu_engine.py covers it end to end")
# the default run: the one-row path (~5 s on the interpreter); the multi-row one is slow
@pytest.mark.parametrize("path", ["gemv", pytest.param("fused", marks=pytest.mark.slow)])
@pytest.mark.slow
def test_llama_gemv_path_equals_layer_path(tiny_llama, monkeypatch, path):
    """The CUDA paths of the Llama layers against the torch layer path, over a prefill of 5
    tokens, 2 decode steps, a 3-token (verification-like) step and a 20-token one (qkv and gate/up
    as GEMVs, o_proj and down on the torch path), with aux hidden states
    (EAGLE-3) collected. ``gemv``: the one-row path (4 GEMVs with fused RMSNorm / residual /
    SiLU*up prologues, kernels/gemv.py; RoPE fused with the K/V store). ``fused``: the
    multi-row path that carries the residual stream into the RMSNorm kernels
    (``forward_fused``)."""
    from speculant.models import llama
    from speculant.models.loader import load_config, load_model

    cfg = load_config(tiny_llama)
    model = load_model(tiny_llama, cfg, torch.float32, torch.device("cpu"), 256)
    model._cpu_plan = False  # the layer loop, not the CPU fast path

    def run(cuda_path: bool):
        return _forward_steps(model, monkeypatch, cuda_path, cuda_path and path == "gemv")

    ref = run(False)
    calls = _triton_gemv(monkeypatch)
    layer_calls = [0]
    monkeypatch.setattr(llama.LlamaDecoderLayer, "forward_fused", _counted(
        llama.LlamaDecoderLayer.forward_fused, layer_calls))
    got = run(True)
    # the first four steps have <= GEMV_FEW_ROWS rows: all four projections of a layer are GEMVs
    # (one-row steps: forward_gemv; the others: forward_fused, norms in the split-K reduces);
    # the 20-row step (GEMV_FEW_ROWS < 20 <= GEMV_IN_ROWS): qkv and gate/up only
    assert fused.GEMV_FEW_ROWS < 20 <= fused.GEMV_IN_ROWS
    L = cfg.num_hidden_layers
    assert calls[0] == 4 * 4 * L + 2 * L
    if path == "gemv":  # the two one-row decode steps; the others take the fused path
        assert layer_calls[0] == 3 * L
    else:
        assert layer_calls[0] == 5 * L
    for (h, aux), (h_ref, aux_ref) in zip(got, ref):
        torch.testing.assert_close(h, h_ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(aux, aux_ref, atol=1e-4, rtol=1e-4)


def _forward_steps(model, monkeypatch, cuda_path: bool, one_row_gemv: bool) -> list:
    """(hidden, aux hidden) of ``model`` over a prefill of 5 tokens, 2 decode steps, a 3-token
    step and a 20-token one, on the CUDA layer paths (``fused.enabled``: rope_store_, fused
    norms, forward_fused; ``one_row_gemv``: the one-row steps as forward_gemv) or the torch
    ones."""
    from speculant.engine.model_runner import ModelRunner
    from speculant.engine.sequence import Sequence
    from speculant.outputs import RequestMetrics
    from speculant.sampling_params import SamplingParams

    monkeypatch.setattr(fused, "gemv_enabled", lambda x: one_row_gemv and x.shape[0] == 1)
    monkeypatch.setattr(fused, "enabled", lambda x: cuda_path)
    runner = ModelRunner(model, 8, 16, torch.device("cpu"), torch.float32)
    seqs = [Sequence("r", 0, [1, 5, 9, 200, 7], SamplingParams(), RequestMetrics(0.0), None)]
    seqs[0].block_table = [0, 1]
    outs = [runner.forward(seqs, [seqs[0].token_ids], (1,))]
    for toks in ([11], [300], [4, 77, 12], list(range(20, 40))):
        outs.append(runner.forward(seqs, [toks], (1,)))
    return outs


def _triton_gemv(monkeypatch) -> list[int]:
    """Send the Llama layers' ``gemv`` calls to the Triton kernel (interpreter) and count them."""
    from speculant.kernels.gemv import gemv as gemv_fn
    from speculant.models import llama

    calls = [0]

    def spy(*a, **kw):
        calls[0] += 1
        return gemv_fn(*a, **kw, force_triton=True)

    monkeypatch.setattr(llama, "gemv", spy)
    return calls


def _counted(fn, counter):
    def wrapped(*a, **kw):
        counter[0] += 1
        return fn(*a, **kw)

    return wrapped


def test_rope_store_equals_rope_then_store():
    """models/fused.rope_store_ (RoPE on q and k with k and v written to their cache slots in one
    kernel) against rope_ followed by kernels/kv_cache.store_kv_ref; padding slots (-1) stay
    untouched; k itself is not modified."""
    from speculant.kernels.kv_cache import store_kv_ref

    g = torch.Generator().manual_seed(4)
    T, Hq, Hk, D, nb, bs = 6, 8, 2, 32, 5, 4
    qkv = torch.randn(T, (Hq + 2 * Hk) * D, generator=g).to(DEV)
    q, k, v = qkv.split([Hq * D, Hk * D, Hk * D], dim=-1)
    q, k, v = q.view(T, Hq, D), k.view(T, Hk, D), v.view(T, Hk, D)
    pos = torch.tensor([0, 9, 3, 31, 17, 5], device=DEV)
    slots = torch.tensor([3, 17, -1, 0, 19, 8], device=DEV)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    freqs = torch.arange(32).float()[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().to(DEV), emb.sin().to(DEV)
    caches = [torch.randn(nb, bs, Hk, D, generator=g).to(DEV) for _ in range(2)]
    want_q, want_k = q.clone(), k.clone()
    fused.rope_(pos, want_q, want_k, cos, sin)
    want_kc, want_vc = caches[0].clone(), caches[1].clone()
    store_kv_ref(want_k, v, want_kc, want_vc, slots)
    k_before = k.clone()
    fused.rope_store_(pos, q, k, v, cos, sin, caches[0], caches[1], slots)
    torch.testing.assert_close(q, want_q, atol=0, rtol=0)
    torch.testing.assert_close(caches[0], want_kc, atol=0, rtol=0)
    torch.testing.assert_close(caches[1], want_vc, atol=0, rtol=0)
    assert torch.equal(k, k_before)
    with pytest.raises(ValueError, match="do not hold k"):
        fused.rope_store_(pos, q, k, v, cos, sin, caches[0][:, :, :1], caches[1], slots)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test of the CUDA code path; "
                    "on CUDA tests/test_gpu_engine.py covers the EAGLE heads end to end")
@pytest.mark.parametrize("which", ["llama_layer", "eagle3_layer"])
def test_one_row_head_layers_equal_torch_path(monkeypatch, which):
    """The one-row CUDA path of the layers the EAGLE heads run (``LlamaDecoderLayer.forward``:
    EAGLE-1; ``Eagle3Layer.forward``): the second RMSNorm with the residual add and gate/up, and
    SiLU * up with down, as GEMVs (kernels/gemv.py), against the torch path, one decode row over
    a cache holding 5 earlier tokens."""
    import transformers

    from speculant.models import llama
    from speculant.models.attention import AttentionMetadata, ForwardContext
    from speculant.models.layers import RotaryEmbedding
    from speculant.plugins import eagle

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    torch.manual_seed(5)
    rope = RotaryEmbedding(cfg, 16, 64)
    if which == "llama_layer":
        layer = llama.LlamaDecoderLayer(cfg, 0, rope, False)
    else:
        layer = eagle.Eagle3Layer(cfg, rope)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() > 1 else 0.1) + (1.0 if p.dim() == 1 else 0))
    bs, nb = 4, 3
    caches = [torch.randn(nb, bs, 2, 16) for _ in range(2)]
    meta = AttentionMetadata.build([1], [6], [[0, 1]], bs, torch.device("cpu"))
    pos = torch.tensor([5])
    x, h = torch.randn(1, 64), torch.randn(1, 64)

    def run(cuda_path: bool):
        monkeypatch.setattr(fused, "enabled", lambda t: cuda_path)
        monkeypatch.setattr(fused, "gemv_enabled", lambda t: cuda_path and t.shape[0] == 1)
        ctx = ForwardContext(meta=meta, kv_caches=[(caches[0].clone(), caches[1].clone())])
        with torch.no_grad():
            if which == "llama_layer":
                return layer(pos, x, ctx)
            return layer(pos, x, h, ctx)

    ref = run(False)
    calls = _triton_gemv(monkeypatch)
    got = run(True)
    # gate/up (norm + residual) and down (SiLU * up); o_proj's GEMV is in LlamaAttention's CUDA
    # branch, which CPU tensors never take (tests/test_gpu_engine.py runs it)
    assert calls[0] == 2
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def _rope_tables(D, n=64):
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    freqs = torch.arange(n).float()[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos().to(DEV), emb.sin().to(DEV)


# the default run: split-K 1 and 3; 2 is slow
@pytest.mark.parametrize("split", [1, pytest.param(2, marks=pytest.mark.slow), 3])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4), (3, 1)])
@pytest.mark.slow
def test_reduce_rope_store_equals_gemv_then_rope_store(split, bias, heads):
    """models/fused.reduce_rope_store_ (the QKV projection's split-K reduce, RoPE and the K/V
    store in one kernel) on gemv_partials' pieces against gemv (same launch configuration) then
    rope_store_: q, the returned k / v and both caches bit-identical; padding slots (-1) stay
    untouched; the torch reference agrees too."""
    from speculant.kernels.gemv import GemvConfig, gemv, gemv_partials

    g = torch.Generator().manual_seed(6)
    Hq, Hk = heads
    T, D, H, nb, bs = 6, 32, 96, 5, 4
    N = (Hq + 2 * Hk) * D
    x = torch.randn(T, H, generator=g).to(DEV)
    w = (torch.randn(N, H, generator=g) * 0.1).to(DEV)
    b = torch.randn(N, generator=g).to(DEV) if bias else None
    cfg = GemvConfig(block_n=16, block_k=32, split_k=split, use_dot=True, swap_ab=True,
                     pad_rows=False)
    pos = torch.tensor([0, 9, 3, 31, 17, 5], device=DEV)
    slots = torch.tensor([3, 17, -1, 0, 19, 8], device=DEV)
    cos, sin = _rope_tables(D)
    caches = [torch.randn(nb, bs, Hk, D, generator=g).to(DEV) for _ in range(2)]

    qkv = gemv(x, w, b, config=cfg, force_triton=True)
    q, k, v = qkv.split([Hq * D, Hk * D, Hk * D], dim=-1)
    q, k, v = q.view(T, Hq, D), k.view(T, Hk, D), v.view(T, Hk, D)
    want_c = [c.clone() for c in caches]
    fused.rope_store_(pos, q, k, v, cos, sin, want_c[0], want_c[1], slots)

    p = gemv_partials(x, w, config=cfg, force_triton=True)
    assert p.shape[0] == split
    got_c = [c.clone() for c in caches]
    got = fused.reduce_rope_store_(p, b, pos, cos, sin, got_c[0], got_c[1], slots, Hq, Hk,
                                   force_triton=True)
    assert torch.equal(got, qkv)  # q rotated in place above; k and v as summed
    assert torch.equal(got_c[0], want_c[0]) and torch.equal(got_c[1], want_c[1])
    written = torch.zeros(nb * bs, dtype=torch.bool)
    written[[3, 17, 0, 19, 8]] = True  # the padding row (slot -1) writes nothing
    for c, c0 in zip(got_c, caches):
        flat, flat0 = c.reshape(nb * bs, -1).cpu(), c0.reshape(nb * bs, -1).cpu()
        assert torch.equal(flat[~written], flat0[~written])
        assert not torch.equal(flat[written], flat0[written])
    ref_c = [c.clone() for c in caches]
    ref = fused._reduce_rope_store_ref(p, b, pos, cos, sin, ref_c[0], ref_c[1], slots, Hq, Hk,
                                       torch.float32)
    torch.testing.assert_close(ref, got, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ref_c[0], got_c[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ref_c[1], got_c[1], atol=0, rtol=0)
    with pytest.raises(ValueError, match="do not hold"):
        fused.reduce_rope_store_(p, b, pos, cos, sin, got_c[0], got_c[1], slots, Hq + 1, Hk,
                                 force_triton=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test of the CUDA code path; "
                    "on CUDA tests/test_gpu_engine.py covers it end to end")
@pytest.mark.slow  # ~5 s; the default run: its kernel's own tests above
def test_llama_fused_qkv_rope_path_equals_layer_path(tiny_llama, monkeypatch):
    """``forward_fused`` with qkv as ``gemv_partials`` (K in two pieces) and the reduce + RoPE +
    K/V store kernel (``LlamaAttention.attend_partials``) against the torch layer path, over a
    prefill, decode steps, a 3-token step and a 20-token one."""
    import functools

    from speculant.kernels.gemv import GemvConfig, gemv_partials
    from speculant.models import llama
    from speculant.models.loader import load_config, load_model

    cfg = load_config(tiny_llama)
    model = load_model(tiny_llama, cfg, torch.float32, torch.device("cpu"), 256)
    model._cpu_plan = False

    def run(cuda_path: bool):
        return _forward_steps(model, monkeypatch, cuda_path, False)

    ref = run(False)
    _triton_gemv(monkeypatch)
    split2 = GemvConfig(block_n=16, block_k=16, split_k=2, use_dot=True, swap_ab=True,
                        pad_rows=False)
    fused_calls = [0]
    monkeypatch.setattr(llama, "gemv_split", lambda x, w: 2)  # the CPU has no Triton path
    monkeypatch.setattr(llama, "gemv_partials", functools.partial(
        gemv_partials, config=split2, force_triton=True))
    monkeypatch.setattr(fused, "reduce_rope_store_", _counted(functools.partial(
        fused.reduce_rope_store_, force_triton=True), fused_calls))
    got = run(True)
    assert fused_calls[0] == 5 * cfg.num_hidden_layers  # every step on the multi-row path
    for (h, aux), (h_ref, aux_ref) in zip(got, ref):
        torch.testing.assert_close(h, h_ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(aux, aux_ref, atol=1e-4, rtol=1e-4)


def test_reduce_rope_store_output_dtype_and_cache_dtype():
    """qkv comes back in the dtype asked for (the layer's), the caches get their own dtype."""
    g = torch.Generator().manual_seed(7)
    T, Hq, Hk, D, nb, bs = 3, 4, 2, 16, 4, 4
    p = torch.randn(2, T, (Hq + 2 * Hk) * D, generator=g).to(DEV)
    pos, slots = torch.tensor([1, 4, 7], device=DEV), torch.tensor([0, 5, -1], device=DEV)
    cos, sin = _rope_tables(D)
    got_c = [torch.zeros(nb, bs, Hk, D, dtype=torch.float64, device=DEV) for _ in range(2)]
    ref_c = [c.clone() for c in got_c]
    got = fused.reduce_rope_store_(p, None, pos, cos, sin, got_c[0], got_c[1], slots, Hq, Hk,
                                   dtype=torch.float32, force_triton=True)
    ref = fused._reduce_rope_store_ref(p, None, pos, cos, sin, ref_c[0], ref_c[1], slots, Hq, Hk,
                                       torch.float32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_c[0], ref_c[0], atol=1e-6, rtol=1e-6)
    assert torch.equal(got_c[1], ref_c[1]) and got_c[1].abs().sum() > 0
