"""draft_model strategy: a smaller LM with its own paged KV cache proposes tokens.

Greedy equivalence with plain decoding (batch 1 and 8, k in {1, 3, 5}, a weak random draft and a
draft equal to the target), cache synchronisation (preemption, a full draft cache), the sampling
distribution against the exact target distribution (with a negative control), SmolLM2 as its own
draft, and configuration errors."""

from __future__ import annotations

import json
import math
import shutil
import warnings

import pytest
import torch

from speculant import LLM, SamplingParams, hookimpl
from speculant.drafting.runner import _common_prefix
from speculant.kernels.sampling import sampling_probs_ref
from speculant.plugins.draft_model import DraftModelStrategy
from speculant.spec_registry import StrategyError

PROMPT_LENS = [5, 9, 3, 14, 7, 11, 4, 20]
MAX_TOKENS = [24, 17, 30, 12, 21, 26, 9, 15]  # different lengths: the batch shrinks over time


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(3, 2000, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def target(tiny_factory):
    return tiny_factory("llama", seed=0)


@pytest.fixture(scope="module")
def small_draft(tiny_factory):
    """A different random model with one layer: drafts are mostly rejected."""
    return tiny_factory("llama", seed=1, num_hidden_layers=1)


@pytest.fixture(scope="module")
def plain_ref(target):
    llm = LLM(model=str(target))
    return _ids(llm.generate(_prompts(), _params(), use_tqdm=False))


def _spec_llm(target, draft, k, **kw) -> LLM:
    return LLM(model=str(target), speculative_config={"model": str(draft),
                                                      "num_speculative_tokens": k}, **kw)


def test_common_prefix():
    assert _common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert _common_prefix([1, 2, 3, 9, 9], [1, 2, 3, 4]) == 3
    assert _common_prefix([5, 2], [1, 2]) == 0
    assert _common_prefix([], [1]) == 0
    a = list(range(1000))
    b = a[:617] + [-1] + a[618:]
    assert _common_prefix(a, b) == 617


def test_common_prefix_matches_a_plain_scan():
    """Every mismatch position (the short scan near the end, the bisection before it), and
    lists of different lengths, against an element-by-element scan."""

    def scan(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    base = list(range(40))
    for la in (0, 1, 7, 8, 9, 39, 40):
        for lb in (0, 5, 8, 33, 40):
            for cut in range(-1, 41):
                a, b = base[:la], base[:lb]
                if 0 <= cut < lb:
                    b = b[:cut] + [-1] + b[cut + 1 :]
                assert _common_prefix(a, b) == scan(a, b), (la, lb, cut)
                # with a known common start: any start up to the true prefix (past the shorter
                # list's end when that whole list is the common prefix)
                p = scan(a, b)
                for start in {0, 3, 9, p, 60}:
                    if start <= p or p == min(len(a), len(b)):
                        assert _common_prefix(a, b, start) == p, (la, lb, cut, start)


# the default run: same-1, small-3, same-5 (k = 1, 3, 5 and both drafts); the rest are slow
@pytest.mark.parametrize("which,k", [
    ("same", 1), ("small", 3), ("same", 5),
    pytest.param("small", 1, marks=pytest.mark.slow), pytest.param("same", 3, marks=pytest.mark.slow),
    pytest.param("small", 5, marks=pytest.mark.slow),
])
@pytest.mark.slow
def test_greedy_equivalence_batch_1_and_8(target, small_draft, plain_ref, which, k):
    draft = target if which == "same" else small_draft
    llm = _spec_llm(target, draft, k)
    assert llm.engine.spec.name == "draft_model", "a bare `model` must infer the draft_model method"
    batch = _ids(llm.generate(_prompts(), _params(), use_tqdm=False))
    assert batch == plain_ref
    m = llm.get_metrics()
    assert m.num_draft_tokens > 0
    assert len(m.proposed_per_position) == k
    if which == "same":  # the draft is the target: drafts must (nearly) always be accepted
        assert m.acceptance_rate > 0.95, m.as_dict()
        assert m.mean_accepted_length > 1 + 0.9 * k * (k == 1) or m.mean_accepted_length > 2.5
    for i in (0, 3):  # batch of one
        single = _ids(llm.generate([_prompts()[i]], _params()[i], use_tqdm=False))
        assert single == [plain_ref[i]]
    strat = llm.engine.spec.strategy
    assert not strat.runner.states, "on_requests_finished must free every draft cache"
    assert strat.runner.block_manager.num_free_blocks == strat.runner.block_manager.num_blocks


@pytest.mark.slow
def test_draft_catches_up_after_preemption(target, plain_ref):
    """Few target KV blocks: the scheduler preempts, the draft frees the sequence's cache and
    prefills it again when it comes back; acceptance stays ~1 with draft == target."""
    llm = _spec_llm(target, target, 3, num_gpu_blocks_override=8)
    out = _ids(llm.generate(_prompts(), _params(), use_tqdm=False))
    assert out == plain_ref
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.get_metrics().acceptance_rate > 0.95
    assert not llm.engine.spec.strategy.runner.states


@pytest.mark.slow
def test_full_draft_cache_degrades_to_fewer_drafts(target, plain_ref):
    """A draft KV cache of 8 blocks (128 tokens) for 8 sequences: some sequences get no drafts
    some steps, output stays identical."""
    block = 2 * 2 * 16 * 2 * 16 * 4  # layers * (k, v) * block_size * kv_heads * head_dim * fp32
    llm = LLM(model=str(target), speculative_config={
        "model": str(target), "num_speculative_tokens": 3, "kv_cache_memory": 8 * block})
    strat = llm.engine.spec.strategy
    assert strat.runner.block_manager.num_blocks == 8
    out = _ids(llm.generate(_prompts(), _params(), use_tqdm=False))
    assert out == plain_ref
    m = llm.get_metrics()
    # some sequence-steps ran without drafts (num_drafts counts only steps that proposed)
    assert m.num_drafts < m.num_spec_steps + m.num_plain_steps and m.num_accepted_tokens > 0
    assert strat.runner.block_manager.num_free_blocks == 8


@pytest.mark.slow  # ~8 s; seeded draft-model sampling stays in test_distribution's default run
def test_mixed_greedy_and_seeded_sampling(target, small_draft, plain_ref):
    prompts = _prompts()[:4]
    params = [_params()[0], SamplingParams(temperature=0.9, top_k=50, seed=7, max_tokens=20),
              _params()[2], SamplingParams(temperature=1.0, top_p=0.9, seed=8, max_tokens=20)]

    def run():
        llm = _spec_llm(target, small_draft, 3)
        return _ids(llm.generate(prompts, params, use_tqdm=False)), llm.get_metrics()

    a, m = run()
    b, _ = run()
    assert a == b, "seeded requests must be reproducible"
    assert a[0] == plain_ref[0] and a[2] == plain_ref[2], "greedy rows stay exact in a mixed batch"
    assert m.num_draft_tokens > 0


# ------------------------------------------------------------------ sampling distribution
SMALL_V = 16
DIST_PROMPT = [1, 5, 9, 3, 7]
DIST_PARAMS = dict(temperature=0.8, top_p=0.95)
N_SAMPLES = 4000


def _exact_joint(path) -> torch.Tensor:
    """P(t1, t2, t3) [V, V, V] of the first three sampled tokens, from Hugging Face's own model
    (an independent implementation) and the vLLM temperature / top-p rule."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    V = SMALL_V

    def probs(logits):
        r = logits.shape[0]
        return sampling_probs_ref(logits.float(), torch.full((r,), DIST_PARAMS["temperature"]),
                                  torch.zeros(r, dtype=torch.int32),
                                  torch.full((r,), DIST_PARAMS["top_p"]), torch.zeros(r)).double()

    with torch.no_grad():
        p1 = probs(hf(torch.tensor([DIST_PROMPT])).logits[:, -1])[0]  # [V]
        two = torch.tensor([DIST_PROMPT + [a] for a in range(V)])
        p2 = probs(hf(two).logits[:, -1])  # [V(a), V(b)]
        three = torch.tensor([DIST_PROMPT + [a, b] for a in range(V) for b in range(V)])
        p3 = probs(hf(three).logits[:, -1]).view(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def _tv_bound(p: torch.Tensor, n: int, delta: float) -> float:
    """With prob >= 1 - delta, TV(empirical of n draws, p) is below this: E[TV] <= 1/2 sum
    sqrt(p(1-p)/n) (Jensen), and one draw moves TV by <= 1/n (McDiarmid)."""
    p = p.flatten().double()
    return float(0.5 * (p * (1 - p) / n).sqrt().sum() + math.sqrt(math.log(1 / delta) / (2 * n)))


def _tv(samples: torch.Tensor, p: torch.Tensor) -> float:
    emp = torch.bincount(samples, minlength=p.numel()).double() / samples.numel()
    return float(0.5 * (emp - p.flatten()).abs().sum())


def _projections(toks: torch.Tensor, joint: torch.Tensor) -> list[tuple[str, float, float]]:
    """(name, TV, bound) for the marginals that speculation produces: t2, t3, (t1, t2), (t2, t3).
    The union bound keeps the family-wise false-alarm rate below 1e-4."""
    V, n = SMALL_V, toks.shape[0]
    checks = [("t2", toks[:, 1], joint.sum((0, 2))),
              ("t3", toks[:, 2], joint.sum((0, 1))),
              ("t1,t2", toks[:, 0] * V + toks[:, 1], joint.sum(2)),
              ("t2,t3", toks[:, 1] * V + toks[:, 2], joint.sum(0))]
    return [(name, _tv(s, p), _tv_bound(p, n, 1e-4 / len(checks))) for name, s, p in checks]


def _sample(target, draft) -> tuple[torch.Tensor, LLM]:
    llm = LLM(model=str(target), skip_tokenizer_init=True, max_num_seqs=512, seed=11,
              speculative_config={"model": str(draft), "num_speculative_tokens": 2})
    params = SamplingParams(**DIST_PARAMS, max_tokens=3, ignore_eos=True, n=N_SAMPLES // 4)
    outs = llm.generate([DIST_PROMPT] * 4, params, use_tqdm=False)
    toks = torch.tensor([c.token_ids for o in outs for c in o.outputs])
    assert toks.shape == (N_SAMPLES, 3)
    return toks, llm


@pytest.fixture(scope="module")
def small_vocab(tiny_factory):
    target = tiny_factory("llama", vocab_size=SMALL_V, tokenizer=False, seed=0)
    draft = tiny_factory("llama", vocab_size=SMALL_V, tokenizer=False, seed=1, num_hidden_layers=1)
    return target, draft, _exact_joint(target)


@pytest.mark.slow  # the default run: test_distribution.py's [draft_model] (and its negative control)
def test_sampling_matches_target_distribution(small_vocab):
    target, draft, joint = small_vocab
    toks, llm = _sample(target, draft)
    m = llm.get_metrics()
    assert m.num_draft_tokens > N_SAMPLES and 0.05 < m.acceptance_rate < 0.95, m.as_dict()
    for name, tv, bound in _projections(toks, joint):
        assert tv < bound, f"{name}: TV {tv:.4f} >= bound {bound:.4f}"


@pytest.mark.slow  # the default run: test_distribution.py's test_the_check_rejects_blind_acceptance
def test_sampling_check_catches_a_broken_verifier(small_vocab, monkeypatch):
    """Negative control: a verifier that accepts every draft the target does not rule out
    (acceptance uniforms forced to 0, so min(1, p/q) is ignored) emits the draft's distribution;
    the same check must reject it. (Omitting Proposal.probs is NOT a broken verifier: point-mass
    verification is lossless for any way of choosing the drafts, only less efficient.)"""
    import speculant.plugins.rejection_sampler as rs

    target, draft, joint = small_vocab
    real = rs.rejection_sample

    def accept_all(draft_ids, num_draft, draft_probs, target_probs, greedy, u_acc, u_smp, **kw):
        return real(draft_ids, num_draft, draft_probs, target_probs, greedy,
                    torch.zeros_like(u_acc), u_smp, **kw)

    monkeypatch.setattr(rs, "rejection_sample", accept_all)
    toks, _ = _sample(target, draft)
    failed = [name for name, tv, bound in _projections(toks, joint) if tv >= bound]
    assert {"t2", "t2,t3"} <= set(failed), _projections(toks, joint)


def test_draft_probs_are_the_processed_draft_distribution(small_vocab):
    """Proposal.probs rows are the draft's probabilities after temperature / top-p, and every
    drafted token has q > 0 under them."""
    target, draft, _ = small_vocab
    llm = LLM(model=str(target), skip_tokenizer_init=True,
              speculative_config={"model": str(draft), "num_speculative_tokens": 3})
    strat = llm.engine.spec.strategy
    seen = []
    real = DraftModelStrategy.propose

    @hookimpl
    def spy(batch):
        prop = real(strat, batch)
        seen.append((batch, prop))
        return prop

    # pluggy calls the most recently registered implementation first: the spy answers propose
    spy_plugin = type("Spy", (), {"propose": staticmethod(spy)})()
    llm.engine.spec.pm.register(spy_plugin, name="spy")
    params = [SamplingParams(**DIST_PARAMS, max_tokens=8, ignore_eos=True, seed=3),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)]
    llm.generate([DIST_PROMPT, DIST_PROMPT[:3]], params, use_tqdm=False)
    sampled = [(b, p) for b, p in seen if not all(s.params.is_greedy for s in b.seqs)]
    assert sampled, "the sampled request must have been drafted for"
    # an all-greedy batch may send point-mass drafts (probs=None); a sampled one must not
    for batch, prop in sampled:
        assert prop.probs is not None and prop.probs.dtype == torch.float32
        assert prop.probs.shape[:2] == (len(batch), 3) and prop.probs.shape[2] == SMALL_V
        for i, drafts in enumerate(prop.token_ids):
            for j, t in enumerate(drafts):
                q = prop.probs[i, j]
                assert abs(float(q.sum()) - 1) < 1e-5 and q[t] > 0
                if batch.seqs[i].params.is_greedy:
                    assert q[t] == 1.0
                else:
                    assert (q > 0).sum() < SMALL_V, "top_p=0.95 must cut the tail"


# ------------------------------------------------------------------ SmolLM2 as its own draft
@pytest.mark.slow  # the default run: test_greedy_equivalence_batch_1_and_8[same-*] (tiny target)
def test_smollm_self_draft_accepts_everything(default_model_path, smollm):
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=32)
    plain = _ids(smollm.generate(prompts, params, use_tqdm=False))
    llm = LLM(model=str(default_model_path), max_num_seqs=4,
              speculative_config={"model": str(default_model_path), "num_speculative_tokens": 4})
    assert _ids(llm.generate(prompts, params, use_tqdm=False)) == plain
    m = llm.get_metrics()
    assert m.acceptance_rate > 0.97, m.as_dict()
    assert m.mean_accepted_length > 3.5, m.as_dict()


# ------------------------------------------------------------------ configuration errors
def test_vocab_size_mismatch_names_both_files(target, tiny_factory):
    other = tiny_factory("llama", vocab_size=SMALL_V, tokenizer=False, seed=0)
    with pytest.raises(ValueError) as e:
        _spec_llm(target, other, 2)
    msg = str(e.value)
    assert str(other / "config.json") in msg and str(target / "config.json") in msg
    assert "vocab_size=16" in msg and "vocab_size=49152" in msg


@pytest.mark.slow
def test_tokenizer_mismatch_is_explained(target, tmp_path):
    draft = tmp_path / "swapped"
    shutil.copytree(target, draft)
    tj = json.loads((draft / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = "hello", "world"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (draft / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(ValueError, match=r"different tokenizer vocabulary.*2 token\(s\) differ") as e:
        _spec_llm(target, draft, 2)
    assert str(draft) in str(e.value)


@pytest.mark.slow
def test_tensor_parallel_draft_is_refused(target):
    with pytest.raises(StrategyError, match="tensor parallelism is not supported yet"):
        LLM(model=str(target), speculative_config={
            "model": str(target), "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2})
    llm = LLM(model=str(target), speculative_config={
        "method": "draft_model", "model": str(target), "num_speculative_tokens": 2,
        "draft_tensor_parallel_size": 1, "dtype": "float32"})
    assert llm.engine.spec.strategy.model.lm_head.weight.dtype == torch.float32


def test_unknown_option_lists_accepted_ones(target):
    with pytest.raises(StrategyError) as e:
        LLM(model=str(target), speculative_config={
            "model": str(target), "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    msg = str(e.value)
    assert "prompt_lookup_max" in msg
    for opt in ("model", "num_speculative_tokens", "draft_tensor_parallel_size", "dtype"):
        assert opt in msg.split("accepts")[1]


def test_missing_options_are_explained(target):
    with pytest.raises(StrategyError, match="num_speculative_tokens"):
        LLM(model=str(target), speculative_config={"model": str(target)})
    with pytest.raises(StrategyError, match="model"):
        LLM(model=str(target), speculative_config={"method": "draft_model",
                                                   "num_speculative_tokens": 2})
    with pytest.raises(StrategyError, match="not found|no such"):
        LLM(model=str(target), speculative_config={"method": "draft_model",
                                                   "model": "/nonexistent/draft",
                                                   "num_speculative_tokens": 2})


def test_legacy_keywords(target, plain_ref):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        llm = LLM(model=str(target), speculative_model=str(target), num_speculative_tokens=2)
    assert any(issubclass(x.category, DeprecationWarning) for x in w)
    assert llm.engine.spec.name == "draft_model"
    assert _ids(llm.generate(_prompts()[:2], _params()[:2], use_tqdm=False)) == plain_ref[:2]
