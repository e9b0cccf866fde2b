"""Verification of a tree of drafts (:class:`speculant.spec_types.DraftTree`) against the
target: the greedy rule and lossless recursive rejection sampling over siblings (SpecInfer,
Miao et al. 2305.09781; recursive speculative decoding, Jeon et al. 2402.14160). docs/trees.md
has the rules and the proof sketch.

Both take ``target`` ``[n + 1, vocab]``: row 0 the distribution of the token after the root (the
sequence's last token), row ``i + 1`` the one after node ``i`` (its root path appended), already
processed as the request samples (:func:`speculant.drafting.target_distribution`: processed
logits for a greedy request, probabilities for a sampled one). On a chain they give the tokens
the chain verifier (``rejection_sample``) gives, bit for bit, from the same uniform numbers.

Cost: one pass over the visited rows and one host read per sibling tried (a per-node loop on the
host, O(tried siblings * vocab) device work); fine for the trees of tens of nodes these are for,
not yet a batched kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speculant.kernels.rejection_sampling import QUANT_SCALE, sample_from_probs
from speculant.spec_types import DraftTree, DraftTreeError


@dataclass
class TreeVerifyResult:
    """The outcome of verifying one :class:`DraftTree`: the accepted root path and the tokens to
    append (the accepted nodes' tokens, then one bonus or recovered token)."""

    path: list[int]  # accepted node indices, root side first (a root path of the tree)
    token_ids: list[int]  # len(path) + 1: the path's tokens, then the bonus / recovered token

    @property
    def num_accepted(self) -> int:
        return len(self.path)


def _check_target(tree: DraftTree, target: torch.Tensor) -> None:
    n = tree.num_nodes
    if not isinstance(target, torch.Tensor) or target.dim() != 2 or target.shape[0] != n + 1:
        shape = tuple(target.shape) if isinstance(target, torch.Tensor) else type(target).__name__
        raise DraftTreeError(
            f"target must be [n + 1, vocab] = [{n + 1}, vocab] for a DraftTree of {n} nodes "
            f"(row 0: after the root, row i + 1: after node i), got {shape}")
    vocab = target.shape[1]
    bad = next((i for i, t in enumerate(tree.token_ids) if not 0 <= t < vocab), None)
    if bad is not None:
        raise DraftTreeError(f"DraftTree.token_ids[{bad}] = {tree.token_ids[bad]} is outside "
                             f"the target's vocabulary [0, {vocab})")


def _children_lists(tree: DraftTree) -> dict[int, list[int]]:
    """node (-1: the root) -> its children in index order."""
    out: dict[int, list[int]] = {}
    for i, p in enumerate(tree.parents):
        out.setdefault(p, []).append(i)
    return out


def verify_tree_greedy(tree: DraftTree, target: torch.Tensor) -> TreeVerifyResult:
    """Greedy tree verification: from the root, move to the child whose token is the argmax of
    the current row (lowest index on ties; of equal siblings, the first), while there is one;
    then append that row's argmax. The result is the longest root path whose every node is its
    parent's argmax, i.e. exactly what plain greedy decoding would produce.

    :param tree: the drafts (``probs`` is not used).
    :param target: ``[n + 1, vocab]`` processed logits or probabilities (argmax is the same).
    :return: the accepted path and ``len(path) + 1`` tokens. One host read.
    """
    _check_target(tree, target)
    argmax = target.argmax(dim=1).tolist()  # [n + 1]: lowest index on ties
    children = _children_lists(tree)
    path: list[int] = []
    node = -1
    while True:
        want = argmax[node + 1]
        nxt = next((c for c in children.get(node, ()) if tree.token_ids[c] == want), None)
        if nxt is None:
            return TreeVerifyResult(path, [tree.token_ids[c] for c in path] + [want])
        path.append(nxt)
        node = nxt


def _has_mass(r: torch.Tensor) -> bool:
    """Whether ``r`` has weight in the integer inverse CDF of ``sample_from_probs`` (an entry of
    at least 2**-40): the kernels' test of a residual with no mass."""
    return bool((r.clamp(max=1.0) * QUANT_SCALE >= 1.0).any())


def verify_tree_sampled(tree: DraftTree, target: torch.Tensor, u: torch.Tensor
                        ) -> TreeVerifyResult:
    """Lossless tree verification of a sampled request by recursive rejection sampling.

    At the current node (first the root), ``r`` = its target row; its children are tried in index
    order: child ``c`` with token ``x`` drawn from ``q_c`` (``tree.probs[c]``, a point mass at
    ``x`` when ``probs`` is None) is accepted iff ``r(x) > 0`` and ``u[c] * q_c(x) <= r(x)``
    (``r`` normalised), i.e. with probability ``min(1, r(x) / q_c(x))``; then verification moves
    on to ``c``. A rejected child replaces ``r`` by the residual ``max(r - q_c, 0)`` (normalised;
    if it has no mass, ``r`` is kept, as the chain kernels fall back to ``p``). When no child is
    accepted (or the node has none) the last token is drawn from ``r`` by inverse CDF at
    ``u[n]`` (``sample_from_probs``). The output follows the target distribution exactly
    whenever each node's token was drawn from its ``probs`` row given its parent and earlier
    siblings: siblings drawn with replacement (equal rows) and without replacement (rows with the
    earlier siblings removed, :func:`sibling_draft_probs`) alike (docs/trees.md has the proof).

    :param tree: the drafts and the distributions they were drawn from.
    :param target: ``[n + 1, vocab]`` float probabilities (``target_distribution`` of a sampled
        request).
    :param u: ``[n + 1]`` uniform numbers in [0, 1): ``u[i]`` the accept test of node ``i`` (each
        node is tested at most once), ``u[n]`` the draw of the last token. On a chain, the same
        numbers as ``rejection_sample``'s ``u_accept`` then ``u_sample`` give the same tokens.
    :return: the accepted path and ``len(path) + 1`` tokens.
    """
    _check_target(tree, target)
    n, dev = tree.num_nodes, target.device
    if not isinstance(u, torch.Tensor) or tuple(u.shape) != (n + 1,):
        shape = tuple(u.shape) if isinstance(u, torch.Tensor) else type(u).__name__
        raise DraftTreeError(f"u must be [n + 1] = [{n + 1}] uniform numbers (one accept test per "
                             f"node, then the last token's draw), got {shape}")
    if tree.probs is not None and tuple(tree.probs.shape) != (n, target.shape[1]):
        raise DraftTreeError(f"DraftTree.probs has shape {tuple(tree.probs.shape)}, expected "
                             f"[n, vocab] = ({n}, {target.shape[1]})")
    p = target.float()  # [n + 1, vocab]
    u = u.float().to(dev)  # [n + 1]
    q_all = tree.probs.float().to(dev) if tree.probs is not None else None  # [n, vocab]
    children = _children_lists(tree)
    path: list[int] = []
    node = -1
    while True:
        r = p[node + 1]  # [vocab]: the (unnormalised) distribution still to match
        z = torch.ones((), device=dev)  # its mass (a target row counts as 1, as in the kernels)
        nxt = None
        for c in children.get(node, ()):
            x = tree.token_ids[c]
            if q_all is not None:
                q = q_all[c]  # [vocab]
            else:
                q = torch.zeros_like(r)
                q[x] = 1.0
            if bool((r[x] > 0) & (u[c] * q[x] * z <= r[x])):
                nxt = c
                break
            residual = torch.clamp(r / z - q, min=0.0)  # [vocab]
            if _has_mass(residual):
                r, z = residual, residual.sum()
        if nxt is None:
            last = int(sample_from_probs(r[None].contiguous(), u[n:]).item())
            return TreeVerifyResult(path, [tree.token_ids[c] for c in path] + [last])
        path.append(nxt)
        node = nxt


def sibling_draft_probs(q: torch.Tensor, token_ids: list[int], replacement: bool
                        ) -> torch.Tensor:
    """The ``DraftTree.probs`` rows of siblings drawn from one draft distribution ``q``
    ``[vocab]``, in drawing order: with replacement every row is ``q``; without replacement row
    ``j`` is ``q`` with ``token_ids[:j]`` set to 0, renormalised (what sibling ``j`` was drawn
    from after the earlier ones were taken out).

    :return: ``[len(token_ids), vocab]`` float32.
    """
    q = q.float()
    rows = q[None].repeat(len(token_ids), 1)  # [m, vocab]
    if not replacement:
        for j in range(1, len(token_ids)):
            rows[j:, token_ids[j - 1]] = 0.0
        rows = rows / rows.sum(dim=1, keepdim=True)
    return rows


__all__ = [
    "DraftTree",
    "DraftTreeError",
    "TreeVerifyResult",
    "sibling_draft_probs",
    "verify_tree_greedy",
    "verify_tree_sampled",
]
