from __future__ import annotations

import importlib
import math

import pytest
import torch
import torch.nn.functional as F

from speculant.kernels.paged_attention import paged_attention, paged_attention_ref

# ||out - ref|| / ||ref|| bounds: ref is fp32 math on the same (rounded) inputs
REL_TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}


def make_batch(
    q_lens,
    ctx_lens,
    num_heads,
    num_kv_heads,
    head_dim,
    block_size,
    dtype,
    num_blocks=None,
    high_blocks=False,
):
    """Random paged batch; blocks are a random permutation (or the top ids of the cache)."""
    ns = len(q_lens)
    per_seq = [math.ceil(c / block_size) for c in ctx_lens]
    max_blocks = max(per_seq + [1]) + 1  # one spare column: never read
    need = sum(per_seq)
    nb = num_blocks or (need + 5)
    kc = torch.randn(nb, block_size, num_kv_heads, head_dim).to(dtype)
    vc = torch.randn(nb, block_size, num_kv_heads, head_dim).to(dtype)
    ids = torch.arange(nb - need, nb) if high_blocks else torch.randperm(nb)[:need]
    ids = ids[torch.randperm(need)]
    bt = torch.full((ns, max_blocks), nb + 10**6, dtype=torch.int32)  # garbage when read
    o = 0
    for s, n in enumerate(per_seq):
        bt[s, :n] = ids[o : o + n]
        o += n
    qsl = torch.zeros(ns + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    q = torch.randn(int(qsl[-1]), num_heads, head_dim).to(dtype)
    return q, kc, vc, bt, torch.tensor(ctx_lens, dtype=torch.int32), qsl


def to(dev, *ts):
    return [t.to(dev) for t in ts]


def dense_attention(q, kc, vc, bt, cl, qsl, scale):
    """Dead-simple: gather contiguous K/V per sequence, causal SDPA in float64."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    H, Hkv = q.shape[1], kc.shape[2]
    bs = kc.shape[1]
    for s in range(len(cl)):
        q0, q1, ctx = int(qsl[s]), int(qsl[s + 1]), int(cl[s])
        if q1 == q0:
            continue
        pos = torch.arange(ctx)
        k = kc[bt[s, pos // bs].long(), pos % bs].double()  # [ctx, Hkv, D]
        v = vc[bt[s, pos // bs].long(), pos % bs].double()
        qs = q[q0:q1].double()
        qpos = torch.arange(q1 - q0) + ctx - (q1 - q0)
        mask = pos[None, :] <= qpos[:, None]
        o = F.scaled_dot_product_attention(
            qs.transpose(0, 1),
            k.repeat_interleave(H // Hkv, 1).transpose(0, 1),
            v.repeat_interleave(H // Hkv, 1).transpose(0, 1),
            attn_mask=mask,
            scale=scale,
        )
        out[q0:q1] = o.transpose(0, 1)
    return out


def rel_err(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


# prefill + decode + (k+1) verification + an empty sequence, in one batch
MIXED = dict(q_lens=[7, 1, 6, 0, 1, 3], ctx_lens=[7, 45, 70, 12, 1, 19])


@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize("gqa", [(4, 4), (8, 2), (8, 1)])
def test_reference_matches_dense_sdpa(block_size, gqa):
    H, Hkv = gqa
    q, kc, vc, bt, cl, qsl = make_batch(
        **MIXED,
        num_heads=H,
        num_kv_heads=Hkv,
        head_dim=32,
        block_size=block_size,
        dtype=torch.float32,
    )
    ref = paged_attention_ref(q, kc, vc, bt, cl, qsl, 0.17)
    dense = dense_attention(q, kc, vc, bt, cl, qsl, 0.17)
    assert rel_err(ref, dense) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("gqa", [(4, 4), (8, 2), (8, 1)])
# the default run: cache blocks of 16; blocks of 8 are slow
@pytest.mark.parametrize("block_size", [16, pytest.param(8, marks=pytest.mark.slow)])
def test_kernel_mixed_batch(device, dtype, gqa, block_size):
    H, Hkv = gqa
    q, kc, vc, bt, cl, qsl = make_batch(
        **MIXED, num_heads=H, num_kv_heads=Hkv, head_dim=64, block_size=block_size, dtype=dtype
    )
    scale = 1 / 8
    ref = paged_attention_ref(q, kc, vc, bt, cl, qsl, scale)
    out = torch.full_like(q, float("nan"))
    res = paged_attention(
        *to(device, q, kc, vc, bt, cl, qsl), scale, out=out.to(device), force_triton=True
    )
    assert not torch.isnan(res).any()
    assert rel_err(res, ref) < REL_TOL[dtype]


@pytest.mark.parametrize("num_splits", [1, 3, 8])
# the default run: cache blocks of 16; blocks of 32 are slow
@pytest.mark.parametrize("block_size", [16, pytest.param(32, marks=pytest.mark.slow)])
def test_kernel_split_k_head_dim_128(device, num_splits, block_size):
    """Split-K paths (incl. splits that get no keys) on decode + verification rows."""
    q, kc, vc, bt, cl, qsl = make_batch(
        q_lens=[1, 6, 1, 2],
        ctx_lens=[300, 133, 2, 64],
        num_heads=8,
        num_kv_heads=2,
        head_dim=128,
        block_size=block_size,
        dtype=torch.float16,
    )
    scale = 128**-0.5
    ref = paged_attention_ref(q, kc, vc, bt, cl, qsl, scale)
    out = paged_attention(
        *to(device, q, kc, vc, bt, cl, qsl),
        scale,
        max_query_len=6,
        num_splits=num_splits,
        force_triton=True,
    )
    assert rel_err(out, ref) < REL_TOL[torch.float16]


def test_kernel_long_prefill_tiles(device):
    """Prefill longer than one query tile (several tiles per sequence), hint given."""
    q, kc, vc, bt, cl, qsl = make_batch(
        q_lens=[40, 1, 19],
        ctx_lens=[50, 9, 19],
        num_heads=4,
        num_kv_heads=1,
        head_dim=32,
        block_size=16,
        dtype=torch.float32,
    )
    ref = paged_attention_ref(q, kc, vc, bt, cl, qsl, 0.2)
    for mql in (None, 40):
        out = paged_attention(
            *to(device, q, kc, vc, bt, cl, qsl), 0.2, max_query_len=mql, force_triton=True
        )
        assert rel_err(out, ref) < REL_TOL[torch.float32]


def test_padding_tokens_untouched_and_strided_q(device):
    """q a strided view (fused qkv); rows past query_start_loc[-1] are left alone."""
    H, Hkv, D = 4, 2, 32
    q, kc, vc, bt, cl, qsl = make_batch(
        q_lens=[3, 1],
        ctx_lens=[10, 30],
        num_heads=H,
        num_kv_heads=Hkv,
        head_dim=D,
        block_size=16,
        dtype=torch.float16,
    )
    n = q.shape[0]
    qkv = torch.randn(n + 2, H + 2 * Hkv, D).to(torch.float16)
    qkv[:n, :H] = q
    q_view = qkv[:, :H]  # 2 padding tokens at the end
    out = torch.full((n + 2, H, D), float("nan"), dtype=torch.float16)
    res = paged_attention(
        *to(device, q_view, kc, vc, bt, cl, qsl), 0.3, out=out.to(device), force_triton=True
    ).cpu()
    ref = paged_attention_ref(q, kc, vc, bt, cl, qsl, 0.3)
    assert rel_err(res[:n], ref) < REL_TOL[torch.float16]
    assert torch.isnan(res[n:]).all()


def test_high_block_ids_and_int64_offsets(device):
    """Block ids at the top of a cache with more than 2**31 elements (K and V share it)."""
    bs, Hkv, D = 16, 1, 16
    nb = 2**31 // (bs * Hkv * D) + 8
    try:
        cache = torch.empty((nb, bs, Hkv, D), dtype=torch.float16, device=device)
    except (RuntimeError, MemoryError):
        pytest.skip("cannot reserve a >4 GiB cache here")
    ctx = [40, 21]  # query lengths 1 and 2
    ids = torch.arange(nb - 6, nb)
    bt = torch.stack([ids[:3], ids[3:]]).to(torch.int32)
    for b in ids.tolist():
        cache[b] = torch.randn(bs, Hkv, D).to(torch.float16)
    qsl = torch.tensor([0, 1, 3], dtype=torch.int32)
    cl = torch.tensor(ctx, dtype=torch.int32)
    q = torch.randn(3, 4, D).to(torch.float16)
    small = torch.zeros((nb - ids[0].item() + 1, bs, Hkv, D), dtype=torch.float16)
    small[1:] = cache[ids[0] :].cpu()
    ref = paged_attention_ref(q, small, small, (bt - ids[0] + 1), cl, qsl, 0.25)
    out = paged_attention(
        q.to(device), cache, cache, *to(device, bt, cl, qsl), 0.25, force_triton=True
    )
    assert rel_err(out, ref) < REL_TOL[torch.float16]
    # split-K with 16-token chunks: every split gets keys (partial outputs + merge kernel)
    pa = importlib.import_module("speculant.kernels.paged_attention")  # module, not the fn
    out = torch.full_like(q, float("nan")).to(device)
    pa._paged_attention_triton(
        q.to(device),
        cache,
        cache,
        *to(device, bt, cl, qsl),
        0.25,
        None,
        out,
        overrides={"num_splits": 3, "block_n": 16},
    )
    assert rel_err(out, ref) < REL_TOL[torch.float16]
    del cache


def test_torch_path_matches_reference():
    q, kc, vc, bt, cl, qsl = make_batch(
        **MIXED, num_heads=4, num_kv_heads=2, head_dim=16, block_size=8, dtype=torch.float32
    )
    a = paged_attention(q, kc, vc, bt, cl, qsl, 0.5)
    b = dense_attention(q, kc, vc, bt, cl, qsl, 0.5)
    assert rel_err(a, b) < 1e-6


def test_validation_errors(device):
    q, kc, vc, bt, cl, qsl = to(
        device,
        *make_batch(
            q_lens=[1, 2],
            ctx_lens=[5, 9],
            num_heads=4,
            num_kv_heads=2,
            head_dim=32,
            block_size=16,
            dtype=torch.float16,
        ),
    )
    args = dict(
        q=q,
        k_cache=kc,
        v_cache=vc,
        block_tables=bt,
        context_lens=cl,
        query_start_loc=qsl,
        scale=0.1,
    )

    def call(**kw):
        paged_attention(**{**args, **kw}, force_triton=True)

    with pytest.raises(ValueError, match="k_cache"):
        call(k_cache=kc.float())
    with pytest.raises(ValueError, match="v_cache"):
        call(v_cache=vc[:, :8])
    with pytest.raises(ValueError, match="num_heads"):
        call(q=torch.randn(3, 3, 32, dtype=torch.float16, device=device))
    with pytest.raises(ValueError, match="head_dim"):
        call(q=torch.randn(3, 4, 16, dtype=torch.float16, device=device))
    with pytest.raises(ValueError, match="context_lens"):
        call(context_lens=cl[:1])
    with pytest.raises(ValueError, match="query_start_loc"):
        call(query_start_loc=qsl.float())
    with pytest.raises(ValueError, match="block_tables"):
        call(block_tables=bt[0])
    with pytest.raises(ValueError, match="out"):
        call(out=torch.empty(3, 4, 32, dtype=torch.float32, device=device))
    with pytest.raises(ValueError, match="q "):
        call(q=q.to(torch.int32))
    with pytest.raises(ValueError, match="power of two"):
        h = 48
        call(
            q=torch.randn(3, 4, h, dtype=torch.float16, device=device),
            k_cache=torch.randn(4, 16, 2, h, dtype=torch.float16, device=device),
            v_cache=torch.randn(4, 16, 2, h, dtype=torch.float16, device=device),
        )


@pytest.mark.parametrize("block_size", [1, 5, 12, 64])
def test_kernel_odd_block_sizes(device, block_size):
    """Block sizes that are not 16 (any positive int, powers of two or not)."""
    q, kc, vc, bt, cl, qsl = make_batch(
        q_lens=[1, 4, 0, 9],
        ctx_lens=[70, 33, 5, 9],
        num_heads=6,
        num_kv_heads=2,
        head_dim=32,
        block_size=block_size,
        dtype=torch.float16,
    )
    ref = paged_attention_ref(q, kc, vc, bt, cl, qsl, 0.2)
    out = paged_attention(*to(device, q, kc, vc, bt, cl, qsl), 0.2, force_triton=True)
    assert rel_err(out, ref) < REL_TOL[torch.float16]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_llama3_8b_heads_verification(device, dtype):
    """Llama-3-8B geometry (32 q heads, 8 kv heads, head_dim 128): k+1 = 6 verification rows and
    decode rows over ragged contexts, with the split-K heuristic left to choose."""
    q, kc, vc, bt, cl, qsl = make_batch(
        q_lens=[6, 1, 6, 3],
        ctx_lens=[517, 200, 6, 64],
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        block_size=16,
        dtype=dtype,
    )
    scale = 128**-0.5
    ref = paged_attention_ref(q, kc, vc, bt, cl, qsl, scale)
    out = torch.full_like(q, float("nan")).to(device)
    paged_attention(
        *to(device, q, kc, vc, bt, cl, qsl), scale, max_query_len=6, out=out, force_triton=True
    )
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < REL_TOL[dtype]


@pytest.mark.parametrize("scheme", ["plain", "prefetch", "bt_ahead"])
# the default run: chunks of 64 (~2 s each on the interpreter); chunks of 16 are slow
@pytest.mark.parametrize("block_n", [pytest.param(16, marks=pytest.mark.slow), 64])
def test_kernel_prefetch_and_chunk_sizes(device, scheme, block_n):
    """The K/V loading schemes (next chunk prefetched into registers, the next chunk's
    block-table entries loaded a chunk ahead, or neither), chunk sizes smaller and larger than
    the cache block, with and without split-K; includes a split with no keys."""
    pa = importlib.import_module("speculant.kernels.paged_attention")  # module, not the fn
    q, kc, vc, bt, cl, qsl = make_batch(
        q_lens=[1, 6, 3, 1],
        ctx_lens=[150, 70, 3, 33],
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float16,
    )
    ref = paged_attention_ref(q, kc, vc, bt, cl, qsl, 0.125)
    for splits in (1, 5):
        out = torch.full_like(q, float("nan")).to(device)
        pa._paged_attention_triton(
            *to(device, q, kc, vc, bt, cl, qsl),
            0.125,
            6,
            out,
            overrides={"prefetch": scheme == "prefetch", "bt_ahead": scheme == "bt_ahead",
                       "block_n": block_n, "num_splits": splits, "num_stages": 3},
        )
        assert not torch.isnan(out).any()
        assert rel_err(out, ref) < REL_TOL[torch.float16]


@pytest.mark.parametrize("heads_first", [False, True])
def test_kernel_program_order(device, heads_first):
    """Both grid orders (tiles first / KV heads first) give the same attention."""
    pa = importlib.import_module("speculant.kernels.paged_attention")
    q, kc, vc, bt, cl, qsl = make_batch(
        q_lens=[1, 6, 2],
        ctx_lens=[90, 40, 2],
        num_heads=8,
        num_kv_heads=4,
        head_dim=32,
        block_size=16,
        dtype=torch.float16,
    )
    ref = paged_attention_ref(q, kc, vc, bt, cl, qsl, 0.2)
    for splits in (1, 3):
        out = torch.full_like(q, float("nan")).to(device)
        pa._paged_attention_triton(
            *to(device, q, kc, vc, bt, cl, qsl),
            0.2,
            6,
            out,
            overrides={"heads_first": heads_first, "num_splits": splits},
        )
        assert not torch.isnan(out).any()
        assert rel_err(out, ref) < REL_TOL[torch.float16]


def test_varying_ints_are_not_specialised(monkeypatch):
    """Triton compiles a separate binary for every integer argument equal to 1 or divisible by
    16. The batch size, split count and block-table width change between eager calls (prefill,
    a proposer's catch-up): those are not specialised, or a table 16 blocks wide (a context of
    241-256 tokens) would compile a variant of its own mid-run (an H100 run paid 0.6 s)."""
    import sys

    mod = sys.modules["speculant.kernels.paged_attention"]
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the compiled kernel's JITFunction, not built
    flags = {p.name: p.do_not_specialize for p in mod._paged_attn_kernel.jitted().params}
    assert flags["num_seqs"] and flags["num_splits"] and flags["stride_bt"]
    assert not flags["stride_qt"] and not flags["stride_kb"]  # fixed per model: specialised
    reduce = {p.name: p.do_not_specialize for p in mod._paged_attn_reduce_kernel.jitted().params}
    assert reduce["num_seqs"] and reduce["num_splits"] and not reduce["stride_ot"]


def test_split_count_for_full_waves_over_short_tables():
    """Decode tiles that fill every SM run unsplit over a table of at most 512 tokens (the merge
    costs more than the walk saves there) and keep their splits over longer tables; fewer
    programs than SMs split as before."""
    from speculant.kernels.paged_attention import choose_launch_config

    def splits(num_seqs, max_context, sm_count=132):
        return choose_launch_config(
            num_tokens=num_seqs, num_seqs=num_seqs, num_heads=16, num_kv_heads=4, head_dim=128,
            max_query_len=1, max_context=max_context, dtype=torch.bfloat16,
            sm_count=sm_count)["num_splits"]

    assert splits(64, 320) == 1  # 256 programs >= 132 SMs, a 320-token table
    assert splits(64, 8192) == 2  # the same over 8k tokens
    assert splits(16, 320) == 5  # 64 programs: split (capped by the table's 5 chunks)
    assert splits(1, 320) == 5
