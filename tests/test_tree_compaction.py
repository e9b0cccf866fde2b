"""engine/tree_compaction.py: the tree steps' K/V compaction staged for CUDA graph replays (one
pinned int64 vector per (sequences, path) bucket), on the CPU against the reference."""

from __future__ import annotations

import random

import torch

from speculant.engine.tree_compaction import CompactionGraphs
from speculant.kernels.tree_kv import compact_tree_kv_ref


def _case(rng: random.Random, n: int, width: int):
    """A cache [layers 2, 2, 40 blocks, block 4, 2 heads, d 8], ``n`` sequences with distinct
    blocks (tables of up to ``width`` blocks) and accepted paths (rows[i] >= i + 1, sorted)."""
    kv = torch.randn(2, 2, 40, 4, 2, 8)
    blocks = rng.sample(range(40), 40)
    tables, starts, paths = [], [], []
    for i in range(n):
        nb = rng.randrange(4, width + 1)
        tables.append(blocks[i * 5 : i * 5 + min(nb, 5)])
        starts.append(rng.randrange(0, 4 * len(tables[-1]) - 13))
        paths.append(sorted(rng.sample(range(1, 13), rng.randrange(0, 7))))
    return kv, tables, starts, paths


def _ref(kv, tables, starts, paths):
    W = max(len(t) for t in tables)
    P = max(1, max(len(p) for p in paths))
    bt = torch.tensor([t + [0] * (W - len(t)) for t in tables], dtype=torch.int32)
    rows = torch.tensor([p + [-1] * (P - len(p)) for p in paths])
    compact_tree_kv_ref(kv, bt, torch.tensor(starts), rows)


def test_staged_compactions_match_the_reference_and_reuse_their_vectors():
    rng = random.Random(0)
    kv0 = torch.randn(2, 2, 40, 4, 2, 8)
    graphs = CompactionGraphs(kv0.clone(), width=6)
    want = kv0.clone()
    for step in range(12):  # bucket sizes change and repeat: stale entries must not leak
        n = rng.choice([1, 2, 3, 5])
        _, tables, starts, paths = _case(rng, n, 6)
        if not any(paths):
            paths[0] = [1, 3]
        assert graphs.run(tables, starts, paths)
        _ref(want, tables, starts, paths)
        assert torch.equal(graphs.kv_cache, want), f"step {step}"
    assert {k[0] for k in graphs.entries} <= {1, 2, 4, 8}


def test_calls_that_do_not_fit_are_refused():
    graphs = CompactionGraphs(torch.zeros(1, 2, 8, 4, 1, 2), width=2)
    assert not graphs.run([[0, 1, 2]], [0], [[1]])  # a table wider than the graphs'
    assert not graphs.run([[0]] * 257, [0] * 257, [[1]] * 257)  # more sequences
    assert not graphs.run([[0]], [0], [list(range(1, 66))])  # a path past 64 nodes
    assert not graphs.entries


def test_eager_compactions_match_the_reference():
    """The path of calls no graph fits (and of every call without CUDA graphs): the same
    vector, unpadded, in one copy."""
    rng = random.Random(1)
    kv0 = torch.randn(2, 2, 40, 4, 2, 8)
    graphs = CompactionGraphs(kv0.clone(), width=0)
    want = kv0.clone()
    for step in range(6):
        _, tables, starts, paths = _case(rng, rng.choice([1, 3, 5]), 6)
        paths[0] = paths[0] or [2]
        graphs.eager(tables, starts, paths)
        _ref(want, tables, starts, paths)
        assert torch.equal(graphs.kv_cache, want), f"step {step}"
    assert not graphs.entries
