"""Batch invariance on the CPU (fp32, our C kernels): a sequence's logits rows are bit for bit the
same computed alone or within a batch of 4 or 16 other sequences (any mix of query lengths, blocks
consecutive or not), and for a query of 1 row or k+1 rows (a verification pass); so greedy output,
plain or speculative, with or without penalties, and its log-probabilities do not depend on what
else is batched (README, "Lossless")."""

from __future__ import annotations

import os

import pytest
import torch

from speculant import LLM, SamplingParams
from speculant.engine.sequence import Sequence
from speculant.models import cpu_kernels
from speculant.outputs import RequestMetrics

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available() and not os.environ.get("CI"),
    reason="CPU kernels not built / no AVX2 (the guarantee needs them)",
)

BLOCKS = 6  # cache blocks per sequence in the logits test (block size 16: up to 96 tokens)


def _engine(path):
    llm = LLM(model=str(path), max_num_seqs=16)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2), use_tqdm=False)
    return llm


@pytest.fixture(scope="module")
def llm(tiny_llama):
    llm = _engine(tiny_llama)
    assert llm.engine.model._cpu_plan.kernels is not None  # the C kernels are in use
    return llm


@pytest.fixture(scope="module", params=["llama", "qwen2", "opt"])
def arch_llm(request, tiny_factory):
    """The Llama family's flat CPU loop (Qwen2: with q/k/v biases) and a module path (OPT)."""
    return _engine(tiny_factory(request.param))


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 4000, (20 + 3 * i,), generator=g).tolist() for i in range(n)]


def _seq(i: int, blocks: list[int]) -> Sequence:
    s = Sequence(f"b{i}", 0, [1], SamplingParams(), RequestMetrics(arrival_time=0.0), None)
    s.block_table = blocks
    return s


def _rows(llm, n: int, qlen: int, scattered: bool = False) -> torch.Tensor:
    """Sequence 0's logits rows for its ``qlen`` new tokens, fed with ``n - 1`` other sequences
    (prompts of other lengths, query lengths 1 .. 5) after a batched prefill of all ``n``.
    ``scattered``: sequence 0's blocks are not consecutive (reversed)."""
    runner = llm.engine.runner
    assert runner.block_size * BLOCKS >= 80
    tables = [list(range(i * BLOCKS, (i + 1) * BLOCKS)) for i in range(n)]
    if scattered:
        tables[0] = tables[0][::-1]
    seqs = [_seq(i, t) for i, t in enumerate(tables)]
    prompts = _prompts(16)
    runner.forward(seqs, prompts[:n])
    new = [[5, 77, 123, 9, 42][:qlen]] + [[11 + i, 12, 13, 14, 15][: 1 + i % 5] for i in range(1, n)]
    h, _ = runner.forward(seqs, new)
    return runner.logits(h)[:qlen]


def test_logits_rows_do_not_depend_on_the_batch_or_query_length(arch_llm):
    """Reference: sequence 0 alone, prefilled then fed one token per step."""
    llm = arch_llm
    runner = llm.engine.runner
    s = _seq(0, list(range(BLOCKS)))
    runner.forward([s], _prompts(1))
    ref = torch.cat([runner.logits(runner.forward([s], [[t]])[0]) for t in (5, 77, 123, 9, 42)])
    assert torch.equal(_rows(llm, 1, 5), ref)  # a 5-row verification pass, alone
    for n in (4, 16):
        assert torch.equal(_rows(llm, n, 1), ref[:1]), n  # a decode step within a batch
        assert torch.equal(_rows(llm, n, 5), ref), n  # a verification pass within a batch
    assert torch.equal(_rows(llm, 4, 5, scattered=True), ref)  # blocks not consecutive


