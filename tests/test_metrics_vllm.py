"""vLLM's metric access patterns run on speculant (docs/metrics.md): iterating
``LLM.get_metrics()`` yields vLLM V1-style Counter / Vector objects with vLLM's names and
definitions, ``RequestOutput.metrics.spec_token_acceptance_counts`` is vLLM V0's list, and our own
fields (attributes, ``as_dict()``) keep working beside them. Also: ``speculant bench``'s
theoretical speedup counts the steps that do not draft."""

from __future__ import annotations

import types

import pytest

from speculant import LLM, Proposal, SamplingParams
from speculant.bench import _summarise, expected_tokens, run_bench, theoretical_speedup
from speculant.hookspecs import hookimpl
from speculant.metrics import Counter, Metric, Vector
from speculant.outputs import SpecMetrics

K = 4
# the default model copies the list: n-gram drafts are accepted on about half of the steps
PROMPTS = ["Here is a list of fruits:\n- apple\n- banana\n- cherry\n- date\n\n"
           "Here is the same list of fruits again:\n-",
           "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox "
           "jumps over the lazy dog. The quick brown fox"]


@pytest.fixture(scope="module")
def ngram_run(default_model_path):
    llm = LLM(model=str(default_model_path),
              speculative_config={"method": "ngram", "num_speculative_tokens": K})
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    return llm, outs


def _by_name(metrics) -> dict[str, Metric]:
    got = {}
    for metric in metrics:  # vLLM's loop: `for metric in llm.get_metrics()`
        assert isinstance(metric, Metric) and metric.name not in got
        got[metric.name] = metric
    return got


