"""The engine itself: batching equals one-at-a-time (also under preemption), block manager
bookkeeping and rollback, n > 1, chat, RequestOutput fields, the CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from speculant import LLM, SamplingParams
from speculant.engine.block_manager import BlockManager
from speculant.engine.sequence import Sequence
from speculant.outputs import RequestMetrics

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
PROMPTS = [
    [1, 5, 6, 7],
    [1] + list(range(200, 230)),
    [1, 77],
    [1, 9, 9, 9, 9, 9],
    [1, 4000, 12],
    [1] + list(range(1000, 1018)),
]


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return LLM(model=str(tiny_llama), max_num_seqs=8)


def toks(llm, prompts, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_batch_equals_one_at_a_time(tiny):
    batched = toks(tiny, PROMPTS)
    single = [toks(tiny, [p])[0] for p in PROMPTS]
    assert batched == single
    assert all(len(t) == 40 for t in batched)
    # mixed lengths: max_tokens per prompt, so sequences leave the batch at different steps
    params = [GREEDY.clone(max_tokens=5 + 7 * i) for i in range(len(PROMPTS))]
    mixed = toks(tiny, PROMPTS, params)
    assert mixed == [s[: 5 + 7 * i] for i, s in enumerate(single)]


@pytest.mark.slow  # the default run: test_batch_equals_one_at_a_time (tiny), test_models_hf (batched)
def test_smollm_batch_equals_one_at_a_time(smollm):
    prompts = ["The three primary colors are", "import numpy as np\n", "Once upon a time"]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in smollm.generate(prompts, sp, use_tqdm=False)]
    single = [smollm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert batched == single


def test_preemption_keeps_outputs(tiny_llama, tiny):
    reference = [toks(tiny, [p])[0] for p in PROMPTS]
    # 6 sequences of up to 31 + 40 tokens need 3-5 blocks of 16 each; 10 blocks force preemption
    small = LLM(model=str(tiny_llama), max_num_seqs=8, num_gpu_blocks_override=10)
    assert small.engine.block_manager.num_blocks == 10
    assert toks(small, PROMPTS) == reference
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.block_manager.num_free_blocks == 10  # everything given back


def _seq(n_tokens: int) -> Sequence:
    return Sequence("r", 0, list(range(n_tokens)), SamplingParams(), RequestMetrics(0.0), None)


def test_block_manager_reserve_rollback_free():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = _seq(10), _seq(3)
    bm.reserve(a, 10)
    assert a.block_table == [0, 1, 2] and bm.num_free_blocks == 5  # empty cache: from block 0
    bm.reserve(b, 3)
    assert b.block_table == [5]  # the middle of the largest free run [3, 8): room for a to grow
    assert bm.slot(a, 9) == 2 * 4 + 1
    bm.reserve(a, 12)  # still fits in 3 blocks
    assert len(a.block_table) == 3
    bm.reserve(a, 13)
    assert a.block_table == [0, 1, 2, 3] and bm.num_free_blocks == 3  # grows in place
    a.num_cached_tokens = 13
    bm.rollback(a, 13 - 2)  # drop the last 2 positions: 11 positions need 3 blocks
    assert a.block_table == [0, 1, 2] and a.num_cached_tokens == 11 and bm.num_free_blocks == 4
    bm.rollback(a, 8)  # exactly two blocks
    assert a.block_table == [0, 1] and a.num_cached_tokens == 8 and bm.num_free_blocks == 5
    bm.rollback(a, 9)  # rolling "forward" frees nothing and caches nothing new
    assert a.block_table == [0, 1] and a.num_cached_tokens == 8
    assert not bm.can_reserve(b, 4 * 7)
    with pytest.raises(RuntimeError, match="out of KV cache blocks"):
        bm.reserve(b, 4 * 7)
    bm.reserve(b, 4 * 6)  # 6 blocks: [5, 6, 7] then, the next one taken, any free blocks
    assert b.block_table[:3] == [5, 6, 7] and sorted(b.block_table[3:]) == [2, 3, 4]
    assert bm.num_free_blocks == 0
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8 and a.block_table == [] and a.num_cached_tokens == 0


def test_block_manager_keeps_sequences_consecutive():
    """Sequences admitted together and decoded in lockstep keep consecutive blocks (the CPU
    attention then reads each one's K/V as a slice of the cache, no gather)."""
    bm = BlockManager(num_blocks=64, block_size=4)
    seqs = [_seq(n) for n in (9, 5, 13, 2)]
    for s in seqs:
        bm.reserve(s, len(s))
    for _step in range(20):
        for s in seqs:
            s.token_ids.append(0)
            bm.reserve(s, len(s) + 3)  # a decode step with 3 lookahead slots
    for s in seqs:
        bt = s.block_table
        assert bt == list(range(bt[0], bt[0] + len(bt)))
    used = sorted(b for s in seqs for b in s.block_table)
    assert len(set(used)) == len(used) and bm.num_free_blocks == 64 - len(used)


def test_attention_slices_equal_gather_path():
    """The CPU attention over consecutive blocks (cache slices) gives what the padded gather path
    gives, for decode, verification (q_len > 1 over a longer context) and prefill rows."""
    from speculant.models.attention import AttentionMetadata, paged_attention_torch

    torch.manual_seed(0)
    bs, nkv, nh, d = 4, 2, 6, 8
    k_cache = torch.randn(32, bs, nkv, d)  # [num_blocks, block_size, nkv, d]
    v_cache = torch.randn(32, bs, nkv, d)
    q_lens, ctx_lens = [1, 5, 7], [9, 14, 7]
    tables = [[3, 4, 5], [10, 11, 12, 13], [20, 21]]
    q = torch.randn(sum(q_lens), nh, d)  # [num_tokens, nh, d]
    meta = AttentionMetadata.build(q_lens, ctx_lens, tables, bs, torch.device("cpu"))
    assert meta.seq_starts == [12, 40, 80]
    fast = paged_attention_torch(q, k_cache, v_cache, meta, 0.3)
    ref_meta = AttentionMetadata.build(q_lens, ctx_lens, tables, bs, torch.device("cpu"))
    ref_meta.seq_starts = None  # forces the gather path
    ref = paged_attention_torch(q, k_cache, v_cache, ref_meta, 0.3)
    assert fast.shape == ref.shape == (sum(q_lens), nh, d)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)
    # a non-consecutive table falls back to the gather path for the whole batch
    meta2 = AttentionMetadata.build(
        q_lens, ctx_lens, [[3, 5, 4], *tables[1:]], bs, torch.device("cpu")
    )
    assert meta2.seq_starts[0] == -1


