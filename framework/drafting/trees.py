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
``TREE_MAX_ROWS`` (64), in exchange for no per-node K/V bookkeeping between levels.

A propose runs the drafter's catch-up eagerly, then all levels as one function of static
device buffers (:meth:`HeadTreeDrafter.draft`: the inputs of every level staged up front as one
int64 vector, :class:`TreeInputs`): on a GPU one CUDA graph replay per call
(:mod:`speculant.drafting.tree_graph`, captured at start-up for every batch bucket), on the CPU,
with ``enforce_eager`` or for calls no graph fits the same function eagerly. One host read per
call at the end.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, Field, model_validator

from speculant.drafting import tree_graph
from speculant.drafting.graphs import to_device_async
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
            raise TokenTreeError(
                f"{name}={value!r} is not a Python literal; write it as a list "
                "of tuples of sibling ranks, e.g. [(0,), (1,), (0, 0)]"
            ) from None
    if not isinstance(value, (list, tuple)) or not value:
        raise TokenTreeError(
            f"{name} must be a non-empty list of paths (tuples of sibling "
            f"ranks, e.g. [(0,), (1,), (0, 0)]), got {value!r}"
        )
    paths: list[tuple[int, ...]] = []
    for p in value:
        if isinstance(p, int) and not isinstance(p, bool):
            p = (p,)
        if (
            not isinstance(p, (list, tuple))
            or not p
            or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in p)
        ):
            raise TokenTreeError(
                f"{name}: path {p!r} is not a non-empty tuple of sibling ranks "
                ">= 0 (rank 0 = the parent's most likely child)"
            )
        paths.append(tuple(p))
    if len(set(paths)) != len(paths):
        dup = next(p for p in paths if paths.count(p) > 1)
        raise TokenTreeError(f"{name}: path {dup} is listed twice; list each node once")
    have = set(paths)
    for p in paths:
        if len(p) > 1 and p[:-1] not in have:
            raise TokenTreeError(
                f"{name}: path {p} has no parent {p[:-1]} in the list; list every node's parent too"
            )
    if len(paths) > MAX_TREE_NODES:
        raise TokenTreeError(
            f"{name} has {len(paths)} nodes; a tree has at most "
            f"{MAX_TREE_NODES} (MAX_TREE_NODES); use fewer paths"
        )
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
    return DraftTree(
        [int(token_ids[c]) for c in nodes],
        [new[int(parents[c])] if parents[c] >= 0 else -1 for c in nodes],
    )


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
            raise TokenTreeError(
                f"num_draft_tokens={self.budget}: a tree has at most "
                f"{MAX_TREE_NODES} nodes (MAX_TREE_NODES)"
            )
        if self.max_rows() > TREE_MAX_ROWS:
            raise TokenTreeError(
                f"eagle_topk={self.topk} x (num_speculative_tokens - 1 = {self.depth - 1}) = "
                f"{self.max_rows()} query rows per sequence in the head's last level; the tree "
                f"mask covers at most {TREE_MAX_ROWS}: lower eagle_topk or num_speculative_tokens"
            )

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
        1,
        ge=1,
        le=TREE_MAX_ROWS,
        description="EAGLE-2 dynamic tree (SGLang's "
        "speculative_eagle_topk): children drafted per expanded node and nodes expanded per "
        "level, num_speculative_tokens levels; 1: a chain",
    )
    num_draft_tokens: int | None = Field(
        None,
        ge=2,
        le=MAX_TREE_NODES + 1,
        description="tokens verified per step with a dynamic "
        "tree, the last token included (SGLang's speculative_num_draft_tokens): the tree keeps "
        "the best num_draft_tokens - 1 nodes by cumulative draft probability; default "
        "min(eagle_topk * num_speculative_tokens, 63) + 1",
    )
    speculative_token_tree: str | list[tuple[int, ...]] | None = Field(
        None,
        description="a static tree (vLLM's option): its nodes as paths of sibling "
        "ranks from the root, e.g. [(0,), (1,), (0, 0)] or its string form; each node's "
        "children are the top ranks of the head's output after its path",
    )

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
                    "num_draft_tokens shape a dynamic one: set one or the other"
                )
            shape = TokenTreeShape(self.speculative_token_tree)
            if (
                k is not None
                and "num_speculative_tokens" in self.model_fields_set
                and k != shape.num_nodes
            ):
                raise TokenTreeError(
                    f"num_speculative_tokens={k} but speculative_token_tree has "
                    f"{shape.num_nodes} nodes: with a token tree it is the node count (as in "
                    f"vLLM); set num_speculative_tokens={shape.num_nodes} or leave it out"
                )
            if shape.max_rows() > TREE_MAX_ROWS:
                raise TokenTreeError(
                    f"speculative_token_tree: a level needs {shape.max_rows()} head rows per "
                    f"sequence (expanded nodes x depth), more than {TREE_MAX_ROWS}; use a "
                    "narrower or shallower tree"
                )
            return shape
        if topk == 1:
            if n is not None and k is not None and n != k + 1:
                raise TokenTreeError(
                    f"num_draft_tokens={n} with eagle_topk=1: the drafts are a chain of "
                    f"num_speculative_tokens={k}, so {k + 1} tokens are verified; set "
                    "eagle_topk > 1 for a tree, or leave num_draft_tokens out"
                )
            return None
        if k is None:
            raise TokenTreeError("eagle_topk > 1 needs num_speculative_tokens (the depth)")
        tree = DynamicTree(topk, k, min(topk * k, MAX_TREE_NODES) if n is None else n - 1)
        if tree.budget > tree.num_candidates:
            raise TokenTreeError(
                f"num_draft_tokens={n}: eagle_topk={topk} and num_speculative_tokens={k} make "
                f"at most {tree.num_candidates} candidate nodes; set num_draft_tokens <= "
                f"{tree.num_candidates + 1}"
            )
        return tree


