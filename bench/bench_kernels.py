"""GPU benchmark and large-shape checks for speculant.kernels.

Run on a CUDA machine (from the repository root, with ``speculant.kernels`` importable)::

    python bench/bench_kernels.py --out kernels.json

What it does:

1. HBM bandwidth: a large device-to-device copy (bytes read + bytes written) / median time.
2. Checks every kernel against its torch reference on large shapes.
3. Paged attention at Llama-3-8B geometry (32 q heads, 8 kv heads, head_dim 128, bf16, block
   16) for context 8k/16k/32k x batch 1/8/32/64 x q_len 1 (decode) and 6 (k=5 verification):
   median time (``triton.testing.do_bench``, L2 flushed before each run) of the eager call and
   of a CUDA-graph replay of it; achieved bandwidth = KV bytes read / time, as % of the copy
   bandwidth; and ``scaled_dot_product_attention`` on the same K/V gathered contiguous. Each
   is also timed after evicting L2 by a 256 MB *read* (``*_clean_l2``): do_bench's flush is a
   256 MB zero fill whose dirty lines are written back while the timed kernel reads, which
   weighs on the small (batch 1, ~30-70 us) cases. And in the steady state of the engine's
   decode CUDA graph (``*_graphN``): ``--graph-copies`` N (default 8) distinct KV caches (one
   per layer in the engine; one block table for all, as there), together larger than L2,
   attended one after another inside ONE captured graph; back-to-back replays timed with CUDA
   events, median / N. N shrinks where N copies would exceed 20 GB (at least 1: such a copy is
   far larger than L2). SDPA likewise, on N distinct gathered copies.
4. Launch-parameter sweep for decode / verification attention (``--sweep``: split counts,
   block_n / num_warps / num_stages / prefetch overrides and program order of the kernel;
   ``--sweep-cases b:ctx:q,...`` picks the shapes, ``--sweep-splits-only`` varies only the
   split count and the program order, ``--sweep-only`` skips everything else).
   ``--attention-only`` skips section 5.
5. Rejection sampling at batch 64, k 5, vocab 128256 (all-random, all-greedy, mixed, with and
   without draft probs), ``sample_from_probs``, and ``sampling_probs`` (torch vs Triton) on the
   same rows; ``store_kv``.

Writes everything to ``--out`` (JSON) and prints a short table at the end.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import platform
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from _checkout import use_checkout  # bench/, the script's folder
from _graph_timing import capture, replay_median_ms  # bench/

use_checkout()

import triton  # noqa: E402
import triton.testing  # noqa: E402

from speculant.kernels.kv_cache import store_kv, store_kv_ref  # noqa: E402
from speculant.kernels.paged_attention import paged_attention, paged_attention_ref  # noqa: E402
from speculant.kernels.rejection_sampling import (  # noqa: E402
    rejection_sample,
    rejection_sample_ref,
    sample_from_probs,
    sample_from_probs_ref,
)
from speculant.kernels.sampling import sampling_probs, sampling_probs_ref  # noqa: E402

pa_mod = importlib.import_module("speculant.kernels.paged_attention")  # module, not the fn

DEV = torch.device("cuda")
RESULTS: dict = {"errors": []}
# --smoke: tiny shapes on the CPU under the Triton interpreter, to check this script itself
SMOKE = False
VOCAB = 128256


def log(*a):
    print(*a, flush=True)


def bench(fn, rep=100, warmup=25) -> float:
    """Median ms, L2 flushed before each run (triton.testing.do_bench)."""
    if SMOKE:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def bench_graph(fn, rep=100) -> float:
    """Median ms of a CUDA-graph replay of ``fn`` (captured once after a warm-up call)."""
    if SMOKE:
        return bench(fn)
    return bench(capture(fn).replay, rep=rep)


def bench_graph_clean_l2(fn, rep=50) -> float:
    """Median ms of a CUDA-graph replay of ``fn`` after evicting L2 by READING 256 MB (no dirty
    lines left to write back, unlike do_bench's zero fill): the cold-cache time without the
    write-back of the flush buffer competing for HBM."""
    if SMOKE:
        return bench(fn)
    g = capture(fn)
    flush = torch.empty(64 << 20, dtype=torch.float32, device=DEV).normal_()
    # 1-element out with an explicit dim: torch.sum(x, out=<0-dim>) is rejected by torch 2.11
    acc = torch.empty(1, dtype=torch.float32, device=DEV)
    return replay_median_ms(g, rep, 5, before=lambda: torch.sum(flush, dim=0, keepdim=True, out=acc))


# steady-state timing (``*_graphN``): copies of the K/V per timed graph, and their byte budget
GRAPH_COPIES = 8
KV_LAYOUT = "nhd"  # --kv-layout
BLOCK_ORDER = "random"  # --block-order
STEADY_HEADS = (32, 8, 128)  # --steady-heads: query heads, KV heads, head dim of the steady sweep
TABLE_TOKENS = 0  # --table-tokens: block tables at least this wide (the engine's graph width)
GRAPH_COPIES_MAX_BYTES = 20e9


def graph_copies(nbytes: int) -> int:
    """Copies of ``nbytes`` of K/V for the steady-state timing: GRAPH_COPIES, fewer where they
    would exceed GRAPH_COPIES_MAX_BYTES or 80% of the free device memory (the first copy exists
    already; at least 1), 0 when switched off."""
    if GRAPH_COPIES <= 0:
        return 0
    n = min(GRAPH_COPIES, int(GRAPH_COPIES_MAX_BYTES // max(1, nbytes)))
    if not SMOKE:
        n = min(n, 1 + int(0.8 * torch.cuda.mem_get_info()[0] // max(1, nbytes)))
    return max(1, n)


def bench_graph_steady(fns, rep=30) -> float:
    """Steady-state ms per call: ONE CUDA graph runs every fn of ``fns`` one after another (each
    on its own memory, together larger than L2, like the layers of the engine's decode graph);
    back-to-back replays (no L2 flush) timed with CUDA events, median replay / len(fns)."""
    if SMOKE:  # the plain timing, as the other timers (every fn runs once)
        t = time.perf_counter()
        for f in fns:
            f()
        return (time.perf_counter() - t) * 1e3 / len(fns)

    def run_all():
        for f in fns:
            f()

    g = capture(run_all)
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(1 << 21)  # ~1 ms of GPU work: the replays queue up behind it
    t = replay_median_ms(g, rep, 3)
    del g
    return t / len(fns)


OUT_PATH: Path | None = None


def save() -> None:
    """Write RESULTS so far (after every section: a run cut off keeps what it measured)."""
    if OUT_PATH is not None:
        OUT_PATH.parent.mkdir(parents=True, exist_ok=True)
        OUT_PATH.write_text(json.dumps(RESULTS, indent=1))


def section(name):
    def deco(f):
        def run(*a, **kw):
            t0 = time.time()
            log(f"== {name}")
            try:
                return f(*a, **kw)
            except Exception as e:  # keep going: one broken section must not lose the rest
                tb = traceback.format_exc()
                log(tb)
                RESULTS["errors"].append({"section": name, "error": repr(e), "trace": tb[-3000:]})
                if not SMOKE:
                    torch.cuda.synchronize()
            finally:
                log(f"   ({time.time() - t0:.1f}s)")
                save()

        return run

    return deco


# ---------------------------------------------------------------------------------------------
@section("hbm bandwidth")
def hbm_bandwidth():
    n = 1 << (20 if SMOKE else 30)  # 1 GiB each way
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), rep=200)
    gbps = 2 * n / (ms * 1e-3) / 1e9
    RESULTS["hbm_copy"] = {"bytes_each_way": n, "ms": ms, "GBps": gbps}
    log(f"   copy 1 GiB: {ms:.3f} ms -> {gbps:.0f} GB/s (read + write)")
    # read-only stream for context (attention mostly reads): sum of 2 GiB of bf16
    x = torch.randn(n, dtype=torch.bfloat16, device=DEV)
    ms_r = bench(lambda: x.sum(dtype=torch.float32), rep=200)
    RESULTS["hbm_read"] = {"bytes": 2 * n, "ms": ms_r, "GBps": 2 * n / (ms_r * 1e-3) / 1e9}
    log(f"   read 2 GiB (sum): {ms_r:.3f} ms -> {RESULTS['hbm_read']['GBps']:.0f} GB/s")
    return gbps


# ---------------------------------------------------------------------------------------------
def make_paged(batch, ctx, q_len, H=32, Hkv=8, D=128, bs=16, dtype=torch.bfloat16, extra_blocks=0):
    blocks_per = math.ceil(ctx / bs)
    nb = batch * blocks_per + extra_blocks
    if KV_LAYOUT == "hnd":  # each KV head's positions of a block contiguous; same logical shape
        kc = torch.randn(nb, Hkv, bs, D, device=DEV, dtype=dtype).permute(0, 2, 1, 3)
        vc = torch.randn(nb, Hkv, bs, D, device=DEV, dtype=dtype).permute(0, 2, 1, 3)
    else:
        kc = torch.randn(nb, bs, Hkv, D, device=DEV, dtype=dtype)
        vc = torch.randn(nb, bs, Hkv, D, device=DEV, dtype=dtype)
    if BLOCK_ORDER == "sequential":  # each sequence's blocks in order: SDPA's gathered layout
        perm = torch.arange(batch * blocks_per, device=DEV, dtype=torch.int32)
    else:
        perm = torch.randperm(nb, device=DEV)[: batch * blocks_per].to(torch.int32)
    bt = perm.view(batch, blocks_per)
    if TABLE_TOKENS > blocks_per * bs:  # a wider table (entries past the context are not read)
        pad = torch.zeros(batch, math.ceil(TABLE_TOKENS / bs) - blocks_per, dtype=torch.int32, device=DEV)
        bt = torch.cat([bt, pad], dim=1)
    cl = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEV) * q_len
    q = torch.randn(batch * q_len, H, D, device=DEV, dtype=dtype)
    return q, kc, vc, bt, cl, qsl


def rel_err(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


@section("checks vs references (large shapes)")
def checks():
    out = {}
    # paged attention: mixed prefill / decode / verification, GQA 4, bf16 and fp16, long ctx
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        q_lens = [1, 6, 300, 1, 6, 0, 1]
        ctxs = [8000, 4100, 1000, 17, 32768, 50, 1]
        if SMOKE:
            q_lens, ctxs = [1, 6, 20, 0], [300, 41, 20, 5]
        bs, H, Hkv, D = 16, 32, 8, 128
        per = [math.ceil(c / bs) for c in ctxs]
        nb = sum(per) + 7
        kc = torch.randn(nb, bs, Hkv, D, device=DEV).to(dtype)
        vc = torch.randn(nb, bs, Hkv, D, device=DEV).to(dtype)
        perm = torch.randperm(nb, device=DEV)
        bt = torch.zeros(len(ctxs), max(per), dtype=torch.int32, device=DEV)
        o = 0
        for i, n in enumerate(per):
            bt[i, :n] = perm[o : o + n]
            o += n
        qsl = torch.tensor(
            [0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=DEV
        )
        cl = torch.tensor(ctxs, dtype=torch.int32, device=DEV)
        q = torch.randn(int(qsl[-1]), H, D, device=DEV).to(dtype)
        ref = paged_attention_ref(q, kc, vc, bt, cl, qsl, D**-0.5)
        for splits in (None, 1, 7):
            res = torch.full_like(q, float("nan"))
            paged_attention(
                q, kc, vc, bt, cl, qsl, D**-0.5, max_query_len=300, out=res, num_splits=splits
            )
            key = f"paged_attention_{str(dtype)[6:]}_splits{splits}"
            out[key] = {"rel_err": rel_err(res, ref), "nan": bool(res.isnan().any())}
    # head_dim 64, GQA 1 and 8, block size 32
    for H, Hkv, D, bs in ((16, 16, 64, 32), (32, 4, 64, 16), (8, 1, 256, 16)):
        q, kc, vc, bt, cl, qsl = make_paged(3, 50 if SMOKE else 5000, 6, H=H, Hkv=Hkv, D=D, bs=bs)
        ref = paged_attention_ref(q, kc, vc, bt, cl, qsl, D**-0.5)
        res = paged_attention(q, kc, vc, bt, cl, qsl, D**-0.5)
        out[f"paged_attention_H{H}_Hkv{Hkv}_D{D}_bs{bs}"] = {"rel_err": rel_err(res, ref)}
    # store_kv
    n_tok = 64 if SMOKE else 4096
    k = torch.randn(n_tok, 8, 128, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    kc = torch.full((1024, 16, 8, 128), float("nan"), device=DEV, dtype=torch.bfloat16)
    vc = kc.clone()
    kr, vr = kc.clone(), vc.clone()
    slots = torch.randperm(1024 * 16, device=DEV)[:n_tok]
    slots[::97] = -1
    store_kv(k, v, kc, vc, slots)
    store_kv_ref(k, v, kr, vr, slots)
    out["store_kv"] = {
        "exact": bool(
            torch.equal(kc.nan_to_num(), kr.nan_to_num())
            and torch.equal(vc.nan_to_num(), vr.nan_to_num())
            and torch.equal(kc.isnan(), kr.isnan())
        )
    }
    # rejection sampling: exact equality on big vocab, random & greedy mixed, both draft kinds
    for with_q in (True, False):
        args = rejection_inputs(
            4 if SMOKE else 64, 5, VOCAB, with_q=with_q, greedy_frac=0.5, ragged=True
        )
        o1, n1 = rejection_sample(*args, max_num_draft_tokens=5)
        o2, n2 = rejection_sample_ref(*args, max_num_draft_tokens=5)
        out[f"rejection_sample_q{with_q}"] = {
            "exact": bool(torch.equal(o1, o2) and torch.equal(n1, n2)),
            "mean_accepted": float((n1 - 1).float().mean()),
        }
    probs = torch.softmax(torch.randn(384, VOCAB, device=DEV) * 3, -1)
    u = torch.rand(384, device=DEV)
    out["sample_from_probs"] = {
        "exact": bool(torch.equal(sample_from_probs(probs, u), sample_from_probs_ref(probs, u)))
    }
    # sampling_probs: Triton vs torch
    logits, temp, tk, tp, mp = sampling_inputs(8 if SMOKE else 384, VOCAB, "mixed")
    a = sampling_probs(logits, temp, tk, tp, mp, impl="triton")
    b = sampling_probs_ref(logits, temp, tk, tp, mp)
    out["sampling_probs"] = {
        "max_abs_diff": float((a - b).abs().max()),
        "support_mismatch_frac": float(((a > 0) != (b > 0)).float().mean()),
        "rows_with_support_mismatch": int(((a > 0) != (b > 0)).any(1).sum()),
    }
    RESULTS["checks"] = out
    for k_, v_ in out.items():
        log(f"   {k_}: {v_}")


# ---------------------------------------------------------------------------------------------
def kv_bytes(batch, ctx, Hkv=8, D=128, elem=2):
    return batch * ctx * Hkv * D * 2 * elem


@section("paged attention (Llama-3-8B heads, bf16, block 16)")
def attention_bench(hbm_gbps, contexts, batches, q_lens, with_sdpa=True):
    rows = []
    free = 1e12 if SMOKE else torch.cuda.mem_get_info()[0]
    for ctx in contexts:
        for batch in batches:
            for q_len in q_lens:
                need = kv_bytes(batch, ctx) * (2.2 if with_sdpa else 1.1)
                if need > 0.8 * free:
                    log(f"   skip ctx={ctx} batch={batch}: needs {need / 1e9:.1f} GB")
                    continue
                q, kc, vc, bt, cl, qsl = make_paged(batch, ctx, q_len)
                out = torch.empty_like(q)
                scale = 128**-0.5

                def fn(q=q, kc=kc, vc=vc, bt=bt, cl=cl, qsl=qsl, out=out, q_len=q_len, scale=scale):
                    paged_attention(q, kc, vc, bt, cl, qsl, scale, max_query_len=q_len, out=out)

                fn()
                cfg = pa_mod.choose_launch_config(
                    num_tokens=q.shape[0],
                    num_seqs=batch,
                    num_heads=32,
                    num_kv_heads=8,
                    head_dim=128,
                    max_query_len=q_len,
                    max_context=bt.shape[1] * 16,
                    dtype=q.dtype,
                    sm_count=pa_mod.num_sms(DEV),
                )
                t_eager = bench(fn)
                t_graph = bench_graph(fn)
                try:
                    t_clean = bench_graph_clean_l2(fn)
                except Exception as e:  # noqa: BLE001
                    log(f"   clean-L2 timing failed: {e!r}"[:300])
                    t_clean = float("nan")
                nbytes = kv_bytes(batch, ctx)
                n_copies = graph_copies(nbytes)
                t_steady = float("nan")
                if n_copies:
                    try:
                        t_steady = paged_graphn(q, kc, vc, bt, cl, qsl, q_len, scale, out, n_copies)
                    except Exception as e:  # noqa: BLE001
                        log(f"   graphN timing failed: {e!r}"[:300])
                    if not SMOKE:
                        torch.cuda.empty_cache()
                row = {
                    "ctx": ctx,
                    "batch": batch,
                    "q_len": q_len,
                    "kv_bytes": nbytes,
                    "num_splits": cfg["num_splits"],
                    "block_q": cfg["block_q"],
                    "block_n": cfg["block_n"],
                    "num_warps": cfg["num_warps"],
                    "num_stages": cfg["num_stages"],
                    "prefetch": cfg["prefetch"],
                    "ms_eager": t_eager,
                    "ms_graph": t_graph,
                    "ms_graph_clean_l2": t_clean,
                    "pct_hbm_graph_clean_l2": 100 * nbytes / (t_clean * 1e-3) / 1e9 / hbm_gbps,
                    "graphN_copies": n_copies,
                    "ms_graphN": t_steady,
                    "pct_hbm_graphN": 100 * nbytes / (t_steady * 1e-3) / 1e9 / hbm_gbps,
                    "GBps_graph": nbytes / (t_graph * 1e-3) / 1e9,
                    "pct_hbm_graph": 100 * nbytes / (t_graph * 1e-3) / 1e9 / hbm_gbps,
                    "pct_hbm_eager": 100 * nbytes / (t_eager * 1e-3) / 1e9 / hbm_gbps,
                }
                if with_sdpa:
                    try:
                        row.update(
                            sdpa_bench(q, kc, vc, bt, batch, ctx, q_len, scale, out, hbm_gbps)
                        )
                        row["vs_sdpa"] = row["sdpa_ms"] / t_graph
                        if "sdpa_ms_graphN" in row:
                            row["vs_sdpa_graphN"] = row["sdpa_ms_graphN"] / t_steady
                    except Exception as e:  # noqa: BLE001
                        row["sdpa_error"] = repr(e)[:300]
                rows.append(row)
                log(
                    f"   ctx={ctx:6d} b={batch:3d} q={q_len} splits={cfg['num_splits']:2d} "
                    f"graph {t_graph * 1e3:8.1f} us ({row['pct_hbm_graph']:5.1f}% hbm) "
                    f"cleanL2 {t_clean * 1e3:8.1f} us "
                    f"sdpa-cleanL2 {row.get('sdpa_ms_clean_l2', float('nan')) * 1e3:8.1f} us "
                    f"graph{n_copies} {t_steady * 1e3:8.1f} us "
                    f"sdpa-graph{n_copies} {row.get('sdpa_ms_graphN', float('nan')) * 1e3:8.1f} us "
                    f"eager {t_eager * 1e3:8.1f} us  sdpa {row.get('sdpa_ms', float('nan')) * 1e3:8.1f}"
                    f" us  err {row.get('rel_err_vs_sdpa', float('nan')):.1e}"
                )
                del q, kc, vc, bt, out
                torch.cuda.empty_cache()
    RESULTS.setdefault("attention", []).extend(rows)


def kv_copies(q, kc, vc, out, n) -> list[tuple]:
    """(q, k_cache, v_cache, out) and ``n - 1`` distinct random copies of them: the inputs of a
    steady-state (graphN) timing."""
    sets = [(q, kc, vc, out)]
    for _ in range(n - 1):
        sets.append(
            (torch.randn_like(q), torch.randn_like(kc), torch.randn_like(vc), torch.empty_like(out))
        )
    return sets


def paged_graphn(q, kc, vc, bt, cl, qsl, q_len, scale, out, n):
    """Steady-state ms of one paged_attention call: ``n`` distinct K/V caches (plus q / out)
    sharing one block table, as the layers of the engine's decode graph, in one CUDA graph."""
    sets = kv_copies(q, kc, vc, out, n)
    fns = []
    for q_, kc_, vc_, out_ in sets:

        def fn(q=q_, kc=kc_, vc=vc_, out=out_):
            paged_attention(q, kc, vc, bt, cl, qsl, scale, max_query_len=q_len, out=out)

        fns.append(fn)
    try:
        return bench_graph_steady(fns)
    finally:
        del sets, fns


def sdpa_bench(q, kc, vc, bt, batch, ctx, q_len, scale, out, hbm_gbps):
    H, D = q.shape[1], q.shape[2]
    Hkv = kc.shape[2]
    # gather to contiguous [B, Hkv, ctx, D]
    kd = kc[bt.long()].reshape(batch, -1, Hkv, D)[:, :ctx].transpose(1, 2).contiguous()
    vd = vc[bt.long()].reshape(batch, -1, Hkv, D)[:, :ctx].transpose(1, 2).contiguous()
    qd = q.view(batch, q_len, H, D).transpose(1, 2)  # [B, H, q_len, D]
    mask = None
    if q_len > 1:
        qpos = torch.arange(q_len, device=DEV) + ctx - q_len
        mask = torch.arange(ctx, device=DEV)[None, :] <= qpos[:, None]
    try:
        F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale, enable_gqa=True)

        def sfn():
            return F.scaled_dot_product_attention(
                qd, kd, vd, attn_mask=mask, scale=scale, enable_gqa=True
            )

        mode = "enable_gqa"
    except Exception:  # noqa: BLE001
        kx = kd.repeat_interleave(H // Hkv, 1)
        vx = vd.repeat_interleave(H // Hkv, 1)

        def sfn():
            return F.scaled_dot_product_attention(qd, kx, vx, attn_mask=mask, scale=scale)

        mode = "expanded"
    ref = sfn().transpose(1, 2).reshape(-1, H, D)
    t = bench(sfn)
    nbytes = kv_bytes(batch, ctx)
    res = {
        "sdpa_ms": t,
        "sdpa_mode": mode,
        "sdpa_pct_hbm": 100 * nbytes / (t * 1e-3) / 1e9 / hbm_gbps,
        "rel_err_vs_sdpa": rel_err(out, ref),
    }
    try:
        res["sdpa_ms_clean_l2"] = bench_graph_clean_l2(sfn)
    except Exception as e:  # noqa: BLE001
        res["sdpa_clean_l2_error"] = repr(e)[:200]
    n = graph_copies(nbytes)
    if n and mode == "enable_gqa":
        # steady state, as paged_graphn: n distinct gathered copies in one graph
        sets, fns = [(qd, kd, vd)], []
        try:
            for _ in range(n - 1):
                sets.append((torch.randn_like(qd), torch.randn_like(kd), torch.randn_like(vd)))
            for q_, k_, v_ in sets:

                def sfn_n(q=q_, k=k_, v=v_):
                    return F.scaled_dot_product_attention(
                        q, k, v, attn_mask=mask, scale=scale, enable_gqa=True
                    )

                fns.append(sfn_n)
            t_n = bench_graph_steady(fns)
            res["sdpa_graphN_copies"] = n
            res["sdpa_ms_graphN"] = t_n
            res["sdpa_pct_hbm_graphN"] = 100 * nbytes / (t_n * 1e-3) / 1e9 / hbm_gbps
        except Exception as e:  # noqa: BLE001
            res["sdpa_graphN_error"] = repr(e)[:200]
        finally:
            del sets, fns
            if not SMOKE:
                torch.cuda.empty_cache()
    elif n:
        res["sdpa_graphN_error"] = "needs enable_gqa (torch >= 2.5)"
    return res


@section("decode attention launch sweep")
def attention_sweep(hbm_gbps, cases=None, splits_only=False):
    rows = []
    cases = cases or [
        (1, 8192, 1),
        (1, 32768, 1),
        (4, 16384, 1),
        (8, 8192, 1),
        (64, 32768, 1),
        (1, 8192, 6),
        (1, 32768, 6),
        (8, 8192, 6),
        (8, 32768, 6),
        (32, 8192, 6),
        (64, 16384, 6),
    ]
    if SMOKE:
        cases = [(1, 300, 1), (2, 100, 6)]
    for batch, ctx, q_len in cases:
        q, kc, vc, bt, cl, qsl = make_paged(batch, ctx, q_len)
        out = torch.empty_like(q)
        nbytes = kv_bytes(batch, ctx)
        best = None
        variants = []
        for bn in (64, 128):
            for nw in (4, 8):
                for ns in (2, 3):
                    for pf in (False, True):
                        variants.append(
                            {"block_n": bn, "num_warps": nw, "num_stages": ns, "prefetch": pf}
                        )
        if SMOKE or splits_only:
            variants = variants[:2] if SMOKE else []
        for splits in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96):
            for pf in (False,) if splits_only else (False, True):
                variants.append({"num_splits": splits, "prefetch": pf})
        # program order, at the default split count and at its neighbours
        for hf in (False, True):
            variants.append({"heads_first": hf})
            for f in (0.5, 2.0):
                cfg = pa_mod.choose_launch_config(
                    num_tokens=q.shape[0],
                    num_seqs=batch,
                    num_heads=32,
                    num_kv_heads=8,
                    head_dim=128,
                    max_query_len=q_len,
                    max_context=bt.shape[1] * 16,
                    dtype=q.dtype,
                    sm_count=pa_mod.num_sms(DEV),
                )
                variants.append(
                    {"heads_first": hf, "num_splits": max(1, round(cfg["num_splits"] * f))}
                )
        for ov in variants:

            def fn(ov=ov, q=q, kc=kc, vc=vc, bt=bt, cl=cl, qsl=qsl, q_len=q_len, out=out):
                pa_mod._paged_attention_triton(
                    q, kc, vc, bt, cl, qsl, 128**-0.5, q_len, out, overrides=ov
                )

            try:
                fn()
                t = bench_graph(fn, rep=30)
            except Exception as e:  # noqa: BLE001
                rows.append(
                    {"batch": batch, "ctx": ctx, "q_len": q_len, **ov, "error": repr(e)[:200]}
                )
                continue
            pct = 100 * nbytes / (t * 1e-3) / 1e9 / hbm_gbps
            rows.append(
                {"batch": batch, "ctx": ctx, "q_len": q_len, **ov, "ms_graph": t, "pct_hbm": pct}
            )
            if best is None or t < best[0]:
                best = (t, ov, pct)
        if best is None:
            log(f"   b={batch} ctx={ctx} q={q_len}: every variant failed: {rows[-1]}")
        else:
            log(
                f"   b={batch} ctx={ctx} q={q_len}: best {best[1]} {best[0] * 1e3:.1f} us "
                f"({best[2]:.1f}%)"
            )
        del q, kc, vc, bt, out
        torch.cuda.empty_cache()
    RESULTS["attention_sweep"] = rows


@section("decode attention steady-state sweep (graphN)")
def attention_steady_sweep(hbm_gbps, cases, variants):
    """Each override set of ``variants`` on each case, timed as the ``graphN`` column: N
    distinct K/V copies in one CUDA graph (launched with PDL where the device has it), so the
    kernels run back to back as the layers of a decode step do."""
    rows = []
    H, Hkv, D = STEADY_HEADS
    for batch, ctx, q_len in cases:
        q, kc, vc, bt, cl, qsl = make_paged(batch, ctx, q_len, H=H, Hkv=Hkv, D=D)
        nbytes = kv_bytes(batch, ctx, Hkv=Hkv, D=D)
        n = graph_copies(nbytes)
        sets = kv_copies(q, kc, vc, torch.empty_like(q), n)
        ref = None
        for ov in variants:
            if "programs_per_sm" in ov:  # a split count from a programs-per-SM target
                ov = dict(ov)
                pps = ov.pop("programs_per_sm")
                cfg = pa_mod.choose_launch_config(
                    num_tokens=batch * q_len, num_seqs=batch, num_heads=H, num_kv_heads=Hkv,
                    head_dim=D, max_query_len=q_len, max_context=bt.shape[1] * 16,
                    dtype=q.dtype, sm_count=pa_mod.num_sms(DEV),
                )
                bn = ov.get("block_n", cfg["block_n"])
                progs = batch * -(-q_len // cfg["block_q"]) * Hkv
                want = round(pps * pa_mod.num_sms(DEV) / progs)
                ov["num_splits"] = max(1, min(64, -(-bt.shape[1] * 16 // bn), want))
            fns = []
            for q_, kc_, vc_, out_ in sets:

                def fn(ov=ov, q=q_, kc=kc_, vc=vc_, out=out_, bt=bt, cl=cl, qsl=qsl, ql=q_len):
                    pa_mod._paged_attention_triton(
                        q, kc, vc, bt, cl, qsl, D**-0.5, ql, out, overrides=ov
                    )

                fns.append(fn)
            try:
                fns[0]()
                if ref is None:
                    ref = sets[0][3].clone()
                err = rel_err(sets[0][3], ref)
                t = bench_graph_steady(fns)
            except Exception as e:  # noqa: BLE001
                rows.append({"batch": batch, "ctx": ctx, "q_len": q_len, **ov, "error": repr(e)[:200]})
                log(f"   b={batch} ctx={ctx} q={q_len} {ov}: failed {e!r}"[:300])
                continue
            pct = 100 * nbytes / (t * 1e-3) / 1e9 / hbm_gbps
            rows.append(
                {
                    "batch": batch,
                    "ctx": ctx,
                    "q_len": q_len,
                    **ov,
                    "copies": n,
                    "ms_graphN": t,
                    "pct_hbm": pct,
                    "rel_diff_vs_first": err,
                }
            )
            log(f"   b={batch:2d} ctx={ctx:5d} q={q_len} {t * 1e3:7.1f} us {pct:5.1f}%  {ov}")
        del sets, q, kc, vc, bt
        torch.cuda.empty_cache()
    RESULTS.setdefault("attention_steady_sweep", []).extend(rows)


def steady_sweep_variants(names: str) -> list[dict]:
    """Override sets for ``--steady-sweep``: the default launch config, plus 'splits' (split
    counts) and/or 'tiles' (block_n x num_warps x num_stages) or 'all'; 'deep': 5-6 stages,
    the first counts at which Triton's pipeliner double-buffers the K/V tiles (it gives the
    block-table load a stage of its own, and below 5 stages keeps one K/V buffer)."""
    out = [{}]
    want = set(names.split(","))
    if want & {"splits", "all"}:
        out += [{"num_splits": sp} for sp in (16, 24, 32, 64, 96)]
    if "fewsplits" in want:  # wide batches: no split (no merge kernel) against a few
        out += [{"num_splits": sp} for sp in (1, 2, 3, 4)]
        out.append({})
    if "short" in want:  # short contexts (a draft model's): split counts x 16-64-token chunks
        for sp in (1, 2, 4, 8, 16):
            for bn in (16, 32, 64):
                for nw in (2, 4):
                    out.append({"num_splits": sp, "block_n": bn, "num_warps": nw})
    if "deep" in want:  # K/V double-buffered in shared memory: the index load takes a stage
        for bn in (32, 64, 128):
            for nw in (4, 8):
                for ns in (5, 6):
                    out.append({"block_n": bn, "num_warps": nw, "num_stages": ns})
        out += [{"block_n": 64, "num_stages": 5, "num_splits": sp} for sp in (16, 24, 32, 64)]
        out.append({})  # the default again, timed last: the run's drift
    if "pps" in want:  # programs per SM x stages, 64-token chunks
        for pps in (1, 2, 3):
            for ns in (2, 5):
                out.append({"block_n": 64, "num_warps": 4, "num_stages": ns, "programs_per_sm": pps})
        out.append({})
    if "deepsplits" in want:  # few long splits (about one program per SM), deep pipelines
        for sp in (8, 12, 16, 20, 32):
            for bn, nw, ns in ((64, 4, 5), (64, 4, 7), (64, 8, 7), (128, 8, 5), (32, 4, 8)):
                out.append({"block_n": bn, "num_warps": nw, "num_stages": ns, "num_splits": sp})
        out.append({})
    if "ahead" in want:  # block-table entries a chunk ahead: K/V double-buffered from 3 stages
        for bn, nw, ns in ((32, 4, 3), (32, 4, 4), (32, 2, 3), (64, 4, 3), (64, 8, 3), (64, 4, 4)):
            out.append({"bt_ahead": True, "block_n": bn, "num_warps": nw, "num_stages": ns})
        for pps in (1, 2):
            for bn, ns in ((32, 3), (64, 3)):
                out.append({"bt_ahead": True, "block_n": bn, "num_stages": ns, "programs_per_sm": pps})
        out.append({"bt_ahead": True})  # the default tiles (2 stages: one K/V buffer either way)
        out.append({})
    if want & {"tiles", "all"}:
        for bn in (32, 64, 128):
            for nw in (2, 4, 8):
                for ns in (2, 3, 4):
                    if (bn, nw, ns) != (64, 4, 2):
                        out.append({"block_n": bn, "num_warps": nw, "num_stages": ns})
    return out


# ---------------------------------------------------------------------------------------------
def rejection_inputs(B, k, V, with_q=True, greedy_frac=0.0, ragged=False, agree=0.7):
    nd = torch.full((B,), k, dtype=torch.int32, device=DEV)
    if ragged:
        nd = torch.randint(0, k + 1, (B,), dtype=torch.int32, device=DEV)
        nd[0] = k
    T = int(nd.sum())
    tp = torch.softmax(torch.randn(T + B, V, device=DEV) * 4, -1)
    dp = torch.softmax(torch.randn(T, V, device=DEV) * 4, -1) if with_q else None
    req = torch.repeat_interleave(torch.arange(B, device=DEV), nd.long())
    am = tp[torch.arange(T, device=DEV) + req].argmax(-1)
    x = torch.where(torch.rand(T, device=DEV) < agree, am, torch.randint(0, V, (T,), device=DEV))
    greedy = torch.rand(B, device=DEV) < greedy_frac
    return (x, nd, dp, tp, greedy, torch.rand(T, device=DEV), torch.rand(B, device=DEV))


@section("rejection sampling (batch 64, k 5, vocab 128256)")
def rejection_bench():
    rows = []
    B, k, V = (4 if SMOKE else 64), 5, VOCAB
    for name, with_q, gf in (
        ("random+draft_probs", True, 0.0),
        ("random point-mass", False, 0.0),
        ("greedy", False, 1.0),
        ("mixed 50% greedy", True, 0.5),
    ):
        args = rejection_inputs(B, k, V, with_q=with_q, greedy_frac=gf)

        def fn(args=args):
            return rejection_sample(*args, max_num_draft_tokens=k)

        fn()
        t_e = bench(fn)
        t_g = bench_graph(fn)
        rows.append({"case": name, "ms_eager": t_e, "ms_graph": t_g})
        log(f"   {name:22s} graph {t_g * 1e3:7.1f} us  eager {t_e * 1e3:7.1f} us")
    probs = torch.softmax(torch.randn(B, V, device=DEV), -1)
    u = torch.rand(B, device=DEV)
    t_g = bench_graph(lambda: sample_from_probs(probs, u))
    t_m = bench(lambda: torch.multinomial(probs, 1))
    rows.append({"case": "sample_from_probs 64 rows", "ms_graph": t_g, "torch_multinomial_ms": t_m})
    log(
        f"   sample_from_probs(64 rows) graph {t_g * 1e3:7.1f} us (torch.multinomial "
        f"{t_m * 1e3:.1f} us)"
    )
    RESULTS["rejection"] = rows


def sampling_inputs(rows, V, case):
    logits = (torch.randn(rows, V, device=DEV) * 3).to(torch.bfloat16)
    temp = torch.full((rows,), 0.8, device=DEV)
    tk = torch.zeros(rows, dtype=torch.int32, device=DEV)
    tp = torch.ones(rows, device=DEV)
    mp = torch.zeros(rows, device=DEV)
    if case == "top_p":
        tp.fill_(0.9)
    elif case == "top_k":
        tk.fill_(50)
    elif case == "top_k+top_p":
        tk.fill_(50)
        tp.fill_(0.9)
    elif case == "mixed":
        idx = torch.arange(rows, device=DEV)
        temp[idx % 4 == 0] = 0.0
        tk[idx % 3 == 1] = 40
        tp[idx % 2 == 1] = 0.92
        mp[idx % 5 == 2] = 0.05
    return logits, temp, tk, tp, mp


@section("sampling_probs (torch vs triton)")
def sampling_bench():
    rows = []
    V = VOCAB
    for nrows in (4, 8) if SMOKE else (64, 384):
        for case in ("temperature", "top_p", "top_k", "top_k+top_p", "mixed"):
            args = sampling_inputs(nrows, V, case)
            r = {"rows": nrows, "case": case}
            for impl in ("torch", "triton"):

                def fn(impl=impl, args=args):
                    return sampling_probs(*args, impl=impl)

                fn()
                r[f"{impl}_ms"] = bench(fn)
                try:
                    r[f"{impl}_graph_ms"] = bench_graph(fn)
                except Exception as e:  # noqa: BLE001
                    r[f"{impl}_graph_error"] = repr(e)[:200]
            rows.append(r)
            log(
                f"   rows={nrows:3d} {case:12s} torch {r['torch_ms'] * 1e3:8.1f} us  "
                f"triton {r['triton_ms'] * 1e3:8.1f} us"
            )
    RESULTS["sampling"] = rows


@section("store_kv")
def store_kv_bench(hbm_gbps):
    rows = []
    nb = 64 if SMOKE else 65536
    for n in (64, 8192):
        n = min(n, nb * 16)
        k = torch.randn(n, 8, 128, device=DEV, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        kc = torch.randn(nb, 16, 8, 128, device=DEV, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        slots = torch.randperm(nb * 16, device=DEV)[:n]
        t = bench_graph(lambda k=k, v=v, kc=kc, vc=vc, slots=slots: store_kv(k, v, kc, vc, slots))
        nbytes = 2 * 2 * k.numel() * 2
        rows.append({"tokens": n, "ms_graph": t, "GBps": nbytes / (t * 1e-3) / 1e9})
        log(f"   tokens={n:5d} graph {t * 1e3:7.1f} us  {rows[-1]['GBps']:.0f} GB/s")
    RESULTS["store_kv"] = rows


# ---------------------------------------------------------------------------------------------
def summary(hbm):
    log("\n================ summary ================")
    log(f"device: {RESULTS['device']}   HBM copy: {hbm:.0f} GB/s")
    log("paged attention (bf16, H=32, Hkv=8, D=128, block 16); us = CUDA-graph replay median")
    log(
        "cleanL2: replay after a 256 MB read flush; graphN: steady state, N distinct KV copies "
        "in one graph (N = column N), per copy"
    )
    nan = float("nan")
    log(
        f"{'ctx':>6} {'batch':>5} {'q':>2} {'splits':>6} {'us':>8} {'%hbm':>6} "
        f"{'eager us':>9} {'sdpa us':>8} {'sdpa %':>6} {'vs sdpa':>7} {'cleanL2':>8} "
        f"{'%hbm':>6} {'sdpa cL2':>8} {'N':>2} {'graphN us':>9} {'%hbm graphN':>11} "
        f"{'sdpa graphN us':>14}"
    )
    for r in RESULTS.get("attention", []):
        log(
            f"{r['ctx']:>6} {r['batch']:>5} {r['q_len']:>2} {r['num_splits']:>6} "
            f"{r['ms_graph'] * 1e3:>8.1f} {r['pct_hbm_graph']:>6.1f} {r['ms_eager'] * 1e3:>9.1f} "
            f"{r.get('sdpa_ms', nan) * 1e3:>8.1f} {r.get('sdpa_pct_hbm', nan):>6.1f} "
            f"{r.get('vs_sdpa', nan):>7.3f} {r.get('ms_graph_clean_l2', nan) * 1e3:>8.1f} "
            f"{r.get('pct_hbm_graph_clean_l2', nan):>6.1f} "
            f"{r.get('sdpa_ms_clean_l2', nan) * 1e3:>8.1f} {r.get('graphN_copies', 0):>2} "
            f"{r.get('ms_graphN', nan) * 1e3:>9.1f} {r.get('pct_hbm_graphN', nan):>11.1f} "
            f"{r.get('sdpa_ms_graphN', nan) * 1e3:>14.1f}"
        )
    for r in RESULTS.get("rejection", []):
        log(f"rejection {r['case']:26s} graph {r['ms_graph'] * 1e3:7.1f} us")
    for r in RESULTS.get("sampling", []):
        log(
            f"sampling_probs rows={r['rows']:3d} {r['case']:12s} torch {r['torch_ms'] * 1e3:8.1f} us"
            f"  triton {r['triton_ms'] * 1e3:8.1f} us"
        )
    for r in RESULTS.get("store_kv", []):
        log(f"store_kv tokens={r['tokens']:5d} {r['ms_graph'] * 1e3:7.1f} us")
    bad = {
        k: v
        for k, v in RESULTS.get("checks", {}).items()
        if (("exact" in v and not v["exact"]) or v.get("rel_err", 0) > 2e-2 or v.get("nan"))
    }
    log(f"checks: {len(RESULTS.get('checks', {}))} run, suspicious: {bad if bad else 'none'}")
    log(f"errors: {[e['section'] + ': ' + e['error'][:150] for e in RESULTS['errors']]}")


def main():
    global SMOKE, DEV, VOCAB, GRAPH_COPIES, KV_LAYOUT, BLOCK_ORDER, STEADY_HEADS, TABLE_TOKENS
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="kernels_bench.json")
    ap.add_argument("--quick", action="store_true", help="fewer attention shapes")
    ap.add_argument("--sweep", action="store_true", help="decode launch-parameter sweep")
    ap.add_argument(
        "--sweep-cases",
        default="",
        help="sweep only these cases, 'batch:ctx:q_len,...' (implies --sweep)",
    )
    ap.add_argument(
        "--sweep-splits-only",
        action="store_true",
        help="sweep the split count only (default tiles), with and without prefetch",
    )
    ap.add_argument(
        "--sweep-only",
        action="store_true",
        help="measure the copy bandwidth, run the sweep, nothing else",
    )
    ap.add_argument("--no-sdpa", action="store_true")
    ap.add_argument(
        "--kv-layout",
        choices=("nhd", "hnd"),
        default="nhd",
        help="memory order of the attention benchmarks' K/V caches (logical shape [blocks, "
        "block_size, kv_heads, head_dim] either way): nhd = that order (the engine's), hnd = "
        "[blocks, kv_heads, block_size, head_dim] in memory",
    )
    ap.add_argument(
        "--block-order",
        choices=("random", "sequential"),
        default="random",
        help="block tables of the attention benchmarks: random = a random permutation of the "
        "cache's blocks (a fragmented cache); sequential = each sequence's blocks in order (the "
        "same memory layout as SDPA's gathered tensors)",
    )
    ap.add_argument(
        "--steady-sweep",
        default="",
        help="after the copy bandwidth, time these override sets (comma list of default, "
        "splits, tiles, deep, deepsplits, fewsplits, pps, ahead, short, all) as graphN on --sweep-cases (default 1:8192:1,1:16384:1,1:32768:1,"
        "8:8192:1) and stop",
    )
    ap.add_argument(
        "--steady-heads",
        default="32,8,128",
        help="query heads, KV heads, head dim of the --steady-sweep cases (Llama-3.2-1B: 32,8,64)",
    )
    ap.add_argument(
        "--table-tokens",
        type=int,
        default=0,
        help="--steady-sweep: block tables at least this many tokens wide (the split count is "
        "chosen from the table width, which in the engine's CUDA graphs is the model's length)",
    )
    ap.add_argument(
        "--graph-copies",
        type=int,
        default=GRAPH_COPIES,
        help="steady-state attention timing (graphN columns): distinct KV copies per captured "
        "graph, reduced where they would exceed 20 GB; 0 skips it",
    )
    ap.add_argument(
        "--attention-only",
        action="store_true",
        help="skip rejection sampling, sampling_probs and store_kv",
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shapes on the CPU under TRITON_INTERPRET=1 (checks the script)",
    )
    args = ap.parse_args()
    GRAPH_COPIES = args.graph_copies
    KV_LAYOUT = args.kv_layout
    RESULTS["kv_layout"] = KV_LAYOUT
    BLOCK_ORDER = args.block_order
    STEADY_HEADS = tuple(int(x) for x in args.steady_heads.split(","))
    TABLE_TOKENS = args.table_tokens
    RESULTS["steady_heads"], RESULTS["table_tokens"] = STEADY_HEADS, TABLE_TOKENS
    RESULTS["block_order"] = BLOCK_ORDER
    if args.smoke:
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--smoke needs TRITON_INTERPRET=1")
        SMOKE, DEV, VOCAB = True, torch.device("cpu"), 1000
    elif not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA device")
    torch.manual_seed(0)
    if SMOKE:
        RESULTS["device"] = "cpu (smoke, Triton interpreter)"
        RESULTS["env"] = {"torch": torch.__version__, "triton": triton.__version__}
    else:
        props = torch.cuda.get_device_properties(DEV)
        RESULTS["device"] = props.name
        RESULTS["env"] = {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "python": platform.python_version(),
            "sms": props.multi_processor_count,
            "mem_GB": props.total_memory / 1e9,
        }
    global OUT_PATH
    OUT_PATH = Path(args.out)
    t0 = time.time()
    hbm = hbm_bandwidth() or float("nan")
    if args.steady_sweep:
        cases = [tuple(int(x) for x in c.split(":")) for c in args.sweep_cases.split(",") if c]
        cases = cases or [(1, 8192, 1), (1, 16384, 1), (1, 32768, 1), (8, 8192, 1)]
        if SMOKE:
            cases = [(1, 300, 1), (2, 100, 6)]
        variants = steady_sweep_variants(args.steady_sweep)
        attention_steady_sweep(hbm, cases, variants[:3] if SMOKE else variants)
        save()
        return
    if args.sweep_only:
        cases = [tuple(int(x) for x in c.split(":")) for c in args.sweep_cases.split(",") if c]
        attention_sweep(hbm, cases or None, splits_only=args.sweep_splits_only)
        save()
        return
    checks()
    contexts = (8192, 16384, 32768)
    batches = (1, 8, 32, 64)
    if args.quick:
        contexts, batches = (8192, 32768), (1, 64)
    if SMOKE:
        contexts, batches = (100, 300), (1, 2)
    attention_bench(hbm, contexts, batches, (1, 6), with_sdpa=not args.no_sdpa)
    if not args.attention_only:
        rejection_bench()
        sampling_bench()
        store_kv_bench(hbm)
    if args.sweep or args.sweep_cases:
        cases = [tuple(int(x) for x in c.split(":")) for c in args.sweep_cases.split(",") if c]
        attention_sweep(hbm, cases or None, splits_only=args.sweep_splits_only)
    RESULTS["wall_s"] = time.time() - t0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(RESULTS, indent=1))
    summary(hbm)


if __name__ == "__main__":
    main()
