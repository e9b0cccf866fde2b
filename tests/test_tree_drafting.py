"""Tree drafting (speculant.drafting.trees; docs/strategies.md "Token trees"): the static tree
shapes (vLLM's speculative_token_tree), EAGLE-2's final selection, the tree options, the head
drafter's trees checked node by node against a plain causal re-run of the head along each
node's root path, the staged levels (the tree CUDA graph's function, speculant.drafting.
tree_graph) equal to the per-level eager drafting they replaced, padded or not, and greedy
output with EAGLE-1 / EAGLE-3 trees equal to plain greedy decoding on tiny random checkpoints
(tests/checkpoints.py) at batch 1 and 8, eagerly and through the graph path run on the CPU."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from checkpoints import make_eagle1, make_eagle3
from fake_graphs import replay_on_cpu
from test_eagle import SMALL_V, TARGET_LAYERS, generate_ids, greedy_params, prompts_for

from speculant import LLM, SamplingParams
from speculant.drafting import (
    DynamicTree,
    HeadTreeDrafter,
    TokenTreeError,
    TokenTreeShape,
    fill_static_tree,
    parse_token_tree,
    select_tree,
)
from speculant.drafting.kv_cache import cache_slot
from speculant.models.attention import AttentionMetadata, ForwardContext
from speculant.spec_registry import StrategyError
from speculant.spec_types import DraftTree, SpecBatch, SpecSequence

VLLM_TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


# --------------------------------------------------------------------------------------------
# shapes and selection
# --------------------------------------------------------------------------------------------
def test_static_shapes_parse_sort_and_refuse():
    s = TokenTreeShape("[(1, 0), (0,), (1,), (0, 0), (0, 0, 0)]")
    assert s.paths == [(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]  # by depth, then ranks
    assert s.parents == [-1, -1, 0, 1, 2] and s.ranks == [0, 1, 0, 0, 0]
    assert s.depths == [1, 1, 2, 2, 3] and s.depth == 3
    assert s.width(1) == 2 and s.expanded(1) == [0, 1] and s.expanded(3) == []
    assert s.max_rows() == 2 * 1  # two expanded nodes at depth 1, one path row each
    assert parse_token_tree([[0], (0, 1), 2]) == [(0,), (0, 1), (2,)]
    for bad, words in [
        ("[(0,), ", "not a Python literal"),
        ([], "non-empty list"),
        ([(0,), (0, 1, 0)], "no parent (0, 1)"),
        ([(0,), (0,)], "listed twice"),
        ([(0,), (0, -1)], "sibling ranks"),
        ([(0,), ()], "sibling ranks"),
        ([(0,), (True,)], "sibling ranks"),
        ([(i,) for i in range(64)], "at most 63"),
    ]:
        with pytest.raises(TokenTreeError, match=words.replace("(", r"\(").replace(")", r"\)")):
            parse_token_tree(bad)


def test_fill_static_tree_takes_each_depths_ranked_tokens():
    s = TokenTreeShape(VLLM_TREE)
    ranked = [[10, 11, 12], [20, 21], [30]]
    t = fill_static_tree(s, ranked)
    assert t.token_ids == [10, 11, 12, 20, 21, 20, 30]
    assert t.parents == [-1, -1, -1, 0, 0, 1, 3] and t.probs is None
    cut = fill_static_tree(s, ranked, max_nodes=4)  # a prefix of index order is a tree
    assert cut.token_ids == [10, 11, 12, 20] and cut.parents == [-1, -1, -1, 0]


def _random_candidates(rng: random.Random, C: int, monotone: bool):
    """C candidates (token of candidate c: 1000 + c, so the tree maps back), each parent
    earlier; scores cumulative (never growing along a path) or arbitrary."""
    parents, scores = [], []
    for c in range(C):
        p = rng.randrange(-1, c) if c else -1
        base = scores[p] if p >= 0 else 0.0
        parents.append(p)
        scores.append(base - rng.random() * 2 if monotone else rng.uniform(-5, 0))
    return [1000 + c for c in range(C)], scores, parents


@pytest.mark.parametrize("monotone", [True, False])
def test_select_tree_keeps_the_best_nodes_with_their_ancestors(monotone):
    rng = random.Random(7)
    for _ in range(300):
        C = rng.randrange(1, 40)
        toks, scores, parents = _random_candidates(rng, C, monotone)
        budget = rng.randrange(1, 45)
        t = select_tree(toks, scores, parents, budget)
        kept = [tok - 1000 for tok in t.token_ids]
        assert kept == sorted(kept)  # candidate order: parents before children
        assert all(p < i for i, p in enumerate(t.parents))
        for i, c in enumerate(kept):  # the structure is the candidates' own
            assert (t.parents[i] < 0) if parents[c] < 0 else kept[t.parents[i]] == parents[c]
        for c in kept:  # ancestors of a kept node are kept
            assert parents[c] < 0 or parents[c] in kept
        assert len(kept) <= min(budget, C)
        if monotone:  # cumulative scores never grow: exactly the best ones (ties: earlier)
            best = sorted(range(C), key=lambda c: (-scores[c], c))[: min(budget, C)]
            assert kept == sorted(best)


def test_dynamic_tree_limits():
    t = DynamicTree(4, 5, 20)
    assert t.num_candidates == 4 + 4 * 16 and t.max_rows() == 16
    with pytest.raises(TokenTreeError, match="at most 63"):
        DynamicTree(4, 5, 64)
    with pytest.raises(TokenTreeError, match="lower eagle_topk"):
        DynamicTree(9, 9, 20)  # 9 x 8 = 72 rows in the last level


# --------------------------------------------------------------------------------------------
# the head drafter's trees
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target(tiny_factory) -> Path:
    return tiny_factory(
        "llama", vocab_size=SMALL_V, tokenizer=False, num_hidden_layers=TARGET_LAYERS
    )


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("tree-heads")
    return {
        "eagle": make_eagle1(
            d / "e1", target, SMALL_V, "safetensors", layers=2, bias=False, seed=2, copy=True
        ),
        "eagle3": make_eagle3(d / "e3", SMALL_V, 40, "safetensors", seed=3, target=target),
    }


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return prompts_for(SMALL_V, 8, seed=1)


@pytest.fixture(scope="module")
def reference(target, prompts) -> list[list[int]]:
    llm = LLM(model=str(target), skip_tokenizer_init=True, max_num_seqs=8)
    return generate_ids(llm, prompts, greedy_params(8))


def _llm(target: Path, head: Path, **opts) -> LLM:
    return LLM(
        model=str(target),
        skip_tokenizer_init=True,
        max_num_seqs=8,
        speculative_config={"model": str(head), **opts},
    )


def _batch(strategy, lengths: list[int], seed: int = 0) -> SpecBatch:
    """Sequences of ``lengths`` random tokens with random target features for every position."""
    g = torch.Generator().manual_seed(seed)
    seqs = [
        SpecSequence(
            i,
            torch.randint(3, SMALL_V, (n,), generator=g).tolist(),
            n,
            63,
            SamplingParams(temperature=0.0),
        )
        for i, n in enumerate(lengths)
    ]
    counts = [n - 1 for n in lengths]
    width = strategy.drafter.feature_width
    feats = torch.randn(sum(counts), width, generator=g)
    if strategy.name == "eagle3":
        return SpecBatch(
            seqs, aux_hidden_states=feats, hidden_counts=counts, hidden_start=[0] * len(seqs)
        )
    return SpecBatch(seqs, hidden_states=feats, hidden_counts=counts, hidden_start=[0] * len(seqs))


def _path_state(strategy, st, n: int, x: torch.Tensor, path_tokens: list[int]) -> torch.Tensor:
    """The head's state after ``path_tokens`` drafted after a sequence of ``n`` tokens whose
    catch-up state is ``x`` [H]: one causal one-row step per token (as chain drafting runs),
    writing K/V right after the context (the tree levels overwrite them anyway)."""
    cache = strategy.drafter.cache
    for j, tok in enumerate(path_tokens):
        ctx_len = n - st.offset + j  # the step writes index n - 1 + j - offset
        meta = AttentionMetadata.build([1], [ctx_len], [st.table], cache.block_size, x.device)
        fctx = ForwardContext(meta=meta, kv_caches=cache.kv_caches)
        ids, pos = torch.tensor([tok], device=x.device), torch.tensor([n - 1 + j], device=x.device)
        x = strategy.step(ids, x[None], pos, fctx)[0]
    return x


def _propose_recording(strategy, batch: SpecBatch) -> tuple[list, list]:
    """The proposal's trees, and every head level's (frontier paths' tokens [A, F, d], their
    output states [A, F, H]) as the tree drafter ran them."""
    tree, levels = strategy.drafter.tree, []
    real = tree._level

    def spy(st, level, tok, xin):
        out = real(st, level, tok, xin)
        levels.append((tok.clone(), out.clone()))
        return out

    tree._level = spy
    try:
        return strategy.propose(batch).token_ids, levels
    finally:
        del tree._level


@torch.inference_mode()
def _check_against_paths(strategy, batch: SpecBatch, trees: list, levels: list, ranks_of) -> None:
    """Re-run the head causally along every root path: each level's output state must be the
    re-run's (the tree mask lets a path's rows see their own ancestors only), and
    ``ranks_of(tree, node, ranked)`` checks each node's token against its parent path's
    ranked tokens."""
    drafter = strategy.drafter
    plan, _ = drafter.plan(batch, ahead=drafter.tree.max_rows())
    W = max(len(p.st.table) for p in plan)
    xs = drafter.catch_up(batch, strategy.features(batch), plan, W)
    for a, (p, x) in enumerate(zip(plan, xs)):
        for tok, out in levels:
            for f in range(tok.shape[1]):
                ref = _path_state(strategy, p.st, p.n, x, tok[a, f].tolist())
                tol = 1e-5 if ref.device.type == "cpu" else 5e-3  # Triton: tf32 dots
                torch.testing.assert_close(out[a, f], ref, atol=tol, rtol=tol)
        tree: DraftTree = trees[p.i]
        assert isinstance(tree, DraftTree) and tree.probs is None
        for node in range(tree.num_nodes):
            path = tree.path(node)
            state = _path_state(strategy, p.st, p.n, x, [tree.token_ids[a] for a in path[:-1]])
            logp = torch.log_softmax(strategy.logits(state[None])[0], dim=-1)
            ranks_of(tree, node, logp.topk(8).indices.tolist())


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_static_tree_nodes_are_the_heads_ranked_tokens(target, heads, method):
    llm = _llm(target, heads[method], speculative_token_tree=str(VLLM_TREE))
    strategy = llm.engine.spec.strategy
    assert strategy.num_speculative_tokens == len(VLLM_TREE)  # the engine's per-step budget
    batch = _batch(strategy, [5, 11, 8])
    trees, levels = _propose_recording(strategy, batch)
    assert [tuple(t.shape[1:]) for t, _ in levels] == [(2, 1), (1, 2)]  # F x d per level
    shape = strategy.drafter.tree.tree
    assert [t.parents for t in trees] == [shape.parents] * 3

    def exact(tree, node, ranked):
        assert tree.token_ids[node] == ranked[shape.ranks[node]], (node, ranked)

    _check_against_paths(strategy, batch, trees, levels, exact)
    # batch-independent: each sequence alone drafts the same tree
    feats, row = strategy.features(batch), 0
    for i, s in enumerate(batch.seqs):
        c = batch.hidden_counts[i]
        alone = SpecBatch(
            [s],
            hidden_counts=[c],
            hidden_start=[0],
            **{
                "aux_hidden_states" if method == "eagle3" else "hidden_states": feats[row : row + c]
            },
        )
        row += c
        assert strategy.propose(alone).token_ids[0].token_ids == trees[i].token_ids


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_dynamic_tree_nodes_follow_the_heads_top_k(target, heads, method):
    llm = _llm(target, heads[method], num_speculative_tokens=4, eagle_topk=3, num_draft_tokens=12)
    strategy = llm.engine.spec.strategy
    assert strategy.drafter.tree.tree == DynamicTree(3, 4, 11)
    assert strategy.num_speculative_tokens == 11
    batch = _batch(strategy, [6, 12])
    trees, levels = _propose_recording(strategy, batch)
    assert [tuple(t.shape[1:]) for t, _ in levels] == [(3, 1), (3, 2), (3, 3)]
    for t in trees:
        assert t.num_nodes == 11 and max(t.depths()) <= 4
        assert all(len(t.children(a)) <= 3 for a in range(-1, t.num_nodes))
        assert len(set(t.depths())) > 1  # more than one level was expanded

    def in_top_k(tree, node, ranked):
        assert tree.token_ids[node] in ranked[:3], (node, ranked)
        sib = [tree.token_ids[c] for c in tree.children(tree.parents[node])]
        assert len(set(sib)) == len(sib)  # distinct children

    _check_against_paths(strategy, batch, trees, levels, in_top_k)
    # the per-sequence budget (max_draft) cuts the tree, ancestors kept
    batch.seqs[0].max_draft = 4
    small = strategy.propose(batch).token_ids[0]
    assert small.num_nodes == 4 and all(p < i for i, p in enumerate(small.parents))


def test_top1_tree_is_the_chain(target, heads):
    llm = _llm(target, heads["eagle"], num_speculative_tokens=4)
    strategy = llm.engine.spec.strategy
    batch = _batch(strategy, [5, 9, 7])
    chain = strategy.propose(batch).token_ids
    strategy.drafter.tree = HeadTreeDrafter(strategy.drafter, DynamicTree(1, 4, 4))
    trees = strategy.propose(batch).token_ids
    assert [t.token_ids for t in trees] == chain and all(t.is_chain for t in trees)


# --------------------------------------------------------------------------------------------
# the staged, static-buffer levels (the CUDA graph's function) against the per-level eager
# drafting they replaced
# --------------------------------------------------------------------------------------------
@torch.inference_mode()
def _legacy_trees(tree: HeadTreeDrafter, batch: SpecBatch, feats: torch.Tensor) -> list:
    """The trees of the per-level eager drafting (host lists staged before every level, the
    static tree's indices staged per depth) that ``HeadTreeDrafter.draft`` replaced: the
    reference the staged levels must equal exactly."""
    d = tree.drafter
    plan, _ = d.plan(batch, ahead=tree.max_rows())
    W = max(len(p.st.table) for p in plan)
    x = d.catch_up(batch, feats, plan, W)
    rows = [p for p in plan if p.k > 0]
    bs = d.cache.block_size

    def level(tok, xin):  # [A, F, D], [A, F, D, H] -> [A, F, H]
        A, F, D = tok.shape
        pos, slots, ctxs, tables, bits = [], [], [], [], []
        row_bits = [(((1 << (j + 1)) - 1) << (f * D)) for f in range(F) for j in range(D)]
        row_bits = [b - (1 << 64) if b >= 1 << 63 else b for b in row_bits]
        for p in rows:
            base = p.n - 1 - p.st.offset
            pos.extend(p.n - 1 + j for _ in range(F) for j in range(D))
            slots.extend(cache_slot(p.st.table, base + r, bs) for r in range(F * D))
            ctxs.append(base + F * D)
            tables.append(p.st.table + [0] * (W - len(p.st.table)))
            bits.extend(row_bits)
        n = A * F * D
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            context_lens=torch.tensor(ctxs, dtype=torch.int32),
            query_start_loc=torch.arange(0, n + 1, F * D, dtype=torch.int32),
            query_lens=[F * D] * A,
            context_lens_list=ctxs,
            block_size=bs,
            tree_bits=torch.tensor(bits),
        )
        fctx = ForwardContext(meta=meta, kv_caches=d.cache.kv_caches)
        out = d.head.step(tok.reshape(n), xin.reshape(n, -1), torch.tensor(pos), fctx)
        return out.view(A, F, D, -1)[:, :, D - 1]

    budgets = [min(batch.seqs[p.i].max_draft, tree.budget) for p in rows]
    A, H = x.shape
    if isinstance(tree.tree, DynamicTree):
        k, depth = tree.tree.topk, tree.tree.depth
        score, tok = tree._ranked(x, k)
        c_tok, c_score, c_par = [tok], [score], [torch.full((A, k), -1)]
        front = torch.arange(k).expand(A, k)
        path_tok, path_x, made = tok[:, :, None], x[:, None, None, :].expand(A, k, 1, H), k
        for _ in range(depth - 1):
            state = level(path_tok, path_x)
            v, ct = tree._ranked(state, k)
            cum, ct = (score[:, :, None] + v).reshape(A, k * k), ct.reshape(A, k * k)
            c_tok.append(ct)
            c_score.append(cum)
            c_par.append(front.repeat_interleave(k, dim=1))
            score, sel = cum.topk(k, dim=1)
            j, front, made = sel // k, made + sel, made + k * k
            path_tok = torch.cat(
                [
                    path_tok.gather(1, j[:, :, None].expand(-1, -1, path_tok.shape[2])),
                    ct.gather(1, sel)[:, :, None],
                ],
                dim=2,
            )
            parent = state.gather(1, j[:, :, None].expand(-1, -1, H))
            path_x = torch.cat(
                [
                    path_x.gather(1, j[:, :, None, None].expand(-1, -1, path_x.shape[2], H)),
                    parent[:, :, None],
                ],
                dim=2,
            )
        toks, scores, pars = (torch.cat(c, 1).tolist() for c in (c_tok, c_score, c_par))
        return [select_tree(toks[a], scores[a], pars[a], n) for a, n in enumerate(budgets)]
    s = tree.tree
    node_tok = torch.zeros(A, s.num_nodes, dtype=torch.long)
    node_in = x.new_zeros(A, s.num_nodes, H)
    for depth in range(1, s.depth + 1):
        nodes = [i for i in range(s.num_nodes) if s.depths[i] == depth]
        parents = sorted({s.parents[i] for i in nodes})
        if depth == 1:
            states = x[:, None]
        else:
            idx = torch.tensor([tree._path(s.parents, q) for q in parents])  # [F, d]
            states = level(node_tok[:, idx], node_in[:, idx])
        _, ranked = tree._ranked(states, s.width(depth))
        where = {q: f for f, q in enumerate(parents)}
        for i in nodes:
            node_tok[:, i] = ranked[:, where[s.parents[i]], s.ranks[i]]
            node_in[:, i] = states[:, where[s.parents[i]]]
    return [DraftTree(node_tok[a].tolist()[:n], s.parents[:n]) for a, n in enumerate(budgets)]


def _as_graph_on_cpu(monkeypatch, drafter) -> list:
    """The tree graphs' path on the CPU (tests/fake_graphs.py); the keys replayed."""
    return replay_on_cpu(monkeypatch, drafter.graphs)


@pytest.mark.parametrize("shape", ["dynamic", "static"])
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_staged_levels_equal_the_per_level_eager_trees(target, heads, method, shape, monkeypatch):
    """The staged levels (HeadTreeDrafter.draft) give exactly the trees of the per-level eager
    drafting, at batch 1 and 5, unpadded (the eager path) and padded to the graph's batch
    bucket and block-table width (the graph path, replayed eagerly on the CPU: 1 -> 1, 5 -> 8
    sequences)."""
    opts = {
        "dynamic": {"num_speculative_tokens": 4, "eagle_topk": 3, "num_draft_tokens": 12},
        "static": {"speculative_token_tree": str(VLLM_TREE)},
    }[shape]
    strategy = _llm(target, heads[method], **opts).engine.spec.strategy
    drafter = strategy.drafter
    for lengths in ([9], [5, 11, 8, 14, 6]):
        batch = _batch(strategy, lengths, seed=len(lengths))
        want = _legacy_trees(drafter.tree, batch, strategy.features(batch))
        assert [t.num_nodes for t in want] == [drafter.tree.budget] * len(lengths)
        assert strategy.propose(batch).token_ids == want  # eager: unpadded
        with monkeypatch.context() as m:
            keys = _as_graph_on_cpu(m, drafter)
            assert strategy.propose(batch).token_ids == want  # padded, through the graph's fn
            Bp = 1 if len(lengths) == 1 else 8
            assert keys == [("tree", Bp)]
            host = drafter.graphs.inputs[keys[0]][-1].numpy()  # the staged vector
            assert host.size == drafter.tree.num_ints(Bp, drafter.tree.graph_width)
            assert host[2 * Bp : 3 * Bp].tolist() == [1] * len(lengths) + [0] * (Bp - len(lengths))


def test_tree_graph_capture_on_padding_writes_no_kv(target, heads, monkeypatch):
    """Start-up capture in tree mode (HeadDrafter.capture_graphs): one tree graph per batch
    bucket up to max_num_seqs, on padding inputs that write no K/V (slot -1: on the CPU's torch
    path the cache's last slot, which no sequence here holds) and attend nothing."""
    strategy = _llm(target, heads["eagle"], **TREE_OPTIONS["dynamic"]).engine.spec.strategy
    drafter = strategy.drafter
    keys = _as_graph_on_cpu(monkeypatch, drafter)
    before = [k.clone() for pair in drafter.cache.kv_caches for k in pair]
    assert strategy.capture_graphs(max_num_seqs=8, progress=False) == 4
    assert keys == [("tree", b) for b in (1, 2, 4, 8)]
    after = [k for pair in drafter.cache.kv_caches for k in pair]
    for a, b in zip(before, after):
        assert torch.equal(a.flatten(0, 1)[:-1], b.flatten(0, 1)[:-1])


# --------------------------------------------------------------------------------------------
# end to end
# --------------------------------------------------------------------------------------------
TREE_OPTIONS = {
    "dynamic": {"num_speculative_tokens": 4, "eagle_topk": 3, "num_draft_tokens": 10},
    "static": {"speculative_token_tree": VLLM_TREE},
}


@pytest.mark.parametrize("bs", [1, 8])
@pytest.mark.parametrize("shape", ["dynamic", "static"])
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_greedy_with_trees_matches_plain_decoding(
    target, heads, prompts, reference, method, shape, bs
):
    llm = _llm(target, heads[method], **TREE_OPTIONS[shape])
    assert llm.engine.spec.name == method
    assert generate_ids(llm, prompts[:bs], greedy_params(bs)) == reference[:bs]
    m = llm.get_metrics()
    assert m.num_tree_drafts > 0 and m.num_faults == 0
    assert m.num_accepted_tokens > 0


@pytest.mark.parametrize("shape", ["dynamic", "static"])
def test_greedy_with_tree_graphs_replayed_on_cpu_matches_plain(
    target, heads, prompts, reference, shape, monkeypatch
):
    """The graph path (padded batch buckets, staged vector, graph-wide block tables) through
    the engine, its function "replayed" eagerly on the CPU: greedy output equals plain."""
    llm = _llm(target, heads["eagle3"], **TREE_OPTIONS[shape])
    keys = _as_graph_on_cpu(monkeypatch, llm.engine.spec.strategy.drafter)
    assert generate_ids(llm, prompts, greedy_params(8)) == reference
    assert llm.get_metrics().num_tree_drafts > 0 and 8 in {k[1] for k in keys}


def test_sampled_requests_draft_trees_and_are_reproducible(target, heads, prompts):
    """Point-mass trees for sampled requests too (lossless by the engine's sample-and-follow
    rule); a seeded request gives the same tokens alone and in a batch."""
    llm = _llm(target, heads["eagle"], **TREE_OPTIONS["dynamic"])
    params = [
        SamplingParams(temperature=0.8, top_p=0.95, seed=11 + i, max_tokens=12, ignore_eos=True)
        for i in range(4)
    ]
    together = generate_ids(llm, prompts[:4], params)
    assert llm.get_metrics().num_tree_drafts > 0
    assert [generate_ids(llm, [p], [q])[0] for p, q in zip(prompts[:4], params)] == together


@pytest.mark.parametrize(
    "opts, words",
    [
        ({"eagle_topk": 4, "speculative_token_tree": [(0,)]}, "set one or the other"),
        ({"num_draft_tokens": 3, "num_speculative_tokens": 4}, "with eagle_topk=1"),
        (
            {"eagle_topk": 2, "num_speculative_tokens": 3, "num_draft_tokens": 40},
            "at most 10 candidate nodes",
        ),
        ({"eagle_topk": 20, "num_speculative_tokens": 5}, "lower eagle_topk"),
        ({"eagle_topk": 4, "num_draft_tokens": 65}, "num_draft_tokens"),
        ({"speculative_token_tree": "[(0, 0)]"}, "no parent"),
        ({"speculative_token_tree": [(0,), (1,)], "num_speculative_tokens": 3}, "node count"),
    ],
)
def test_tree_option_errors(target, heads, opts, words):
    with pytest.raises(StrategyError, match=words):
        _llm(target, heads["eagle"], **opts)


# --------------------------------------------------------------------------------------------
# CUDA: the head's levels through the Triton paged-attention kernel's tree mask
# --------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_cuda_tree_levels_and_greedy_output(target, heads, prompts, method):
    """On CUDA: the eager levels (graphs off) match a path-by-path re-run through the Triton
    kernel's tree mask; with graphs on, the tree graphs of batch buckets 1-8 are captured at
    start-up and every propose replays them (no level runs eagerly), the replayed trees' nodes
    are the re-run paths' top tokens, and greedy output equals plain."""
    cuda = {
        "device": "cuda",
        "dtype": "float32",
        "skip_tokenizer_init": True,
        "max_num_seqs": 8,
        "kv_cache_memory": 1 << 26,
    }
    plain = generate_ids(LLM(model=str(target), **cuda), prompts, greedy_params(8))
    for opts in TREE_OPTIONS.values():
        llm = LLM(
            model=str(target), **cuda, speculative_config={"model": str(heads[method]), **opts}
        )
        strategy = llm.engine.spec.strategy
        graphs = strategy.drafter.graphs
        assert {("tree", b) for b in (1, 2, 4, 8)} <= set(graphs.graphs)  # start-up capture
        batch = _batch(strategy, [5, 11, 8])
        for name in ("hidden_states", "aux_hidden_states"):
            if getattr(batch, name) is not None:
                setattr(batch, name, getattr(batch, name).cuda())
        graphs.enabled = False  # the same levels, eagerly, recorded level by level
        try:
            trees, levels = _propose_recording(strategy, batch)
        finally:
            graphs.enabled = True
        _check_against_paths(strategy, batch, trees, levels, lambda *a: None)
        replayed, none = _propose_recording(strategy, batch)  # the graph of bucket 4
        assert none == [] and [t.num_nodes for t in replayed] == [t.num_nodes for t in trees]

        def near_top(tree, node, ranked):  # tf32 attention: a near tie may swap ranks
            assert tree.token_ids[node] in ranked[:4], (node, ranked)

        _check_against_paths(strategy, batch, replayed, [], near_top)
        tree, eager_levels = strategy.drafter.tree, []
        real = tree._level

        def spy(*args, real=real, eager_levels=eager_levels):  # a level run eagerly
            eager_levels.append(args[1])
            return real(*args)

        tree._level = spy
        try:
            assert generate_ids(llm, prompts, greedy_params(8)) == plain
        finally:
            del tree._level
        assert eager_levels == [] and llm.get_metrics().num_tree_drafts > 0
