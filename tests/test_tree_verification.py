"""Token trees (docs/trees.md): the public DraftTree type and its checks, greedy tree
verification on hand-built trees, chain equivalence with the chain verifier (bit for bit, from the
same numbers), and the sampled rule's output distribution against the target's (temperature
0.8, top-p 0.95; a chain, a star of 4 siblings, a 2x2 tree and an unbalanced tree; siblings
drawn with replacement, without replacement and as deterministic point masses), with a negative
control showing the statistic catches a wrong rule."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch

import speculant.drafting.tree_verification as tree_verification
from speculant import SamplingParams
from speculant.drafting import (
    DraftTree,
    DraftTreeError,
    Row,
    sibling_draft_probs,
    target_distribution,
    verify_tree_greedy,
    verify_tree_sampled,
)
from speculant.engine.sampler import greedy_pack
from speculant.engine.spec_decode import _draft_ids
from speculant.kernels.rejection_sampling import rejection_sample_ref
from speculant.plugins.rejection_sampler import verify_greedy
from speculant.spec_types import SpecSequence


# --------------------------------------------------------------------------------------------
# the type
# --------------------------------------------------------------------------------------------
def test_shape_helpers_of_a_hand_built_tree():
    #        root
    #       /    \
    #     0:5    1:7
    #      |      |
    #     2:3    3:3
    #             |
    #            4:8
    t = DraftTree([5, 7, 3, 3, 8], [-1, -1, 0, 1, 3])
    assert t.num_nodes == 5 and not t.is_chain
    assert t.children() == [0, 1] and t.children(1) == [3] and t.children(4) == []
    assert t.depths() == [1, 1, 2, 2, 3]
    assert t.path(4) == [1, 3, 4] and t.path(0) == [0]
    assert t.leaves() == [2, 4]
    assert t.root_paths() == [[0, 2], [1, 3, 4]]
    m = t.ancestor_mask()
    assert m.dtype == torch.bool and m.shape == (5, 5)
    want = torch.zeros(5, 5, dtype=torch.bool)
    for i in range(5):
        want[i, t.path(i)] = True
    assert torch.equal(m, want)
    assert m[4].tolist() == [False, True, False, True, True]
    with pytest.raises(IndexError, match="node 5"):
        t.path(5)


def test_chain_is_the_tree_of_a_proposal_row():
    c = DraftTree.chain(torch.tensor([4, 4, 9]))
    assert c.token_ids == [4, 4, 9] and c.parents == [-1, 0, 1] and c.is_chain
    assert c.depths() == [1, 2, 3] and c.root_paths() == [[0, 1, 2]]
    assert torch.equal(c.ancestor_mask(), torch.ones(3, 3, dtype=torch.bool).tril())
    empty = DraftTree.chain([])
    assert empty.num_nodes == 0 and empty.is_chain and empty.root_paths() == []
    assert empty.ancestor_mask().shape == (0, 0)
    assert DraftTree(np.array([1, 2]), np.array([-1, -1])).parents == [-1, -1]


@pytest.mark.parametrize("ids,parents,match", [
    ([1, 2], [-1], r"2 token_ids but 1 parents"),
    ([1, 2], [-1, 1], r"parents\[1\] = 1: .* earlier node \(0\.\.0\)"),
    ([1, 2], [-1, 5], r"parents\[1\] = 5"),
    ([1, 2], [-2, 0], r"parents\[0\] = -2"),
    ([1, True], [-1, 0], r"token_ids\[1\] = True is not an integer"),
    ([1, 2.0], [-1, 0], r"token_ids\[1\] = 2.0 is not an integer"),
    ([1, 2], [-1, "0"], r"parents\[1\] = '0' is not an integer"),
    (torch.zeros(2, 2, dtype=torch.long), [-1, 0], r"token_ids must be 1-d"),
    ("12", [-1, 0], r"token_ids must be a list of ints, got str"),
])
def test_malformed_trees_are_refused_naming_the_field(ids, parents, match):
    with pytest.raises(DraftTreeError, match=match):
        DraftTree(ids, parents)


def test_validate_checks_budget_vocabulary_and_q():
    who = "strategy 'tree_test'"
    t = DraftTree([1, 2, 3], [-1, -1, 0])
    t.validate(vocab_size=4, max_nodes=3, who=who)
    with pytest.raises(DraftTreeError, match=r"^strategy 'tree_test': a DraftTree of 3 nodes, "
                                             r"more than the sequence's limit of 2"):
        t.validate(vocab_size=4, max_nodes=2, who=who)
    with pytest.raises(DraftTreeError, match=r"token_ids\[2\] = 3 is outside the vocabulary "
                                             r"\[0, 3\)"):
        t.validate(vocab_size=3, who=who)
    q = torch.full((3, 4), 0.25)
    DraftTree([1, 2, 3], [-1, -1, 0], q).validate(4)
    with pytest.raises(DraftTreeError, match=r"probs has shape \(3, 5\), expected \[n, vocab\] "
                                             r"= \(3, 4\)"):
        DraftTree([1, 2, 3], [-1, -1, 0], torch.full((3, 5), 0.2)).validate(4)
    with pytest.raises(DraftTreeError, match="must be a float tensor"):
        DraftTree([1, 2, 3], [-1, -1, 0], torch.ones(3, 4, dtype=torch.long)).validate(4)
    cases = [
        (lambda q: q.__setitem__((1, 0), float("nan")), r"probs\[1\] has a non-finite entry"),
        (lambda q: q[2].copy_(torch.tensor([0.5, -0.25, 0.5, 0.25])),
         r"probs\[2\] has a negative entry"),
        (lambda q: q[0].mul_(0.5), r"probs\[0\] does not sum to 1"),
        (lambda q: q[1].copy_(torch.tensor([0.5, 0.5, 0.0, 0.0])),
         r"probs\[1\] gives the node's own token probability 0"),
    ]
    for edit, match in cases:
        bad = q.clone()
        edit(bad)
        with pytest.raises(DraftTreeError, match=rf"^{who}: DraftTree\.{match}"):
            DraftTree([1, 2, 3], [-1, -1, 0], bad).validate(4, who=who)


def test_the_chain_reader_refuses_a_tree():
    # the engine reads trees on their own path (tests/test_tree_engine.py); its chain reader,
    # given one, says so instead of reading its token ids as a chain
    ids, problem = _draft_ids(DraftTree.chain([1, 2]), 10)
    assert ids == [] and problem == "drafts must be a list of token ids, got DraftTree"


def test_verification_checks_its_inputs():
    t = DraftTree([1, 2], [-1, -1])
    with pytest.raises(DraftTreeError, match=r"target must be \[n \+ 1, vocab\] = \[3, vocab\]"):
        verify_tree_greedy(t, torch.zeros(2, 4))
    with pytest.raises(DraftTreeError, match=r"token_ids\[1\] = 2 is outside the target's "
                                             r"vocabulary \[0, 2\)"):
        verify_tree_greedy(t, torch.zeros(3, 2))
    with pytest.raises(DraftTreeError, match=r"token_ids\[0\] = -1 is outside"):
        verify_tree_sampled(DraftTree([-1, 2], [-1, -1]), torch.full((3, 4), 0.25), torch.rand(3))
    with pytest.raises(DraftTreeError, match=r"u must be \[n \+ 1\] = \[3\]"):
        verify_tree_sampled(t, torch.full((3, 4), 0.25), torch.rand(2))
    with pytest.raises(DraftTreeError, match=r"probs has shape \(2, 5\)"):
        verify_tree_sampled(DraftTree([1, 2], [-1, -1], torch.full((2, 5), 0.2)),
                            torch.full((3, 4), 0.25), torch.rand(3))


# --------------------------------------------------------------------------------------------
# greedy
# --------------------------------------------------------------------------------------------
def _logits(argmaxes: list[int], vocab: int = 10) -> torch.Tensor:
    """[len(argmaxes), vocab]: random rows whose argmax is the given token."""
    g = torch.Generator().manual_seed(len(argmaxes))
    out = torch.randn(len(argmaxes), vocab, generator=g)
    out[torch.arange(len(argmaxes)), argmaxes] = 10.0
    return out


def test_greedy_follows_the_argmax_path():
    t = DraftTree([5, 7, 3, 3, 8], [-1, -1, 0, 1, 3])
    #                 row: root  0  1  2  3  4
    r = verify_tree_greedy(t, _logits([7, 1, 3, 2, 8, 6]))
    assert r.path == [1, 3, 4] and r.token_ids == [7, 3, 8, 6] and r.num_accepted == 3
    r = verify_tree_greedy(t, _logits([5, 3, 0, 0, 0, 0]))
    assert r.path == [0, 2] and r.token_ids == [5, 3, 0]
    r = verify_tree_greedy(t, _logits([7, 0, 9, 0, 0, 0]))  # node 1 accepted, 9 is no child
    assert r.path == [1] and r.token_ids == [7, 9]
    r = verify_tree_greedy(t, _logits([2, 0, 0, 0, 0, 0]))  # no child of the root
    assert r.path == [] and r.token_ids == [2]


def test_greedy_takes_the_first_of_equal_siblings_and_the_lowest_argmax():
    t = DraftTree([4, 4, 6], [-1, -1, 1])  # node 2 hangs under the second 4
    r = verify_tree_greedy(t, _logits([4, 6, 6, 1]))
    assert r.path == [0] and r.token_ids == [4, 6]
    tie = torch.zeros(4, 10)
    tie[0, [3, 4]] = 1.0  # tie at the root: token 3 wins (the lowest index), not a draft
    assert verify_tree_greedy(t, tie).token_ids == [3]
    assert verify_tree_greedy(DraftTree([], []), _logits([9])).token_ids == [9]


def test_greedy_chain_matches_the_chain_verifiers_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    vocab = 6
    for _ in range(200):
        k = int(torch.randint(0, 5, (1,), generator=g))
        logits = torch.randn(k + 1, vocab, generator=g)  # [k + 1, vocab]
        top = logits.argmax(dim=1)
        # drafts that follow the argmax for a while, then (maybe) leave it
        drafts = [int(top[j]) if torch.rand(1, generator=g) < 0.7
                  else int(torch.randint(0, vocab, (1,), generator=g)) for j in range(k)]
        tree_r = verify_tree_greedy(DraftTree.chain(drafts), logits)
        host = verify_greedy([drafts], greedy_pack(logits))
        ref, n_out = rejection_sample_ref(
            torch.tensor(drafts, dtype=torch.long), torch.tensor([k], dtype=torch.int32), None,
            logits, torch.tensor([True]), torch.zeros(k), torch.zeros(1), max_num_draft_tokens=k)
        assert tree_r.token_ids == host.token_ids[0] == ref[0, : int(n_out[0])].tolist()
        assert tree_r.path == list(range(host.num_accepted[0]))


# --------------------------------------------------------------------------------------------
# sampled: chains are the chain verifier
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("point_mass", [False, True])
def test_sampled_chain_matches_the_chain_kernel_bit_for_bit(point_mass):
    g = torch.Generator().manual_seed(1)
    vocab = 5
    for case in range(300):
        k = int(torch.randint(0, 5, (1,), generator=g))
        p = torch.softmax(2 * torch.randn(k + 1, vocab, generator=g), dim=1)  # [k + 1, vocab]
        p[p < 0.08] = 0.0  # tokens the target never takes (top-p / top-k cut)
        p = p / p.sum(dim=1, keepdim=True)
        q = torch.softmax(2 * torch.randn(k, vocab, generator=g), dim=1)  # [k, vocab]
        if case % 10 == 0:
            q = p[:k].clone()  # q == p: every residual is empty, the kernels fall back to p
            q[:, 0] += 1e-7
        drafts = [int(torch.multinomial(q[j], 1, generator=g)) for j in range(k)]
        u = torch.rand(k + 1, generator=g)  # [k + 1]
        probs = None if point_mass else q
        tree_r = verify_tree_sampled(DraftTree.chain(drafts, probs), p, u)
        ref, n_out = rejection_sample_ref(
            torch.tensor(drafts, dtype=torch.long), torch.tensor([k], dtype=torch.int32), probs,
            p, torch.tensor([False]), u[:k], u[k:], max_num_draft_tokens=k)
        assert tree_r.token_ids == ref[0, : int(n_out[0])].tolist(), (case, drafts)
        assert tree_r.path == list(range(int(n_out[0]) - 1))


def test_sibling_draft_probs():
    q = torch.tensor([0.1, 0.2, 0.3, 0.4])
    assert torch.equal(sibling_draft_probs(q, [3, 3], replacement=True), torch.stack([q, q]))
    rows = sibling_draft_probs(q, [3, 1, 2], replacement=False)
    assert torch.allclose(rows, torch.tensor([[0.1, 0.2, 0.3, 0.4],
                                              [1 / 6, 2 / 6, 3 / 6, 0.0],
                                              [0.25, 0.0, 0.75, 0.0]]))
    DraftTree([3, 1, 2], [-1, -1, -1], rows).validate(4)


# --------------------------------------------------------------------------------------------
# sampled: the output distribution is the target's
# --------------------------------------------------------------------------------------------
VOCAB = 6
SHAPES = {
    "chain": [-1, 0, 1],  # depth 3
    "star4": [-1, -1, -1, -1],  # 4 siblings
    "tree2x2": [-1, -1, 0, 0, 1, 1],  # 2 children each, depth 2
    "unbalanced": [-1, -1, 0, 0, 2, -1],  # a deep branch, a leaf, a late sibling of the root
}


class Models:
    """A toy target and draft over VOCAB tokens: the next-token distributions after any
    continuation ``ctx`` (a tuple of tokens after the root). The target's goes through the
    engine's own sampling transforms at temperature 0.8, top-p 0.95; the draft's is the target's
    logits plus noise (full support: it proposes tokens the target never takes), or with
    ``independent`` a draft unrelated to the target."""

    def __init__(self, seed: int, independent: bool = False) -> None:
        self.seed = seed
        self.independent = independent
        self.params = SamplingParams(temperature=0.8, top_p=0.95)
        self.seq = SpecSequence(0, [0], 1, 8, self.params)
        self._p: dict[tuple, torch.Tensor] = {}
        self._q: dict[tuple, torch.Tensor] = {}
        self._q_np: dict[tuple, np.ndarray] = {}

    def _logits(self, ctx: tuple) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash((self.seed, ctx)) % 2**31)
        return 1.5 * torch.randn(VOCAB, generator=g)  # [vocab]

    def p(self, ctx: tuple) -> torch.Tensor:  # [vocab] float32
        if ctx not in self._p:
            rows = [Row(self.seq, [])]
            self._p[ctx] = target_distribution(self._logits(ctx)[None], rows, None)[0]
        return self._p[ctx]

    def q(self, ctx: tuple) -> torch.Tensor:  # [vocab] float32
        if ctx not in self._q:
            g = torch.Generator().manual_seed(hash((self.seed, 1, ctx)) % 2**31)
            noise = torch.randn(VOCAB, generator=g)  # [vocab]
            logits = 2 * noise if self.independent else self._logits(ctx) + noise
            self._q[ctx] = torch.softmax(logits, 0)
        return self._q[ctx]

    def q_np(self, ctx: tuple) -> np.ndarray:  # [vocab] float64
        if ctx not in self._q_np:
            self._q_np[ctx] = self.q(ctx).double().numpy()
        return self._q_np[ctx]

    def exact(self, length: int) -> dict[tuple, float]:
        """The target's distribution over its first ``length`` tokens."""
        out = {(): 1.0}
        for _ in range(length):
            nxt = {}
            for ctx, w in out.items():
                for t, pt in enumerate(self.p(ctx).tolist()):
                    if pt > 0:
                        nxt[ctx + (t,)] = w * pt
            out = nxt
        return out


