"""A seeded request's output depends only on its seed and its own tokens (issue 34, defect 3):
the same 16-request burst under a small KV cache (the scheduler preempts) gives the outputs of
the one-at-a-time run, plain and speculative (n-gram; a draft model with sampled drafts).

The mechanism (engine/sampler.py ``uniforms``): a seeded request's random numbers are
counter-based, keyed by (seed, position of the token decided, purpose), and a preempted sequence
resumes where it stopped. Point-mass drafts (n-gram) are verified by sampling each position with
the number a plain step there would use, so n-gram output equals plain output, seed for seed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from speculant import LLM, SamplingParams
from speculant.engine.sampler import PURPOSES, Row, counter_uniforms, sample_tokens, uniforms
from speculant.engine.sequence import SeedStream, Sequence
from speculant.outputs import RequestMetrics

V = 256
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def target(tiny_factory):
    return tiny_factory("llama", vocab_size=V, tokenizer=False)


@pytest.fixture(scope="module")
def small_draft(tiny_factory):
    return tiny_factory("llama", vocab_size=V, tokenizer=False, seed=1, num_hidden_layers=1)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(4, 30, (16,), generator=g).tolist()
    return [torch.randint(3, V, (n,), generator=g).tolist() * 2 for n in lens]  # repeats: drafts


def _params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=MAX_TOKENS,
                           ignore_eos=True) for i in range(16)]


def _burst_and_solo(llm: LLM) -> tuple[list, list, int]:
    """(one-at-a-time outputs, burst outputs, preemptions during the burst)."""
    prompts, params = _prompts(), _params()
    solo = [llm.generate([p], [sp], use_tqdm=False)[0].outputs[0].token_ids
            for p, sp in zip(prompts, params)]
    before = llm.engine.scheduler.num_preemptions
    burst = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    return solo, burst, llm.engine.scheduler.num_preemptions - before


def _llm(target, spec=None, blocks=16) -> LLM:
    # 16 sequences of up to 58 + 40 tokens need 3-7 blocks of 16 each: 16 blocks preempt often
    return LLM(model=str(target), skip_tokenizer_init=True, num_gpu_blocks_override=blocks,
               speculative_config=spec)


@pytest.fixture(scope="module")
def plain_solo(target):
    solo, burst, preempted = _burst_and_solo(_llm(target))
    assert burst == solo and preempted > 0
    return solo


def test_plain_burst_equals_one_at_a_time(plain_solo):
    assert len(plain_solo) == 16 and all(len(t) == MAX_TOKENS for t in plain_solo)


def test_ngram_burst_equals_one_at_a_time_and_plain(target, plain_solo):
    llm = _llm(target, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})
    solo, burst, preempted = _burst_and_solo(llm)
    assert preempted > 0
    assert burst == solo
    # point-mass drafts take each position's plain sample: speculation changes nothing
    assert solo == plain_solo
    assert llm.get_metrics().num_draft_tokens > 100


@pytest.mark.slow  # the default run: n-gram's
def test_draft_model_sampled_drafts_burst_equals_one_at_a_time(target, small_draft):
    llm = _llm(target, {"model": str(small_draft), "num_speculative_tokens": 3})
    solo, burst, preempted = _burst_and_solo(llm)
    assert preempted > 0
    assert burst == solo
    m = llm.get_metrics()
    assert m.num_draft_tokens > 100 and 0 < m.num_accepted_tokens < m.num_draft_tokens


def test_preemption_counter_counts(target):
    llm = _llm(target, blocks=16)
    assert llm.engine.scheduler.num_preemptions == 0
    llm.generate(_prompts()[:8], _params()[:8], use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    roomy = _llm(target, blocks=200)
    roomy.generate(_prompts()[:8], _params()[:8], use_tqdm=False)
    assert roomy.engine.scheduler.num_preemptions == 0


# ---------------------------------------------------------------------------- the numbers
def _seq(seed: int | None, n_tokens: int) -> Sequence:
    return Sequence("r", 0, list(range(n_tokens)), SamplingParams(temperature=1.0, seed=seed),
                    RequestMetrics(arrival_time=0.0), None if seed is None else SeedStream(seed))


def test_counter_uniforms_keyed_and_uniform():
    pos = np.arange(200_000, dtype=np.uint64)
    u = counter_uniforms(np.full(len(pos), 7, dtype=np.uint64), pos, PURPOSES["sample"])
    assert u.dtype == torch.float32 and 0.0 <= float(u.min()) and float(u.max()) < 1.0
    # uniform: 20 bins of 10_000 expected, chi-square (19 dof) far below its 0.1% point (43.8)
    counts = torch.histc(u, bins=20, min=0.0, max=1.0)
    assert float(((counts - 10_000) ** 2 / 10_000).sum()) < 43.8
    # neighbouring positions, purposes and seeds are uncorrelated
    acc = counter_uniforms(np.full(len(pos), 7, dtype=np.uint64), pos, PURPOSES["accept"])
    other = counter_uniforms(np.full(len(pos), 8, dtype=np.uint64), pos, PURPOSES["sample"])
    for a, b in ((u[1:], u[:-1]), (u, acc), (u, other)):
        assert abs(float(torch.corrcoef(torch.stack([a, b]))[0, 1])) < 0.01
    # a pure function of the key
    again = counter_uniforms(np.array([7], dtype=np.uint64), np.array([123], dtype=np.uint64), 0)
    assert float(again[0]) == float(u[123])


def test_uniforms_depend_only_on_seed_and_position():
    a, b, c = _seq(5, 10), _seq(6, 4), _seq(None, 7)
    gen = torch.Generator().manual_seed(0)
    alone = uniforms([a], [3], gen, "cpu", purpose="accept")
    mixed = uniforms([b, c, a], [2, 4, 3], gen, "cpu", purpose="accept")
    assert torch.equal(mixed[6:], alone)
    # positions: the sequence's length on, or starts=
    shifted = uniforms([a], [2], gen, "cpu", purpose="accept", starts=[11])
    assert torch.equal(shifted, alone[1:])
    assert not torch.equal(uniforms([a], [3], gen, "cpu", purpose="sample"), alone)
    # unseeded rows draw from the engine generator (a new number each time)
    assert not torch.equal(uniforms([c], [3], gen, "cpu", purpose="accept"),
                           uniforms([c], [3], gen, "cpu", purpose="accept"))


def test_plain_sample_is_the_same_in_any_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, V)
    gen = torch.Generator().manual_seed(0)
    a, b = _seq(11, 9), _seq(12, 5)
    together = sample_tokens(logits[:2], [Row(a, []), Row(b, [])], gen, None).tolist()
    alone_b = sample_tokens(logits[1:2], [Row(b, [])], gen, None).tolist()
    assert together[1] == alone_b[0]
    # the row of an overlapped step (ahead=1) decides the next position: the number of a row
    # one token further on
    ahead = sample_tokens(logits[:1], [Row(a, [], ahead=1)], gen, None).tolist()
    assert ahead == sample_tokens(logits[:1], [Row(a, [0])], gen, None).tolist()


def test_preemptions_on_metrics(target):
    """/metrics' speculant_num_preemptions_total is the scheduler's counter."""
    pytest.importorskip("prometheus_client")
    from speculant.server.metrics import _EngineCollector

    llm = _llm(target)
    llm.generate(_prompts()[:8], _params()[:8], use_tqdm=False)

    class Server:  # the AsyncEngine calls the collector makes
        engine, inflight_seqs, num_steps = llm.engine, 0, 0

        def kv_blocks(self):
            return 0, llm.engine.block_manager.num_blocks

        def num_running(self):
            return 0

        def num_waiting(self):
            return 0

        def spec_metrics(self):
            return llm.get_metrics()

    fams = {f.name: f for f in _EngineCollector(Server(), "m").collect()}
    sample = fams["speculant_num_preemptions"].samples[0]
    assert sample.name == "speculant_num_preemptions_total"
    assert sample.value == llm.engine.scheduler.num_preemptions > 0