# ---------------------------------------------------------------------------------------------
# a head drafter's trees
# ---------------------------------------------------------------------------------------------
def _signed(b: int) -> int:
    return b - (1 << 64) if b >= 1 << 63 else b


@dataclass(frozen=True)
class TreeInputs:
    """The int64 inputs of one call of :meth:`HeadTreeDrafter.draft`, views into its staged
    vector (``Bp`` sequences, the drafting ones first, then padding; block tables ``W`` wide).
    Layout of the vector::

        first positions [Bp] | cache indices [Bp] | live [Bp] | block tables [Bp, W] | constants

    A sequence's first in-step row (its last token) is at position ``pos0`` and cache index
    ``base``; the constants (the tree shape's, the same every call) are each level's path-row
    indices and tree bits, and a static tree's node indices (``HeadTreeDrafter`` keeps their
    offsets). A padding sequence (``live`` 0) writes no K/V and attends nothing."""

    pos0: torch.Tensor  # [Bp] int64: position of the sequence's first in-step row (n - 1)
    base: torch.Tensor  # [Bp] int64: its cache index (n - 1 - the cache's offset)
    live: torch.Tensor  # [Bp] int64: 1 a drafting sequence, 0 padding
    tables: torch.Tensor  # [Bp, W] int64: the draft cache's block tables, zero-padded
    tables32: torch.Tensor  # [Bp, W] int32: the same, for the attention kernel
    consts: torch.Tensor  # [n_consts] int64: the tree shape's constants

    @classmethod
    def views(cls, ints: torch.Tensor, Bp: int, W: int) -> TreeInputs:
        """The parts of ``ints`` (``[3 * Bp + Bp * W + n_consts]``)."""
        t = 3 * Bp + Bp * W
        tables = ints[3 * Bp : t].view(Bp, W)
        return cls(
            ints[:Bp],
            ints[Bp : 2 * Bp],
            ints[2 * Bp : 3 * Bp],
            tables,
            tables.to(torch.int32),
            ints[t:],
        )


