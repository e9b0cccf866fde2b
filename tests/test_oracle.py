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


# ------------------------------------------------------------------ stratified draws, unit level
def _oracle_unit(alpha, k, draws, seed=0, vocab=1000):
    from speculant.plugins.oracle import OracleConfig, OracleStrategy
    from speculant.spec_types import StrategyContext

    ref_out = [(7 * i + 3) % vocab for i in range(4000)]
    cfg = OracleConfig(num_speculative_tokens=k, alpha=alpha, seed=seed, draws=draws,
                       references=[{"prompt_token_ids": [1, 2], "output_token_ids": ref_out}])
    ctx = StrategyContext(target_model=None, target_config=None, vocab_size=vocab, device=None,
                          dtype=None, block_size=16, max_model_len=8192, max_num_seqs=8)
    return OracleStrategy(cfg, ctx), [1, 2] + ref_out


def _simulate(strat, ref, k, steps, seq_id=0):
    """Greedy verification against the reference: per step, the accepted prefix of the draft."""
    from speculant.spec_types import SpecBatch, SpecSequence

    tokens, accepted = ref[:2], []
    for _ in range(steps):
        seq = SpecSequence(seq_id, list(tokens), 2, k, None)
        draft = strat.propose(SpecBatch(seqs=[seq])).token_ids[0]
        n = len(tokens)
        j = 0
        while j < len(draft) and draft[j] == ref[n + j]:
            j += 1
        accepted.append(j)
        tokens = ref[: n + j + 1]
    return accepted


def _tokens_per_step_vs_formula(accepted, k):
    trials = sum(min(k, j + 1) for j in accepted)
    a = sum(accepted) / trials
    formula = (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1
    return (sum(accepted) / len(accepted) + 1) / formula


@pytest.mark.parametrize("draws", ["stratified", "independent"])
def test_each_draft_follows_the_independent_law(draws):
    """One draft per sequence over many sequences (fresh u_0 each): the accepted prefix j has
    P(j >= m) = alpha^m, and tokens after the first corrupted one are corrupted at 1 - alpha."""
    alpha, k, n = 0.7, 5, 6000
    strat, ref = _oracle_unit(alpha, k, draws, seed=11)
    counts = [0] * (k + 1)
    after = after_bad = 0
    from speculant.spec_types import SpecBatch, SpecSequence

    for i in range(n):
        draft = strat.propose(SpecBatch(seqs=[SpecSequence(i, ref[:2], 2, k, None)])).token_ids[0]
        truth = ref[2 : 2 + k]
        bad = [d != t for d, t in zip(draft, truth)]
        j = bad.index(True) if True in bad else k
        counts[j] += 1
        after += len(bad) - j - 1 if j < k else 0
        after_bad += sum(bad[j + 1 :])
    for m in range(1, k + 1):
        got = sum(counts[m:]) / n
        assert abs(got - alpha**m) < 4 * (alpha**m * (1 - alpha**m) / n) ** 0.5 + 1e-3, (m, got)
    assert abs(after_bad / after - (1 - alpha)) < 0.03


def test_stratified_runs_match_the_formula_and_independent_ones_need_not():
    """A 60-step run (about a 256-token benchmark at alpha = 0.9, k = 5): with stratified draws
    the realized tokens per step stay within 1.5% of Leviathan's formula from the measured
    acceptance for every seed; independent draws miss that band for some seeds (what the
    stratification is for)."""
    k, steps = 5, 60
    worst = {}
    for draws in ("stratified", "independent"):
        devs = []
        for seed in range(40):
            strat, ref = _oracle_unit(0.9, k, draws, seed=seed)
            devs.append(abs(_tokens_per_step_vs_formula(_simulate(strat, ref, k, steps), k) - 1))
        worst[draws] = max(devs)
    assert worst["stratified"] < 0.015, worst
    assert worst["independent"] > 0.02, worst


def test_stratified_edges():
    for alpha, want in ((1.0, 3), (0.0, 0)):
        strat, ref = _oracle_unit(alpha, 3, "stratified")
        assert set(_simulate(strat, ref, 3, 20)) == {want}
    strat, _ = _oracle_unit(0.5, 3, "stratified")
    strat.on_requests_finished([0])  # unknown ids are fine
    with pytest.raises(Exception, match="draws"):
        _oracle_unit(0.5, 3, "sobol")
