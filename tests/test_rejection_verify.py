"""The default verify hook (rejection_sampler plugin): exact target distribution, greedy rule,
seeded reproducibility. Drives the hook directly with hand-made logits."""

from __future__ import annotations

import pytest
import torch

from speculant import SamplingParams
from speculant.plugins.rejection_sampler import RejectionSampler
from speculant.spec_types import Proposal, ScoreResult, SpecBatch, SpecSequence, StrategyContext

V = 10


def _ctx():
    return StrategyContext(target_model=None, target_config=None, vocab_size=V,
                           device=torch.device("cpu"), dtype=torch.float32, block_size=16,
                           max_model_len=64, max_num_seqs=1, seed=0)


def expected_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Hand-written vLLM semantics: temperature, then top-k, then top-p (smallest set with mass
    >= top_p), then min-p."""
    x = logits.double() / p.temperature
    probs = torch.softmax(x, -1)
    if p.top_k > 0:
        kth = probs.topk(p.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, 0.0)
        probs /= probs.sum()
    if p.top_p < 1.0:
        vals, idx = probs.sort(descending=True)
        cum = vals.cumsum(0)
        keep = (cum - vals) < p.top_p
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask[idx[keep]] = True
        probs = torch.where(mask, probs, 0.0)
        probs /= probs.sum()
    if p.min_p > 0:
        probs = torch.where(probs >= p.min_p * probs.max(), probs, 0.0)
        probs /= probs.sum()
    return probs.float()


def run_verify(n, params, target_logits, drafts, draft_probs=None, seed=0, verifier=None):
    """n sequences with the same target logits; returns the [n, k+1] emitted tokens (-1 padded).
    With ``draft_probs`` [k, V] each sequence's drafts are sampled from it (as a real proposer
    would), otherwise every sequence proposes ``drafts``."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [SpecSequence(i, [0, 1, 2], 3, len(drafts), params, gen) for i in range(n)]
    batch = SpecBatch(seqs=seqs)
    probs = None
    token_ids = [list(drafts)] * n
    if draft_probs is not None:
        probs = draft_probs[None].expand(n, -1, -1).contiguous()
        sampled = torch.stack([torch.multinomial(q, n, replacement=True, generator=gen)
                               for q in draft_probs], dim=1)  # [n, k]
        token_ids = sampled.tolist()
    proposal = Proposal(token_ids=token_ids, probs=probs)
    # ScoreResult contract: sum(k_i + 1) rows, i.e. k + 1 rows per sequence (fewer drafts than
    # the fixture has positions -> only the first k + 1 rows are the scores of this proposal)
    logits = target_logits[: len(drafts) + 1].repeat(n, 1)  # [n * (k+1), V]
    res = (verifier or RejectionSampler(None, _ctx())).verify(
        batch=batch, proposal=proposal, scores=ScoreResult(logits=logits))
    out = torch.full((n, len(drafts) + 1), -1)
    for i, toks in enumerate(res.token_ids):
        out[i, : len(toks)] = torch.tensor(toks)
        assert res.num_accepted[i] == len(toks) - 1
    return out


def tv(samples: torch.Tensor, p: torch.Tensor) -> float:
    emp = torch.bincount(samples, minlength=V).float() / samples.numel()
    return 0.5 * (emp - p).abs().sum().item()


@pytest.fixture(scope="module")
def logits():
    torch.manual_seed(3)
    return torch.randn(3, V) * 1.5  # two draft positions + bonus


CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.8, top_p=0.95),
    SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05),
]


@pytest.mark.parametrize("params", CASES, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
@pytest.mark.parametrize("with_q", [False, True], ids=["point-mass", "draft-probs"])
def test_first_and_second_token_follow_target(logits, params, with_q):
    torch.manual_seed(0)
    q = torch.softmax(torch.randn(2, V), -1)  # a draft distribution unlike the target
    drafts = [3, 5]
    p0, p1 = expected_probs(logits[0], params), expected_probs(logits[1], params)
    tvs = []
    for n in (1000, 40_000):
        out = run_verify(n, params, logits, drafts, q if with_q else None, seed=n)
        tvs.append(tv(out[:, 0], p0))
    # converges: sampling noise at 4e4 draws over 10 outcomes is ~0.008 TV
    assert tvs[1] < 0.025, tvs
    assert tvs[0] < 0.12, tvs
    if not with_q:
        second = out[out[:, 0] == drafts[0], 1]
        if second.numel() > 4000:
            assert tv(second, p1) < 0.05


def test_draft_probs_really_matter(logits):
    """Negative control: the verifier must be given the q that really produced the drafts.
    Claiming a different q (uniform) for drafts sampled from a peaked q breaks the output
    distribution, so the distribution test above can fail. (Point-mass treatment, by contrast,
    is lossless for any draft distribution, only less efficient: checked too.)"""
    params = SamplingParams(temperature=1.0)
    q = torch.softmax(torch.randn(2, V) * 3, -1)
    n = 30_000
    gen = torch.Generator().manual_seed(1)
    d0 = torch.multinomial(q[0], n, replacement=True, generator=gen)
    seqs = [SpecSequence(i, [0, 1, 2], 3, 1, params, None) for i in range(n)]
    p0 = expected_probs(logits[0], params)

    def verify(probs):
        res = RejectionSampler(None, _ctx()).verify(
            batch=SpecBatch(seqs=seqs),
            proposal=Proposal(token_ids=[[int(t)] for t in d0], probs=probs),
            scores=ScoreResult(logits=logits[:2].repeat(n, 1)))
        return torch.tensor([t[0] for t in res.token_ids])

    good = verify(q[:1][None].expand(n, -1, -1).contiguous())
    point_mass = verify(None)
    wrong_q = verify(torch.full((n, 1, V), 1.0 / V))
    assert tv(good, p0) < 0.025
    assert tv(point_mass, p0) < 0.025
    assert tv(wrong_q, p0) > 0.05


def test_greedy_accepts_while_draft_is_argmax(logits):
    params = SamplingParams(temperature=0.0)
    a0, a1, a2 = (int(x) for x in logits.argmax(-1))
    out = run_verify(1, params, logits, [a0, a1])
    assert out[0].tolist() == [a0, a1, a2]
    wrong = (a1 + 1) % V
    out = run_verify(1, params, logits, [a0, wrong])
    assert out[0].tolist() == [a0, a1, -1]
    out = run_verify(1, params, logits, [])
    assert out[0].tolist() == [a0]


def test_logits_rows_must_match_the_proposal(logits):
    """Scores for the wrong number of positions are a caller bug: a clear error, not a guess."""
    seqs = [SpecSequence(0, [0, 1, 2], 3, 0, SamplingParams(temperature=0.0), None)]
    with pytest.raises(ValueError, match=r"sum\(k_i \+ 1\) = 1 rows"):
        RejectionSampler(None, _ctx()).verify(
            batch=SpecBatch(seqs=seqs), proposal=Proposal(token_ids=[[]]),
            scores=ScoreResult(logits=logits))


def test_seeded_runs_are_reproducible(logits):
    params = SamplingParams(temperature=1.0, seed=123)
    a = run_verify(200, params, logits, [3, 5], seed=7)
    b = run_verify(200, params, logits, [3, 5], seed=7)
    c = run_verify(200, params, logits, [3, 5], seed=8)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