def test_prefill_equals_token_by_token(arch_llm):
    """A prompt prefilled in one pass (any length) leaves the same cache and last-row logits as
    fed token by token."""
    llm = arch_llm
    runner = llm.engine.runner
    prompt = _prompts(1, seed=3)[0]
    a, b = _seq(0, list(range(BLOCKS))), _seq(1, list(range(BLOCKS, 2 * BLOCKS)))
    whole = runner.logits(runner.forward([a], [prompt])[0])[-1]
    for t in prompt:
        last = runner.logits(runner.forward([b], [[t]])[0])[-1]
    assert torch.equal(whole, last)
    n = len(prompt)
    kv = runner.kv_cache.view(runner.kv_cache.shape[0], 2, -1, *runner.kv_cache.shape[-2:])
    slots = runner.block_size * BLOCKS
    assert torch.equal(kv[:, :, :n], kv[:, :, slots : slots + n])


PENALTIES = {
    "none": {},
    "frequency": {"frequency_penalty": 1.0},
    "repetition": {"repetition_penalty": 1.1, "presence_penalty": 0.2},
}


def _greedy(llm, prompts, batch, **kw):
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1, **kw)
    outs = []
    for i in range(0, len(prompts), batch):
        group = [{"prompt_token_ids": p} for p in prompts[i : i + batch]]
        outs += llm.generate(group, sp, use_tqdm=False)
    return [(o.outputs[0].token_ids, [
        {t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs
    ]) for o in outs]


@pytest.fixture(scope="module")
def ngram(tiny_llama):
    return LLM(model=str(tiny_llama), max_num_seqs=16, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})


# the default run: no penalty; the frequency penalty and repetition + presence (~4 s each) are
# slow
@pytest.mark.parametrize("penalty", [
    pytest.param(p, marks=pytest.mark.slow) if p != "none" else p for p in PENALTIES])
def test_greedy_outputs_do_not_depend_on_the_batch(llm, ngram, penalty):
    """16 prompts (repetitive, so n-gram speculation drafts) one at a time, 4 at a time and all
    together: the same tokens and log-probabilities, plain and speculative."""
    g = torch.Generator().manual_seed(7)
    prompts = []
    for i in range(16):
        motif = torch.randint(10, 4000, (3 + i % 4,), generator=g).tolist()
        prompts.append(motif * 4 + torch.randint(10, 4000, (i % 5,), generator=g).tolist())
    kw = PENALTIES[penalty]
    plain = _greedy(llm, prompts, 1, **kw)
    assert _greedy(llm, prompts, 4, **kw) == plain
    assert _greedy(llm, prompts, 16, **kw) == plain
    before = ngram.engine.spec_metrics().num_draft_tokens
    for batch in (1, 4, 16):
        spec = _greedy(ngram, prompts, batch, **kw)
        assert [t for t, _ in spec] == [t for t, _ in plain], batch
    assert ngram.engine.spec_metrics().num_draft_tokens > before  # speculation did draft


@pytest.mark.slow
def test_default_model_greedy_with_penalty_does_not_depend_on_the_batch(default_model_path, smollm):
    """The issue's case on the embedded default model (fp32, the CPU default): its logits rows
    bit for bit alone / batched / 1 or k+1 rows / prefilled or token by token; with
    frequency_penalty=1.0, plain greedy decoding at batch 1, 4 and 16 and n-gram speculation give
    the same tokens (and plain decoding the same log-probabilities)."""
    from speculant.demo import DEMO_PROMPTS

    test_logits_rows_do_not_depend_on_the_batch_or_query_length(smollm)
    test_prefill_equals_token_by_token(smollm)

    tok = smollm.get_tokenizer()
    texts = [p for _, p in DEMO_PROMPTS] + [
        "The history of the printing press begins", "List the planets of the solar system:",
        "def fibonacci(n):", "Write a haiku about the sea.",
    ]
    prompts = [tok.encode(t) for t in (texts * 4)[:16]]
    kw = {"frequency_penalty": 1.0}
    plain = _greedy(smollm, prompts, 1, **kw)
    assert _greedy(smollm, prompts, 4, **kw) == plain
    assert _greedy(smollm, prompts, 16, **kw) == plain
    spec = LLM(model=str(default_model_path), max_num_seqs=16, speculative_config={
        "method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3})
    for batch in (1, 16):
        assert [t for t, _ in _greedy(spec, prompts, batch, **kw)] == [t for t, _ in plain], batch