def draft(models: Models, parents: list[int], mode: str, rng: np.random.Generator
          ) -> tuple[DraftTree, dict[int, tuple]]:
    """A tree of the given shape drawn from the draft model: siblings with replacement
    ("iid"), without replacement ("distinct"), or its top tokens as point masses ("top");
    and each node's continuation (its root path's tokens). numpy, for speed."""
    n = len(parents)
    ids = [0] * n
    rows = np.zeros((n, VOCAB))
    ctx: dict[int, tuple] = {-1: ()}
    for parent in dict.fromkeys(parents):  # each parent once, in order of first child
        sib = [i for i in range(n) if parents[i] == parent]
        left = models.q_np(ctx[parent]).copy()  # [vocab] float64
        top = np.argsort(-left, kind="stable")
        for j, i in enumerate(sib):
            rows[i] = left / left.sum()  # what this sibling is drawn from
            t = int(top[j]) if mode == "top" else int(
                np.searchsorted(np.cumsum(rows[i]), rng.random() * rows[i].sum(), "right"))
            ids[i] = min(t, VOCAB - 1)
            ctx[i] = ctx[parent] + (ids[i],)
            if mode == "distinct":
                left[ids[i]] = 0.0
    probs = None if mode == "top" else torch.from_numpy(rows).float()
    return DraftTree(ids, parents, probs), ctx