def test_get_metrics_iterates_like_vllm(ngram_run):
    llm, outs = ngram_run
    m = llm.get_metrics()
    got = _by_name(m)
    assert len(m) == len(got) and m[0] is not None
    for name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens"):
        assert isinstance(got[name], Counter)
    per_pos = got["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert isinstance(per_pos, Vector) and len(per_pos.values) == K  # vLLM's: k entries
    num_drafts = got["vllm:spec_decode_num_drafts"].value
    num_draft_tokens = got["vllm:spec_decode_num_draft_tokens"].value
    num_accepted = got["vllm:spec_decode_num_accepted_tokens"].value
    # the values are our counters
    assert (num_drafts, num_draft_tokens, num_accepted) == (
        m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens)
    assert per_pos.values == m.accepted_per_position + [0] * (K - len(m.accepted_per_position))
    assert got["speculant:spec_decode_num_draft_tokens_per_pos"].values[:len(
        m.proposed_per_position)] == m.proposed_per_position
    assert got["speculant:spec_decode_num_spec_steps"].value == m.num_spec_steps
    assert got["speculant:spec_decode_num_plain_steps"].value == m.num_plain_steps
    assert got["speculant:spec_decode_num_emitted_tokens"].value == m.num_emitted_tokens
    # the drafts were accepted often enough to tell the definitions apart
    assert 0 < num_accepted < num_draft_tokens and m.num_plain_steps > 0
    # vLLM's formulas (examples/offline_inference/spec_decode.py) on vLLM's numbers = ours
    assert m.mean_accepted_length == 1 + num_accepted / num_drafts
    assert m.acceptance_rate == num_accepted / num_draft_tokens
    assert sum(per_pos.values) == num_accepted
    assert all(a >= b for a, b in zip(per_pos.values, per_pos.values[1:]))  # accepted prefixes
    # vLLM counts a draft per sequence-step that drafted; plain steps are not drafts
    decode_steps = m.num_spec_steps + m.num_plain_steps
    assert num_drafts <= m.num_spec_steps < decode_steps
    assert m.draft_fraction == num_drafts / decode_steps
    # ours: tokens per decode step over every step (the old mean_accepted_length), and what
    # links the two: f * mean_accepted_length + (1 - f) less the tokens stop rules cut
    decode_tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    assert m.num_emitted_tokens == decode_tokens
    assert m.tokens_per_step == decode_tokens / decode_steps < m.mean_accepted_length
    cut = num_drafts + num_accepted + (decode_steps - num_drafts) - decode_tokens
    assert 0 <= cut <= K * len(outs)
    # the per-request metrics add up to the run's
    per = [o.metrics.spec for o in outs]
    assert num_drafts == sum(p.num_drafts for p in per)
    assert num_accepted == sum(p.num_accepted_tokens for p in per)
    # as_dict() and attribute access as before, with the new figures beside
    d = m.as_dict()
    assert d["mean_accepted_length"] == round(m.mean_accepted_length, 4)
    assert d["tokens_per_step"] == round(m.tokens_per_step, 4)
    assert d["num_drafts"] == num_drafts and d["accepted_per_position"] == m.accepted_per_position
    assert outs[0].metrics.accepted_per_position == outs[0].metrics.spec.accepted_per_position


def test_spec_token_acceptance_counts_is_vllm_v0s(ngram_run):
    llm, outs = ngram_run
    for o in outs:
        counts = o.metrics.spec_token_acceptance_counts
        s = o.metrics.spec
        assert len(counts) == K + 1
        # [0]: every step that emitted a token (the prefill + each decode step)
        assert counts[0] == 1 + s.num_spec_steps + s.num_plain_steps
        assert counts[1:] == s.accepted_per_position + [0] * (K - len(s.accepted_per_position))
        assert all(a >= b for a, b in zip(counts, counts[1:]))
        # sum(counts): every token a step produced, those that max_tokens cut included
        n = len(o.outputs[0].token_ids)
        assert n <= sum(counts) <= n + K
    assert any(sum(o.metrics.spec_token_acceptance_counts[1:]) > 0 for o in outs)


# slow (its own SmolLM2 engine, ~12 s busy): the default run checks the same V0 semantics on
# the shared n-gram run (test_spec_token_acceptance_counts_is_vllm_v0s)
@pytest.mark.slow
def test_spec_token_acceptance_counts_step_by_step(default_model_path):
    """The V0 counts against the engine watched step by step: [0] = the steps where the
    request's output grew, [i] = the steps where it grew by more than i tokens (the last step
    may have produced more than max_tokens let through)."""
    llm = LLM(model=str(default_model_path),
              speculative_config={"method": "ngram", "num_speculative_tokens": K})
    eng = llm.engine
    req = eng.add_request("r0", PROMPTS[0], list(llm.tokenizer(PROMPTS[0]).input_ids),
                          SamplingParams(temperature=0, max_tokens=24))
    seq, grew, out = req.seqs[0], [], None
    while eng.has_unfinished_requests():
        before = seq.num_output_tokens
        for o in eng.step():
            out = o
        if seq.num_output_tokens > before:
            grew.append(seq.num_output_tokens - before)
    counts = out.metrics.spec_token_acceptance_counts
    assert counts[0] == len(grew) and sum(grew) == len(out.outputs[0].token_ids)
    for i in range(1, K + 1):
        full = sum(g > i for g in grew[:-1])
        last = counts[i] - full  # the last step accepted >= its growth - 1 drafts
        assert last == 1 if grew[-1] > i else last in (0, 1), (counts, grew)
    assert max(grew) > 1  # some drafts were accepted


def test_without_speculation(tiny_llama):
    llm = LLM(model=str(tiny_llama))
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert out.metrics.spec_token_acceptance_counts == [0]  # as vLLM V0 without speculation
    got = _by_name(llm.get_metrics())
    assert got["vllm:spec_decode_num_drafts"].value == 0
    assert got["vllm:spec_decode_num_accepted_tokens_per_pos"].values == []
    assert llm.get_metrics().mean_accepted_length == 1.0  # vLLM's value with no drafts


def test_merge_keeps_new_counters():
    a = SpecMetrics(num_prefill_steps=1, num_speculative_tokens=3)
    a.record(3, 1)
    b = SpecMetrics(num_prefill_steps=2)
    b.record(2, 2)
    a.merge(b)
    assert (a.num_prefill_steps, a.num_speculative_tokens, a.num_drafts) == (3, 3, 2)
    assert _by_name(a)["vllm:spec_decode_num_accepted_tokens_per_pos"].values == [2, 1, 0]


# ----------------------------------------------------------------- bench: theoretical speedup
def test_theoretical_speedup_counts_steps_without_drafts():
    a, k, c = 0.7, 4, 0.05
    assert theoretical_speedup(a, k, c) == pytest.approx((1 - a ** 5) / (1 - a) / (k * c + 1))
    half = theoretical_speedup(a, k, c, draft_fraction=0.5)
    assert half == pytest.approx((0.5 * expected_tokens(a, k) + 0.5) / (k * c + 1))
    assert half < theoretical_speedup(a, k, c)
    # drafts of 2 tokens on average, and the proposer called on half of the steps
    assert theoretical_speedup(a, k, c, 0.5, 2.0, 0.5) == pytest.approx(
        (0.5 * (1 + a + a * a) + 0.5) / (0.5 * k * c + 1))
    assert expected_tokens(1.0, 3) == 4


def test_summarise_a_strategy_that_drafts_on_half_the_steps():
    """A synthetic row: 100 decode steps of one sequence, 50 of them drafting k = 4 tokens."""
    k, steps, drafts, c = 4, 100, 50, 0.02
    m = SpecMetrics(num_speculative_tokens=k)
    for i in range(drafts):
        m.record(k, 2 if i % 2 else 3)  # 125 accepted
        m.num_spec_steps += 1
        m.num_emitted_tokens += 1 + (2 if i % 2 else 3)
    m.num_plain_steps = steps - drafts
    m.num_emitted_tokens += steps - drafts
    counter = types.SimpleNamespace(acceptance=0.75)
    plain_step = 0.01
    timer = types.SimpleNamespace(propose_s=steps * k * c * plain_step, propose_calls=steps,
                                  first_s=0.0, first_calls=0, propose_max_s=0.001, score_s=0.0,
                                  score_calls=drafts, steps=steps)
    plain = {"step_s": plain_step, "tokens_per_s": 100.0, "tokens_per_s_trimmed": 100.0}
    r = {"decode_s": 1.0, "prefill_s": 0.1, "steps": steps, "decode_tokens": m.num_emitted_tokens,
         "step_times": [0.01] * steps}
    dec = types.SimpleNamespace(k=k, strategy_config=types.SimpleNamespace())
    row = _summarise({"method": "half", "num_speculative_tokens": k}, 1, r, dec, m, counter,
                     timer, plain, True)
    assert row["draft_fraction"] == 0.5 and row["mean_draft_length"] == k
    assert row["propose_fraction"] == 1.0 and row["c"] == pytest.approx(c)
    assert row["mean_accepted_length"] == 1 + 125 / 50
    assert row["tokens_per_step"] == (50 + 125 + 50) / 100
    want = (0.5 * expected_tokens(0.75, k) + 0.5) / (k * c + 1)
    assert row["theoretical_speedup"] == pytest.approx(want)
    assert row["theoretical_speedup"] < theoretical_speedup(0.75, k, c)  # the old figure


class _EveryOtherStep:
    """Blanks the proposal of every second step of a run: a strategy that drafts half the time."""

    def __init__(self) -> None:
        self.ids: set[int] = set()
        self.calls = 0

    @hookimpl(wrapper=True)
    def propose(self, batch):
        proposal = yield
        ids = {s.seq_id for s in batch.seqs}
        if ids != self.ids:  # a new run: start with a drafting step
            self.ids, self.calls = ids, 0
        self.calls += 1
        if self.calls % 2 == 0:
            return Proposal(token_ids=[[] for _ in batch.seqs])
        return proposal


def test_bench_row_of_a_strategy_that_drafts_on_half_the_steps(tiny_factory, monkeypatch):
    """A real bench cell: the oracle (every draft accepted) drafting every other step; the
    theoretical tokens per step are the measured ones, the speedup counts the plain steps."""
    import speculant.bench as bench

    real = bench._set_strategy

    def with_half(engine, spec_config):
        dec = real(engine, spec_config)
        if dec is not None:
            dec.pm.register(_EveryOtherStep(), name="test:every-other-step")
        return dec

    monkeypatch.setattr(bench, "_set_strategy", with_half)
    llm = LLM(model=str(tiny_factory("llama", tokenizer=False)), skip_tokenizer_init=True)
    prompts = bench.random_prompts(1, 6, llm.engine.vocab_size)
    result = run_bench(llm.engine, prompts, [{"method": "oracle", "alpha": 1.0,
                                              "num_speculative_tokens": 3}], 20, [1])
    row = next(r for r in result["runs"] if r["method"] == "oracle")
    assert row["same_tokens_as_plain"] and row["acceptance"] == 1.0
    # 19 decode tokens: D(4) P(1) D P D P D -> 7 steps, 4 of them drafting
    assert row["num_drafts"] == 4 and row["num_spec_steps"] + row["num_plain_steps"] == 7
    assert row["draft_fraction"] == pytest.approx(4 / 7) and row["mean_draft_length"] == 3
    assert row["mean_accepted_length"] == 4.0 and row["tokens_per_step"] == pytest.approx(19 / 7)
    assert row["propose_fraction"] == 1.0  # the proposer runs every step, drafts or not
    cost = row["propose_fraction"] * 3 * row["c"] + 1
    assert row["theoretical_speedup"] * cost == pytest.approx(row["tokens_per_step"])
    assert row["theoretical_speedup"] < theoretical_speedup(1.0, 3, row["c"])
