"""Token trees through the engine (docs/trees.md): a strategy returns a DraftTree per sequence,
the engine scores root + nodes in one forward with tree attention, the built-in verifier accepts
a root path losslessly, and the accepted path's K/V are compacted. Greedy output equals plain
greedy (tree oracle, n-gram trees, a custom tree strategy, mixed batches of trees and chains),
seeded sampled requests are reproducible, tree sampling follows the target, and bad trees are
their sequence's fault."""

from __future__ import annotations

import logging

import pytest
import test_distribution as td  # its peaky 32-token target's exact joint and the TV checks
import torch
from greedy_refs import greedy_with_references, tokens
from pydantic import BaseModel, ConfigDict

from speculant import LLM, Proposal, SamplingParams, hookimpl
from speculant.hookspecs import Strategy
from speculant.plugin_manager import register, unregister
from speculant.spec_registry import StrategyError
from speculant.spec_types import DraftTree

K = 6
MAX_TOKENS = 40
PROMPTS = [[1, 5, 6, 5, 7, 5, 8, 5], [1, 9, 9, 9], [1, 2000, 31, 77, 5, 6, 7], [1, 42],
           [1, 5, 6, 5, 6, 5], [1, 300, 301], [1, 8000, 12, 12], [1, 77, 78, 79, 80]]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_factory):
    return str(tiny_factory("llama", tokenizer=False))


@pytest.fixture(scope="module")
def plain(tiny):
    """Plain greedy outputs and oracle references K tokens longer."""
    return greedy_with_references(tiny, PROMPTS, MAX_TOKENS, K)


def _oracle(tiny, refs, **kw) -> LLM:
    return LLM(model=tiny, skip_tokenizer_init=True, max_num_seqs=8, speculative_config={
        "method": "oracle", "num_speculative_tokens": K, "alpha": 0.7, "references": refs, **kw})


@pytest.mark.parametrize("batch", [1, 8])
def test_tree_oracle_greedy_equals_plain(tiny, plain, batch):
    want, refs = plain
    llm = _oracle(tiny, refs, tree_width=2, rank_probs=[0.5, 0.3])
    prompts = PROMPTS[:batch]
    out = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert out == want[:batch]
    m = llm.get_metrics()
    assert m.num_tree_drafts == m.num_drafts > 0
    # 3 levels of 2 siblings: acceptance by depth about 0.8 given the depth before
    assert m.proposed_per_position[:3] == [m.num_drafts] * 3
    assert 0 < m.num_accepted_tokens < m.num_draft_tokens
    assert m.accepted_per_position[0] > 0.5 * m.num_drafts
    assert m.mean_accepted_length > 1.5


def test_tree_oracle_config_errors(tiny, plain):
    _, refs = plain
    with pytest.raises(StrategyError, match="rank_probs"):
        _oracle(tiny, refs, tree_width=2, rank_probs=[0.5])
    with pytest.raises(StrategyError, match="at most 1"):
        _oracle(tiny, refs, tree_width=2, rank_probs=[0.7, 0.6])
    with pytest.raises(StrategyError, match="tree_width >= 2"):
        _oracle(tiny, refs, rank_probs=[0.5])


