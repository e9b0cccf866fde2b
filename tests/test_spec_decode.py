"""The speculative loop with the n-gram strategy: greedy equivalence, stops inside accepted runs,
sampling exactness, configuration, and the score / on_requests_finished hooks."""

from __future__ import annotations

import warnings

import pytest
import torch

from speculant import LLM, SamplingParams, hookimpl
from speculant.drafting import find_draft
from speculant.plugins.ngram import NgramStrategy
from speculant.spec_registry import StrategyError

REPETITIVE = [
    "Repeat exactly: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat.",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef",
    "One two three four five. One two three four five. One two three",
    "Copy this list: apple, banana, cherry, apple, banana, cherry, apple,",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Summarize: Paris is the capital of France. Paris is known for the Eiffel Tower.",
    "a b c d e f g a b c d e f g a b c",
    "Hello hello hello hello hello",
]


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_find_draft_takes_longest_most_recent_match():
    t = torch.tensor([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3])
    assert find_draft(t, 1, 3, 2) == [7, 8]  # most recent earlier "1 2 3" is followed by 7 8
    assert find_draft(torch.tensor([5, 6, 7]), 1, 3, 2) == []
    t = torch.tensor([4, 1, 9, 9, 4, 2, 9, 4])
    assert find_draft(t, 1, 2, 3) == [2, 9, 4]  # only a 1-gram matches: most recent "4"


@pytest.fixture(scope="module")
def smollm_plain(default_model_path):
    return LLM(model=str(default_model_path), max_num_seqs=8)


# slow (40-55 s on a busy 2-core machine): the default run checks n-gram greedy equivalence on
# three tiny models (below) and, with penalties and at batch 1 / 4 / 16, on a tiny Llama
# (tests/test_batch_invariance.py); SmolLM2 itself in the slow run
@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_equivalence_smollm_batch_1_and_8(default_model_path, smollm_plain, k):
    params = SamplingParams(temperature=0, max_tokens=24)
    spec = LLM(model=str(default_model_path), max_num_seqs=8,
               speculative_config={"method": "ngram", "num_speculative_tokens": k})
    batch = spec.generate(REPETITIVE, params, use_tqdm=False)
    assert _ids(batch) == _ids(smollm_plain.generate(REPETITIVE, params, use_tqdm=False))
    single = spec.generate(REPETITIVE[:2], params, use_tqdm=False)
    assert _ids(single) == _ids(batch[:2])
    m = spec.get_metrics()
    assert m.num_draft_tokens > 0 and m.num_accepted_tokens > 0
    assert len(m.accepted_per_position) <= k
    assert not spec.engine.spec.strategy._last, "on_requests_finished must clear per-seq state"


# the default run: k = 3 on every architecture, k = 1 and 5 on Llama (the rest slow)
@pytest.mark.parametrize("arch,k", [
    (arch, k) if k == 3 or arch == "llama" else pytest.param(arch, k, marks=pytest.mark.slow)
    for k in (1, 3, 5) for arch in ("llama", "qwen2", "opt")])
def test_greedy_equivalence_tiny_models(tiny_factory, arch, k):
    path = str(tiny_factory(arch))
    prompts = [[3, 4, 5, 6, 3, 4, 5, 6, 3, 4], [7, 8, 7, 8, 7, 8], [11, 12, 13],
               [20, 21, 22, 20, 21], [1, 2, 1, 2], [9] * 6, [30, 31, 32, 33, 30, 31], [40, 41]]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = LLM(model=path).generate(prompts, params, use_tqdm=False)
    spec_llm = LLM(model=path, speculative_config={"method": "ngram", "num_speculative_tokens": k})
    assert _ids(spec_llm.generate(prompts, params, use_tqdm=False)) == _ids(plain)
    assert _ids(spec_llm.generate(prompts[:1], params, use_tqdm=False)) == _ids(plain[:1])


def test_stops_inside_an_accepted_run(tiny_llama):
    prompt = [[5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]]
    plain = LLM(model=str(tiny_llama))
    spec = LLM(model=str(tiny_llama), speculative_config={"method": "ngram", "num_speculative_tokens": 5})
    for params in (SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
                   SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[7]),
                   SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=["ing"])):
        a = plain.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        b = spec.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == \
            (a.token_ids, a.text, a.finish_reason, a.stop_reason)
    assert len(plain.generate(prompt, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].token_ids) == 7


