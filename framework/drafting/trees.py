"""Token-tree drafting (docs/strategies.md "Token trees"): the tree shapes learned strategies
propose instead of one chain, and the builders that fill them.

* :class:`TokenTreeShape`: a static tree given as the list of its root paths of sibling ranks
  (vLLM's ``speculative_token_tree``, Medusa's ``medusa_choices``): ``(0,)`` is the root's best
  child, ``(1, 0)`` the best child of its second-best child. :func:`fill_static_tree` fills one
  from per-depth ranked tokens (Medusa: head ``d``'s top-k is the same for every parent).
* :func:`select_tree`: EAGLE-2's final step, the best ``budget`` candidates by cumulative draft
  probability (ancestors of a kept node always kept), renumbered parents before children.
* :class:`HeadTreeDrafter`: trees drafted by a :class:`~speculant.drafting.HeadDrafter`'s head
  (EAGLE-1, EAGLE-3): EAGLE-2's dynamic tree (:class:`DynamicTree`, expand the ``topk`` best
  frontier nodes by cumulative probability for ``depth`` levels, keep the best ``budget``
  nodes) or a static :class:`TokenTreeShape` (each node's children: its head output's top
  ranks).

Every tree here holds deterministic top-k tokens: ``DraftTree.probs`` is None (point masses).
That is lossless for greedy AND sampled requests: the engine verifies a point-mass tree with
``verify_tree_sampled``, which then amounts to drawing from the target and following the child
holding that token (docs/trees.md, "Why the sampled rule is lossless"); sampled requests accept
less than with sampled drafts, never a different distribution.

The head's attention over the tree: at level ``d`` every frontier node's root path (``d``
nodes) is run as its own chain of rows in one forward, every row seeing the sequence's cached
context and the earlier rows of its own path only (``AttentionMetadata.tree_bits``, the tree
mask of the paged-attention kernel). Ancestors shared by several frontier nodes are recomputed
once per path: ``F * d`` rows per sequence at level ``d`` (``F`` frontier nodes), at most
``TREE_MAX_ROWS`` (64), in exchange for no per-node K/V bookkeeping between levels. The levels
run eagerly (no CUDA graph), with one host read per call at the end.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import BaseModel, Field, model_validator

from speculant.drafting.graphs import to_device_async
from speculant.drafting.kv_cache import cache_slot
from speculant.engine.staging import read_back
from speculant.models.attention import AttentionMetadata, ForwardContext
from speculant.spec_types import MAX_TREE_NODES, DraftTree, Proposal, SpecBatch

# query rows of one sequence in one tree-attention forward (one int64 of visibility bits a row)
TREE_MAX_ROWS = 64


class TokenTreeError(ValueError):
    """A tree shape or tree option that cannot be used; the message names the problem and fix."""


# ---------------------------------------------------------------------------------------------
# static shapes
# ---------------------------------------------------------------------------------------------
def parse_token_tree(value: Any, name: str = "speculative_token_tree") -> list[tuple[int, ...]]:
    """The root paths of a static tree, from a list of tuples / lists of sibling ranks or its
    string form (``"[(0,), (1,), (0, 0)]"``, as vLLM's ``speculative_token_tree``). Checks
    each path: non-empty, ranks non-negative ints, every proper prefix also listed, no
    duplicates; at most ``MAX_TREE_NODES`` paths. Raises :class:`TokenTreeError` naming
    ``name``."""
    if isinstance(value, str):
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise TokenTreeError(f"{name}={value!r} is not a Python literal; write it as a list "
                                 "of tuples of sibling ranks, e.g. [(0,), (1,), (0, 0)]") from None
    if not isinstance(value, (list, tuple)) or not value:
        raise TokenTreeError(f"{name} must be a non-empty list of paths (tuples of sibling "
                             f"ranks, e.g. [(0,), (1,), (0, 0)]), got {value!r}")
    paths: list[tuple[int, ...]] = []
    for p in value:
        if isinstance(p, int) and not isinstance(p, bool):
            p = (p,)
        if not isinstance(p, (list, tuple)) or not p or not all(
                isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in p):
            raise TokenTreeError(f"{name}: path {p!r} is not a non-empty tuple of sibling ranks "
                                 ">= 0 (rank 0 = the parent's most likely child)")
        paths.append(tuple(p))
    if len(set(paths)) != len(paths):
        dup = next(p for p in paths if paths.count(p) > 1)
        raise TokenTreeError(f"{name}: path {dup} is listed twice; list each node once")
    have = set(paths)
    for p in paths:
        if len(p) > 1 and p[:-1] not in have:
            raise TokenTreeError(f"{name}: path {p} has no parent {p[:-1]} in the list; list "
                                 "every node's parent too")
    if len(paths) > MAX_TREE_NODES:
        raise TokenTreeError(f"{name} has {len(paths)} nodes; a tree has at most "
                             f"{MAX_TREE_NODES} (MAX_TREE_NODES); use fewer paths")
    return paths


class TokenTreeShape:
    """A static tree: ``paths`` (:func:`parse_token_tree`) sorted by depth, then rank by rank,
    so parents come before children and siblings in rank order. ``parents[i]``: node ``i``'s
    parent (-1: the root); ``ranks[i]``: its rank among the parent's candidates (0 = the most
    likely); ``depths[i]``: 1 for children of the root.

    >>> s = TokenTreeShape([(1,), (0, 0), (0,)])
    >>> s.paths, s.parents, s.ranks
    ([(0,), (1,), (0, 0)], [-1, -1, 0], [0, 1, 0])
    """

    def __init__(self, paths: Any, name: str = "speculative_token_tree") -> None:
        self.paths = sorted(parse_token_tree(paths, name), key=lambda p: (len(p), p))
        index = {p: i for i, p in enumerate(self.paths)}
        self.parents = [index[p[:-1]] if len(p) > 1 else -1 for p in self.paths]
        self.ranks = [p[-1] for p in self.paths]
        self.depths = [len(p) for p in self.paths]
        self.depth = max(self.depths)

    @property
    def num_nodes(self) -> int:
        return len(self.paths)

    def width(self, depth: int) -> int:
        """How many ranked candidates level ``depth`` needs: 1 + its highest rank."""
        return 1 + max(r for r, d in zip(self.ranks, self.depths) if d == depth)

    def expanded(self, depth: int) -> list[int]:
        """The nodes of ``depth`` that have children, in index order."""
        has = set(self.parents)
        return [i for i, d in enumerate(self.depths) if d == depth and i in has]

    def max_rows(self) -> int:
        """The most query rows per sequence a head's level forward needs (``F * d``)."""
        return max((len(self.expanded(d)) * d for d in range(1, self.depth)), default=0)