# ------------------------------------------------------------------------------- n-gram trees
def _ngram(tiny, branches: int, **kw) -> LLM:
    return LLM(model=tiny, skip_tokenizer_init=True, max_num_seqs=8, speculative_config={
        "method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1, "tree_branches": branches, "adaptive": False, **kw})


@pytest.mark.parametrize("batch", [1, 8])
def test_ngram_tree_greedy_equals_plain(tiny, plain, batch):
    want, _ = plain
    llm = _ngram(tiny, 3, adaptive=batch > 1)  # adaptive: draft budgets follow tree acceptance
    out = tokens(llm.generate(PROMPTS[:batch], GREEDY, use_tqdm=False))
    assert out == want[:batch]
    m = llm.get_metrics()
    assert m.num_tree_drafts > 0 and m.num_accepted_tokens > 0, m.as_dict()


def test_ngram_branches_and_merge():
    from speculant.drafting import NgramIndex
    from speculant.plugins.ngram import merge_branches

    t = [1, 5, 6, 7, 5, 8, 9, 5, 3, 4, 5]
    index = NgramIndex(1, 2, keep_all=True)
    index.update(t)
    chain = index.find(3)
    found = index.find_branches(3, 3)
    assert found[0] == chain  # the chain mode's draft comes first
    assert [b[0] for b in found] == [3, 8, 6]  # "5" was followed by 3 (latest), 8, then 6
    tree = merge_branches([[1, 2, 3], [1, 4], [5]], budget=4)
    assert tree.token_ids == [1, 5, 2, 4] and tree.parents == [-1, -1, 0, 0]
    # adaptive mode's acceptance of a tree: (tokens matched along a path, a leaf reached)
    from speculant.plugins.ngram import _accepted

    assert _accepted(tree, [1, 4, 9]) == (2, True)
    assert _accepted(tree, [1, 3]) == (1, False)
    assert _accepted(tree, [7]) == (0, False)
    assert _accepted([1, 2, 3], [1, 2, 3, 4]) == (3, True)


# ------------------------------------------------------------- a custom tree strategy (public API)
REFS: dict[tuple[int, ...], list[int]] = {}  # prompt -> prompt + plain greedy continuation
MARK = 42  # prompts starting [1, MARK] get the bad trees of the "bad_*" modes


class TreeyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_speculative_tokens: int = K
    mode: str = "mixed"
    seed: int = 0


class Treey(Strategy):
    """Test strategy. "mixed": trees for sequences whose prompt has an even length (true tokens
    at varying sibling ranks, from REFS), chains for the others. "bad_*": a bad tree for marked
    sequences. "sampled" / "point": trees of 2 x 2 nodes drawn from a fixed draft distribution
    (with its probs / as point masses), drawn from a seeded request's own generator."""

    name = "treey"
    Config = TreeyConfig

    def __init__(self, config: TreeyConfig, ctx) -> None:
        super().__init__(config, ctx)
        self.V = ctx.vocab_size
        g = torch.Generator().manual_seed(config.seed)
        self.q = torch.softmax(torch.randn(self.V, generator=g), 0)  # [V] the draft distribution
        self.rng = torch.Generator().manual_seed(config.seed + 1)
        # "hidden": the target's hidden states, checked against the tokens they produced
        self.needs_hidden_states = config.mode == "hidden"
        self.model = ctx.target_model
        self.checked, self.wrong = 0, []

    def _true(self, s, d: int) -> int:
        ref = REFS.get(tuple(s.token_ids[: s.num_prompt_tokens]))
        n = len(s.token_ids) + d - 1
        return ref[n] if ref is not None and n < len(ref) else 0

    def _mixed(self, s, i: int):
        t = [self._true(s, d) for d in range(1, 5)]
        if s.num_prompt_tokens % 2:
            return [t[0], t[1], t[2], (t[3] + 1) % self.V][: s.max_draft]
        w = [(x + 1) % self.V for x in t]
        # depth 1: [w1, t1]; under w1: [t2]; under t1: [w2, t2]; under t2: [t3, w3]
        ids = [w[0], t[0], t[1], w[1], t[1], t[2], w[2]]
        parents = [-1, -1, 0, 1, 1, 4, 4]
        n = min(s.max_draft, len(ids))
        return DraftTree(ids[:n], parents[:n])

    def _drawn(self, s):
        g = s.generator if s.generator is not None else self.rng  # seeded: the request's own
        first = torch.multinomial(self.q, 2, replacement=False, generator=g).tolist()
        second = [int(torch.multinomial(self.q, 1, generator=g)) for _ in first]
        tree = DraftTree([*first, *second], [-1, -1, 0, 1])
        if self.config.mode == "point":
            return tree
        from speculant.drafting import sibling_draft_probs

        tree.probs = torch.cat([sibling_draft_probs(self.q, first, replacement=False),
                                self.q[None].repeat(2, 1)])
        return tree

    def _check_hidden(self, batch) -> None:
        """The state at position p must give back token p + 1 (greedy) for every generated one."""
        row = 0
        for s, n, p0 in zip(batch.seqs, batch.hidden_counts, batch.hidden_start):
            h = batch.hidden_states[row : row + n]
            row += n
            got = self.model.compute_logits(h).argmax(-1).tolist()
            for j, t in enumerate(got):
                p = p0 + j
                if p >= s.num_prompt_tokens - 1:
                    self.checked += 1
                    if t != s.token_ids[p + 1]:
                        self.wrong.append((s.seq_id, p, t, s.token_ids[p + 1]))

    @hookimpl
    def propose(self, batch):
        mode = self.config.mode
        if mode == "hidden":
            self._check_hidden(batch)
            mode = "mixed"
        drafts = []
        for i, s in enumerate(batch.seqs):
            if s.max_draft < 4:
                drafts.append([])
                continue
            if mode in ("sampled", "point"):
                drafts.append(self._drawn(s))
                continue
            d = self._mixed(s, i)
            if mode.startswith("bad_") and s.token_ids[1] == MARK:
                n = len(d.token_ids) if isinstance(d, DraftTree) else len(d)
                if mode == "bad_oov":
                    d = DraftTree([self.V + 3] * n, [-1] * n)
                elif mode == "bad_too_many":
                    d = DraftTree([5] * (s.max_draft + 1), [-1] * (s.max_draft + 1))
                elif mode == "bad_probs":
                    d = DraftTree([5, 6], [-1, 0], torch.full((2, self.V), 0.5))
                elif mode == "bad_type":
                    d = 3.5
                elif mode == "bad_parents":  # changed after construction
                    d = DraftTree([5, 6], [-1, 0])
                    d.parents = [-1, 1]
            drafts.append(d)
        return Proposal(token_ids=drafts)


    @hookimpl
    def verify(self, batch, proposal, scores):
        if self.config.mode not in ("bad_verify", "bad_path"):
            return None  # the built-in verifier
        from speculant.spec_types import VerifyResult

        if self.config.mode == "bad_path":  # right tokens, a node list that is not their path
            trees = proposal.token_ids
            toks = [[d.token_ids[0], 0] if isinstance(d, DraftTree) else [0] for d in trees]
            return VerifyResult(token_ids=toks, num_accepted=[len(t) - 1 for t in toks],
                                tree_paths=[[d.num_nodes] if isinstance(d, DraftTree) else None
                                            for d in trees])
        # a tree sequence "accepts" a token that no child of the root holds
        toks = [[self.V - 1, 0] if isinstance(d, DraftTree) else [0] for d in proposal.token_ids]
        return VerifyResult(token_ids=toks, num_accepted=[len(t) - 1 for t in toks])


class _Plugin:
    @hookimpl
    def register_strategies(self, register):
        register(Treey)


@pytest.fixture(scope="module")
def treey(plain):
    want, _ = plain
    REFS.update({tuple(p): p + w for p, w in zip(PROMPTS, want)})
    name = register(_Plugin(), name="test-tree-engine")
    yield
    unregister(name)
    REFS.clear()


def _treey(tiny, mode: str, **kw) -> LLM:
    return LLM(model=tiny, skip_tokenizer_init=True, max_num_seqs=8, **kw,
               speculative_config={"method": "treey", "num_speculative_tokens": K, "mode": mode})


def test_mixed_batch_of_trees_and_chains_equals_plain(tiny, plain, treey):
    want, _ = plain
    llm = _treey(tiny, "mixed")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert tokens(outs) == want
    m = llm.get_metrics()
    assert 0 < m.num_tree_drafts < m.num_drafts and m.num_faults == 0
    # the tree's true path sits at sibling ranks 1, 1, 0: 3 accepted per step at most
    assert m.accepted_per_position[0] > 0 and m.accepted_per_position[2] > 0
    # the logprobs of the tokens that came from tree rows are the plain run's
    ref = LLM(model=tiny, skip_tokenizer_init=True, max_num_seqs=8)
    plain_outs = ref.generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(outs, plain_outs):
        got = [lp[t].logprob for lp, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)]
        exp = [lp[t].logprob for lp, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)]
        assert got == pytest.approx(exp, abs=1e-4)


