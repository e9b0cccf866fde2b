"""Issue 5's decode-attention goals against what this GPU, Triton and PyTorch's own kernels reach.

    python bench/decode_limits.py --out OUT [--cases 1:8192,8:8192,...]

Decode attention (one query token, Llama-3-8B heads: 32 query heads, 8 KV heads x 128, bf16,
block 16) over batch x context cached tokens, every kernel timed as ``bench_kernels.py``'s graphN
column: N distinct copies of its inputs (together far larger than the 50 MB L2) run back to back
inside ONE CUDA graph, median replay / N. Per case:

* ``ours``: ``paged_attention`` with its default launch (PDL where the device has it), with the
  best batch-1 setting of the earlier sweeps, and with each ``--splits`` count at batch > 1.
* ``sdpa:<backend>``: ``scaled_dot_product_attention(..., enable_gqa=True)`` on K/V gathered
  contiguous ``[batch, 8, ctx, 128]`` (the issue's comparison), with PyTorch's default choice and
  each backend forced (flash, memory-efficient, cuDNN); a backend that refuses the shape is left
  out.
* ``paged read``: a Triton kernel that only READS the same K/V bytes through the same block table
  (sums them; no attention), over several grids: what any Triton kernel with this access pattern
  pays before doing attention at all. ``balanced read``: the same, persistent (a few programs
  per SM, each an equal slice of the flattened (sequence, KV head, chunk) work: stream-K style).
* ``flat read``: a Triton kernel reading as many contiguous bytes, short programs, several tilings
  (``read_ceiling.py``'s kernel); and ``torch.sum`` of them.

Percentages are of the device-to-device copy bandwidth measured in the same run. Over the
batch-1 contexts each family's times are fitted to ``t = fixed + bytes / bandwidth``: the fixed
per-call cost is what keeps batch 1 at 8k-16k (33.6-67.1 MB, 11-22 us at the copy bandwidth) away
from 80%. Writes decode_limits[_hnd][_sequential].json. CUDA only.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

from read_ceiling import _read as _flat_read  # noqa: E402  (the contiguous read: its tilings)

CASES = "1:4096,1:8192,1:16384,1:32768,1:65536,8:8192,8:32768,64:8192"
H, HKV, D, BS = 32, 8, 128, 16


@triton.jit
def _paged_read(
    k_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    v_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    bt_ptr,  # [batch, blocks_per_seq] int32
    out_ptr,  # [batch, num_kv_heads, parts] fp32: each program's sum of its K and V elements
    ctx,
    chunks_per_part,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_bt,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    d = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    lo = part * chunks_per_part * BLOCK_N
    hi = tl.minimum(lo + chunks_per_part * BLOCK_N, ctx)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    head = kvh.to(tl.int64) * stride_kh
    for start in range(lo, hi, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        ok = offs < hi
        phys = tl.load(bt_row + offs // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        row = phys * stride_kb + (offs % BLOCK_SIZE) * stride_ks + head  # [BLOCK_N]
        k = tl.load(k_ptr + row[:, None] + d[None, :], mask=ok[:, None], other=0.0)
        v = tl.load(v_ptr + row[:, None] + d[None, :], mask=ok[:, None], other=0.0)
        acc += k.to(tl.float32) + v.to(tl.float32)
    n_parts = tl.num_programs(2)
    tl.store(out_ptr + (seq * tl.num_programs(1) + kvh) * n_parts + part, tl.sum(tl.sum(acc, 1), 0))


@triton.jit
def _balanced_read(
    k_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    v_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    bt_ptr,  # [batch, blocks_per_seq] int32
    out_ptr,  # [num_programs] fp32: each program's sum of its K and V elements
    ctx,
    n_chunks,  # chunks of BLOCK_N tokens per (sequence, KV head): cdiv(ctx, BLOCK_N)
    total,  # batch * num_kv_heads * n_chunks work items
    stride_kb,
    stride_ks,
    stride_kh,
    stride_bt,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    # persistent, stream-K-like: program p reads work items [p * total / P, (p + 1) * total / P)
    # of the flattened (sequence, KV head, chunk) space, so every program reads the same number
    # of chunks (+-1) whatever the batch and context: no wave quantization
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    lo = (pid.to(tl.int64) * total) // nprog
    hi = ((pid.to(tl.int64) + 1) * total) // nprog
    d = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for item in range(lo, hi):
        chunk = item % n_chunks
        sh = item // n_chunks
        kvh = sh % NUM_KV_HEADS
        seq = sh // NUM_KV_HEADS
        offs = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = offs < ctx
        phys = tl.load(bt_ptr + seq * stride_bt + offs // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        row = phys * stride_kb + (offs % BLOCK_SIZE) * stride_ks + kvh * stride_kh  # [BLOCK_N]
        k = tl.load(k_ptr + row[:, None] + d[None, :], mask=ok[:, None], other=0.0)
        v = tl.load(v_ptr + row[:, None] + d[None, :], mask=ok[:, None], other=0.0)
        acc += k.to(tl.float32) + v.to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(tl.sum(acc, 1), 0))


# paged read grids: (chunk tokens, chunks per program or None = the attention kernel's split,
# warps, stages)
PAGED_READS = [
    (64, None, 4, 2),  # the attention kernel's decode tiles and split count
    (64, 1, 4, 1),
    (32, 1, 2, 1),
    (32, 2, 4, 1),
    (64, 2, 4, 3),
    (128, 1, 8, 1),
    (64, 4, 4, 3),
    (64, 8, 4, 3),
]
# balanced (persistent) paged reads: (chunk tokens, programs per SM, warps, stages)
BALANCED_READS = [(64, 2, 4, 2), (64, 3, 4, 2), (64, 4, 4, 2), (32, 4, 2, 2), (64, 3, 4, 3)]
FLAT_READS = [(1024, 4, 4, 1), (2048, 4, 8, 1), (4096, 2, 8, 1), (1024, 16, 4, 1), (2048, 8, 8, 3)]
SDPA_BACKENDS = ("default", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")


def _launch_read(kernel, grid, args, meta, k, v, out):
    """A bare-read kernel on one copy: ``kernel[grid](k, v, bt, out, *rest, **meta)`` where
    ``args = (bt, *rest)``."""
    kernel[grid](k, v, args[0], out, *args[1:], **meta)


def _time_ours(bk, record, case, nbytes, sets, tables, ref, name, **launch):
    """One launch variant of our kernel (``launch``: ``num_splits`` / ``overrides`` of the
    launcher), checked against the reference on the first copy, then timed over all copies."""
    bt, cl, qsl = tables
    fns = [
        functools.partial(
            bk.pa_mod._paged_attention_triton, *s_, bt, cl, qsl, D**-0.5, 1, o_, **launch
        )
        for *s_, o_ in sets
    ]
    fns[0]()
    err = bk.rel_err(sets[0][3], ref)
    record(case, "ours", name, bk.bench_graph_steady(fns), nbytes, rel_err=err, **launch)


def _time_read(bk, record, case, nbytes, sets, want, name, launch, out_shape, per_head):
    """A bare read ``launch(k, v, out)``: its sums on the first copy (the cache the gathered
    ``want`` [batch, kv_heads] came from) checked per sequence and KV head, or in total for grids
    that cut across them; then timed over all copies."""
    outs = [torch.empty(out_shape, device="cuda") for _ in sets]
    launch(sets[0][1], sets[0][2], outs[0])
    got, exp = (outs[0].sum(-1), want) if per_head else (outs[0].sum(), want.sum())
    ok = torch.allclose(got, exp, rtol=1e-3, atol=1.0 if per_head else 4.0)
    fns = [functools.partial(launch, s_[1], s_[2], o) for s_, o in zip(sets, outs)]
    record(case, "paged read", name, bk.bench_graph_steady(fns), nbytes, sums_ok=ok)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--cases", default=CASES, help="batch:context,... (decode, one query token)")
    ap.add_argument("--max-copy-bytes", type=float, default=4e9, help="bytes of copies per graph")
    ap.add_argument(
        "--kv-layout",
        choices=("nhd", "hnd"),
        default="nhd",
        help="cache memory layout (bench_kernels.py's option): hnd = each KV head's positions of "
        "a block contiguous (same logical shape)",
    )
    ap.add_argument(
        "--block-order",
        choices=("random", "sequential"),
        default="random",
        help="block tables (bench_kernels.py's option): sequential = every sequence's blocks in "
        "order, the memory layout of the gathered tensors",
    )
    ap.add_argument(
        "--splits",
        default="",
        help="extra split counts for paged_attention at batch > 1, e.g. 2,4,8",
    )
    args = ap.parse_args()
    try:
        cases = [tuple(int(x) for x in spec.split(":")) for spec in args.cases.split(",")]
        extra_splits = [int(x) for x in args.splits.split(",") if x]
    except ValueError:
        ap.error(
            f"--cases wants batch:context,... and --splits n,...; got {args.cases!r}, "
            f"{args.splits!r}"
        )
    if any(len(c) != 2 or min(c) < 1 for c in cases) or any(x < 1 for x in extra_splits):
        ap.error(
            f"--cases wants positive batch:context pairs and --splits positive counts; "
            f"got {args.cases!r}, {args.splits!r}"
        )
    if not torch.cuda.is_available():
        print("decode_limits.py needs a CUDA device")
        return 0
    import bench_kernels as bk
    from torch.nn.attention import SDPBackend, sdpa_kernel

    pa = bk.pa_mod
    bk.KV_LAYOUT = args.kv_layout
    bk.BLOCK_ORDER = args.block_order
    dev = torch.device("cuda")
    hbm = bk.hbm_bandwidth()
    sms = pa.num_sms(dev)
    rows: list[dict] = []

    def record(case, family, name, t_ms, nbytes, **extra):
        pct = 100 * nbytes / (t_ms * 1e-3) / 1e9 / hbm
        rows.append(
            dict(case=case, family=family, kernel=name, us=t_ms * 1e3, pct_copy_bw=pct, **extra)
        )
        print(f"   {case:>9} {family:<11} {name:<40} {t_ms * 1e3:9.1f} us {pct:6.1f}%", flush=True)

    for b, ctx in cases:
        case = f"{b}x{ctx}"
        nbytes = bk.kv_bytes(b, ctx)
        n = max(2, min(8, int(args.max_copy_bytes // nbytes)))
        print(f"== batch {b}, context {ctx}: {nbytes / 1e6:.1f} MB of K/V, {n} copies", flush=True)

        # ---- ours and the paged reads: n distinct caches, one block table -------------------
        q, kc, vc, bt, cl, qsl = bk.make_paged(b, ctx, 1)
        sets = bk.kv_copies(q, kc, vc, torch.empty_like(q), n)
        ref = pa.paged_attention_ref(q.float(), kc, vc, bt, cl, qsl, D**-0.5)  # fp32 math
        cfg = pa.choose_launch_config(
            num_tokens=b,
            num_seqs=b,
            num_heads=H,
            num_kv_heads=HKV,
            head_dim=D,
            max_query_len=1,
            max_context=bt.shape[1] * BS,
            dtype=q.dtype,
            sm_count=sms,
        )

        ours = dict(bk=bk, record=record, case=case, nbytes=nbytes, sets=sets, tables=(bt, cl, qsl))
        _time_ours(name="paged_attention (default)", ref=ref, **ours)
        # the best batch-1 setting of the earlier sweeps (docs/kernels.md):
        # block-table entries a chunk ahead, K/V double-buffered (3 stages), 16 splits
        best_b1 = {"bt_ahead": True, "block_n": 64, "num_stages": 3, "num_splits": 16}
        name = "paged_attention (bt_ahead, 3 stages, 16 splits)"
        _time_ours(name=name, ref=ref, overrides=best_b1, **ours)
        for sp in extra_splits if b > 1 else ():
            _time_ours(name=f"paged_attention ({sp} splits)", ref=ref, num_splits=sp, **ours)

        # the bare reads: exactly the sequences' K and V elements, summed per program
        idx = bt.long()
        kg = kc[idx].reshape(b, -1, HKV, D)[:, :ctx].float()
        vg = vc[idx].reshape(b, -1, HKV, D)[:, :ctx].float()
        gathered_sum = (kg + vg).sum(dim=(1, 3))  # [b, HKV]
        del kg, vg
        strides = (kc.stride(0), kc.stride(1), kc.stride(2), bt.stride(0))  # every copy's

        reads = dict(bk=bk, record=record, case=case, nbytes=nbytes, sets=sets, want=gathered_sum)

        for bn, cpp, nw, ns in PAGED_READS:
            if cpp is None:  # the attention kernel's tiles and split count
                bn = cfg["block_n"]
                cpp = math.ceil(math.ceil(ctx / bn) / cfg["num_splits"])
            parts = math.ceil(math.ceil(ctx / bn) / cpp)
            grid = (b, HKV, parts)
            meta = dict(BLOCK_N=bn, HEAD_DIM=D, BLOCK_SIZE=BS, num_warps=nw, num_stages=ns)

            args_ = (bt, ctx, cpp, *strides)  # after k, v; out goes between bt and ctx
            launch = functools.partial(_launch_read, _paged_read, grid, args_, meta)
            name = f"paged read {bn}x{cpp} w{nw} s{ns} ({b * HKV * parts} programs)"
            _time_read(name=name, launch=launch, out_shape=grid, per_head=True, **reads)
        for bn, pps, nw, ns in BALANCED_READS:
            progs = pps * sms
            n_ch = math.ceil(ctx / bn)
            meta = dict(
                NUM_KV_HEADS=HKV, BLOCK_N=bn, HEAD_DIM=D, BLOCK_SIZE=BS, num_warps=nw, num_stages=ns
            )

            args_ = (bt, ctx, n_ch, b * HKV * n_ch, *strides)
            launch = functools.partial(_launch_read, _balanced_read, (progs,), args_, meta)
            name = f"balanced read {bn} w{nw} s{ns} ({progs} programs)"
            _time_read(name=name, launch=launch, out_shape=(progs,), per_head=False, **reads)
        del sets, q, kc, vc, ref, gathered_sum
        torch.cuda.empty_cache()

        # ---- flat reads of as many contiguous bytes ------------------------------------------
        xs = [torch.randn(nbytes // 2, device=dev, dtype=torch.bfloat16) for _ in range(n)]
        for block, iters, nw, ns in FLAT_READS:
            progs = triton.cdiv(nbytes // 2, block * iters)
            outs = [torch.empty(progs, device=dev) for _ in xs]
            ffns = [
                (
                    lambda x=x, o=o, block=block, iters=iters, nw=nw, ns=ns, progs=progs: (
                        _flat_read[(progs,)](
                            x, o, x.numel(), BLOCK=block, ITERS=iters, num_warps=nw, num_stages=ns
                        )
                    )
                )
                for x, o in zip(xs, outs)
            ]
            name = f"flat read {block}x{iters} w{nw} s{ns} ({progs} programs)"
            record(case, "flat read", name, bk.bench_graph_steady(ffns), nbytes)
            del outs, ffns
        acc = [torch.empty(1, device=dev) for _ in xs]
        sfns = [
            (lambda x=x, a=a: torch.sum(x, dim=0, keepdim=True, dtype=torch.float32, out=a))
            for x, a in zip(xs, acc)
        ]
        record(case, "flat read", "torch.sum", bk.bench_graph_steady(sfns), nbytes)
        del xs, acc, sfns
        torch.cuda.empty_cache()

        # ---- SDPA on gathered contiguous K/V ---------------------------------------------------
        qs = [torch.randn(b, H, 1, D, device=dev, dtype=torch.bfloat16) for _ in range(n)]
        ks = [torch.randn(b, HKV, ctx, D, device=dev, dtype=torch.bfloat16) for _ in range(n)]
        vs = [torch.randn(b, HKV, ctx, D, device=dev, dtype=torch.bfloat16) for _ in range(n)]
        want = F.scaled_dot_product_attention(
            qs[0].float(), ks[0].float(), vs[0].float(), enable_gqa=True
        )
        for backend in SDPA_BACKENDS:
            backends = None if backend == "default" else [getattr(SDPBackend, backend)]

            def call(q, k, v, backends=backends):
                if backends is None:  # PyTorch's own choice
                    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                with sdpa_kernel(backends):
                    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

            try:
                got = call(qs[0], ks[0], vs[0])
                e = bk.rel_err(got, want)
                dfns = [(lambda q=q, k=k, v=v: call(q, k, v)) for q, k, v in zip(qs, ks, vs)]
                record(
                    case, "sdpa", f"sdpa:{backend}", bk.bench_graph_steady(dfns), nbytes, rel_err=e
                )
            except Exception as ex:  # noqa: BLE001  (a backend that refuses the shape)
                rows.append(
                    dict(case=case, family="sdpa", kernel=f"sdpa:{backend}", error=repr(ex)[:200])
                )
                print(f"   {case:>9} sdpa:{backend}: not available ({repr(ex)[:120]})")
        del qs, ks, vs, want
        torch.cuda.empty_cache()

    # ---- fixed cost + marginal bandwidth over the batch-1 contexts ------------------------------
    fits = {}
    b1 = [r for r in rows if r["case"].startswith("1x") and "us" in r]
    for fam in ("ours", "paged read", "flat read", "sdpa"):
        pts = {}
        for r in b1:
            if r["family"] != fam:
                continue
            ctx = int(r["case"].split("x")[1])
            if ctx not in pts or r["us"] < pts[ctx][1]:
                pts[ctx] = (bk.kv_bytes(1, ctx), r["us"])
        if len(pts) < 2:
            continue
        xs_ = torch.tensor([p[0] for p in pts.values()], dtype=torch.float64)
        ts_ = torch.tensor([p[1] for p in pts.values()], dtype=torch.float64)
        a = torch.stack([torch.ones_like(xs_), xs_], 1)
        sol = torch.linalg.lstsq(a, ts_[:, None]).solution[:, 0]
        fixed, per_byte = float(sol[0]), float(sol[1])
        fits[fam] = dict(
            fixed_us=fixed,
            # per_byte: us a byte, so 1e-3 / per_byte GB/s
            marginal_pct_copy_bw=100 * (1e-3 / per_byte) / hbm if per_byte > 0 else None,
            points={str(k): v[1] for k, v in sorted(pts.items())},
        )
        print(
            f"fit {fam:<11} (best of family per context): fixed {fixed:5.1f} us, marginal "
            f"{fits[fam]['marginal_pct_copy_bw']:.1f}% of copy bandwidth"
        )

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = dict(
        kv_layout=args.kv_layout,
        block_order=args.block_order,
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        copy_GBps=hbm,
        rows=rows,
        batch1_fits=fits,
    )
    name = "decode_limits"  # + the non-default options: decode_limits_hnd_sequential.json
    name += "" if args.kv_layout == "nhd" else f"_{args.kv_layout}"
    name += "" if args.block_order == "random" else f"_{args.block_order}"
    name += ".json"
    (out / name).write_text(json.dumps(res, indent=1))
    print(f"wrote {out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
