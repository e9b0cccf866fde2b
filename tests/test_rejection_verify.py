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


def _case_id(p):
    return f"T{p.temperature}-k{p.top_k}-p{p.top_p}"


# the default run: every sampling case once, each way of verifying twice; the other 4 are slow
@pytest.mark.parametrize("with_q,params", [
    pytest.param(with_q, p, id=f"{'draft-probs' if with_q else 'point-mass'}-{_case_id(p)}",
                 marks=() if (i + with_q) % 2 == 0 else pytest.mark.slow)
    for with_q in (False, True) for i, p in enumerate(CASES)
])
@pytest.mark.slow
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


@pytest.mark.slow  # 30000 draws twice (~3.5 s)
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


def _greedy_case(rng: torch.Generator, n: int, vocab: int, max_k: int, ties: bool):
    """n greedy sequences with ragged drafts (0..max_k tokens) that match the target's argmax
    for a random number of positions, and their [sum(k_i + 1), vocab] logits; with ``ties``
    the logits are coarse integers, so rows often have several maxima."""
    lens = torch.randint(0, max_k + 1, (n,), generator=rng).tolist()
    rows = sum(k + 1 for k in lens)
    logits = torch.randn(rows, vocab, generator=rng) * 2
    if ties:
        logits = logits.round()
    amax = logits.argmax(-1).tolist()  # lowest index on ties
    drafts, r = [], 0
    for k in lens:
        good = int(torch.randint(0, k + 1, (1,), generator=rng))
        d = [amax[r + j] if j < good else (amax[r + j] + 1 + j) % vocab for j in range(k)]
        drafts.append(d)
        r += k + 1
    return drafts, logits


@pytest.mark.parametrize("ties", [False, True])
def test_greedy_pack_verification_equals_the_rejection_kernels(ties):
    """``ScoreResult.greedy`` (the scorer's argmax + logprob pack) gives the verifier's host
    path exactly the tokens, counts and log-probabilities of the rejection-sampling path on
    the same logits, over random ragged batches (ties included: both take the lowest index)."""
    from speculant.engine.sampler import greedy_pack
    from speculant.plugins.rejection_sampler import verify_greedy

    rng = torch.Generator().manual_seed(11 + ties)
    params = SamplingParams(temperature=0.0)
    for trial in range(40):
        n = int(torch.randint(1, 7, (1,), generator=rng))
        drafts, logits = _greedy_case(rng, n, 37, 5, ties)
        seqs = [SpecSequence(i, [0, 1, 2], 3, len(d), params, None) for i, d in enumerate(drafts)]
        batch, proposal = SpecBatch(seqs=seqs), Proposal(token_ids=drafts)
        ver = RejectionSampler(None, _ctx())
        ref = ver.verify(batch=batch, proposal=proposal, scores=ScoreResult(logits=logits))
        pack = greedy_pack(logits)
        fast = ver.verify(batch=batch, proposal=proposal,
                          scores=ScoreResult(logits=logits, greedy=pack))
        assert fast.token_ids == ref.token_ids, trial
        assert fast.num_accepted == ref.num_accepted, trial
        for a, b in zip(fast.logprobs, ref.logprobs):
            assert a == pytest.approx(b, abs=1e-5)
        direct = verify_greedy(drafts, pack)  # the function the hook delegates to
        assert direct.token_ids == ref.token_ids
    # the pack is what it says: argmax and log_softmax at it
    lp = torch.log_softmax(logits, -1)
    assert pack[:, 0].long().tolist() == logits.argmax(-1).tolist()
    assert torch.allclose(pack[:, 1].float(), lp.gather(1, logits.argmax(-1)[:, None])[:, 0],
                          atol=1e-5)


def test_greedy_pack_is_used_only_where_it_is_exact(logits, monkeypatch):
    """The host path is taken for greedy requests without logits processing only: a penalty,
    a logits processor, min_tokens or a random request sends the batch to the kernels (whose
    argmax is of the processed logits), and a pack of the wrong shape is a clear error."""
    import speculant.plugins.rejection_sampler as rs
    from speculant.engine.sampler import greedy_pack

    calls = []
    real = rs.verify_greedy
    monkeypatch.setattr(rs, "verify_greedy", lambda *a: calls.append(1) or real(*a))
    a0 = int(logits[0].argmax())
    pack = greedy_pack(logits[:2])

    def run(params):
        seqs = [SpecSequence(0, [0, 1, 2], 3, 1, params, None)]
        return RejectionSampler(None, _ctx()).verify(
            batch=SpecBatch(seqs=seqs), proposal=Proposal(token_ids=[[a0]]),
            scores=ScoreResult(logits=logits[:2], greedy=pack))

    run(SamplingParams(temperature=0.0))
    assert calls == [1]
    for p in (SamplingParams(temperature=0.0, repetition_penalty=1.3),
              SamplingParams(temperature=0.0, logits_processors=[lambda ids, x: x]),
              SamplingParams(temperature=0.0, min_tokens=5),
              SamplingParams(temperature=1.0, seed=1)):
        run(p)
    assert calls == [1]
    seqs = [SpecSequence(0, [0, 1, 2], 3, 1, SamplingParams(temperature=0.0), None)]
    with pytest.raises(ValueError, match=r"ScoreResult.greedy must have shape .* \[2, 2\]"):
        RejectionSampler(None, _ctx()).verify(
            batch=SpecBatch(seqs=seqs), proposal=Proposal(token_ids=[[a0]]),
            scores=ScoreResult(logits=logits[:2], greedy=greedy_pack(logits)))


def test_seeded_bonus_and_point_mass_rows_are_the_plain_sample():
    """A seeded request's token at position p is the plain step's sample there when it is a
    bonus token (sampled drafts, all accepted) or a point-mass verification row: the numbers are
    keyed by (seed, position, purpose), not by how many were drawn."""
    from speculant.engine.sampler import Row, sample_tokens
    from speculant.engine.sequence import SeedStream, Sequence
    from speculant.outputs import RequestMetrics

    torch.manual_seed(0)
    logits = torch.randn(3, V) * 2
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=4)
    prefix = [0, 1, 2]

    def plain(tokens: list[int], row: int) -> int:  # the plain step at position len(tokens)
        s = Sequence("r", 0, tokens, params, RequestMetrics(0.0), SeedStream(4 * 1000003))
        return sample_tokens(logits[row : row + 1], [Row(s, [])], torch.Generator(), None).item()

    def verify(drafts, probs):
        seq = SpecSequence(0, list(prefix), 3, len(drafts), params, SeedStream(4 * 1000003))
        return RejectionSampler(None, _ctx()).verify(
            batch=SpecBatch(seqs=[seq]), proposal=Proposal(token_ids=[drafts], probs=probs),
            scores=ScoreResult(logits=logits[: len(drafts) + 1])).token_ids[0]

    p = torch.stack([expected_probs(row, params) for row in logits])  # [3, V]
    drafts = [int(p[0].argmax()), int(p[1].argmax())]
    # q = p: every draft is accepted, then the bonus at position 5
    out = verify(drafts, p[None, :2].contiguous())
    assert out[:2] == drafts and out[2] == plain(prefix + drafts, 2)
    # point-mass drafts: each position's plain sample, whatever was drafted there
    first = plain(prefix, 0)
    for d in range(V):
        out = verify([d], None)
        assert out[0] == first and (len(out) == 1) == (d != first)
        if d == first:
            assert out[1] == plain(prefix + [d], 1)