def test_hidden_states_of_the_accepted_path_reach_the_proposer(tiny, plain, treey):
    """A strategy with needs_hidden_states gets, after a tree step, the rows of the root and of
    the accepted nodes only (each gives back the token it produced), as after a chain step."""
    want, _ = plain
    llm = _treey(tiny, "hidden")
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
    strat = llm.engine.spec.strategy
    assert llm.get_metrics().num_tree_drafts > 0
    assert strat.checked > len(PROMPTS) * 10 and strat.wrong == [], strat.wrong[:5]


@pytest.mark.parametrize("mode,problem", [
    ("bad_verify", "are not a root path of its DraftTree"),
    ("bad_path", "VerifyResult.tree_paths[0] = "),
])
def test_a_verify_result_off_the_tree_is_the_verifiers_fault(tiny, treey, mode, problem):
    from speculant.engine.spec_decode import StrategyFault

    llm = _treey(tiny, mode)
    with pytest.raises(StrategyFault) as e:
        llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert "verify()" in str(e.value) and problem in str(e.value)
    assert all(o.outputs[0].finish_reason == "abort" for o in e.value.outputs)


@pytest.mark.parametrize("mode,problem", [
    ("bad_oov", "outside the vocabulary"),
    ("bad_too_many", "more than the sequence's limit"),
    ("bad_probs", "does not sum to 1"),
    ("bad_type", "drafts must be a list of token ids, got float"),
    ("bad_parents", "DraftTree.parents[1] = 1: a node's parent must be -1 (the root) or an "
                    "earlier node"),
])
def test_a_bad_tree_is_its_sequences_fault(tiny, plain, treey, caplog, mode, problem):
    want, _ = plain
    marked = [p for p in PROMPTS if p[1] == MARK]
    assert len(marked) == 1
    llm = _treey(tiny, mode)
    with caplog.at_level(logging.WARNING, logger="speculant"):
        out = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert out == want
    m = llm.get_metrics()
    assert m.num_faults == 1 and m.num_tree_drafts > 0, m.as_dict()
    text = caplog.text
    assert "strategy 'treey'" in text and problem in text, text


