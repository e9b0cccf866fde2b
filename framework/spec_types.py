"""Typed data passed through the speculation hooks (see :mod:`speculant.hookspecs`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


class StrategyError(ValueError):
    """A strategy cannot be built or used as configured: an unknown method, invalid options, a
    checkpoint that does not fit the target. The message names the problem and the fix; the
    engine shows it to the user as is."""


@dataclass
class StrategyContext:
    """What a strategy gets when it is instantiated: ``cls(config, ctx)``, where ``config`` is
    the validated instance of the class's ``Config`` (None when it has none, and always None for
    a verifier) and ``ctx`` this."""

    target_model: Any  # the target nn.Module (speculant.models.*): embed(), compute_logits(), config
    target_config: Any  # the target's transformers PretrainedConfig
    vocab_size: int  # target vocabulary size (rows of the LM head)
    device: torch.device
    dtype: torch.dtype
    block_size: int  # paged KV cache block size used by the engine
    max_model_len: int
    max_num_seqs: int
    kv_cache_memory: int | None = None  # bytes a strategy may use for its own caches (None: decide)
    tokenizer: Any = None
    eos_token_id: int | None = None
    seed: int = 0
    # the target's prefill CUDA-graph limit in tokens (0: prefill runs eagerly; None: the default)
    max_prefill_graph_tokens: int | None = None
    # EngineConfig.enforce_eager: no CUDA graphs for the strategy's own forwards either
    enforce_eager: bool = False


@dataclass
class SpecSequence:
    """One running sequence, as a proposer sees it. Treat every field as read-only."""

    seq_id: int  # stable for the sequence's life (preemption included): key per-sequence state
    token_ids: list[int]  # prompt + generated tokens so far (the last one has no KV yet)
    num_prompt_tokens: int
    max_draft: int  # propose at most this many tokens for this sequence now (<= k, may be 0)
    sampling_params: Any  # speculant.SamplingParams
    generator: torch.Generator | None = None  # the request's seeded RNG (None: the engine's)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def params(self) -> Any:
        return self.sampling_params

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass
class SpecBatch:
    """The sequences of one speculative decode step."""

    seqs: list[SpecSequence]
    # Target hidden states of the positions verified since the previous propose call (the whole
    # prompt on the first call), only when the strategy declares ``needs_hidden_states = True``.
    # A row is the input of the target's LM head: the last decoder layer's output AFTER the final
    # norm (Llama family: ``model.norm``; OPT: after ``final_layer_norm`` and ``project_out``
    # where the checkpoint has them), in the engine's dtype, so
    # ``ctx.target_model.compute_logits(row)`` gives that position's target logits back.
    # Rows of sequence i cover positions [hidden_start[i], num_tokens_i - 1): the state at position
    # p is the one that produced token p + 1.
    hidden_states: torch.Tensor | None = None  # [num_rows, hidden]
    # the same rows' inputs of the layers in the strategy's ``aux_hidden_layers`` (the residual
    # stream entering each layer, before its norm), concatenated in layer order (EAGLE-3)
    aux_hidden_states: torch.Tensor | None = None  # [num_rows, len(aux_layers) * hidden]
    hidden_counts: list[int] = field(default_factory=list)  # rows per sequence
    hidden_start: list[int] = field(default_factory=list)  # first position covered, per sequence

    def __len__(self) -> int:
        return len(self.seqs)


@dataclass
class Proposal:
    """Draft tokens for each sequence of a :class:`SpecBatch`, in the same order.

    A sequence's entry is either a chain (a list of token ids: draft ``j`` follows draft
    ``j - 1``) or a :class:`DraftTree` (several continuations verified in one target forward;
    docs/trees.md). A tree's node count is its budget (at most the sequence's ``max_draft``, and
    at most ``MAX_TREE_NODES``); its draft distributions are ``DraftTree.probs`` (``probs``
    below is for chains only: its rows of a tree sequence are ignored). Chains and trees may be
    mixed in one batch. An entry that is not a valid chain or tree is that sequence's fault:
    its drafts are dropped and it decodes plainly this step."""

    token_ids: list[list[int] | DraftTree]  # per sequence: 0..max_draft draft ids, or a DraftTree
    # q(x) for every chain draft position: [batch, max_len, vocab] float32 (rows past a
    # sequence's own length, and the rows of tree sequences, are ignored). None means point-mass
    # drafts (q = 1 for the proposed token).
    probs: torch.Tensor | None = None
    proposer: str = ""  # filled in by the engine: the strategy's name (for error messages)

    @property
    def lengths(self) -> list[int]:
        """Draft tokens per sequence: a chain's length, a tree's node count."""
        return [t.num_nodes if isinstance(t, DraftTree) else len(t) for t in self.token_ids]

    @property
    def has_trees(self) -> bool:
        return any(isinstance(t, DraftTree) for t in self.token_ids)


@dataclass
class ScoreResult:
    """Target model output over each sequence's last token plus its drafts: ``k_i + 1`` rows per
    sequence, row 0 after the last token. A chain's row ``j + 1`` is after draft ``j``; a
    tree's (:class:`DraftTree`, ``k_i`` nodes) row ``i + 1`` is after node ``i`` (its root path
    appended), the convention of ``verify_tree_greedy`` / ``verify_tree_sampled``.

    The built-in scorer's tensors may be views of a CUDA graph's static buffers: read them
    during the step (``verify``), clone what you keep beyond it."""

    logits: torch.Tensor  # [sum(k_i + 1), vocab] float32
    hidden_states: torch.Tensor | None = None  # [sum(k_i + 1), hidden]
    aux_hidden_states: torch.Tensor | None = None  # [sum(k_i + 1), n_aux * hidden]
    # optional, same device: each row's argmax of ``logits`` (lowest index on ties) and its
    # log-probability (log_softmax of the raw logits), packed for one read (float64 holds every
    # token id exactly; speculant.engine.sampler.greedy_pack). The built-in scorer computes it
    # inside its CUDA graph, or when every sequence is greedy; the built-in verifier then
    # verifies greedy batches from it on the host, with no kernel launch.
    greedy: torch.Tensor | None = None  # [sum(k_i + 1), 2] float64


@dataclass
class VerifyResult:
    """Tokens to append per sequence: accepted drafts, then one bonus or recovered token."""

    token_ids: list[list[int]]
    num_accepted: list[int]  # accepted draft tokens per sequence (len(token_ids[i]) - 1)
    # optional: the target's log-probability (log_softmax of the raw score logits) of each token
    # in token_ids, same shape; when None the engine computes them (one batched gather)
    logprobs: list[list[float]] | None = None
    # optional, for token trees: per sequence, the accepted nodes of its DraftTree (node indices,
    # root side first; num_accepted[i] of them; None for a chain). The engine checks that they
    # are a root path spelling the accepted tokens; when None it finds that path itself
    tree_paths: list[list[int] | None] | None = None


# ---------------------------------------------------------------------------------------------
# Token trees (docs/trees.md)
# ---------------------------------------------------------------------------------------------
# a node's q may sum to 1 within this (the engine's tolerance for Proposal.probs)
TREE_PROB_SUM_TOLERANCE = 1e-3
# the most nodes of one tree the engine scores (the root and 63 nodes: one int64 of tree-attention
# bits per row, kernels/paged_attention.py TREE_MAX_ROWS)
MAX_TREE_NODES = 63


class DraftTreeError(ValueError):
    """A :class:`DraftTree` that is not a well-formed tree of draft tokens, or does not fit the
    sequence it was drafted for. The message names the field, the node and the fix."""


_INT_TYPE = {int}


def _int_list(values: Any, name: str) -> list[int]:
    """``values`` (a list, tuple, 1-d tensor or array of integers) as a list of Python ints;
    :class:`DraftTreeError` naming ``DraftTree.<name>[i]`` for anything else (bools included)."""
    if type(values) is list and set(map(type, values)) <= _INT_TYPE:
        return list(values)  # the common case, ~10x cheaper than the checks below
    if isinstance(values, torch.Tensor) or type(values).__module__ == "numpy":
        if getattr(values, "ndim", 1) != 1:
            raise DraftTreeError(f"DraftTree.{name} must be 1-d, got shape "
                                 f"{tuple(values.shape)}")
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise DraftTreeError(f"DraftTree.{name} must be a list of ints, got "
                             f"{type(values).__name__}")
    out = []
    for i, v in enumerate(values):
        try:
            if type(v).__name__ in ("bool", "bool_") or (
                    isinstance(v, torch.Tensor) and v.dtype == torch.bool):
                raise TypeError
            out.append(int(v.__index__()))
        except (TypeError, AttributeError, RuntimeError):
            raise DraftTreeError(f"DraftTree.{name}[{i}] = {v!r} is not an integer "
                                 f"({type(v).__name__})") from None
    return out


@dataclass
class DraftTree:
    """A tree of draft tokens for one sequence: each node a token that would follow the tokens of
    its ancestors. The root is the sequence's last token (it is not a node); a chain of ``k``
    drafts is the tree whose node ``i`` has parent ``i - 1`` (:meth:`chain`).

    Nodes are numbered ``0..n-1`` with every parent before its children (``parents[i] < i``), so
    index order is a topological order. Children of one parent are *siblings*, ordered by
    index: that is the order in which their tokens were drawn and in which verification tries
    them (:func:`speculant.drafting.verify_tree_sampled`).

    ``probs`` row ``i`` is the draft distribution node ``i``'s token was drawn from, given its
    parent's path *and its earlier siblings*: siblings drawn with replacement (i.i.d.) have equal
    rows; siblings drawn without replacement have the parent's q with the earlier siblings'
    tokens removed and renormalised (:func:`speculant.drafting.sibling_draft_probs` makes both).
    ``None`` means point masses (q = 1 at each node's token): tokens chosen deterministically,
    such as the top-k of a draft head. Lossless sampled verification needs these rows to be the
    true ones (docs/trees.md).

    Construction checks the structure (:class:`DraftTreeError`); :meth:`validate` also checks the
    tree against a vocabulary and a node budget.
    """

    token_ids: list[int]  # [n] each node's draft token
    parents: list[int]  # [n] each node's parent: -1 (the root, i.e. the sequence's last token) or j < i
    probs: torch.Tensor | None = None  # [n, vocab] float: row i = the q node i's token was drawn from

    def __post_init__(self) -> None:
        self.token_ids = _int_list(self.token_ids, "token_ids")
        self.parents = _int_list(self.parents, "parents")
        n = len(self.token_ids)
        if len(self.parents) != n:
            raise DraftTreeError(f"DraftTree has {n} token_ids but {len(self.parents)} parents: "
                                 "give one parent per node")
        if all(map(int.__lt__, self.parents, range(n))) and min(self.parents, default=0) >= -1:
            return  # the common case in one pass; the loop below names the first bad node
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise DraftTreeError(
                    f"DraftTree.parents[{i}] = {p}: a node's parent must be -1 (the root) or an "
                    f"earlier node (0..{i - 1}); number the nodes parents before children")

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def chain(cls, token_ids: Any, probs: torch.Tensor | None = None) -> DraftTree:
        """The chain ``token_ids[0] -> token_ids[1] -> ...`` (node ``i``'s parent is ``i - 1``):
        what a :class:`Proposal` row means, as a tree. ``probs`` ``[k, vocab]`` as in
        ``Proposal.probs`` for that sequence (None: point masses)."""
        ids = _int_list(token_ids, "token_ids")
        return cls(ids, list(range(-1, len(ids) - 1)), probs)

    # -- shape ------------------------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return len(self.token_ids)

    @property
    def is_chain(self) -> bool:
        """Whether every node's parent is the node before it (an empty tree is a chain)."""
        return self.parents == list(range(-1, self.num_nodes - 1))

    def children(self, node: int = -1) -> list[int]:
        """The children of ``node`` (-1: the root), in index (drawing) order."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def depths(self) -> list[int]:
        """Each node's depth: 1 for children of the root. Node ``i``'s token would sit at
        position ``num_tokens - 1 + depth[i]`` of a sequence of ``num_tokens`` tokens."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to ``node`` (inclusive), root side first."""
        if not 0 <= node < self.num_nodes:
            raise IndexError(f"node {node} is not in a DraftTree of {self.num_nodes} nodes")
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def leaves(self) -> list[int]:
        """The nodes without children, in index order."""
        has_child = set(self.parents)
        return [i for i in range(self.num_nodes) if i not in has_child]

    def root_paths(self) -> list[list[int]]:
        """Every root-to-leaf path (node indices, root side first), in leaf order: the
        candidate continuations the tree proposes (one per leaf)."""
        return [self.path(leaf) for leaf in self.leaves()]

    def ancestor_mask(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``[n, n]`` bool: ``mask[i, j]`` is True iff node ``j`` is node ``i`` or one of its
        ancestors, i.e. on its root path: the attention mask of the drafts among themselves
        in a tree-attention forward (every node also sees the whole sequence before the root)."""
        n = self.num_nodes
        mask = torch.eye(n, dtype=torch.bool)  # [n, n]
        for i, p in enumerate(self.parents):
            if p >= 0:
                mask[i] |= mask[p]  # a parent's row is complete before its children's
        return mask.to(device) if device is not None else mask

    # -- checks against a sequence --------------------------------------------------------------
    def validate(self, vocab_size: int, max_nodes: int | None = None, who: str = "DraftTree"
                 ) -> None:
        """Check the tree against a target: at most ``max_nodes`` nodes (the sequence's
        ``max_draft``), token ids in ``[0, vocab_size)``, and ``probs`` (if any) a float tensor
        ``[n, vocab_size]`` whose rows are distributions (finite, non-negative, summing to 1
        within ``TREE_PROB_SUM_TOLERANCE``) with q > 0 at each node's own token. Raises
        :class:`DraftTreeError` starting with ``who`` (the plugin, as the engine's proposal
        checks name it). Reads ``probs`` back to the host once."""
        n = self.num_nodes
        if max_nodes is not None and n > max_nodes:
            raise DraftTreeError(f"{who}: a DraftTree of {n} nodes, more than the sequence's "
                                 f"limit of {max_nodes} (SpecSequence.max_draft): propose fewer")
        ok = not self.token_ids or (min(self.token_ids) >= 0 and max(self.token_ids) < vocab_size)
        for i, t in enumerate(() if ok else self.token_ids):
            if not 0 <= t < vocab_size:
                raise DraftTreeError(f"{who}: DraftTree.token_ids[{i}] = {t} is outside the "
                                     f"vocabulary [0, {vocab_size})")
        q = self.probs
        if q is None:
            return
        if not isinstance(q, torch.Tensor) or not q.is_floating_point():
            raise DraftTreeError(f"{who}: DraftTree.probs must be a float tensor [n, vocab] or "
                                 f"None, got {getattr(q, 'dtype', type(q).__name__)}")
        if tuple(q.shape) != (n, vocab_size):
            raise DraftTreeError(f"{who}: DraftTree.probs has shape {tuple(q.shape)}, expected "
                                 f"[n, vocab] = ({n}, {vocab_size})")
        if n == 0:
            return
        qf = q.detach().float()
        ids = torch.tensor(self.token_ids, dtype=torch.long, device=q.device)
        at = qf.gather(1, ids[:, None])[:, 0]  # [n]: q of each node's own token
        sums = qf.sum(dim=1)  # [n]
        # one read: per row, not finite / negative / sum off 1 / q = 0 at the token
        flags = torch.stack([~torch.isfinite(qf).all(dim=1), (qf < 0).any(dim=1),
                             ~((sums - 1).abs() <= TREE_PROB_SUM_TOLERANCE), ~(at > 0)]).tolist()
        what = ("has a non-finite entry", "has a negative entry",
                f"does not sum to 1 (within {TREE_PROB_SUM_TOLERANCE})",
                "gives the node's own token probability 0 (it cannot have been drawn from it)")
        for flag_row, problem in zip(flags, what):
            if any(flag_row):
                i = flag_row.index(True)
                raise DraftTreeError(f"{who}: DraftTree.probs[{i}] {problem}: each row must be "
                                     "the distribution node i's token was drawn from "
                                     "(docs/trees.md), or pass probs=None for point masses")