def test_logprobs_with_speculation_are_the_targets(tiny_llama):
    prompt = [[5, 6, 7, 5, 6, 7, 5, 6]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    a = LLM(model=str(tiny_llama)).generate(prompt, params, use_tqdm=False)[0].outputs[0]
    b = LLM(model=str(tiny_llama), speculative_config={"method": "ngram", "num_speculative_tokens": 4}
            ).generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert a.token_ids == b.token_ids
    assert b.cumulative_logprob == pytest.approx(a.cumulative_logprob, abs=1e-3)
    for da, db in zip(a.logprobs, b.logprobs):
        assert set(da) == set(db)
        for t in da:
            assert db[t].logprob == pytest.approx(da[t].logprob, abs=1e-4)


def _exact_two_token_marginal(path, prompt, params):
    """p(t2) = sum_t1 p(t1 | prompt) p(t2 | prompt, t1), by HF transformers, with the request's
    temperature/top-p applied to each step's distribution."""
    from transformers import AutoModelForCausalLM

    from tests.test_rejection_verify import expected_probs

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        p1 = expected_probs(hf(torch.tensor([prompt])).logits[0, -1], params)
        V = p1.shape[0]
        batch = torch.tensor([prompt + [t] for t in range(V)])
        p2_given = torch.stack([expected_probs(r, params) for r in hf(batch).logits[:, -1]])
    return p1, (p1[:, None] * p2_given).sum(0)


def test_sampling_follows_target_distribution(tiny_factory):
    path = str(tiny_factory("llama", vocab_size=16, tokenizer=False))
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=2, ignore_eos=True, n=3000, seed=5)
    llm = LLM(model=path, skip_tokenizer_init=True, max_num_seqs=512,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    outs = llm.generate([prompt], params, use_tqdm=False)[0].outputs
    toks = torch.tensor([o.token_ids for o in outs])  # [n, 2]
    assert llm.get_metrics().num_draft_tokens > 0, "the second token must go through verification"
    p1, p2 = _exact_two_token_marginal(path, prompt, params)
    emp1 = torch.bincount(toks[:, 0], minlength=16).float() / len(outs)
    emp2 = torch.bincount(toks[:, 1], minlength=16).float() / len(outs)
    # 3000 draws over 16 outcomes: expected TV ~0.03; 0.07 leaves a wide margin
    assert 0.5 * (emp1 - p1).abs().sum() < 0.07
    assert 0.5 * (emp2 - p2).abs().sum() < 0.07


def test_legacy_keywords_warn_and_work(tiny_llama):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        llm = LLM(model=str(tiny_llama), speculative_model="[ngram]", num_speculative_tokens=3,
                  ngram_prompt_lookup_max=3, ngram_prompt_lookup_min=2)
    assert any(issubclass(x.category, DeprecationWarning) for x in w)
    assert isinstance(llm.engine.spec.strategy, NgramStrategy)
    assert llm.engine.spec.strategy.config.prompt_lookup_max == 3
    assert llm.engine.spec.k == 3


@pytest.mark.parametrize("cfg,message", [
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_mx": 2}, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 3}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 3, "acceptance_method": "typical"}, "typical"),
])
def test_bad_speculative_config_is_explained(tiny_llama, cfg, message):
    with pytest.raises((StrategyError, ValueError)) as e:
        LLM(model=str(tiny_llama), speculative_config=cfg)
    assert message in str(e.value)


def test_score_hook_can_be_overridden(tiny_llama):
    """A plugin's score implementation runs before the default (which it can defer to)."""
    llm = LLM(model=str(tiny_llama), speculative_config={"method": "ngram", "num_speculative_tokens": 3})

    class CountingScorer:
        calls = 0

        @hookimpl(tryfirst=True)
        def score(self, batch, proposal):
            CountingScorer.calls += 1
            return None  # fall through to the engine's TargetScorer

    llm.engine.spec.pm.register(CountingScorer(), name="test-counting-scorer")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm.generate([[5, 6, 7, 5, 6, 7, 5]], params, use_tqdm=False)
    assert CountingScorer.calls > 0


def test_metrics_are_consistent(tiny_llama):
    llm = LLM(model=str(tiny_llama), speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    outs = llm.generate([[5, 6, 7, 5, 6, 7, 5], [1, 2, 3]],
                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    total = llm.get_metrics()
    per = [o.metrics.spec for o in outs]
    assert total.num_draft_tokens == sum(p.num_draft_tokens for p in per)
    assert total.num_accepted_tokens == sum(p.num_accepted_tokens for p in per)
    assert sum(total.accepted_per_position) == total.num_accepted_tokens
    for o in outs:
        m = o.metrics
        assert m.time_to_first_token > 0 and m.time_per_output_token > 0
        # every decode step emitted 1 + accepted tokens
        assert m.spec.num_emitted_tokens == len(o.outputs[0].token_ids) - 1
        assert m.spec.mean_accepted_length >= 1.0


@pytest.mark.parametrize("overlap", [False, True])
def test_the_decoder_uses_only_the_target_engine_interface(tiny_llama, overlap):
    """SpecDecoder reads nothing of its engine beyond engine/target.py's TargetEngine: with the
    engine hidden behind an object that has only those methods, speculative and plain steps
    (overlapped or not) give plain decoding's tokens."""
    from speculant.engine.target import TargetEngine

    calls = [n for n in vars(TargetEngine) if not n.startswith("_")]
    assert set(calls) == {"strategy_context", "take_back", "decode", "score", "reserve_slots",
                          "rollback", "append_token", "compact_tree"}

    class OnlyTarget:
        def __init__(self, engine):
            for n in calls:
                setattr(self, n, getattr(engine, n))

    prompts = [[5, 6, 7, 5, 6, 7, 5], [1, 2, 3, 1, 2, 3]]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (6, 20)]
    plain = LLM(model=str(tiny_llama)).generate(prompts, params, use_tqdm=False)
    llm = LLM(model=str(tiny_llama), async_scheduling=overlap,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "disable_by_batch_size": 1})  # plain steps while 2 run
    llm.engine.spec.engine = OnlyTarget(llm.engine)
    out = llm.generate(prompts, params, use_tqdm=False)
    assert _ids(out) == _ids(plain)
    m = llm.get_metrics()
    assert m.num_plain_steps > 0 and m.num_spec_steps > 0 and m.num_draft_tokens > 0


# ----------------------------------------------------------------- proposal checks (issue 34)
def test_draft_ids_accept_every_integer_type_and_nothing_else():
    import numpy as np

    from speculant.engine.spec_decode import _draft_ids

    got, problem = _draft_ids([np.int64(3), torch.tensor(4), 5, np.int32(6)], 10)
    assert (got, problem) == ([3, 4, 5, 6], None) and all(type(t) is int for t in got)
    assert _draft_ids(torch.tensor([1, 2]), 10) == ([1, 2], None)  # a row as a tensor
    assert _draft_ids(np.array([7]), 10) == ([7], None)
    for bad, what in [([1.0], "not an integer"), ([True], "not an integer"),
                      ([torch.tensor(1.5)], "not an integer"), (["3"], "not an integer"),
                      ([10], "outside the vocabulary [0, 10)"), ([-1], "outside"),
                      (5, "must be a list")]:
        got, problem = _draft_ids(bad, 10)
        assert got == [] and what in problem, (bad, problem)


def test_check_probs_flags_bad_rows_and_verifies_them_as_point_masses():
    from speculant.engine.spec_decode import _check_probs

    V = 6
    ids = [[1, 2], [3], [4, 5], [0, 1], []]
    q = torch.full((5, 3, V), 1.0 / V)
    q[1, 1:] = float("nan")  # past its one draft: not used, not checked
    q[2, 1, 0] = -0.1  # negative entry at a used row
    q[2, 1, 1] += 0.1
    q[3, 0] = 0.0
    q[3, 0, 2] = 1.0  # a distribution, but q = 0 at its own draft (0)
    q[4] = float("nan")  # no drafts: nothing used
    out, bad = _check_probs(q, ids, 2)
    assert bad.tolist() == [False, False, True, True, False]
    assert out.shape == (5, 2, V)
    torch.testing.assert_close(out[:2], q[:2, :2], rtol=0, atol=0, equal_nan=True)  # untouched
    for i in (2, 3):  # point masses at the drafts
        for j, t in enumerate(ids[i]):
            assert out[i, j].tolist() == [1.0 if v == t else 0.0 for v in range(V)]
    q2 = torch.full((1, 1, V), 0.2)  # sums to 1.2
    assert _check_probs(q2, [[0]], 1)[1].tolist() == [True]
    q3 = torch.full((1, 1, V), 1.0 / V)
    q3[0, 0, 0] = float("inf")
    assert _check_probs(q3, [[0]], 1)[1].tolist() == [True]