# ------------------------------------------------------------------------ sampling with trees
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, ignore_eos=True, seed=123)


@pytest.fixture(scope="module")
def small(tiny_factory):
    """A tiny Llama with a 512-token vocabulary (top-p over a large one dominates on the CPU)
    and oracle references of its plain greedy continuations."""
    path = str(tiny_factory("llama", vocab_size=512, tokenizer=False))
    prompts = [[t % 512 for t in p] for p in PROMPTS]
    llm = LLM(model=path, skip_tokenizer_init=True, max_num_seqs=8)
    long = tokens(llm.generate(prompts, SamplingParams(temperature=0, max_tokens=30,
                                                        ignore_eos=True), use_tqdm=False))
    return path, prompts, [{"prompt_token_ids": p, "output_token_ids": t}
                           for p, t in zip(prompts, long)]


@pytest.mark.parametrize("how", ["point", "sampled", "oracle"])
def test_seeded_tree_request_is_reproducible_alone_and_in_a_batch(small, treey, how):
    path, prompts, refs = small
    if how == "oracle":
        def make():
            return _oracle(path, refs, tree_width=3)
    else:
        def make():
            return _treey(path, how)
    alone = tokens(make().generate([prompts[2]], SAMPLED, use_tqdm=False))[0]
    others = [SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=7 + i)
              if i % 2 else SamplingParams(temperature=0.7, max_tokens=24, ignore_eos=True)
              for i in range(len(prompts))]
    others[2] = SAMPLED
    llm = make()
    batch = tokens(llm.generate(prompts, others, use_tqdm=False))
    assert batch[2] == alone
    assert llm.get_metrics().num_tree_drafts > 0
    if how != "sampled":  # point-mass trees: a seeded request's output is its plain output
        ref = LLM(model=path, skip_tokenizer_init=True, max_num_seqs=8)
        assert tokens(ref.generate([prompts[2]], SAMPLED, use_tqdm=False))[0] == alone


