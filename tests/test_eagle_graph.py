"""The one-graph greedy EAGLE propose (plugins/eagle_graph.py) run eagerly on the CPU: the padded
function the CUDA graph captures (catch-up padded to a query bucket, batch padded to a bucket,
padding rows with slot -1, padded sequences with context 0 and an empty query range, the gather
of each drafting sequence's last row, the K greedy steps) must propose exactly the drafts of the
eager path, step for step, for EAGLE-1 and EAGLE-3. Attention runs through the kernels' torch
references (store_kv skips slot -1, paged attention skips empty query ranges), which is what the
Triton kernels do inside the graph; both runs use them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoints import make_eagle1, make_eagle3

import speculant.engine.attention as attention_mod
import speculant.plugins.eagle_graph as eagle_graph
from speculant import LLM, SamplingParams
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


def _run(target: Path, head: Path, fused: bool, monkeypatch) -> tuple[list, list, int]:
    """(outputs, (token ids, drafts) of every speculative step, fused graph calls)."""
    llm = LLM(
        model=str(target),
        skip_tokenizer_init=True,
        max_num_seqs=8,
        speculative_config={"model": str(head), "num_speculative_tokens": 3},
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


@pytest.mark.parametrize("version", [1, 3])
def test_one_graph_propose_equals_eager(target, tmp_path, monkeypatch, version):
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
