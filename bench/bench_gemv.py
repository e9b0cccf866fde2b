"""GPU micro-benchmark of the few-row GEMV with a fused prologue (speculant.kernels.gemv).

Run on a CUDA machine from the repository root::

    python bench/bench_gemv.py [--out bench/results] [--rows 1,2,4,6,8] [--shapes qkv,o_proj]

Llama-3-8B projections in bf16, for M rows (decode batch / verification tokens):

========  ======  =====  ======================================  ===============================
shape     N       K      our kernel                              torch baseline (today's model)
========  ======  =====  ======================================  ===============================
qkv       6144    4096   rmsnorm prologue, residual add fused    fused.rms_norm(+res), F.linear
o_proj    4096    4096   no prologue                             F.linear
gate_up   28672   4096   rmsnorm prologue, residual add fused    fused.rms_norm(+res), F.linear
down      4096    14336  silu_mul prologue on [M, 28672]         fused.silu_mul, F.linear
lm_head   128256  4096   rmsnorm prologue, no residual           fused.rms_norm, F.linear
========  ======  =====  ======================================  ===============================

Timing (steady state, L2 defeated): ONE CUDA graph runs the op on ``copies`` DISTINCT weight
copies one after another (as the layers of the model's decode graph do; 8 copies, fewer for the
LM head, always more than 2x the L2 size together), replays it back to back, times each replay
with CUDA events, and reports the median replay / copies. The activations are shared by the
copies (they are L2-resident in the model too). Achieved bandwidth = weight bytes / time; it is
also given as a fraction of the device-to-device copy bandwidth (1 GiB copy, bytes read +
written, CUDA events) measured in the same run.

Every config of the sweep is first checked once against ``gemv_reference`` (max abs error of y;
the residual out must be exact) and flagged when off. The sweep compiles a few hundred Triton
kernels: they are compiled ahead in ``--jobs`` worker processes (Triton's on-disk cache is
shared), so the whole run takes about 1.5 minutes on an H100 (89 s measured with 15 workers,
38 s of it compiling). ``--rows`` / ``--shapes`` narrow it.

Writes ``gemv_<gpu-name>.json`` to ``--out`` and prints a table and the best config per
(shape, M). Exits 0 with a message when no CUDA device is present.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import importlib
import importlib.util
import json
import math
import multiprocessing as mp
import os
import platform
import re
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from _checkout import REPO, use_checkout  # bench/, the script's folder
from _graph_timing import capture, replay_median_ms  # bench/

use_checkout()

from speculant.kernels.gemv import (  # noqa: E402
    GemvConfig,
    _as_config,
    choose_config,
    gemv,
    gemv_reference,
)


def _import_fused():
    """speculant.models.fused (the model's RMSNorm / SiLU*up kernels); loaded from its file when
    the package's models cannot be imported here (a bare checkout on the GPU image)."""
    try:
        return importlib.import_module("speculant.models.fused")
    except ImportError:
        name = "speculant_models_fused"
        spec = importlib.util.spec_from_file_location(name, REPO / "framework/models/fused.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        return mod


@dataclass(frozen=True)
class Shape:
    name: str
    N: int
    K: int
    prologue: str
    residual: bool = False


SHAPES = (
    Shape("qkv", 6144, 4096, "rmsnorm", True),
    Shape("o_proj", 4096, 4096, "none"),
    Shape("gate_up", 28672, 4096, "rmsnorm", True),
    Shape("down", 4096, 14336, "silu_mul"),
    Shape("lm_head", 128256, 4096, "rmsnorm", False),
    # verification steps (2-8 rows): the inputs of qkv and gate/up arrive normed (the previous
    # projection's split-K reduce does the RMSNorm), so the products alone against cuBLAS
    Shape("qkv_plain", 6144, 4096, "none"),
    Shape("gate_up_plain", 28672, 4096, "none"),
    Shape("lm_head_plain", 128256, 4096, "none"),  # verification rows: the final norm is done
    # Llama-3.2-1B geometry (the 8B target's draft model: hidden 2048, 32 x 64 q heads, 8 KV
    # heads, ffn 8192): its one-row steps
    Shape("qkv_1b", 3072, 2048, "rmsnorm", True),
    Shape("o_proj_1b", 2048, 2048, "none"),
    Shape("gate_up_1b", 16384, 2048, "rmsnorm", True),
    Shape("down_1b", 2048, 8192, "silu_mul"),
    Shape("lm_head_1b", 128256, 2048, "rmsnorm", False),
    # its multi-row forwards (catch-up, batched steps: qkv and gate/up inputs arrive normed) and
    # its LM head over a 32768-id token map (input normed)
    Shape("qkv_1b_plain", 3072, 2048, "none"),
    Shape("gate_up_1b_plain", 16384, 2048, "none"),
    Shape("lm_head_tm_1b", 32768, 2048, "none"),
    # tensor-parallel shards (docs/tensor_parallel.md): a rank's products at Llama-3-8B TP 2 and
    # Llama-3-70B TP 4, whose inputs arrive normed (the fused all-reduce + RMSNorm)
    Shape("qkv_tp2", 3072, 4096, "none"),
    Shape("o_proj_tp2", 4096, 2048, "none"),
    Shape("gate_up_tp2", 14336, 4096, "none"),
    Shape("down_tp2", 4096, 7168, "silu_mul"),
    Shape("qkv_70b_tp4", 2560, 8192, "none"),
    Shape("o_proj_70b_tp4", 8192, 2048, "none"),
    Shape("gate_up_70b_tp4", 14336, 8192, "none"),
    Shape("down_70b_tp4", 8192, 7168, "silu_mul"),
    Shape("lm_head_70b", 128256, 8192, "none"),
)
ROWS = (1, 2, 4, 6, 8)
DTYPE = torch.bfloat16
EPS = 1e-5
MAX_COPY_BYTES = 4e9  # weight copies of one shape together at most (at least 2 copies)


def log(*a) -> None:
    print(*a, flush=True)


# ---------------------------------------------------------------------------------------------
# sweep
# ---------------------------------------------------------------------------------------------
def sweep_configs(shape: Shape, M: int) -> list[GemvConfig]:
    """The launch parameters tried for one (shape, M); split-K only where N <= 6144.

    One row: CUDA-core FMAs over BLOCK_N {8, 16, 32} (and 4 where N <= 6144) x BLOCK_K {256,
    512} tiles, 4 or 8 warps, split 1 or 2 (and 4 where N <= 4096); the next-tile prefetch once;
    the deep-prefetch tiles of ``deep_prefetch_configs``. More rows: tensor-core dots over
    BLOCK_N {32, 64}
    x BLOCK_K {128, 256}, 4 or 8 warps, either operand order, prologue rows interleaved or
    masked (``pad_rows``), split 1, 2 or 4. (Pruned from a wider H100 sweep: BLOCK_N 16 and the
    prefetch were never the best with several rows.)
    """
    splits = (1, 2, 4) if shape.N <= 6144 else (1,)
    out = []
    if M == 1:
        for bn in (4, 8, 16, 32) if shape.N <= 6144 else (8, 16, 32):
            for bk in (256, 512):
                for nw in (4, 8):
                    for s in splits if shape.N <= 4096 else splits[:2]:
                        out.append(GemvConfig(bn, bk, nw, s, use_dot=False))
        out.append(GemvConfig(8, 512, 4, 1, use_dot=False, prefetch=True))
        out += deep_prefetch_configs(shape)
        return out
    for bn in (32, 64):
        for bk in (128, 256):
            for nw in (4, 8):
                for swap in (False, True):
                    for pad in (True, False):
                        for s in splits:
                            out.append(
                                GemvConfig(bn, bk, nw, s, use_dot=True, swap_ab=swap, pad_rows=pad)
                            )
    return out


def deep_prefetch_configs(shape: Shape) -> list[GemvConfig]:
    """One-row configurations whose whole K range per program is one tile, loaded before the
    PDL wait (``prefetch``): the weight streams while the previous kernel finishes. Tiles of at
    most 64 elements a thread."""
    out = []
    for s in (1, 2, 4):
        for bk in (1024, 2048, 4096):
            if bk * s != shape.K:  # each of the s pieces of K is one tile
                continue
            for bn in (2, 4, 8):
                for nw in (4, 8):
                    if 8 <= bn * bk // (32 * nw) <= 64:
                        out.append(GemvConfig(bn, bk, nw, s, use_dot=False, prefetch=True))
    return out


def n_copies(shape: Shape) -> int:
    """8 copies, more for small weights (together at least 256 MB, 5x the H100's L2)."""
    wbytes = shape.N * shape.K * DTYPE.itemsize
    return max(2, min(max(8, math.ceil(256e6 / wbytes)), int(MAX_COPY_BYTES // wbytes)))


def make_inputs(shape: Shape, M: int, dev, copies: int, empty: bool = False, seed: int = 0):
    """(weights [copies x [N, K]], kwargs of gemv without weight)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    alloc = (
        (lambda *s: torch.empty(*s, dtype=DTYPE, device=dev))
        if empty
        else (lambda *s: (torch.randn(*s, device=dev, generator=g)).to(DTYPE))
    )
    weights = []
    for _ in range(copies):
        w = alloc(shape.N, shape.K)
        if not empty:
            w.mul_(0.02)
        weights.append(w)
    xk = 2 * shape.K if shape.prologue == "silu_mul" else shape.K
    kw = {"x": alloc(M, xk), "prologue": shape.prologue}
    if shape.prologue == "rmsnorm":
        nw = alloc(shape.K)
        kw["norm_weight"] = nw if empty else (1.0 + 0.1 * nw).to(DTYPE)
        kw["eps"] = EPS
        if shape.residual:
            kw["residual"] = alloc(M, shape.K)
    return weights, kw


# ---------------------------------------------------------------------------------------------
# ahead-of-time compilation in worker processes
# ---------------------------------------------------------------------------------------------
def _compile_key(shape: Shape, M: int, cfg: GemvConfig) -> tuple:
    """What selects a distinct Triton binary (approximately: a miss only costs a compile in the
    main process)."""
    rows = 1 << (M - 1).bit_length()
    return (
        shape.prologue,
        shape.residual,
        M == 1,
        rows,
        cfg.block_n,
        cfg.block_k,
        cfg.num_warps,
        cfg.split_k > 1,
        cfg.use_dot,
        cfg.swap_ab,
        cfg.pad_rows,
        cfg.prefetch,
    )


def _compile_worker(tasks: list[tuple[dict, int, dict]]) -> tuple[int, list[str]]:
    dev = torch.device("cuda")
    errors = []
    for shape_d, M, cfg_d in tasks:
        shape, cfg = Shape(**shape_d), GemvConfig(**cfg_d)
        try:
            weights, kw = make_inputs(shape, M, dev, 1, empty=True)
            gemv(weight=weights[0], config=cfg, **kw)
        except Exception as e:  # reported again (and recorded) by the timing pass
            errors.append(f"{shape.name} M={M} {cfg}: {type(e).__name__}: {str(e)[:200]}")
    torch.cuda.synchronize()
    return len(tasks), errors


def precompile(work: list[tuple[Shape, int, GemvConfig]], jobs: int) -> None:
    seen, tasks = set(), []
    for shape, M, cfg in work:
        key = _compile_key(shape, M, cfg)
        if key not in seen:
            seen.add(key)
            tasks.append((asdict(shape), M, asdict(cfg)))
    t0 = time.time()
    chunks = [tasks[i::jobs] for i in range(jobs)]
    done = 0
    ctx = mp.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as ex:
        for n, errs in ex.map(_compile_worker, chunks):
            done += n
            for e in errs[:3]:
                log(f"   compile: {e}")
    log(f"   precompiled {done} kernels in {jobs} processes: {time.time() - t0:.1f}s")


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------
def time_steady_us(fns, rep: int = 20, warmup: int = 3) -> float:
    """Median us per fn: ONE CUDA graph runs every fn of ``fns`` (each on its own weights) one
    after another; back-to-back replays, each between two CUDA events."""

    def run_all():
        for f in fns:
            f()

    g = capture(run_all)
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(1 << 20)  # the replays queue up behind ~0.5 ms of GPU work
    ms = replay_median_ms(g, rep, warmup)
    del g
    return 1e3 * ms / len(fns)


def copy_bandwidth() -> float:
    """GB/s of a 1 GiB device-to-device copy, bytes read + written, CUDA events, median of 20."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    ts = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ms = sorted(ts)[len(ts) // 2]
    del src, dst
    return 2 * n / (ms * 1e-3) / 1e9


def baseline_fn(fused, shape: Shape, w: torch.Tensor, kw: dict):
    """The separate ops the model runs today."""
    x = kw["x"]
    if shape.prologue == "rmsnorm":
        nw, r = kw["norm_weight"], kw.get("residual")

        def fn():
            h = fused.rms_norm(x, nw, EPS, residual=r)
            if r is not None:
                h = h[0]
            return F.linear(h, w)

    elif shape.prologue == "silu_mul":

        def fn():
            return F.linear(fused.silu_mul(x), w)

    else:

        def fn():
            return F.linear(x, w)

    return fn


def check(cfg: GemvConfig | None, w, kw, ref) -> tuple[float, bool, str]:
    """(max abs error of y, ok, note) of one call against the reference."""
    out = gemv(weight=w, config=cfg, **kw)
    torch.cuda.synchronize()
    y, res_out = out if isinstance(out, tuple) else (out, None)
    ref_y, ref_res = ref if isinstance(ref, tuple) else (ref, None)
    err = float((y.float() - ref_y.float()).abs().max())
    scale = max(1.0, float(ref_y.float().abs().max()))
    ok = math.isfinite(err) and err <= 2e-2 * scale  # bf16 output: ~1 ulp at |y| ~ scale
    note = ""
    if res_out is not None and not torch.equal(res_out, ref_res):
        ok, note = False, "residual out differs"
    elif not ok:
        note = f"max abs err {err:.3g} > {2e-2 * scale:.3g}"
    return err, ok, note


def row_entry(us: float, wbytes: int, copy_gbps: float) -> dict:
    gbps = wbytes / (us * 1e-6) / 1e9
    return {"us": round(us, 3), "GBps": round(gbps, 1), "frac_copy_bw": round(gbps / copy_gbps, 4)}


def bench_shape(shape: Shape, rows, fused, copy_gbps: float, dev) -> dict:
    copies = n_copies(shape)
    weights, kw0 = make_inputs(shape, max(rows), dev, copies, seed=1)
    wbytes = shape.N * shape.K * DTYPE.itemsize
    res = {
        "N": shape.N,
        "K": shape.K,
        "prologue": shape.prologue,
        "residual": shape.residual,
        "weight_bytes": wbytes,
        "copies": copies,
        "rows": {},
    }
    for M in rows:
        t0 = time.time()
        kw = {k: (v[:M] if k in ("x", "residual") else v) for k, v in kw0.items()}
        ref = gemv_reference(weight=weights[0], **kw)
        entry = {}
        base_fns = [baseline_fn(fused, shape, w, kw) for w in weights]
        entry["baseline"] = row_entry(time_steady_us(base_fns), wbytes, copy_gbps)
        # the launcher's own choice (the default table)
        cfg0 = _as_config(None, M, shape.N, shape.K, shape.prologue, dev)
        configs = [("default", None)] + [("sweep", c) for c in sweep_configs(shape, M)]
        results = []
        for kind, cfg in configs:
            r = {"kind": kind, "config": asdict(cfg if cfg is not None else cfg0)}
            try:
                err, ok, note = check(cfg, weights[0], kw, ref)
                r.update(max_abs_err=err, ok=ok, note=note)
                fns = [
                    (lambda w=w, cfg=cfg, kw=kw: gemv(weight=w, config=cfg, **kw)) for w in weights
                ]
                r.update(row_entry(time_steady_us(fns), wbytes, copy_gbps))
            except Exception as e:  # compile failure (out of resources...) and the like
                r.update(ok=False, note=f"{type(e).__name__}: {str(e)[:300]}")
                torch.cuda.synchronize()
            results.append(r)
        good = [r for r in results if r.get("ok") and "us" in r]
        best = min(good, key=lambda r: r["us"]) if good else None
        entry["default"] = results[0]
        entry["sweep"] = results[1:]
        entry["best"] = best
        entry["failures"] = [r for r in results if not r.get("ok")]
        res["rows"][str(M)] = entry
        b = entry["baseline"]
        d = results[0]
        msg = (
            f"   {shape.name:8s} M={M}: baseline {b['us']:8.2f} us ({b['frac_copy_bw']:.0%})"
            f" | default {d.get('us', float('nan')):8.2f} us"
            f" ({d.get('frac_copy_bw', float('nan')):.0%})"
        )
        if best is not None:
            msg += (
                f" | best {best['us']:8.2f} us ({best['frac_copy_bw']:.0%}) "
                f"{_cfg_str(best['config'])} x{b['us'] / best['us']:.2f}"
            )
        nfail = len(entry["failures"])
        log(msg + (f" | {nfail} FAILED" if nfail else "") + f"  [{time.time() - t0:.1f}s]")
        for f in entry["failures"][:3]:
            log(f"      FAILED {_cfg_str(f['config'])}: {f.get('note')}")
    del weights
    torch.cuda.empty_cache()
    return res


def _cfg_str(c: dict) -> str:
    kind = "fma"
    if c["use_dot"]:
        kind = "dot" + (" swap" if c["swap_ab"] else "") + ("" if c["pad_rows"] else " m16")
    return (
        f"bn{c['block_n']} bk{c['block_k']} w{c['num_warps']} s{c['split_k']} {kind}"
        f"{' pf' if c['prefetch'] else ''}"
    )


def print_table(results: dict) -> None:
    log(
        "\n shape     M   baseline us (%copy)   default us (%copy)   best us (%copy)   "
        "best/baseline  best config"
    )
    for name, sh in results["shapes"].items():
        for M, e in sh["rows"].items():
            b, d, best = e["baseline"], e["default"], e["best"]
            line = f" {name:8s} {M:>2s}   {b['us']:9.2f} ({b['frac_copy_bw']:5.1%})"
            line += f"   {d.get('us', float('nan')):9.2f} ({d.get('frac_copy_bw', 0):5.1%})"
            if best:
                line += (
                    f"   {best['us']:9.2f} ({best['frac_copy_bw']:5.1%})"
                    f"   {b['us'] / best['us']:6.2f}x   {_cfg_str(best['config'])}"
                )
            log(line)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(REPO / "bench" / "results"), help="output folder")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="M values")
    ap.add_argument("--shapes", default=",".join(s.name for s in SHAPES))
    ap.add_argument(
        "--jobs",
        type=int,
        default=min(8, os.cpu_count() or 1),
        help="processes compiling the sweep ahead (0: compile in the timing pass)",
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        log("bench_gemv: no CUDA device here; this benchmark runs on a GPU only. Nothing done.")
        return 0
    rows = [int(m) for m in args.rows.split(",")]
    names = args.shapes.split(",")
    shapes = [s for s in SHAPES if s.name in names]
    if len(shapes) != len(names):
        log(f"unknown shape in {names}; known: {[s.name for s in SHAPES]}")
        return 2
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    t_start = time.time()
    fused = _import_fused()
    import triton

    results = {
        "gpu": props.name,
        "sms": props.multi_processor_count,
        "l2_bytes": getattr(props, "L2_cache_size", None),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "dtype": str(DTYPE).replace("torch.", ""),
        "timing": "one CUDA graph over distinct weight copies, median replay / copies",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    copy_gbps = copy_bandwidth()
    results["copy_GBps"] = round(copy_gbps, 1)
    log(
        f"== {props.name}: {props.multi_processor_count} SMs, L2 "
        f"{results['l2_bytes'] and results['l2_bytes'] / 1e6:.0f} MB; "
        f"1 GiB copy {copy_gbps:.0f} GB/s (read + write)"
    )
    work = [(s, M, c) for s in shapes for M in rows for c in sweep_configs(s, M)]
    work += [(s, M, choose_config(M, s.N, s.K, s.prologue, dev)) for s in shapes for M in rows]
    if args.jobs > 0:
        precompile(work, args.jobs)
    results["shapes"] = {}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    gpu = re.sub(r"[^A-Za-z0-9]+", "_", props.name).strip("_").lower()
    path = out_dir / f"gemv_{gpu}.json"
    for shape in shapes:
        try:
            results["shapes"][shape.name] = bench_shape(shape, rows, fused, copy_gbps, dev)
        except Exception as e:
            log(traceback.format_exc())
            results.setdefault("errors", []).append({"shape": shape.name, "error": repr(e)})
        path.write_text(json.dumps(results, indent=1))
    print_table(results)
    results["seconds"] = round(time.time() - t_start, 1)
    path.write_text(json.dumps(results, indent=1))
    log(f"\nwrote {path} ({results['seconds']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