@pytest.fixture(scope="module")
def peaky(tiny_factory, tmp_path_factory):
    """test_distribution's target (a 32-token Llama whose LM head is scaled by 3) and the exact
    joint distribution of its first three sampled tokens."""
    import shutil

    from safetensors.torch import load_file, save_file

    base = tiny_factory("llama", vocab_size=td.V, tokenizer=False, num_hidden_layers=td.LAYERS)
    path = tmp_path_factory.mktemp("peaky-tree")
    for f in base.iterdir():
        if f.is_file():
            shutil.copy(f, path / f.name)
    weights = load_file(str(base / "model.safetensors"))
    weights["lm_head.weight"] = weights["lm_head.weight"] * 3  # [V, H]
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path, td.exact_joint(path)


def _tree_samples(target, how: str) -> tuple[torch.Tensor, object]:
    llm = LLM(model=str(target), skip_tokenizer_init=True, max_num_seqs=td.N,
              max_num_batched_tokens=td.N * len(td.PROMPT), speculative_config={
                  "method": "treey", "num_speculative_tokens": 4, "mode": how, "seed": 3})
    params = SamplingParams(temperature=td.TEMPERATURE, top_p=td.TOP_P, max_tokens=3,
                            ignore_eos=True)
    toks = torch.tensor(tokens(llm.generate([td.PROMPT] * td.N, params, use_tqdm=False)))
    assert toks.shape == (td.N, 3)
    return toks, llm.get_metrics()


# slow (~9 s each on a busy 2-core machine), as its negative control below: the default run checks
# tree verification's distribution in tests/test_tree_verification.py and chains' end to end in
# tests/test_distribution.py
@pytest.mark.slow
@pytest.mark.parametrize("how", ["sampled", "point"])
def test_tree_sampling_follows_the_target_distribution(treey, peaky, how):
    """As tests/test_distribution.py does for chains: N requests of 3 tokens from a peaky
    32-token target at temperature 0.8 / top-p 0.95, each step a 2 x 2 tree (siblings drawn
    without replacement, with their probs; or the same trees as point masses); the empirical
    distributions of t1, t2, t3, (t1, t2), (t2, t3) must be within the TV bound of the exact
    joint distribution."""
    target, joint = peaky
    toks, m = _tree_samples(target, how)
    assert m.num_tree_drafts > td.N and 50 < m.num_accepted_tokens < m.num_draft_tokens, (
        m.as_dict())
    results = td.checks(toks, joint)
    for name, tv, bound in results:
        assert tv < bound, f"{how} {name}: TV {tv:.4f} >= bound {bound:.4f} ({results})"


@pytest.mark.slow
def test_the_check_rejects_blind_acceptance(treey, peaky, monkeypatch):
    """Negative control: accept tests that always pass (u = 0: every draft the target does not
    rule out is accepted) make the output follow the drafter; the same check must fail."""
    import speculant.plugins.rejection_sampler as rs

    real = rs.uniforms

    def blind(*args, purpose=None, **kw):
        u = real(*args, purpose=purpose, **kw)
        return torch.zeros_like(u) if purpose == "accept" else u

    monkeypatch.setattr(rs, "uniforms", blind)
    target, joint = peaky
    toks, _ = _tree_samples(target, "sampled")
    results = td.checks(toks, joint)
    assert any(tv >= bound for _, tv, bound in results), results