class HeadTreeDrafter:
    """Trees drafted with a :class:`~speculant.drafting.HeadDrafter`'s head (``drafter``), in
    the shape ``tree`` (:class:`DynamicTree` or :class:`TokenTreeShape`). Set it as
    ``drafter.tree`` and the drafter's ``propose`` returns its proposals. Every drafting
    sequence gets a :class:`DraftTree` of at most ``min(max_draft, tree budget)`` nodes; the
    head's cache must hold ``max_rows()`` positions past a sequence's context
    (``DraftKVCache.for_head(ctx, head, max_rows() + 1)``).

    A call runs the drafter's (eager) catch-up, then :meth:`draft`: every level of the tree as
    a pure function of one staged int64 vector (:meth:`write_ints`, :class:`TreeInputs`) and the
    catch-up's states, with shapes fixed by the padded batch ``Bp`` and the block-table width
    ``W``. On a GPU with the drafter's ``graphs`` enabled it is one CUDA graph replay per call
    (:mod:`speculant.drafting.tree_graph`; ``Bp`` a batch bucket, ``W`` = ``graph_width``);
    elsewhere the same function runs eagerly (``Bp`` = the drafting sequences)."""

    def __init__(self, drafter: Any, tree: DynamicTree | TokenTreeShape) -> None:
        self.drafter = drafter
        self.tree = tree
        # block-table width of the graphs: the drafter's, plus the blocks of a level's rows
        self.graph_width: int = drafter.graph_width + -(
            -self.max_rows() // drafter.cache.block_size
        )
        self._levels: list[tuple[int, int, int]] = []  # per head level: (F, d, constants offset)
        self._fills: list[tuple[int, int, int]] = []  # static, per depth: (lo, hi, offset)
        consts: list[int] = []

        def level(F: int, D: int, paths: list[int]) -> None:
            self._levels.append((F, D, len(consts)))
            consts.extend(j for _ in range(F) for j in range(D))  # [F * D] row in the path
            consts.extend(
                _signed(((1 << (j + 1)) - 1) << (f * D))  # [F * D] tree bits
                for f in range(F)
                for j in range(D)
            )
            consts.extend(paths)  # [F * D] static: the node of each row

        if isinstance(tree, DynamicTree):
            for D in range(1, tree.depth):
                level(tree.topk, D, [])
        else:
            s = tree
            for depth in range(1, s.depth + 1):
                lo = s.depths.index(depth)
                hi = lo + s.depths.count(depth)  # nodes are sorted by depth
                parents = sorted({s.parents[i] for i in range(lo, hi)})
                if depth > 1:
                    level(
                        len(parents),
                        depth - 1,
                        list(
                            itertools.chain.from_iterable(self._path(s.parents, q) for q in parents)
                        ),
                    )
                where, w = {q: f for f, q in enumerate(parents)}, s.width(depth)
                self._fills.append((lo, hi, len(consts)))
                consts.extend(where[s.parents[i]] * w + s.ranks[i] for i in range(lo, hi))
                consts.extend(where[s.parents[i]] for i in range(lo, hi))
        self.consts = np.asarray(consts, dtype=np.int64)  # [n_consts]

    @property
    def budget(self) -> int:
        """The most nodes of a tree: what the strategy's ``num_speculative_tokens`` (the engine's
        per-sequence draft limit) should be in tree mode."""
        t = self.tree
        return t.budget if isinstance(t, DynamicTree) else t.num_nodes

    def max_rows(self) -> int:
        return self.tree.max_rows()

    # -- the staged inputs (host) ---------------------------------------------------------------
    def num_ints(self, Bp: int, W: int) -> int:
        """The length of the staged vector of ``Bp`` sequences and tables ``W`` wide."""
        return 3 * Bp + Bp * W + self.consts.size

    def write_ints(
        self,
        out: np.ndarray,  # [num_ints(Bp, W)] int64, written in full
        rows: list,  # the drafting sequences (CatchUp), at most Bp, tables at most W wide
        Bp: int,
        W: int,
    ) -> None:
        """The staged vector (:class:`TreeInputs`) of ``rows`` padded to ``Bp`` sequences."""
        A, pad = len(rows), [0] * (Bp - len(rows))
        out[: 3 * Bp] = (
            [p.n - 1 for p in rows]
            + pad
            + [p.n - 1 - p.st.offset for p in rows]
            + pad
            + [1] * A
            + pad
        )
        t = 3 * Bp + Bp * W
        out[3 * Bp : t] = 0
        for r, p in enumerate(rows):
            o = 3 * Bp + r * W
            out[o : o + len(p.st.table)] = p.st.table
        out[t:] = self.consts

    def padding_ints(self, out: np.ndarray, Bp: int, W: int) -> None:
        """The staged vector of a call whose ``Bp`` sequences are all padding (graph capture)."""
        self.write_ints(out, [], Bp, W)

    # -- the device part ------------------------------------------------------------------------
    def draft(
        self,
        ints: torch.Tensor,  # [num_ints(Bp, W)] int64 on the device (write_ints)
        x: torch.Tensor,  # [Bp, H] each sequence's catch-up state (padding rows: anything)
        W: int,
    ) -> torch.Tensor:  # dynamic: [Bp, 3, C] float64; static: [Bp, nodes] int64
        """Every level of the tree, on the device only (no host reads, shapes fixed by ``Bp``,
        ``W`` and the tree): what the CUDA graph captures. Dynamic trees give each sequence's
        candidates (tokens, cumulative log-probabilities, parent candidates) for
        :func:`select_tree`, static ones each node's token. Padding rows: garbage."""
        st = TreeInputs.views(ints, x.shape[0], W)
        if isinstance(self.tree, DynamicTree):
            return self._dynamic(st, x)
        return self._static(st, x)

    def _level(
        self,
        st: TreeInputs,
        level: int,  # index into self._levels
        tok: torch.Tensor,  # [Bp, F, d] int64: each frontier path's tokens, root side first
        xin: torch.Tensor,  # [Bp, F, d, H] the state that chose each of them
    ) -> torch.Tensor:  # [Bp, F, H] each frontier node's output state
        """The head over every frontier path (``F * d`` rows a sequence, a path's rows seeing
        the context and the path's earlier rows only), writing K/V past the context."""
        d = self.drafter
        Bp, F, D = tok.shape
        W, bs, R = st.tables.shape[1], d.cache.block_size, F * D
        o = self._levels[level][2]
        jrow, bits = st.consts[o : o + R], st.consts[o + R : o + 2 * R]  # [R] each
        pos = (st.pos0[:, None] + jrow).reshape(-1)  # [Bp * R]
        idx = st.base[:, None] + torch.arange(R, device=tok.device)  # [Bp, R] cache indices
        blocks = st.tables.gather(1, (idx // bs).clamp(max=W - 1))  # [Bp, R]
        slots = torch.where(st.live[:, None] > 0, blocks * bs + idx % bs, -1)  # padding: -1
        ctx = torch.where(st.live > 0, st.base + R, 0).to(torch.int32)  # [Bp]
        qsl = torch.nn.functional.pad(torch.cumsum(st.live * R, 0), (1, 0))  # [Bp + 1]
        meta = AttentionMetadata.padded(
            slots.reshape(-1),
            st.tables32,
            ctx,
            qsl.to(torch.int32),
            R,
            bs,
            tree_bits=bits.expand(Bp, R).reshape(-1),  # [Bp * R], contiguous
        )
        fctx = ForwardContext(meta=meta, kv_caches=d.cache.kv_caches)
        out = d.head.step(tok.reshape(-1), xin.reshape(Bp * R, -1), pos, fctx)  # [Bp * R, H]
        return out.view(Bp, F, D, -1)[:, :, D - 1]

    def _ranked(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's ``k`` best tokens after states ``x [..., H]`` and their log-probabilities:
        (``[..., k]`` float32, ``[..., k]`` int64), best first."""
        logp = torch.log_softmax(self.drafter.head.logits(x.reshape(-1, x.shape[-1])), dim=-1)
        v, t = logp.topk(k, dim=-1)  # [rows, k]
        return v.view(*x.shape[:-1], k), t.view(*x.shape[:-1], k)

    # -- the two shapes -------------------------------------------------------------------------
    def _dynamic(self, st: TreeInputs, x: torch.Tensor) -> torch.Tensor:  # [Bp, 3, C] float64
        """EAGLE-2: per level, the ``topk`` best children of each of the ``topk`` frontier
        nodes; the new frontier is the ``topk`` best of those by cumulative log-probability."""
        t: DynamicTree = self.tree  # type: ignore[assignment]
        k, (Bp, H) = t.topk, x.shape
        score, tok = self._ranked(x, k)  # [Bp, k] each: the root's children
        c_tok, c_score = [tok], [score]
        c_par = [torch.full((Bp, k), -1, dtype=torch.long, device=x.device)]
        front = torch.arange(k, device=x.device).expand(Bp, k)  # [Bp, k] candidate index
        path_tok = tok[:, :, None]  # [Bp, k, 1]
        path_x = x[:, None, None, :].expand(Bp, k, 1, H)  # [Bp, k, 1, H]
        made = k
        for level in range(t.depth - 1):
            state = self._level(st, level, path_tok, path_x)  # [Bp, k, H]
            v, ct = self._ranked(state, k)  # [Bp, k, k]
            cum = (score[:, :, None] + v).reshape(Bp, k * k)  # [Bp, k * k]
            ct = ct.reshape(Bp, k * k)
            c_tok.append(ct)
            c_score.append(cum)
            # child j * k + i: parent slot j
            c_par.append(front[:, :, None].expand(Bp, k, k).reshape(Bp, k * k))
            score, sel = cum.topk(k, dim=1)  # [Bp, k] the new frontier, best first
            j = sel // k  # its parents' frontier slots
            front = made + sel
            made += k * k
            gj = j[:, :, None].expand(-1, -1, path_tok.shape[2])
            new_tok = ct.gather(1, sel)[:, :, None]
            path_tok = torch.cat([path_tok.gather(1, gj), new_tok], dim=2)
            hx = j[:, :, None, None].expand(-1, -1, path_x.shape[2], path_x.shape[3])
            parent_state = state.gather(1, j[:, :, None].expand(-1, -1, state.shape[2]))
            path_x = torch.cat([path_x.gather(1, hx), parent_state[:, :, None]], dim=2)
        # tokens, scores and parents as float64 (exact for ids): one host read
        return torch.stack([torch.cat(c, 1).double() for c in (c_tok, c_score, c_par)], dim=1)

    def _static(self, st: TreeInputs, x: torch.Tensor) -> torch.Tensor:  # [Bp, nodes] int64
        """A :class:`TokenTreeShape`: each expanded node's children are the top ranks of the
        head's output after its path."""
        s: TokenTreeShape = self.tree  # type: ignore[assignment]
        Bp, H = x.shape
        node_tok = torch.zeros(Bp, s.num_nodes, dtype=torch.long, device=x.device)
        node_in = x.new_zeros(Bp, s.num_nodes, H)  # the state that chose each node
        for depth, (lo, hi, o) in enumerate(self._fills, start=1):
            if depth == 1:
                states = x[:, None]  # [Bp, 1, H] the root's
            else:  # run the head over the parents' root paths
                F, D, p = self._levels[depth - 2]
                paths = st.consts[p + 2 * F * D : p + 3 * F * D]  # [F * d] node of each row
                ptok = node_tok.index_select(1, paths).view(Bp, F, D)  # [Bp, F, d]
                pin = node_in.index_select(1, paths).view(Bp, F, D, H)  # [Bp, F, d, H]
                states = self._level(st, depth - 2, ptok, pin)  # [Bp, F, H]
            _, ranked = self._ranked(states, s.width(depth))  # [Bp, F, width]
            n = hi - lo
            fill, src = st.consts[o : o + n], st.consts[o + n : o + 2 * n]  # [n] each
            node_tok[:, lo:hi] = ranked.reshape(Bp, -1).index_select(1, fill)
            node_in[:, lo:hi] = states.index_select(1, src)
        return node_tok

    # -- the host part --------------------------------------------------------------------------
    def trees(
        self,
        out: torch.Tensor,  # [A, ...] draft()'s rows of the drafting sequences
        budgets: list[int],  # [A] the most nodes of each one's tree
    ) -> list[DraftTree]:
        """The trees of :meth:`draft`'s output: one device read, then (dynamic) EAGLE-2's
        :func:`select_tree` per sequence or (static) the shape's first nodes."""
        if isinstance(self.tree, DynamicTree):
            trees = []
            for (toks, scores, pars), n in zip(read_back(out), budgets):
                trees.append(select_tree([int(v) for v in toks], scores, [int(v) for v in pars], n))
        else:
            parents = self.tree.parents
            trees = [DraftTree(toks[:n], parents[:n]) for toks, n in zip(read_back(out), budgets)]
        self.drafter.graphs.consumed()  # the read waited for the last replay
        return trees

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
        drafted = tree_graph.draft_graph(self, x, rows)  # [A, ...] or None: not in a graph
        if drafted is None:  # eagerly: the same function, unpadded
            host = np.empty(self.num_ints(len(rows), W), dtype=np.int64)
            self.write_ints(host, rows, len(rows), W)
            drafted = self.draft(to_device_async(host, torch.long, x.device), x, W)
        budgets = [min(batch.seqs[p.i].max_draft, self.budget) for p in rows]
        for p, tree in zip(rows, self.trees(drafted, budgets)):
            out[p.i] = tree
        return Proposal(token_ids=out)

    def capture_graphs(self, max_num_seqs: int, progress: bool) -> int:
        """Capture now, on padding inputs, the tree graph of every batch bucket up to
        ``max_num_seqs`` sequences (``HeadDrafter.capture_graphs`` in tree mode). Returns how
        many were captured."""
        return tree_graph.capture_all(self, max_num_seqs, progress)


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