def sample_outputs(models: Models, parents: list[int], mode: str, n_samples: int, seed: int,
                   lie: bool = False) -> Counter:
    """Counts of the first ``depth + 1`` tokens emitted: the verified tokens, completed by
    plain sampling from the target where verification stopped earlier. ``lie``: hand the
    verifier the parent's q for every sibling whatever the drawing (a wrong rule for "distinct")."""
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    depth = max(DraftTree([0] * len(parents), parents).depths())
    counts: Counter = Counter()
    for _ in range(n_samples):
        tree, ctx = draft(models, parents, mode, rng)
        if lie:
            tree.probs = torch.stack([models.q(ctx[p]) for p in parents])
        target = torch.stack([models.p(())] + [models.p(ctx[i]) for i in range(len(parents))])
        out = tuple(verify_tree_sampled(tree, target, torch.rand(len(parents) + 1, generator=g))
                    .token_ids)
        while len(out) < depth + 1:
            p = models.p(out).double().numpy()
            out += (int(rng.choice(VOCAB, p=p / p.sum())),)
        counts[out[: depth + 1]] += 1
    return counts


def chi_square_z(counts: Counter, exact: dict[tuple, float]) -> tuple[float, float]:
    """(z, TV): Pearson's chi-square of the counts against ``exact`` (cells with an expected
    count under 5 pooled into one), as a standard normal deviate (Wilson-Hilferty), and the total
    variation distance of the empirical distribution from ``exact``."""
    n = sum(counts.values())
    outside = sum(c for k, c in counts.items() if k not in exact)
    assert outside == 0, f"{outside} outputs the target never produces"
    chi2, df, pool_e, pool_o = 0.0, -1, 0.0, 0
    for cell, pe in exact.items():
        e, o = n * pe, counts.get(cell, 0)
        if e < 5:
            pool_e, pool_o = pool_e + e, pool_o + o
            continue
        chi2, df = chi2 + (o - e) ** 2 / e, df + 1
    if pool_e > 0:
        chi2, df = chi2 + (pool_o - pool_e) ** 2 / pool_e, df + 1
    a = 2 / (9 * df)
    z = ((chi2 / df) ** (1 / 3) - (1 - a)) / math.sqrt(a)
    tv = 0.5 * sum(abs(counts.get(c, 0) / n - pe) for c, pe in exact.items())
    return z, tv


