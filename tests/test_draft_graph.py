"""The one-graph greedy draft-model propose (drafting/draft_graph.py) run eagerly on the CPU: the
padded function the CUDA graph captures (catch-up padded to a query bucket, batch padded to a
bucket, padding rows with slot -1, padded sequences with context 0 and an empty query range, the
gather of each sequence's last row, K greedy steps, rows drafting fewer than K tokens writing no
K/V in the steps they do not use) must propose exactly the drafts of the eager path, step for
step. Attention runs through the kernels' torch references in both runs (store_kv skips slot -1,
paged attention skips empty query ranges), which is what the Triton kernels do in the graph."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from staging_switch import use_staging

import speculant.drafting.draft_graph as draft_graph
import speculant.models.attention as attention_mod
from speculant import LLM, SamplingParams
from speculant.engine.staging import staging_ext
from speculant.kernels.kv_cache import store_kv_ref
from speculant.kernels.paged_attention import paged_attention_ref

V = 64
# at most 4 running: later prompts join running ones, their first catch-up (the whole prompt)
# padded to a larger query bucket; the last one's exceeds the largest bucket: eager
PROMPT_LENS = [3, 9, 5, 12, 4, 7, 6, 24]
MAX_TOKENS = [24, 14, 31, 11, 22, 27, 18, 16]


@pytest.fixture(scope="module")
def target(tiny_factory) -> Path:
    return tiny_factory("llama", vocab_size=V, tokenizer=False, num_hidden_layers=3)


@pytest.fixture(scope="module")
def weak_draft(tiny_factory) -> Path:
    """One random layer and a 32-token context: near it sequences draft fewer than k tokens."""
    return tiny_factory(
        "llama",
        seed=1,
        vocab_size=V,
        tokenizer=False,
        num_hidden_layers=1,
        max_position_embeddings=32,
    )


def _kernel_attention(q, k, v, k_cache, v_cache, meta, scale):
    """Attention through the kernels' torch references (what the Triton kernels do in a graph).
    q: [T, nh, d], k / v: [T, nkv, d], caches [blocks, block_size, nkv, d] -> [T, nh, d]"""
    store_kv_ref(k, v, k_cache, v_cache, meta.slot_mapping)  # slot -1: skipped
    out = torch.zeros_like(q)  # rows outside every query range stay 0 (garbage on the GPU)
    return paged_attention_ref(
        q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.query_start_loc, scale,
        out=out,
    )


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, V, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _run(target: Path, draft: Path, fused: bool, monkeypatch) -> tuple:
    """(outputs, (token ids, drafts) of every speculative step, ((Bp, Q, K) of each graph call,
    whether a row of it drafts fewer than K tokens))."""
    llm = LLM(
        model=str(target),
        skip_tokenizer_init=True,
        device="cpu",  # the graph code run eagerly on the CPU, on any machine
        max_num_seqs=4,
        speculative_config={"model": str(draft), "num_speculative_tokens": 3},
    )
    strat = llm.engine.spec.strategy
    strat.model._cpu_plan = False  # both runs: the layers' path, attention through attend()
    calls, short = [], []
    if fused:  # "capture" = run the graph's function eagerly on the static inputs
        graphs, static = strat.graphs, {}
        graphs.enabled = True

        def replay(key, fn):  # outputs are static, as a graph's
            # the last call's drafts were read back (split_drafts -> consumed) before this
            # call staged its pinned inputs: writable() never has to wait
            assert not graphs.inflight
            out = fn(*graphs.inputs[key])
            graphs.inflight = True  # as GraphCache.replay
            return static.setdefault(key, out).copy_(out)

        monkeypatch.setattr(graphs, "replay", replay)
        real_ints = draft_graph.fused_ints

        def spy_ints(out, states, feeds, ks, Bp, Q, K, *a):
            calls.append((Bp, Q, K))
            short.append(min(ks) < max(ks))  # rows that skip the last steps
            return real_ints(out, states, feeds, ks, Bp, Q, K, *a)

        monkeypatch.setattr(draft_graph, "fused_ints", spy_ints)
    spec, seen = llm.engine.spec, []
    real_propose = spec._propose

    def spy(batch):
        prop = real_propose(batch)
        if prop is not None:
            seen.append(([list(s.token_ids) for s in batch.seqs], prop.token_ids))
        return prop

    spec._propose = spy
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
    assert (
        not strat.runner.states
        and strat.runner.block_manager.num_free_blocks == strat.runner.block_manager.num_blocks
    )
    return [list(o.outputs[0].token_ids) for o in outs], seen, (calls, short)


@pytest.mark.parametrize("staging", ["c", "python"])
@pytest.mark.parametrize("which", ["self", "weak"])
def test_one_graph_propose_equals_eager(target, weak_draft, monkeypatch, which, staging):
    use_staging(monkeypatch, staging)
    monkeypatch.setattr(attention_mod, "attention", _kernel_attention)
    draft = target if which == "self" else weak_draft
    out_e, seen_e, _ = _run(target, draft, False, monkeypatch)
    out_f, seen_f, (calls, short) = _run(target, draft, True, monkeypatch)
    assert out_f == out_e
    assert len(seen_f) == len(seen_e)
    for step, (a, b) in enumerate(zip(seen_f, seen_e)):
        assert a == b, f"step {step}: fused {a[1]} != eager {b[1]}"
    assert len(calls) > len(seen_f) // 2, (len(calls), len(seen_f))  # mostly one graph
    assert len(calls) < len(seen_f)  # the long first catch-up fell back to the eager path
    assert len({q for _, q, _ in calls} - {1, 2}) >= 2  # catch-ups of whole prompts
    assert len({b for b, _, _ in calls}) > 1  # the batch shrank through several buckets
    if which == "weak":  # sequences near the draft's context end draft fewer than K tokens
        assert any(short) and not all(short)


class _St:
    def __init__(self, cached, table):
        self.num_cached_tokens, self.block_table = cached, table


def test_staging_ext_built():
    """The C staging extension builds with the project (setup-time, optional elsewhere)."""
    if os.environ.get("CI") and staging_ext() is None:
        pytest.fail("speculant._staging was not built: fused_ints runs its Python version")
    if staging_ext() is None:
        pytest.skip("speculant._staging not built here")


@pytest.mark.parametrize("staging", ["c", "python"])
def test_fused_ints_layout(monkeypatch, staging):
    """Two sequences (catch-ups of 2 and 1 tokens, 3 and 1 drafts) padded to Bp=2, Q=2, K=3."""
    St = _St
    bs, W = 4, 3
    states = [St(5, [2, 7, 9]), St(2, [4])]  # blocks for n + k - 1 positions
    M, S, Bp = 4, 2, 2
    a = np.full(3 * M + 3 * Bp + 1 + 3 * S * Bp + Bp + 1 + Bp * W, 99, np.int64)
    use_staging(monkeypatch, staging)
    draft_graph.fused_ints(a, states, [[11, 12], [13]], [3, 1], 2, 2, 3, W, bs)
    parts = np.split(a, np.cumsum([M, M, M, Bp, Bp + 1, Bp, S * Bp, S * Bp, S * Bp, Bp + 1]))
    ids, pos, slots, ctx, qsl, last, spos, sslots, sctx, sqsl, tables = parts
    assert ids.tolist() == [11, 12, 13, 0]
    assert pos.tolist() == [5, 6, 2, 0]
    assert slots.tolist() == [7 * 4 + 1, 7 * 4 + 2, 4 * 4 + 2, -1]
    assert ctx.tolist() == [7, 3] and qsl.tolist() == [0, 2, 3] and last.tolist() == [1, 2]
    assert spos.reshape(S, Bp).tolist() == [[7, 0], [8, 0]]  # row 1 drafts once: no steps
    assert sslots.reshape(S, Bp).tolist() == [[7 * 4 + 3, -1], [9 * 4 + 0, -1]]
    assert sctx.reshape(S, Bp).tolist() == [[8, 3], [9, 3]]
    assert sqsl.tolist() == [0, 1, 2]
    assert tables.reshape(Bp, W).tolist() == [[2, 7, 9], [4, 0, 0]]


@pytest.mark.skipif(staging_ext() is None, reason="speculant._staging not built")
def test_fused_ints_c_equals_python(monkeypatch):
    """The C staging writes exactly what the Python one does, on random batches: ragged
    catch-ups, rows drafting 1..K tokens, tables up to the graph's width, positions past the
    last block for the steps a row skips, large block ids; and rejects bad inputs by name."""
    ext = staging_ext()
    rng = random.Random(0)
    for _ in range(300):
        bs, K, W = rng.choice([1, 4, 16]), rng.randint(1, 6), rng.randint(1, 40)
        Bp, Q = rng.choice([1, 2, 4, 8, 16, 32]), rng.choice([1, 2, 4, 8, 16])
        A = rng.randint(1, Bp)
        states, feeds, ks, rows = [], [], [], 0
        for _ in range(A):
            nf = rng.randint(1, max(1, min(Q, W * bs, Bp * Q - rows - (A - len(states) - 1))))
            k = rng.randint(1, K)
            n = rng.randint(nf, max(nf, (W * bs) - (k - 1)))  # tokens after the catch-up
            need = min(W, -(-(n + k - 1) // bs))
            table = [rng.randint(0, 2**40) for _ in range(need)]
            states.append(_St(n - nf, table))
            feeds.append([rng.randint(0, 2**31) for _ in range(nf)])
            ks.append(k)
            rows += nf
        size = sum(draft_graph._sizes(Bp, Q, K, W))
        a, b = np.full(size, 7, np.int64), np.full(size, -7, np.int64)
        for which, out in (("python", a), ("c", b)):
            use_staging(monkeypatch, which)
            draft_graph.fused_ints(out, states, feeds, ks, Bp, Q, K, W, bs)
        assert a.tolist() == b.tolist(), (Bp, Q, K, W, bs, A)
    good = np.zeros(sum(draft_graph._sizes(1, 2, 2, 2)), np.int64)
    args = ([[3]], [2], [[5]], [2], 1, 2, 2, 2, 4)
    ext.draft_ints(good, *args)
    for bad, msg in [
        ((np.zeros(good.size + 1, np.int64),) + args, "int64 of"),
        ((good.astype(np.int32),) + args, "int64 of"),
        ((good, [[3, 4, 5]], [2], [[5]], [2], 1, 2, 2, 2, 4), "block table of 3 blocks"),
        ((good, [[3]], [4], [[5]], [2], 1, 2, 2, 2, 4), "past its 1 blocks"),
        ((good, [[3]], [0], [[5, 6, 7]], [2], 1, 2, 2, 2, 4), "catch-up rows"),
        ((good, [[3], [4]], [0, 0], [[5], [6]], [1, 1], 1, 2, 2, 2, 4), "batch bucket"),
        ((good, [[3]], [2], [[5]], [2, 2], 1, 2, 2, 2, 4), "differ in length"),
    ]:
        with pytest.raises(ValueError, match=msg):
            ext.draft_ints(*bad)


def test_graph_cache_inflight_protocol():
    """GraphCache.writable() waits only for a replay whose drafts were not read back;
    split_drafts(..., graphs=) marks them read."""
    from speculant.drafting import GraphCache, split_drafts

    g = GraphCache(torch.device("cpu"), "test")
    assert not g.enabled and not g.inflight
    host = g.host_vector(5)
    assert host.dtype == torch.long and host.shape == (5,) and not host.is_pinned()
    g.inflight = True
    assert split_drafts(torch.tensor([[4, 5, 6]]), [1], [2], 2, g) == [[], [4, 5]]
    assert not g.inflight
    g.inflight = True
    view = g.writable(host)  # on the CPU nothing to wait for
    assert not g.inflight
    view[:] = [1, 2, 3, 4, 5]  # writes go to the vector the graph copies
    assert host.tolist() == [1, 2, 3, 4, 5]
