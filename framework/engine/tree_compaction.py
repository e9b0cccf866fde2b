"""The K/V compaction after a token-tree step as CUDA graph replays.

After a tree step the accepted path's K/V must move next to the root (``kernels.tree_kv.
compact_tree_kv``). Launched eagerly that costs the host a Triton launch plus a host-to-device
copy of its inputs (~60 us on the H100 machine, measured in bench/gpu_tree.py's pieces and a
step profile), and that host time sits between one step's read-back and the next step's launch,
where the GPU waits. Here each (sequence bucket ``S``, path bucket ``P``) has a CUDA graph whose
first node copies the inputs from a pinned host vector (``kernels.stage_copy.pinned_copy``) and
whose second is the compaction kernel: the host writes the vector and replays.

The vector ([S + S * P + S * W] int64) holds each sequence's root position, its accepted rows
(-1 padding) and its block table padded to ``W`` entries; padded sequences have no rows, so
they move nothing (they repeat sequence 0's root and table: a slot no one writes). The host
rewrites a vector without waiting on the GPU: a compaction follows a verification, which read
back the scores of a forward enqueued on the same stream after the previous compaction, so that
compaction's copy has run (on a tensor-parallel worker, rank 0's read-back needed the worker's
all-reduces of that forward). An event query and record per replay cost the host ~40 us a step
inside the engine (H100 machine). Calls that fit no graph, and every call without CUDA graphs,
take ``eager``: the same vector, unpadded, in one pinned copy.
"""

from __future__ import annotations

import numpy as np
import torch

from speculant.engine.cuda_graph import _bucket, gc_paused
from speculant.engine.staging import to_device
from speculant.kernels.stage_copy import pinned_copy
from speculant.kernels.tree_kv import compact_tree_kv

SEQ_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PATH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # accepted nodes of one tree: at most MAX_TREE_NODES


def _views(ints, S: int, P: int, W: int):
    """(starts [S], rows [S, P], tables [S, W]): the parts of one staged int64 vector (a tensor
    or the host's numpy array; views, not copies)."""
    return ints[:S], ints[S : S + S * P].reshape(S, P), ints[S + S * P :].reshape(S, W)


class _Entry:
    def __init__(self, S: int, P: int, W: int, device: torch.device) -> None:
        n = S + S * P + S * W
        cuda = device.type == "cuda"
        self.host = torch.zeros(n, dtype=torch.int64, pin_memory=cuda)  # [n] pinned
        self.np = self.host.numpy()
        self.host_views = _views(self.np, S, P, W)  # the same parts of the host vector
        self.dev = torch.zeros(n, dtype=torch.int64, device=device)  # [n]
        self.starts, self.rows, self.tables = _views(self.dev, S, P, W)  # [S], [S, P], [S, W]
        self.graph: torch.cuda.CUDAGraph | None = None


class CompactionGraphs:
    """Compactions of up to 256 sequences, paths of up to 64 nodes and block tables of up to
    ``width`` blocks, replayed from CUDA graphs on CUDA (captured on first use); on the CPU the
    same staging runs the function eagerly (tests)."""

    def __init__(self, kv_cache: torch.Tensor, width: int) -> None:
        self.kv_cache = kv_cache  # [num_layers, 2, num_blocks, block_size, num_kv_heads, d]
        self.W = width
        self.device = kv_cache.device
        self.entries: dict[tuple[int, int], _Entry] = {}
        self.pool = None

    def run(self, tables: list[list[int]], ctx_starts: list[int], paths: list[list[int]]
            ) -> bool:
        """Compact (``compact_tree_kv``'s arguments as lists); False when the call does not fit
        the graphs (the caller compacts eagerly)."""
        S = _bucket(len(tables), SEQ_BUCKETS)
        P = _bucket(max(map(len, paths)), PATH_BUCKETS)
        if S is None or P is None or max(map(len, tables)) > self.W:
            return False
        e = self.entries.get((S, P))
        if e is None:
            e = self.entries[(S, P)] = _Entry(S, P, self.W, self.device)
        _write(*e.host_views, tables, ctx_starts, paths)
        if e.graph is not None:
            e.graph.replay()
        elif self.device.type != "cuda":
            self._fn(e)
        else:
            self._capture(e)  # its warm-up run is this call's compaction
        return True

    def eager(self, tables: list[list[int]], ctx_starts: list[int], paths: list[list[int]]
              ) -> None:
        """Compact without a graph: the vector of ``run``, unpadded, in one copy through pinned
        memory (no stream synchronisation on CUDA; each copy call costs the host ~20 us)."""
        S, P, W = len(tables), max(len(p) for p in paths), max(len(t) for t in tables)
        h = np.zeros(S + S * P + S * W, dtype=np.int64)
        _write(*_views(h, S, P, W), tables, ctx_starts, paths)
        ints = to_device(torch.from_numpy(h), torch.int64, self.device)  # [S + S * P + S * W]
        starts, rows, tables_t = _views(ints, S, P, W)
        compact_tree_kv(self.kv_cache, tables_t, starts, rows)

    def _fn(self, e: _Entry) -> None:
        pinned_copy(e.host, e.dev)  # the graph's first node: [n] pinned -> device
        compact_tree_kv(self.kv_cache, e.tables, e.starts, e.rows)

    def _capture(self, e: _Entry) -> None:
        cur = torch.cuda.current_stream(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(cur)
        # the warm-up compiles the kernels and is this call's compaction (a compaction is not
        # idempotent: a moved entry's old slot may be a later source); the capture runs nothing
        with torch.cuda.stream(stream):
            self._fn(e)
        cur.wait_stream(stream)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        e.graph = torch.cuda.CUDAGraph()
        with gc_paused(), torch.cuda.graph(e.graph, pool=self.pool):
            self._fn(e)


def _write(starts: np.ndarray, rows: np.ndarray, tab: np.ndarray, tables: list[list[int]],
           ctx_starts: list[int], paths: list[list[int]]) -> None:
    """Fill a compaction's host vector (views ``starts [S]``, ``rows [S, P]``, ``tables [S, W]``)
    for ``len(tables) <= S`` sequences: rows padded with -1, tables with 0; padded sequences
    (``S - len(tables)``) get sequence 0's root and table and no rows, so that where padding
    copies a slot onto itself (the CPU path) that is a slot no one writes (a root)."""
    n = len(tables)
    starts[:n] = ctx_starts
    for i in range(n):
        p, t, r, b = paths[i], tables[i], rows[i], tab[i]
        r[: len(p)] = p
        r[len(p) :] = -1
        b[: len(t)] = t
        b[len(t) :] = 0
    if n < len(starts):
        starts[n:] = ctx_starts[0]
        rows[n:] = -1
        tab[n:] = tab[0]
