"""Ceiling for batch-1 decode attention: how fast can ONE kernel read the K/V bytes of a sequence?

    python bench/read_ceiling.py [--out bench/results]

For 8k / 16k / 32k cached tokens of Llama-3-8B heads (8 KV heads x 128, bf16, K and V: 33.6 /
67.1 / 134.2 MB) a plain Triton reduction reads that many bytes (several tilings), timed as
``bench_kernels.py``'s graphN columns are: distinct copies (at least 2 GB together) run back to
back in one CUDA graph, median replay / copies. ``torch.sum`` over the same tensor is shown too.
Percentages are of the copy bandwidth measured in the same run (``bench_kernels.hbm_bandwidth``).
What the attention kernel reaches on the same sizes is in docs/kernels.md; the gap between the
two is what a different decode kernel could win. Writes read_ceiling.json. CUDA only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _graph_timing import capture, replay_median_ms  # noqa: E402


@triton.jit
def _read(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    # x_ptr: [n] bf16; out_ptr: [num_programs] fp32 (one partial sum per program)
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    base = pid.to(tl.int64) * BLOCK * ITERS
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("read_ceiling.py needs a CUDA device")
        return 0
    import bench_kernels as bk

    hbm = bk.hbm_bandwidth()  # GB/s
    rows = []
    for ctx in (8192, 16384, 32768):
        nbytes = ctx * 8 * 128 * 2 * 2
        n = max(8, int(2e9 // nbytes))
        xs = [torch.randn(nbytes // 2, device="cuda").to(torch.bfloat16) for _ in range(n)]
        for block, iters, warps in ((1024, 4, 4), (2048, 4, 8), (4096, 2, 8), (1024, 16, 4)):
            progs = triton.cdiv(nbytes // 2, block * iters)
            outs = [torch.empty(progs, device="cuda") for _ in range(n)]

            def fn(xs=xs, outs=outs, progs=progs, block=block, iters=iters, warps=warps):
                for x, o in zip(xs, outs):
                    _read[(progs,)](x, o, x.numel(), BLOCK=block, ITERS=iters, num_warps=warps)

            t = replay_median_ms(capture(fn), 30, 3) / n
            pct = 100 * nbytes / (t * 1e-3) / 1e9 / hbm
            rows.append(
                dict(
                    ctx=ctx,
                    bytes=nbytes,
                    kernel=f"triton read {block}x{iters}",
                    programs=progs,
                    us=t * 1e3,
                    pct_copy_bw=pct,
                )
            )
            print(
                f"ctx {ctx:5d} {nbytes / 1e6:6.1f} MB  triton read {block}x{iters} "
                f"({progs} programs): {t * 1e3:6.1f} us = {pct:5.1f}%",
                flush=True,
            )
        t = replay_median_ms(capture(lambda xs=xs: [x.sum() for x in xs]), 30, 3) / n
        pct = 100 * nbytes / (t * 1e-3) / 1e9 / hbm
        rows.append(dict(ctx=ctx, bytes=nbytes, kernel="torch.sum", us=t * 1e3, pct_copy_bw=pct))
        print(f"ctx {ctx:5d} {nbytes / 1e6:6.1f} MB  torch.sum: {t * 1e3:6.1f} us = {pct:5.1f}%")
        xs.clear()
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"device": torch.cuda.get_device_name(), "copy_GBps": hbm, "rows": rows}
    (out / "read_ceiling.json").write_text(json.dumps(res, indent=1))
    print(f"wrote {out / 'read_ceiling.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
