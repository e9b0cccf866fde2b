"""The one-graph greedy EAGLE propose (speculant.drafting.head_graph) run eagerly on the CPU: the padded
function the CUDA graph captures (catch-up padded to a query bucket, batch padded to a bucket,
padding rows with slot -1, padded sequences with context 0 and an empty query range, the gather
of each drafting sequence's last row, the K greedy steps) must propose exactly the drafts of the
eager path, step for step, for EAGLE-1 and EAGLE-3. Attention runs through the kernels' torch
references (store_kv skips slot -1, paged attention skips empty query ranges), which is what the
Triton kernels do inside the graph; both runs use them."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoints import make_eagle1, make_eagle3
from staging_switch import use_staging

import speculant.drafting.head_graph as eagle_graph
import speculant.models.attention as attention_mod
from speculant import LLM, SamplingParams
from speculant.drafting import find_draft
from speculant.engine.staging import staging_ext
from speculant.kernels.kv_cache import store_kv_ref
from speculant.kernels.paged_attention import paged_attention_ref

V = 64
# the last prompt's first catch-up (its whole prompt) exceeds the largest query bucket: eager
PROMPT_LENS = [3, 9, 5, 12, 4, 7, 6, 24]
MAX_TOKENS = [24, 13, 30, 9, 21, 26, 17, 15]  # different lengths: drafts shrink to k = 0 at ends


def _kernel_attention(q, k, v, k_cache, v_cache, meta, scale):
    # q: [T, nh, d], k / v: [T, nkv, d], caches [blocks, block_size, nkv, d] -> [T, nh, d]
    store_kv_ref(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.zeros_like(q)  # rows outside every query range stay 0 (garbage on the GPU)
    return paged_attention_ref(
        q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.query_start_loc, scale,
        out=out,
    )




@pytest.fixture(scope="module")
def target(tiny_factory) -> Path:
    return tiny_factory("llama", vocab_size=V, tokenizer=False, num_hidden_layers=7)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, V, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _run(target: Path, head: Path, fused: bool, monkeypatch, **options) -> tuple[list, list, int]:
    """(outputs, (token ids, drafts) of every speculative step, fused graph calls)."""
    llm = LLM(
        model=str(target),
        skip_tokenizer_init=True,
        device="cpu",  # the graph code run eagerly on the CPU, on any machine
        max_num_seqs=8,
        speculative_config={"model": str(head), "num_speculative_tokens": 3, **options},
    )
    strat = llm.engine.spec.strategy
    calls = []
    if fused:  # "capture" = run the graph's function eagerly on the static buffers
        graphs = strat.graphs
        graphs.enabled = True
        monkeypatch.setattr(graphs, "replay", lambda key, fn: fn(*graphs.inputs[key]))
        real = eagle_graph.propose_graph

        def counting(*a):
            calls.append(a[3:6])  # (Bp, Q, K)
            return real(*a)

        monkeypatch.setattr(eagle_graph, "propose_graph", counting)
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
    return [list(o.outputs[0].token_ids) for o in outs], seen, calls


@pytest.mark.parametrize("staging", ["c", "python"])
@pytest.mark.parametrize("version", [1, 3])
def test_one_graph_propose_equals_eager(target, tmp_path, monkeypatch, version, staging):
    use_staging(monkeypatch, staging)
    monkeypatch.setattr(attention_mod, "attention", _kernel_attention)
    if version == 1:
        head = make_eagle1(tmp_path / "e1", target, V, "safetensors", seed=2, copy=True)
    else:
        head = make_eagle3(tmp_path / "e3", V, 40, "safetensors", seed=3, target=target)
    out_e, seen_e, _ = _run(target, head, False, monkeypatch)
    out_f, seen_f, calls = _run(target, head, True, monkeypatch)
    assert out_f == out_e
    assert len(seen_f) == len(seen_e)
    for step, (a, b) in enumerate(zip(seen_f, seen_e)):
        assert a == b, f"step {step}: fused {a[1]} != eager {b[1]}"
    assert len(calls) > len(seen_f) // 2, (len(calls), len(seen_f))  # mostly one graph
    assert len(calls) < len(seen_f)  # the long first catch-up fell back to the eager path
    assert {q for _, q, _ in calls} > {1}  # catch-ups padded to several query buckets
    assert {b for b, _, _ in calls} > {8}  # the batch shrank through several buckets


def test_query_buckets():
    assert [eagle_graph.query_bucket(n) for n in (1, 3, 4, 5, 16)] == [1, 3, 4, 6, 16]
    assert eagle_graph.query_bucket(17) is None


@pytest.mark.parametrize("staging", ["c", "python"])
def test_fused_ints_layout(monkeypatch, staging):
    """The graph's int inputs for two drafting sequences and one catching up only, padded to
    Bp=4, Q=3, K=3, written out by hand (the graph-vs-eager test above cannot see a layout error
    in ``chain_ints``: the eager path uses it too)."""
    from types import SimpleNamespace

    from speculant.drafting import CatchUp as _Plan
    from speculant.drafting import SeqCache as _SeqState

    bs, W, Bp, Q, K = 4, 3, 4, 3, 3
    toks = [list(range(100, 110)), list(range(200, 206)), list(range(300, 305))]
    batch = SimpleNamespace(seqs=[SimpleNamespace(token_ids=t) for t in toks])
    plans = [  # (i, state(table, offset, valid), row, count, start, n, k)
        _Plan(0, _SeqState([5, 6, 1], 1, 7), 0, 2, 7, 10, 3),  # positions 7, 8 (cache idx 6, 7)
        _Plan(1, _SeqState([3, 2], 0, 4), 2, 1, 4, 6, 2),  # position 4
        _Plan(2, _SeqState([8], 0, 2), 3, 2, 2, 5, 0),  # positions 2, 3: no drafts
    ]
    use_staging(monkeypatch, staging)
    M, S = Bp * Q, K - 1
    sizes = [M, M, M, Bp, Bp + 1, Bp, S * Bp, S * Bp, S * Bp, Bp + 1, Bp * W]
    out = np.full(sum(sizes), 99, np.int64)
    eagle_graph.fused_ints(out, batch, plans, 2, Bp, Q, K, W, bs)
    ints = out.tolist()
    parts, o = [], 0
    for n in sizes:
        parts.append(ints[o : o + n])
        o += n
    ids, pos, slots, ctx, qsl, last, cpos, cslots, cctx, cqsl, tables = parts
    assert ids == [108, 109, 205, 303, 304] + [0] * 7
    assert pos == [7, 8, 4, 2, 3] + [0] * 7
    assert slots == [6 * 4 + 2, 6 * 4 + 3, 2 * 4 + 0, 8 * 4 + 2, 8 * 4 + 3] + [-1] * 7
    assert ctx == [8, 5, 4, 0] and qsl == [0, 2, 3, 5, 5] and last == [1, 2, 0, 0]
    # chain: draft step j of a drafting row writes position n - 1 + j (cache index - offset)
    assert cpos == [9, 5, 0, 0, 10, 6, 0, 0]
    assert cslots == [1 * 4 + 0, 2 * 4 + 1, -1, -1, 1 * 4 + 1, 2 * 4 + 2, -1, -1]
    assert cctx == [9, 6, 0, 0, 10, 7, 0, 0]
    assert cqsl == [0, 1, 2, 2, 2]
    assert tables == [5, 6, 1, 3, 2, 0, 8, 0, 0, 0, 0, 0]


@pytest.mark.skipif(staging_ext() is None, reason="speculant._staging not built")
def test_eagle_ints_c_equals_python(monkeypatch):
    """The C staging (``_staging.eagle_ints``) writes exactly what ``eagle_graph.fused_ints``
    builds in Python, on random calls: drafting rows first, then catch-up-only rows, ragged
    catch-ups, cache offsets, catch-up and draft positions past the table (block 0), large block
    ids; and rejects bad inputs by name."""
    from types import SimpleNamespace

    from speculant.drafting import CatchUp as _Plan
    from speculant.drafting import SeqCache as _SeqState

    ext, rng = staging_ext(), random.Random(1)
    for _ in range(300):
        bs, K, W = rng.choice([1, 4, 16]), rng.randint(1, 6), rng.randint(1, 30)
        Bp, Q = rng.choice([1, 2, 4, 8, 16, 32]), rng.choice([1, 2, 4, 8, 16])
        R = rng.randint(1, Bp)
        A = rng.randint(0, R)
        seqs, order, used = [], [], 0
        for r in range(R):
            cnt = rng.randint(1, max(1, min(Q, Bp * Q - used - (R - r - 1))))
            used += cnt
            off = rng.randint(0, 50)
            start = off + rng.randint(0, W * bs)
            n = start + cnt + 1
            table = [rng.randint(0, 2**40) for _ in range(rng.randint(0, W))]
            seqs.append(SimpleNamespace(token_ids=[rng.randint(0, 2**31) for _ in range(n)]))
            order.append(_Plan(r, _SeqState(table, off, start), 0, cnt, start, n, int(r < A)))
        batch = SimpleNamespace(seqs=seqs)
        size = 3 * Bp * Q + 3 * Bp + 1 + 3 * (K - 1) * Bp + Bp + 1 + Bp * W
        want, got = np.full(size, 5, np.int64), np.full(size, -5, np.int64)
        for which, out in (("python", want), ("c", got)):
            use_staging(monkeypatch, which)
            eagle_graph.fused_ints(out, batch, order, A, Bp, Q, K, W, bs)
        assert got.tolist() == want.tolist(), (Bp, Q, K, W, bs, R, A)
    rows = ([p.st.table for p in order], [p.st.offset for p in order], [p.start for p in order],
            [p.n for p in order], [s.token_ids for s in seqs])
    with pytest.raises(ValueError, match="int64 of"):
        ext.eagle_ints(got[:-1], *rows, A, Bp, Q, K, W, bs)
    with pytest.raises(ValueError, match=rf"{R} rows \({R + 1} drafting\)"):
        ext.eagle_ints(got, *rows, R + 1, Bp, Q, K, W, bs)


def test_one_layout_for_both_one_graph_proposes():
    """The head's and the draft model's one-graph proposes read one int layout
    (``drafting.propose_ints``): the same part sizes and the same all-padding call."""
    import speculant.drafting.draft_graph as draft_graph
    from speculant.drafting import propose_ints

    for Bp, Q, K, W in [(1, 1, 1, 1), (2, 3, 4, 5), (8, 4, 3, 7), (16, 1, 6, 2)]:
        sizes = propose_ints.sizes(Bp, Q, K, W)
        assert sizes == draft_graph._sizes(Bp, Q, K, W)
        assert len(sizes) == len(propose_ints.PARTS)
        ours, theirs = np.full(sum(sizes), 7, np.int64), np.full(sum(sizes), 9, np.int64)
        propose_ints.padding_ints(ours, Bp, Q, K, W)
        draft_graph.padding_ints(theirs, Bp, Q, K, W)
        assert ours.tolist() == theirs.tolist()
        chain = np.full(sum(propose_ints.chain_sizes(Bp, K, W)), 7, np.int64)
        propose_ints.chain_padding(chain, Bp, K)
        assert chain.tolist() == ours[sum(sizes[:6]) :].tolist()


def test_one_graph_propose_with_prompt_lookup(target, tmp_path, monkeypatch):
    """prompt_lookup_min: the sequences with a lookup chain catch up only (k = 0 rows in the
    graph's batch, and steps where every sequence looks up and the graph is not used); the
    drafts and outputs equal the eager path's."""
    use_staging(monkeypatch, "c")
    monkeypatch.setattr(attention_mod, "attention", _kernel_attention)
    head = make_eagle1(tmp_path / "e1", target, V, "safetensors", seed=2, copy=True)
    out_e, seen_e, _ = _run(target, head, False, monkeypatch, prompt_lookup_min=1)
    out_f, seen_f, calls = _run(target, head, True, monkeypatch, prompt_lookup_min=1)
    assert out_f == out_e and seen_f == seen_e
    assert calls
    looked = sum(1 for toks, drafts in seen_f for t, d in zip(toks, drafts)
                 if d and d == find_draft(torch.tensor(t), 1, 4, len(d)))
    assert looked > 20, looked