def fill_static_tree(
    shape: TokenTreeShape,
    ranked: Sequence[Sequence[int]],  # [depth][>= width(depth)] token ids, best first
    max_nodes: int | None = None,
) -> DraftTree:
    """The tree of ``shape`` whose node at depth ``d`` and rank ``r`` holds ``ranked[d - 1][r]``:
    the tokens of a level do not depend on the parent (Medusa: head ``d - 1`` reads the same
    state for every node). ``max_nodes``: keep only the first nodes (a prefix of index order is
    a tree). Point masses (``probs`` None).

    >>> fill_static_tree(TokenTreeShape([(0,), (1,), (0, 0)]), [[5, 7], [3]])
    DraftTree(token_ids=[5, 7, 3], parents=[-1, -1, 0], probs=None)
    """
    n = shape.num_nodes if max_nodes is None else min(max_nodes, shape.num_nodes)
    toks = [int(ranked[shape.depths[i] - 1][shape.ranks[i]]) for i in range(n)]
    return DraftTree(toks, shape.parents[:n])


# ---------------------------------------------------------------------------------------------
# dynamic trees (EAGLE-2)
# ---------------------------------------------------------------------------------------------
def select_tree(
    token_ids: Sequence[int],  # [C] candidates' tokens
    scores: Sequence[float],  # [C] cumulative draft log-probability (or probability)
    parents: Sequence[int],  # [C] each candidate's parent candidate (-1: the root), earlier
    budget: int,
) -> DraftTree:
    """EAGLE-2's final selection: the ``budget`` best candidates by cumulative score, a node
    taken only with its parent (ancestors of a kept node are always kept: a node whose parent
    was not taken is skipped, which cumulative scores that never grow along a path make moot),
    renumbered in candidate order (parents before children). Ties: the earlier candidate.

    >>> select_tree([4, 9, 2, 6], [-0.1, -0.5, -0.3, -2.0], [-1, -1, 0, 0], 3)
    DraftTree(token_ids=[4, 9, 2], parents=[-1, -1, 0], probs=None)
    """
    C = len(token_ids)
    order = sorted(range(C), key=lambda c: (-float(scores[c]), c))
    kept: set[int] = set()
    for c in order:
        if len(kept) >= budget:
            break
        p = int(parents[c])
        if p < 0 or p in kept:
            kept.add(c)
    nodes = sorted(kept)
    new = {c: i for i, c in enumerate(nodes)}
    return DraftTree([int(token_ids[c]) for c in nodes],
                     [new[int(parents[c])] if parents[c] >= 0 else -1 for c in nodes])


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2's dynamic tree: ``topk`` children per expanded node and ``topk`` expanded nodes
    per level, ``depth`` levels, the best ``budget`` nodes kept (SGLang's
    ``speculative_eagle_topk``, ``speculative_num_steps``, ``speculative_num_draft_tokens``)."""

    topk: int
    depth: int
    budget: int

    def __post_init__(self) -> None:
        if self.topk < 1 or self.depth < 1 or self.budget < 1:
            raise TokenTreeError(f"{self}: topk, depth and budget must be >= 1")
        if self.budget > MAX_TREE_NODES:
            raise TokenTreeError(f"num_draft_tokens={self.budget}: a tree has at most "
                                 f"{MAX_TREE_NODES} nodes (MAX_TREE_NODES)")
        if self.max_rows() > TREE_MAX_ROWS:
            raise TokenTreeError(
                f"eagle_topk={self.topk} x (num_speculative_tokens - 1 = {self.depth - 1}) = "
                f"{self.max_rows()} query rows per sequence in the head's last level; the tree "
                f"mask covers at most {TREE_MAX_ROWS}: lower eagle_topk or num_speculative_tokens")

    @property
    def num_candidates(self) -> int:
        return self.topk + (self.depth - 1) * self.topk * self.topk

    def max_rows(self) -> int:
        return self.topk * (self.depth - 1)


# ---------------------------------------------------------------------------------------------
# options
# ---------------------------------------------------------------------------------------------
class TreeOptions(BaseModel):
    """The tree options of a learned strategy's ``Config`` (mix it into a pydantic options
    class; chains stay the default). ``eagle_topk`` > 1 asks for EAGLE-2's dynamic tree of
    depth ``num_speculative_tokens`` (the class's own field); ``speculative_token_tree`` for a
    static tree. :meth:`tree_shape` gives the shape (None: a chain)."""

    eagle_topk: int = Field(
        1, ge=1, le=TREE_MAX_ROWS, description="EAGLE-2 dynamic tree (SGLang's "
        "speculative_eagle_topk): children drafted per expanded node and nodes expanded per "
        "level, num_speculative_tokens levels; 1: a chain")
    num_draft_tokens: int | None = Field(
        None, ge=2, le=MAX_TREE_NODES + 1, description="tokens verified per step with a dynamic "
        "tree, the last token included (SGLang's speculative_num_draft_tokens): the tree keeps "
        "the best num_draft_tokens - 1 nodes by cumulative draft probability; default "
        "min(eagle_topk * num_speculative_tokens, 63) + 1")
    speculative_token_tree: str | list[tuple[int, ...]] | None = Field(
        None, description="a static tree (vLLM's option): its nodes as paths of sibling "
        "ranks from the root, e.g. [(0,), (1,), (0, 0)] or its string form; each node's "
        "children are the top ranks of the head's output after its path")

    @model_validator(mode="after")
    def _check_tree(self) -> TreeOptions:
        self.tree_shape()
        return self

    def tree_shape(self) -> DynamicTree | TokenTreeShape | None:
        """The tree these options ask for, or None for a chain; :class:`TokenTreeError` (a
        ``ValueError``) for contradictory options."""
        k = getattr(self, "num_speculative_tokens", None)
        topk, n = self.eagle_topk, self.num_draft_tokens
        if self.speculative_token_tree is not None:
            if topk > 1 or n is not None:
                raise TokenTreeError(
                    "speculative_token_tree gives a static tree; eagle_topk and "
                    "num_draft_tokens shape a dynamic one: set one or the other")
            shape = TokenTreeShape(self.speculative_token_tree)
            if k is not None and "num_speculative_tokens" in self.model_fields_set and \
                    k != shape.num_nodes:
                raise TokenTreeError(
                    f"num_speculative_tokens={k} but speculative_token_tree has "
                    f"{shape.num_nodes} nodes: with a token tree it is the node count (as in "
                    f"vLLM); set num_speculative_tokens={shape.num_nodes} or leave it out")
            if shape.max_rows() > TREE_MAX_ROWS:
                raise TokenTreeError(
                    f"speculative_token_tree: a level needs {shape.max_rows()} head rows per "
                    f"sequence (expanded nodes x depth), more than {TREE_MAX_ROWS}; use a "
                    "narrower or shallower tree")
            return shape
        if topk == 1:
            if n is not None and k is not None and n != k + 1:
                raise TokenTreeError(
                    f"num_draft_tokens={n} with eagle_topk=1: the drafts are a chain of "
                    f"num_speculative_tokens={k}, so {k + 1} tokens are verified; set "
                    "eagle_topk > 1 for a tree, or leave num_draft_tokens out")
            return None
        if k is None:
            raise TokenTreeError("eagle_topk > 1 needs num_speculative_tokens (the depth)")
        tree = DynamicTree(topk, k, min(topk * k, MAX_TREE_NODES) if n is None else n - 1)
        if tree.budget > tree.num_candidates:
            raise TokenTreeError(
                f"num_draft_tokens={n}: eagle_topk={topk} and num_speculative_tokens={k} make "
                f"at most {tree.num_candidates} candidate nodes; set num_draft_tokens <= "
                f"{tree.num_candidates + 1}")
        return tree


# ---------------------------------------------------------------------------------------------
# a head drafter's trees
# ---------------------------------------------------------------------------------------------
def _signed(b: int) -> int:
    return b - (1 << 64) if b >= 1 << 63 else b


class HeadTreeDrafter:
    """Trees drafted with a :class:`~speculant.drafting.HeadDrafter`'s head (``drafter``), in
    the shape ``tree`` (:class:`DynamicTree` or :class:`TokenTreeShape`). Set it as
    ``drafter.tree`` and the drafter's ``propose`` returns its proposals. Every drafting
    sequence gets a :class:`DraftTree` of at most ``min(max_draft, tree budget)`` nodes; the
    head's cache must hold ``max_rows()`` positions past a sequence's context
    (``DraftKVCache.for_head(ctx, head, max_rows() + 1)``)."""

    def __init__(self, drafter: Any, tree: DynamicTree | TokenTreeShape) -> None:
        self.drafter = drafter
        self.tree = tree

    @property
    def budget(self) -> int:
        """The most nodes of a tree: what the strategy's ``num_speculative_tokens`` (the engine's
        per-sequence draft limit) should be in tree mode."""
        t = self.tree
        return t.budget if isinstance(t, DynamicTree) else t.num_nodes

    def max_rows(self) -> int:
        return self.tree.max_rows()

    # -- one level's forward -------------------------------------------------------------------
    def _level(
        self,
        rows: list,  # the plan's drafting sequences (CatchUp)
        tok: torch.Tensor,  # [A, F, d] int64: each frontier path's tokens, root side first
        xin: torch.Tensor,  # [A, F, d, H] the state that chose each of them
        W: int,
    ) -> torch.Tensor:  # [A, F, H] each frontier node's output state
        """The head over every frontier path (``F * d`` rows a sequence, a path's rows seeing
        the context and the path's earlier rows only), writing K/V past the context."""
        d = self.drafter
        A, F, D = tok.shape
        bs = d.cache.block_size
        pos, slots, ctxs, tables, bits = [], [], [], [], []
        row_bits = [_signed(((1 << (j + 1)) - 1) << (f * D)) for f in range(F) for j in range(D)]
        for p in rows:
            base = p.n - 1 - p.st.offset  # cache index of the first in-step row
            pos.extend(p.n - 1 + j for _ in range(F) for j in range(D))
            slots.extend(cache_slot(p.st.table, base + r, bs) for r in range(F * D))
            ctxs.append(base + F * D)
            tables.append(p.st.table + [0] * (W - len(p.st.table)))
            bits.extend(row_bits)
        dev = tok.device
        ints = to_device_async(list(itertools.chain(pos, slots, ctxs, bits,
                                                    itertools.chain.from_iterable(tables))),
                               torch.long, dev)
        n = A * F * D
        pos_t, slots_t = ints[:n], ints[n:2 * n]
        ctx_t, bits_t = ints[2 * n:2 * n + A], ints[2 * n + A:3 * n + A]
        tab_t = ints[3 * n + A:].view(A, W)
        meta = AttentionMetadata(
            slot_mapping=slots_t, block_tables=tab_t.to(torch.int32),
            context_lens=ctx_t.to(torch.int32),
            query_start_loc=torch.arange(0, n + 1, F * D, device=dev, dtype=torch.int32),
            query_lens=[F * D] * A, context_lens_list=ctxs, block_size=bs,
            tree_bits=bits_t.contiguous())
        fctx = ForwardContext(meta=meta, kv_caches=d.cache.kv_caches)
        out = d.head.step(tok.reshape(n), xin.reshape(n, -1), pos_t, fctx)  # [n, H]
        return out.view(A, F, D, -1)[:, :, D - 1]

    def _ranked(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's ``k`` best tokens after states ``x [..., H]`` and their log-probabilities:
        (``[..., k]`` float32, ``[..., k]`` int64), best first."""
        logp = torch.log_softmax(self.drafter.head.logits(x.reshape(-1, x.shape[-1])), dim=-1)
        v, t = logp.topk(k, dim=-1)  # [rows, k]
        return v.view(*x.shape[:-1], k), t.view(*x.shape[:-1], k)

    # -- the two shapes -------------------------------------------------------------------------
    def _dynamic(self, rows: list, x: torch.Tensor, W: int, budgets: list[int]
                 ) -> list[DraftTree]:
        """EAGLE-2: per level, the ``topk`` best children of each of the ``topk`` frontier
        nodes; the new frontier is the ``topk`` best of those by cumulative log-probability."""
        t: DynamicTree = self.tree  # type: ignore[assignment]
        k, A = t.topk, x.shape[0]
        score, tok = self._ranked(x, k)  # [A, k] each: the root's children
        c_tok, c_score = [tok], [score]
        c_par = [torch.full((A, k), -1, dtype=torch.long, device=x.device)]
        front = torch.arange(k, device=x.device).expand(A, k)  # [A, k] candidate index
        path_tok = tok[:, :, None]  # [A, k, 1]
        path_x = x[:, None, None, :].expand(A, k, 1, x.shape[-1])  # [A, k, 1, H]
        made = k
        for _ in range(t.depth - 1):
            state = self._level(rows, path_tok, path_x, W)  # [A, k, H]
            v, ct = self._ranked(state, k)  # [A, k, k]
            cum = (score[:, :, None] + v).reshape(A, k * k)  # [A, k * k]
            ct = ct.reshape(A, k * k)
            c_tok.append(ct)
            c_score.append(cum)
            c_par.append(front.repeat_interleave(k, dim=1))  # child j * k + i: parent slot j
            score, sel = cum.topk(k, dim=1)  # [A, k] the new frontier, best first
            j = sel // k  # its parents' frontier slots
            front = made + sel
            made += k * k
            gj = j[:, :, None].expand(-1, -1, path_tok.shape[2])
            new_tok = ct.gather(1, sel)[:, :, None]
            path_tok = torch.cat([path_tok.gather(1, gj), new_tok], dim=2)
            hx = j[:, :, None, None].expand(-1, -1, path_x.shape[2], path_x.shape[3])
            parent_state = state.gather(1, j[:, :, None].expand(-1, -1, state.shape[2]))
            path_x = torch.cat([path_x.gather(1, hx), parent_state[:, :, None]], dim=2)
        # one read: tokens, scores and parents as float64 (exact for ids)
        toks, scores, pars = read_back(torch.stack([torch.cat(c, 1).double()
                                                    for c in (c_tok, c_score, c_par)]))
        toks = [[int(v) for v in r] for r in toks]
        pars = [[int(v) for v in r] for r in pars]
        return [select_tree(toks[a], scores[a], pars[a], n) for a, n in enumerate(budgets)]

    def _static(self, rows: list, x: torch.Tensor, W: int, budgets: list[int]
                ) -> list[DraftTree]:
        """A :class:`TokenTreeShape`: each expanded node's children are the top ranks of the
        head's output after its path."""
        s: TokenTreeShape = self.tree  # type: ignore[assignment]
        A, H = x.shape
        node_tok = torch.zeros(A, s.num_nodes, dtype=torch.long, device=x.device)
        node_in = x.new_zeros(A, s.num_nodes, H)  # the state that chose each node
        for depth in range(1, s.depth + 1):
            level = [i for i in range(s.num_nodes) if s.depths[i] == depth]
            parents = sorted({s.parents[i] for i in level})
            if depth == 1:
                states = x[:, None]  # [A, 1, H] the root's
            else:  # run the head over the parents' root paths
                chains = [self._path(s.parents, q) for q in parents]  # [F][depth - 1]
                idx = to_device_async(list(itertools.chain.from_iterable(chains)), torch.long,
                                      x.device).view(len(parents), depth - 1)  # [F, d]
                ptok = node_tok[:, idx]  # [A, F, d]
                pin = node_in[:, idx]  # [A, F, d, H]
                states = self._level(rows, ptok, pin, W)  # [A, F, H]
            _, ranked = self._ranked(states, s.width(depth))  # [A, F, width]
            where = {q: f for f, q in enumerate(parents)}
            for i in level:
                f = where[s.parents[i]]
                node_tok[:, i] = ranked[:, f, s.ranks[i]]
                node_in[:, i] = states[:, f]
        toks = read_back(node_tok)  # [A][n]
        return [DraftTree(toks[a][:n], s.parents[:n]) for a, n in enumerate(budgets)]

    @staticmethod
    def _path(parents: list[int], node: int) -> list[int]:
        out = []
        while node >= 0:
            out.append(node)
            node = parents[node]
        return out[::-1]

    def propose(self, batch: SpecBatch, feats: torch.Tensor | None) -> Proposal:
        """A tree per drafting sequence of ``batch`` from the target's features ``feats``
        ``[rows, F]`` (the rows of ``batch.hidden_counts``); others get no drafts."""
        d = self.drafter
        B = len(batch.seqs)
        out: list[list[int] | DraftTree] = [[] for _ in range(B)]
        if feats is None or not B:
            return Proposal(token_ids=out)
        plan, _ = d.plan(batch, ahead=self.max_rows())
        if not plan:
            return Proposal(token_ids=out)
        W = max(len(p.st.table) for p in plan)
        x = d.catch_up(batch, feats, plan, W)  # [drafting sequences, H]
        rows = [p for p in plan if p.k > 0]
        if not rows:
            return Proposal(token_ids=out)
        build = self._dynamic if isinstance(self.tree, DynamicTree) else self._static
        budgets = [min(batch.seqs[p.i].max_draft, self.budget) for p in rows]
        for p, tree in zip(rows, build(rows, x, W, budgets)):
            out[p.i] = tree
        return Proposal(token_ids=out)


__all__ = [
    "DynamicTree",
    "HeadTreeDrafter",
    "TREE_MAX_ROWS",
    "TokenTreeError",
    "TokenTreeShape",
    "TreeOptions",
    "fill_static_tree",
    "parse_token_tree",
    "select_tree",
]