# -------------------------------------------------------------------------------------- CUDA
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("eager", [False, True])
def test_cuda_tree_steps_equal_plain(tiny, plain, treey, eager):
    """On CUDA (float32): the Triton tree attention and K/V compaction, in tree graphs (or
    eagerly), give plain greedy's tokens for tree oracle, n-gram trees and a mixed batch."""
    kw = {"device": "cuda", "dtype": "float32", "enforce_eager": eager,
          "kv_cache_memory": 1 << 26}
    ref = LLM(model=tiny, skip_tokenizer_init=True, max_num_seqs=8, **kw)
    want = tokens(ref.generate(PROMPTS, GREEDY, use_tqdm=False))
    _, refs = plain
    specs = [
        {"method": "oracle", "alpha": 0.7, "references": refs, "tree_width": 2,
         "rank_probs": [0.5, 0.3]},
        {"method": "ngram", "prompt_lookup_max": 3, "tree_branches": 3, "adaptive": False},
        {"method": "treey", "mode": "mixed"},
    ]
    for spec in specs:
        for batch in (1, 8):
            llm = LLM(model=tiny, skip_tokenizer_init=True, max_num_seqs=8, **kw,
                      speculative_config={"num_speculative_tokens": K, **spec})
            out = tokens(llm.generate(PROMPTS[:batch], GREEDY, use_tqdm=False))
            assert out == want[:batch], (spec["method"], batch)
            m = llm.get_metrics()
            assert m.num_tree_drafts > 0, (spec["method"], m.as_dict())
            g = llm.engine.runner.graphs
            assert (g is None) == eager and (eager or len(g.tree_graphs) > 0)


# ------------------------------------------------------------------------- the default model
@pytest.mark.slow
def test_default_model_tree_greedy_equals_plain(smollm, default_model_path):
    texts = ["The capital of France is", "def fibonacci(n):\n    ", "1, 2, 3, 4, 5,",
             "Once upon a time, there was a", "The quick brown fox", "import numpy as np\n",
             "Q: What is 2 + 2?\nA:", "Roses are red, violets are"]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    long = smollm.generate(texts, SamplingParams(temperature=0, max_tokens=32 + K,
                                                 ignore_eos=True), use_tqdm=False)
    want = [o.outputs[0].token_ids[:32] for o in long]
    refs = [{"prompt_token_ids": o.prompt_token_ids, "output_token_ids": o.outputs[0].token_ids}
            for o in long]
    specs = [{"method": "oracle", "alpha": 0.8, "references": refs, "tree_width": 2},
             {"method": "ngram", "tree_branches": 3}]
    for spec in specs:
        llm = LLM(model=str(default_model_path), max_num_seqs=8,
                  speculative_config={"num_speculative_tokens": K, **spec})
        for batch in (1, 8):
            out = tokens(llm.generate(texts[:batch], params, use_tqdm=False))
            assert out == want[:batch], spec["method"]
        assert llm.get_metrics().num_tree_drafts > 0, spec["method"]


def test_packed_greedy_tree_verification_matches_the_rule():
    """The verifier's one-read greedy path (ScoreResult.greedy) gives verify_tree_greedy's path
    and tokens on random trees, and verify_greedy's on chains."""
    from speculant.drafting import verify_tree_greedy
    from speculant.engine.sampler import greedy_pack
    from speculant.plugins.rejection_sampler import verify_greedy, verify_greedy_trees

    g = torch.Generator().manual_seed(0)
    V = 5  # few tokens: drafts often equal the argmax
    for _ in range(200):
        drafts = []
        for _ in range(3):
            n = int(torch.randint(1, 8, (1,), generator=g))
            ids = torch.randint(0, V, (n,), generator=g).tolist()
            if torch.rand(1, generator=g) < 0.3:
                drafts.append(ids)
                continue
            parents = [int(torch.randint(-1, i, (1,), generator=g)) for i in range(n)]
            drafts.append(DraftTree(ids, parents))
        rows = sum((d.num_nodes if isinstance(d, DraftTree) else len(d)) + 1 for d in drafts)
        logits = torch.randn(rows, V, generator=g)
        got = verify_greedy_trees(drafts, greedy_pack(logits))
        r0 = 0
        for i, d in enumerate(drafts):
            if isinstance(d, DraftTree):
                ref = verify_tree_greedy(d, logits[r0 : r0 + d.num_nodes + 1])
                assert (got.token_ids[i], got.num_accepted[i]) == (ref.token_ids,
                                                                    ref.num_accepted)
                assert got.tree_paths[i] == ref.path
                r0 += d.num_nodes + 1
            else:
                ref = verify_greedy([d], greedy_pack(logits[r0 : r0 + len(d) + 1]))
                assert got.token_ids[i] == ref.token_ids[0]
                assert got.logprobs[i] == pytest.approx(ref.logprobs[0])
                r0 += len(d) + 1
