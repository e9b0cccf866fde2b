"""CUDA-graph capture and timing shared by the benchmarks (bench_kernels.py, bench_gemv.py,
read_ceiling.py)."""

from __future__ import annotations

import torch


def capture(fn) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph after two warm-up calls on a side stream."""
    return capture_output(fn)[0]


def capture_output(fn):
    """``(graph, out)``: ``fn`` captured as in ``capture``, and the output tensors of the captured
    call (static: each replay rewrites them)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    torch.cuda.synchronize()
    return g, out


def replay_median_ms(g, rep: int, warmup: int, before=None) -> float:
    """Median ms of ``rep`` replays of ``g``, each between two CUDA events (``before()`` runs
    ahead of each replay, outside the events), after ``warmup`` untimed ones."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    for i in range(-warmup, rep):
        if before is not None:
            before()
        if i >= 0:
            starts[i].record()
        g.replay()
        if i >= 0:
            ends[i].record()
    torch.cuda.synchronize()
    ts = sorted(a.elapsed_time(b) for a, b in zip(starts, ends))
    return float(ts[len(ts) // 2])