def check_distribution(shape: str, mode: str, n_samples: int) -> tuple[float, float]:
    models = Models(seed=11)
    parents = SHAPES[shape]
    depth = max(DraftTree([0] * len(parents), parents).depths())
    exact = models.exact(depth + 1)
    z, tv = chi_square_z(sample_outputs(models, parents, mode, n_samples, seed=5), exact)
    # z: a 4-sigma bound (p ~ 3e-5), the samples seeded; TV: about 2.5x its expected size
    # under the null for this many cells and samples
    cells = sum(1 for pe in exact.values() if pe * n_samples >= 1)
    tv_bound = 0.5 * math.sqrt(cells / n_samples)
    assert z < 4.0 and tv < tv_bound, (shape, mode, z, tv, tv_bound)
    return z, tv


@pytest.mark.slow
def test_distribution_of_a_2x2_tree_without_replacement():
    check_distribution("tree2x2", "distinct", 3000)


@pytest.mark.slow  # the default run: the 2x2 tree
def test_distribution_of_a_star_with_replacement():
    check_distribution("star4", "iid", 3000)


@pytest.mark.slow
@pytest.mark.parametrize("shape,mode", [
    (shape, mode) for shape in SHAPES for mode in ("iid", "distinct", "top")
    if (shape, mode) != ("chain", "distinct")  # a chain has no siblings: the same as iid
])
def test_distribution_is_the_targets(shape, mode):
    # ~20-40 s each on a busy 2-core machine
    check_distribution(shape, mode, 30000)


@pytest.mark.parametrize("shape", ["star4", "chain"])
def test_the_statistic_catches_the_naive_rule(shape, monkeypatch):
    # every sibling tested against the target row itself, and a rejection resampled from it
    # (no residual): the classic wrong rule, far from the target's distribution
    monkeypatch.setattr(tree_verification, "_has_mass", lambda r: False)
    models = Models(seed=11)
    parents = SHAPES[shape]
    depth = max(DraftTree([0] * len(parents), parents).depths())
    z, _ = chi_square_z(sample_outputs(models, parents, "iid", 1000, seed=5),
                        models.exact(depth + 1))
    assert z > 8.0, z


def test_siblings_without_replacement_need_their_own_rows():
    # the same draws (without replacement) verified with the right rows and with the parent's q
    # for every sibling (the with-replacement rule): only the first follows the target
    models = Models(seed=12, independent=True)
    exact = models.exact(2)
    right = chi_square_z(sample_outputs(models, SHAPES["star4"], "distinct", 2000, seed=5),
                         exact)[0]
    wrong = chi_square_z(sample_outputs(models, SHAPES["star4"], "distinct", 2000, seed=5,
                                        lie=True), exact)[0]
    assert right < 4.0 and wrong > 8.0, (right, wrong)
