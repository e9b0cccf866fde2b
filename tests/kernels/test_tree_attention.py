"""Tree attention at the kernel level: the Triton paged-attention kernel with ``tree_bits``
against its torch reference and a dense float64 oracle, the tree-bit helpers and the K/V
compaction of an accepted path (kernels/tree_kv.py)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from test_paged_attention import REL_TOL, make_batch, rel_err, to

from speculant.kernels.paged_attention import paged_attention, paged_attention_ref
from speculant.kernels.tree_kv import (
    compact_tree_kv,
    compact_tree_kv_ref,
    tree_row_bits,
    tree_row_depths,
)


def random_parents(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(-1, i) for i in range(n)]


def step_bits(q_lens, trees):
    """Flat tree_bits of a step: a tree's rows where given, causal rows for plain sequences."""
    bits = []
    for ql, parents in zip(q_lens, trees):
        if parents is None:
            bits += [(1 << (r + 1)) - 1 for r in range(ql)]
        else:
            assert len(parents) + 1 == ql
            bits += tree_row_bits(parents)
    return torch.tensor(bits, dtype=torch.int64)


def dense_tree_attention(q, kc, vc, bt, cl, qsl, scale, trees):
    """float64 oracle built from the parent lists directly (not from the bits)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    H, Hkv, bs = q.shape[1], kc.shape[2], kc.shape[1]
    for s in range(len(cl)):
        q0, q1, ctx = int(qsl[s]), int(qsl[s + 1]), int(cl[s])
        if q1 == q0:
            continue
        ql = q1 - q0
        pos = torch.arange(ctx)
        k = kc[bt[s, pos // bs].long(), pos % bs].double().repeat_interleave(H // Hkv, 1)
        v = vc[bt[s, pos // bs].long(), pos % bs].double().repeat_interleave(H // Hkv, 1)
        mask = torch.zeros(ql, ctx, dtype=torch.bool)
        mask[:, : ctx - ql] = True
        parents = trees[s]
        for r in range(ql):
            if parents is None:
                mask[r, ctx - ql : ctx - ql + r + 1] = True
                continue
            node = r
            while True:  # walk up: node r-1 of the tree is row r
                mask[r, ctx - ql + node] = True
                if node == 0:
                    break
                node = parents[node - 1] + 1
        o = F.scaled_dot_product_attention(
            q[q0:q1].double().transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=mask, scale=scale,
        )
        out[q0:q1] = o.transpose(0, 1)
    return out


def test_tree_row_bits_and_depths():
    #      root
    #     /    \
    #    0      1
    #   / \
    #  2   3 - 4
    parents = [-1, -1, 0, 0, 3]
    assert tree_row_bits(parents) == [0b1, 0b11, 0b101, 0b1011, 0b10011, 0b110011]
    assert tree_row_depths(parents) == [0, 1, 1, 2, 2, 3]
    chain = [-1, 0, 1, 2]
    assert tree_row_bits(chain) == [(1 << (r + 1)) - 1 for r in range(5)]
    with pytest.raises(ValueError, match="topological"):
        tree_row_bits([-1, 2, 0])
    with pytest.raises(ValueError, match="at most 63"):
        tree_row_bits([-1] * 64)
    bits = tree_row_bits(list(range(-1, 62)))  # a 63-node chain: row 63 sets bit 63 (sign)
    assert bits[-1] == -1 and torch.tensor(bits, dtype=torch.int64)[-1].item() == -1


# the default run: float32; the half dtypes (~2 s each on the interpreter) are slow
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.float16, marks=pytest.mark.slow),
                                   pytest.param(torch.bfloat16, marks=pytest.mark.slow)])
def test_random_trees_match_reference(device, dtype):
    rng = random.Random(7)
    trees = [random_parents(n, rng) for n in (5, 9, 1)] + [None]  # + a plain causal sequence
    q_lens = [len(t) + 1 if t is not None else 3 for t in trees]
    ctx_lens = [40, 70, 17, 33]
    q, kc, vc, bt, cl, qsl = make_batch(q_lens, ctx_lens, 8, 2, 32, 16, dtype)
    bits = step_bits(q_lens, trees)
    scale = 32**-0.5
    oracle = dense_tree_attention(q, kc, vc, bt, cl, qsl, scale, trees)
    ref = paged_attention_ref(q, kc, vc, bt, cl, qsl, scale, tree_bits=bits)
    assert rel_err(ref, oracle) < REL_TOL[dtype]
    for splits in (1, 3):
        out = paged_attention(
            *to(device, q, kc, vc, bt, cl, qsl), scale, max_query_len=max(q_lens),
            num_splits=splits, force_triton=True, tree_bits=bits.to(device),
        )
        assert rel_err(out, oracle) < REL_TOL[dtype], splits
    # the mask matters: the causal result differs on tree rows
    causal = paged_attention_ref(q, kc, vc, bt, cl, qsl, scale)
    assert rel_err(causal, oracle) > 10 * REL_TOL[dtype]


def test_chain_bits_equal_causal_bit_for_bit(device):
    q_lens, ctx_lens = [6, 6, 1], [50, 23, 9]
    q, kc, vc, bt, cl, qsl = make_batch(q_lens, ctx_lens, 4, 4, 16, 8, torch.float32)
    bits = step_bits(q_lens, [None] * 3)
    args = to(device, q, kc, vc, bt, cl, qsl)
    for splits in (1, 2):
        plain = paged_attention(*args, 0.25, max_query_len=6, num_splits=splits,
                                force_triton=True)
        tree = paged_attention(*args, 0.25, max_query_len=6, num_splits=splits,
                               force_triton=True, tree_bits=bits.to(device))
        assert torch.equal(plain, tree)
    assert torch.equal(paged_attention_ref(q, kc, vc, bt, cl, qsl, 0.25),
                       paged_attention_ref(q, kc, vc, bt, cl, qsl, 0.25, tree_bits=bits))


def test_large_block_ids_and_deep_tree(device):
    rng = random.Random(3)
    trees = [random_parents(20, rng), [-1] * 12]  # a random tree and a flat 12-way fan
    q_lens = [21, 13]
    q, kc, vc, bt, cl, qsl = make_batch(q_lens, [90, 40], 4, 1, 16, 4, torch.float32,
                                        num_blocks=4000, high_blocks=True)
    bits = step_bits(q_lens, trees)
    oracle = dense_tree_attention(q, kc, vc, bt, cl, qsl, 0.25, trees)
    out = paged_attention(*to(device, q, kc, vc, bt, cl, qsl), 0.25, max_query_len=21,
                          force_triton=True, tree_bits=bits.to(device))
    assert rel_err(out, oracle) < REL_TOL[torch.float32]


def test_tree_bits_argument_checks():
    q, kc, vc, bt, cl, qsl = make_batch([3], [10], 2, 1, 16, 4, torch.float32)
    with pytest.raises(ValueError, match="tree_bits"):
        paged_attention(q, kc, vc, bt, cl, qsl, 0.25, tree_bits=torch.ones(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="tree_bits"):
        paged_attention(q, kc, vc, bt, cl, qsl, 0.25, tree_bits=torch.ones(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="contiguous"):
        paged_attention(q, kc, vc, bt, cl, qsl, 0.25,
                        tree_bits=torch.ones(6, dtype=torch.int64)[::2])
    with pytest.raises(ValueError, match="at most 64"):
        paged_attention(q, kc, vc, bt, cl, qsl, 0.25, max_query_len=65,
                        tree_bits=torch.ones(3, dtype=torch.int64))


def _cache_with_tree(rng, num_layers=2, block_size=4):
    """A cache of 2 sequences (non-consecutive blocks) whose steps hold trees at ctx_start."""
    nb, nkv, d = 24, 2, 8
    kv = torch.randn(num_layers, 2, nb, block_size, nkv, d)
    perm = torch.randperm(nb)
    bt = torch.stack([perm[:8], perm[8:16]]).to(torch.int32)  # 32 positions each
    ctx_start = torch.tensor([5, 14], dtype=torch.int32)
    return kv, bt, ctx_start


def _positions_kv(kv, bt, s, positions):
    bs = kv.shape[3]
    slots = [int(bt[s, p // bs]) * bs + p % bs for p in positions]
    return kv.view(kv.shape[0], 2, -1, *kv.shape[4:])[:, :, slots]


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # as conftest.py's


def _compact_triton(kv, bt, c0, paths):
    out = kv.to(DEVICE)
    compact_tree_kv(out, *to(DEVICE, bt, c0, paths), force_triton=True)
    kv.copy_(out.cpu())


COMPACTIONS = {"ref": compact_tree_kv_ref, "torch": compact_tree_kv, "triton": _compact_triton}


@pytest.mark.parametrize("impl", list(COMPACTIONS))
def test_compact_tree_kv(impl):
    kv, bt, c0 = _cache_with_tree(random.Random(0))
    paths = torch.tensor([[2, 3, 7, -1], [1, 4, 5, 9]])  # overlapping src / dst in both
    before = kv.clone()
    COMPACTIONS[impl](kv, bt, c0, paths)
    for s in range(2):
        start = int(c0[s])
        rows = [r for r in paths[s].tolist() if r >= 0]
        want = _positions_kv(before, bt, s, [start + r for r in rows])
        assert torch.equal(_positions_kv(kv, bt, s, range(start + 1, start + 1 + len(rows))),
                           want)
        # the context and the root are untouched
        assert torch.equal(_positions_kv(kv, bt, s, range(start + 1)),
                           _positions_kv(before, bt, s, range(start + 1)))
    # nothing else moved: only the destinations changed
    bs = kv.shape[3]
    dst = {int(bt[s, p // bs]) * bs + p % bs
           for s, n in ((0, 3), (1, 4)) for p in range(int(c0[s]) + 1, int(c0[s]) + 1 + n)}
    flat_b = before.view(2, 2, -1, 2, 8)
    flat_a = kv.view(2, 2, -1, 2, 8)
    for slot in range(flat_a.shape[2]):
        if slot not in dst:
            assert torch.equal(flat_a[:, :, slot], flat_b[:, :, slot])


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_compact_tree_kv_matches_ref_random(impl):
    rng = random.Random(5)
    for _ in range(4):
        kv, bt, c0 = _cache_with_tree(rng)
        paths = []
        for _s in range(2):
            rows = sorted(rng.sample(range(1, 12), rng.randrange(0, 6)))
            # an accepted path's rows i satisfy rows[i] >= i + 1 (sorted distinct from 1)
            paths.append(rows + [-1] * (6 - len(rows)))
        paths = torch.tensor(paths)
        a, b = kv.clone(), kv.clone()
        compact_tree_kv_ref(a, bt, c0, paths)
        COMPACTIONS[impl](b, bt, c0, paths)
        assert torch.equal(a, b)


def test_compact_tree_kv_checks():
    kv, bt, c0 = _cache_with_tree(random.Random(1))
    with pytest.raises(ValueError, match="increase"):
        compact_tree_kv_ref(kv, bt, c0, torch.tensor([[0, -1], [1, -1]]))
    with pytest.raises(ValueError, match="one per sequence"):
        compact_tree_kv(kv, bt, c0, torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match="contiguous"):
        compact_tree_kv(kv.transpose(0, 1), bt, c0, torch.tensor([[1], [1]]))


# --------------------------------------------------------------------------------------------
# The CPU forward with a tree mask (models/attention.py: the views loop and the torch path)
# --------------------------------------------------------------------------------------------
def _forward(runner, tokens, positions, query_lens, ctx_lens, tables, tree_bits=None):
    from speculant.models.attention import AttentionMetadata, ForwardContext

    meta = AttentionMetadata.build(query_lens, ctx_lens, tables, runner.block_size,
                                   torch.device("cpu"), tree_bits=tree_bits)
    ctx = ForwardContext(meta=meta, kv_caches=runner.kv_caches, kv_cache=runner.kv_cache)
    with torch.inference_mode():
        return runner.model(torch.tensor(tokens), torch.tensor(positions), ctx)  # [T, hidden]


@pytest.mark.parametrize("layout", ["consecutive", "scattered", "module"])
def test_cpu_forward_tree_rows_equal_their_chains(tiny_llama, layout):
    """Two sequences' trees in one CPU forward: every node's hidden state equals that of the
    last row of a chain step over its root path (same cache prefix, positions ctx_start +
    depth)."""
    from speculant import LLM

    runner = LLM(model=str(tiny_llama), max_num_seqs=2).engine.runner
    if layout == "module":
        runner.model._cpu_plan = False  # the models' own layers: ctx.attend, the torch path
    bs = runner.block_size
    rng = random.Random(11)
    prompts = [[1] + [rng.randrange(3, 200) for _ in range(2 * bs + 3)],
               [1] + [rng.randrange(3, 200) for _ in range(bs + 1)]]
    trees = [[-1, 0, 0, -1, 2, 4], [-1, -1, 1]]
    drafts = [[rng.randrange(3, 200) for _ in t] for t in trees]
    if layout == "scattered":
        tables = [[7, 2, 5, 0], [3, 6, 1]]
    else:
        tables = [[0, 1, 2, 3], [4, 5, 6]]
    starts = [len(p) - 1 for p in prompts]  # the root: each prompt's last token
    _forward(runner, [t for p in prompts for t in p[:-1]],
             [i for c in starts for i in range(c)], starts, starts, tables)
    tokens, positions, bits, qls = [], [], [], []
    for p, t, dr, c in zip(prompts, trees, drafts, starts):
        tokens += [p[-1]] + dr
        positions += [c + dep for dep in tree_row_depths(t)]
        bits += tree_row_bits(t)
        qls.append(len(t) + 1)
    hid = _forward(runner, tokens, positions, qls, [c + q for c, q in zip(starts, qls)], tables,
                   tree_bits=bits)  # [T, hidden]
    row0 = 0
    for p, t, dr, c, table, ql in zip(prompts, trees, drafts, starts, tables, qls):
        for node in range(len(t)):
            path = [node]
            while t[path[-1]] >= 0:
                path.append(t[path[-1]])
            path = path[::-1]
            chain = [p[-1]] + [dr[i] for i in path]
            out = _forward(runner, chain, [c + i for i in range(len(chain))], [len(chain)],
                           [c + len(chain)], [table])
            torch.testing.assert_close(hid[row0 + node + 1], out[-1], rtol=1e-4, atol=1e-4)
        row0 += ql
    # the mask is in effect: the same rows read causally (no tree bits) differ
    causal = _forward(runner, tokens, positions, qls, [c + q for c, q in zip(starts, qls)],
                      tables)
    assert not torch.allclose(causal[2:7], hid[2:7], rtol=1e-3, atol=1e-3)


def test_tree_and_compaction_int64_offsets(device):
    """Tree attention and the compaction kernel at block ids past 2**31 elements of the cache."""
    L, bs, Hkv, D = 1, 16, 1, 16
    nb = 2**31 // (bs * Hkv * D) + 8  # one K or V plane alone holds > 2**31 elements
    try:
        kv = torch.empty((L, 2, nb, bs, Hkv, D), dtype=torch.float16, device=device)
    except (RuntimeError, MemoryError):
        pytest.skip("cannot reserve an >8 GiB cache here")
    ids = torch.arange(nb - 3, nb)
    for b in ids.tolist():
        kv[:, :, b] = torch.randn(L, 2, bs, Hkv, D).to(torch.float16)
    bt = ids[None].to(torch.int32)  # [1, 3]: 48 positions
    parents = [-1, 0, -1, 2, 3]
    ctx_start, n = 30, 6
    cl = torch.tensor([ctx_start + n], dtype=torch.int32)
    qsl = torch.tensor([0, n], dtype=torch.int32)
    q = torch.randn(n, 2, D).to(torch.float16)
    bits = torch.tensor(tree_row_bits(parents))
    small = torch.zeros((1, 2, 4, bs, Hkv, D), dtype=torch.float16)  # blocks 1..3 = the top
    small[:, :, 1:] = kv[:, :, ids[0] :].cpu()
    sbt = torch.tensor([[1, 2, 3]], dtype=torch.int32)
    oracle = dense_tree_attention(q, small[0, 0], small[0, 1], sbt, cl, qsl, 0.25,
                                  [parents])
    out = paged_attention(q.to(device), kv[0, 0], kv[0, 1], *to(device, bt, cl, qsl), 0.25,
                          max_query_len=n, force_triton=True, tree_bits=bits.to(device))
    assert rel_err(out, oracle) < REL_TOL[torch.float16]
    path = torch.tensor([[3, 4, 5]])  # nodes 2, 3, 4
    compact_tree_kv_ref(small, sbt, torch.tensor([ctx_start]), path)
    compact_tree_kv(kv, *to(device, bt, torch.tensor([ctx_start]), path), force_triton=True)
    assert torch.equal(kv[:, :, ids[0] :].cpu(), small[:, :, 1:])
    del kv


def test_tree_in_batch_invariant_launch(device):
    """The batch-invariant launch (fixed splits at absolute ranges) takes the tree mask too: a
    tree row's output does not depend on the other sequence in the step."""
    rng = random.Random(9)
    trees = [random_parents(7, rng), random_parents(4, rng)]
    q_lens = [8, 5]
    q, kc, vc, bt, cl, qsl = make_batch(q_lens, [150, 70], 4, 2, 32, 16, torch.float32)
    bits = step_bits(q_lens, trees)
    kw = dict(num_splits=4, split_tokens=64, force_triton=True)
    both = paged_attention(*to(device, q, kc, vc, bt, cl, qsl), 32**-0.5, max_query_len=8,
                           tree_bits=bits.to(device), **kw)
    oracle = dense_tree_attention(q, kc, vc, bt, cl, qsl, 32**-0.5, trees)
    assert rel_err(both, oracle) < REL_TOL[torch.float32]
    alone = paged_attention(*to(device, q[:8], kc, vc, bt[:1], cl[:1], qsl[:2]), 32**-0.5,
                            max_query_len=8, tree_bits=bits[:8].to(device), **kw)
    assert torch.equal(alone, both[:8])
