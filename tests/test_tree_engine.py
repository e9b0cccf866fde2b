"""Token trees through the engine (docs/trees.md): a strategy returns a DraftTree per sequence,
the engine scores root + nodes in one forward with tree attention, the built-in verifier accepts
a root path losslessly, and the accepted path's K/V are compacted. Greedy output equals plain
greedy (tree oracle, n-gram trees, a custom tree strategy, mixed batches of trees and chains),
seeded sampled requests are reproducible, tree sampling follows the target, and bad trees are
their sequence's fault."""

from __future__ import annotations

import logging

import pytest
import torch
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


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def plain(tiny):
    """Plain greedy outputs and oracle references K tokens longer."""
    llm = LLM(model=tiny, skip_tokenizer_init=True, max_num_seqs=8)
    long = _tokens(llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS + K,
                                                        ignore_eos=True), use_tqdm=False))
    refs = [{"prompt_token_ids": p, "output_token_ids": t} for p, t in zip(PROMPTS, long)]
    return [t[:MAX_TOKENS] for t in long], refs


def _oracle(tiny, refs, **kw) -> LLM:
    return LLM(model=tiny, skip_tokenizer_init=True, max_num_seqs=8, speculative_config={
        "method": "oracle", "num_speculative_tokens": K, "alpha": 0.7, "references": refs, **kw})


@pytest.mark.parametrize("batch", [1, 8])
def test_tree_oracle_greedy_equals_plain(tiny, plain, batch):
    want, refs = plain
    llm = _oracle(tiny, refs, tree_width=2, rank_probs=[0.5, 0.3])
    prompts = PROMPTS[:batch]
    out = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
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
    llm = _ngram(tiny, 3)
    out = _tokens(llm.generate(PROMPTS[:batch], GREEDY, use_tqdm=False))
    assert out == want[:batch]
    m = llm.get_metrics()
    assert m.num_tree_drafts > 0 and m.num_accepted_tokens > 0, m.as_dict()


def test_ngram_branches_and_merge():
    from speculant.plugins.ngram import NgramIndex, merge_branches

    t = [1, 5, 6, 7, 5, 8, 9, 5, 3, 4, 5]
    index = NgramIndex(1, 2, keep_all=True)
    index.update(t)
    chain = index.find(3)
    found = index.find_branches(3, 3)
    assert found[0] == chain  # the chain mode's draft comes first
    assert [b[0] for b in found] == [3, 8, 6]  # "5" was followed by 3 (latest), 8, then 6
    tree = merge_branches([[1, 2, 3], [1, 4], [5]], budget=4)
    assert tree.token_ids == [1, 5, 2, 4] and tree.parents == [-1, -1, 0, 0]