@pytest.mark.parametrize("j", [1, 5, 17])
def test_rollback_last_j_positions_then_regenerate(tiny, j):
    """Generate, roll back the last j tokens of a live sequence (tokens and KV cache), continue:
    greedy decoding must regenerate exactly the same tokens over the rolled-back slots."""
    engine = tiny.engine
    ref = toks(tiny, PROMPTS[1:2])[0]
    engine.add_request("rb", None, PROMPTS[1], GREEDY)
    s = engine.requests["rb"].seqs[0]
    while s.num_output_tokens < 25:
        engine.step()
    assert s.output_token_ids == ref[:25] and s.num_cached_tokens == len(s) - 1
    blocks_before = list(s.block_table)
    keep = len(s) - j
    del s.token_ids[keep:]
    engine.block_manager.rollback(s, keep - 1)  # the last kept token is not in the cache yet
    assert s.block_table == blocks_before[: -(-(keep - 1) // engine.block_size)]
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.outputs[0].token_ids for o in outs if o.request_id == "rb"] == [ref]


def test_n_greater_than_one(tiny):
    out = tiny.generate(
        {"prompt_token_ids": PROMPTS[0]},
        SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=16, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    samples = [c.token_ids for c in out.outputs]
    assert all(len(t) == 16 for t in samples) and len({tuple(t) for t in samples}) == 3
    again = tiny.generate(
        {"prompt_token_ids": PROMPTS[0]},
        SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=16, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert [c.token_ids for c in again.outputs] == samples
    greedy = tiny.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY.clone(n=2), use_tqdm=False)[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids == toks(tiny, PROMPTS[:1])[0]


def test_chat_uses_the_chat_template(smollm):
    conv = [
        {"role": "system", "content": "You are brief."},
        {"role": "user", "content": "What is 2 + 2?"},
    ]
    sp = SamplingParams(temperature=0.0, max_tokens=12)
    out = smollm.chat(conv, sp, use_tqdm=False)[0]
    ids = smollm.tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert out.prompt_token_ids == ids
    assert "<|im_start|>assistant" in out.prompt
    direct = smollm.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == direct.outputs[0].token_ids
    two = smollm.chat([conv, [{"role": "user", "content": "Say hi."}]], sp, use_tqdm=False)
    assert len(two) == 2 and two[0].outputs[0].token_ids == out.outputs[0].token_ids


def test_request_output_fields(smollm):
    prompt = "The capital of Italy is"
    sp = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2)
    o = smollm.generate(prompt, sp, use_tqdm=False)[0]
    assert o.prompt == prompt
    assert o.prompt_token_ids == smollm.tokenizer(prompt).input_ids
    assert o.finished is True
    c = o.outputs[0]
    assert len(c.token_ids) == 8 and c.finish_reason == "length" and c.stop_reason is None
    assert c.text == smollm.tokenizer.decode(c.token_ids, skip_special_tokens=True)
    assert c.text.strip() != ""
    assert len(c.logprobs) == 8 and all(t in d for t, d in zip(c.token_ids, c.logprobs))
    assert c.cumulative_logprob == pytest.approx(
        sum(d[t].logprob for t, d in zip(c.token_ids, c.logprobs))
    )
    assert c.cumulative_logprob < 0
    m = o.metrics
    assert m.num_output_tokens == 8
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert m.time_to_first_token > 0 and m.time_per_output_token > 0
    no_lp = smollm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert no_lp[0].outputs[0].logprobs is None and no_lp[0].prompt_logprobs is None
    # the chat reply of the instruct model ends with its EOS: finish_reason "stop"
    eos = smollm.chat(
        [{"role": "user", "content": "Say OK."}],
        SamplingParams(temperature=0.0, max_tokens=200),
        use_tqdm=False,
    )[0].outputs[0]
    assert eos.finish_reason == "stop" and eos.token_ids[-1] == smollm.engine.eos_token_id
    assert len(eos.token_ids) < 200


def _cli(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "speculant.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow  # an interpreter; the default run: test_cli_polish's in-process generate (same check)
def test_cli_generate(tiny_llama, tiny):
    r = _cli("generate", "--model", str(tiny_llama), "--prompt", "Hello there", "--max-tokens", "7")
    assert r.returncode == 0, r.stderr
    want = (
        tiny.generate("Hello there", SamplingParams(temperature=0.0, max_tokens=7), use_tqdm=False)[
            0
        ]
        .outputs[0]
        .text
    )
    assert r.stdout == want + "\n"


@pytest.mark.slow  # two interpreters; the default run: test_bad_input's test_cli_reports_without_traceback
def test_cli_errors(tmp_path):
    r = _cli("generate", "--model", str(tmp_path / "nope"), "--prompt", "x")
    assert r.returncode == 2
    assert "speculant: error:" in r.stderr and "not found" in r.stderr
    assert "Traceback" not in r.stderr
    r = _cli("generate", "--prompt", "x", "--max-tokens", "0")
    assert r.returncode == 2 and "max_tokens" in r.stderr and "Traceback" not in r.stderr


def test_ngram_backs_off_when_drafts_keep_failing():
    """Adaptive n-gram: a draft with nothing accepted makes the sequence skip lookups for 1, 2,
    4, ... tokens (capped), an accepted token resets it; a run of full acceptance grows k."""
    from speculant.plugins.ngram import NgramConfig, NgramStrategy
    from speculant.spec_types import SpecBatch, SpecSequence

    strat = NgramStrategy(NgramConfig(num_speculative_tokens=3, max_backoff=4, min_draft=1), None)
    toks = [1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 3]  # lookup proposes "9 1 2"

    def propose(tokens):
        s = SpecSequence(
            seq_id=7,
            token_ids=list(tokens),
            num_prompt_tokens=3,
            max_draft=3,
            sampling_params=SamplingParams(),
        )
        return strat.propose(SpecBatch(seqs=[s])).token_ids[0]

    assert propose(toks) == [9, 1, 2]
    toks += [5]  # target rejected the draft's first token: back off 1 token
    assert propose(toks) == []
    toks += [1]
    assert propose(toks) == [2]  # "1" matches again; k = accepted (0) + 1
    toks += [4]  # failed again: skip 2 tokens
    assert propose(toks) == [] and propose(toks + [1]) == []
    toks += [1, 2]
    draft = propose(toks)
    assert draft  # lookups resume
    toks += draft[:1] + [6]  # one accepted: the failure count resets, k = 2
    propose(toks)
    assert strat._fails[7] == 0 and strat._k[7] == 2
    strat.on_requests_finished([7])
    assert 7 not in strat._k and 7 not in strat._resume


def test_ngram_min_draft_after_partial_acceptance():
    """After a partly accepted draft the next draft has at least min_draft tokens (a verification
    pass costs about the same for 2 or 5 query rows on CPU), capped at num_speculative_tokens."""
    from speculant.plugins.ngram import NgramConfig, NgramStrategy
    from speculant.spec_types import SpecBatch, SpecSequence

    strat = NgramStrategy(NgramConfig(num_speculative_tokens=6, min_draft=4), None)
    toks = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]

    def propose(tokens):
        s = SpecSequence(
            seq_id=3,
            token_ids=list(tokens),
            num_prompt_tokens=2,
            max_draft=6,
            sampling_params=SamplingParams(),
        )
        return strat.propose(SpecBatch(seqs=[s])).token_ids[0]

    assert propose(toks) == [3, 4, 5, 6, 7, 8]
    toks += [3, 0]  # one draft token accepted, then the target's own token
    assert strat._adapt(3, toks) == 4  # accepted + 1 = 2, raised to min_draft
    strat3 = NgramStrategy(NgramConfig(num_speculative_tokens=3), None)
    assert strat3._adapt(9, toks) == 3  # min_draft capped at k


def test_ngram_index_matches_vectorised_search():
    """The incremental n-gram index gives exactly the drafts of the vectorised full rescan
    (find_draft) at every step of growing sequences, for every n range and k."""
    import random

    import torch

    from speculant.drafting import NgramIndex, find_draft

    rng = random.Random(0)
    for trial in range(40):
        vocab = rng.choice([2, 3, 5, 50])
        n_min = rng.randint(1, 3)
        n_max = rng.randint(n_min, 5)
        k = rng.randint(1, 6)
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        index = NgramIndex(n_min, n_max)
        for _ in range(40):
            index.update(tokens)
            want = find_draft(torch.tensor(tokens), n_min, n_max, k)
            assert index.find(k) == want, (trial, tokens, n_min, n_max, k)
            tokens = tokens + [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
    # a sequence that is not an extension of the indexed one is re-indexed from scratch
    index = NgramIndex(1, 2)
    index.update([1, 2, 3, 1])
    assert index.find(2) == [2, 3]
    index.update([7, 8, 9, 7])
    assert index.find(2) == [8, 9]
