"""The oracle strategy: it replays a recorded greedy continuation, corrupting each token with
probability 1 - alpha, so measured acceptance follows alpha while the output stays exactly that of
plain decoding."""

from __future__ import annotations

import json

import pytest

from speculant import LLM, SamplingParams
from speculant.spec_registry import StrategyError

K = 4
MAX_TOKENS = 48
PROMPTS = [[1, 17, 300, 4000, 52], [1, 9, 9, 9], [1, 2000, 31, 77, 5, 6, 7], [1, 42]]


@pytest.fixture(scope="module")
def tiny(tiny_factory):
    return str(tiny_factory("llama", tokenizer=False))


@pytest.fixture(scope="module")
def recorded(tiny):
    """Plain greedy outputs (MAX_TOKENS) and references K tokens longer, so every oracle step can
    propose a full draft of K tokens."""
    llm = LLM(model=tiny, skip_tokenizer_init=True, max_num_seqs=8)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS + K,
                                                ignore_eos=True), use_tqdm=False)
    long = [o.outputs[0].token_ids for o in outs]
    refs = [{"prompt_token_ids": p, "output_token_ids": t} for p, t in zip(PROMPTS, long)]
    return [t[:MAX_TOKENS] for t in long], refs


def _run(tiny, refs, alpha, seed=0, **extra):
    llm = LLM(model=tiny, skip_tokenizer_init=True, max_num_seqs=8, speculative_config={
        "method": "oracle", "num_speculative_tokens": K, "alpha": alpha, "seed": seed,
        **({"references": refs} if refs is not None else {}), **extra})
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.get_metrics(), llm.engine.spec.strategy


def _conditional_acceptance(m) -> float:
    """P(draft j accepted | drafts < j accepted), pooled over positions (all drafts have K)."""
    trials = m.proposed_per_position[0] + sum(m.accepted_per_position[:-1])
    return sum(m.accepted_per_position) / trials


@pytest.mark.parametrize("alpha", [0.5, 0.8])
def test_acceptance_follows_alpha_and_output_is_plain(tiny, recorded, alpha):
    plain, refs = recorded
    out, m, strat = _run(tiny, refs, alpha)
    assert out == plain
    assert m.proposed_per_position == [m.num_drafts] * K, "every draft must have K tokens"
    got = _conditional_acceptance(m)
    assert abs(got - alpha) < 0.1, (got, alpha)
    mean_len = (1 - alpha ** (K + 1)) / (1 - alpha)
    assert abs(m.mean_accepted_length - mean_len) < 0.35 * mean_len
    # the corruption rate itself, over every token proposed
    assert abs(strat.num_corrupted / strat.num_proposed - (1 - alpha)) < 0.1


def test_alpha_one_accepts_everything_alpha_zero_nothing(tiny, recorded):
    plain, refs = recorded
    out1, m1, _ = _run(tiny, refs, 1.0)
    assert out1 == plain
    assert m1.num_accepted_tokens == m1.num_draft_tokens > 0
    out0, m0, s0 = _run(tiny, refs, 0.0)
    assert out0 == plain
    assert m0.num_accepted_tokens == 0 and m0.num_draft_tokens > 0
    assert s0.num_corrupted == s0.num_proposed


def test_seeded_and_reference_file(tiny, recorded, tmp_path):
    plain, refs = recorded
    path = tmp_path / "refs.json"
    path.write_text(json.dumps(refs))
    a = _run(tiny, None, 0.6, seed=3, reference_file=str(path))[1]
    b = _run(tiny, refs, 0.6, seed=3)[1]
    c = _run(tiny, refs, 0.6, seed=4)[1]
    assert a.accepted_per_position == b.accepted_per_position
    assert a.accepted_per_position != c.accepted_per_position


def test_unknown_prompt_decodes_plainly(tiny, recorded):
    plain, refs = recorded
    out, m, _ = _run(tiny, refs[1:], 0.9)
    assert out == plain
    assert m.num_plain_steps > 0 and m.num_accepted_tokens > 0


def test_config_is_validated(tiny, recorded):
    _, refs = recorded
    with pytest.raises(StrategyError, match="alpha"):
        _run(tiny, refs, 1.5)
    with pytest.raises(StrategyError, match="exactly one"):
        _run(tiny, None, 0.5)
    with pytest.raises(StrategyError, match="unknown option"):
        _run(tiny, refs, 0.5, bogus=1)
