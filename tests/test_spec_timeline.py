"""bench/spec_timeline.py's tree timelines (``--trees``) on the CPU: the tiny Llama geometry of
gpu_tree.py's smoke run, chains against trees of as many nodes, every mark in place."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def timeline_module(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import spec_timeline

    from speculant.engine import cuda_graph, llm_engine, model_runner, spec_decode
    from speculant.plugins import rejection_sampler

    # instrument() patches these classes: restore them after the test
    for owner, attrs in ((llm_engine.LLMEngine, ("step",)),
                         (spec_decode.SpecDecoder, ("_propose", "_apply", "_compact", "_check")),
                         (rejection_sampler.RejectionSampler, ("verify",)),
                         (spec_decode.TargetScorer, ("score",)),
                         (model_runner.ModelRunner, ("score", "forward")),
                         (cuda_graph.CudaGraphRunner, ("run", "run_head", "_stage", "_stage_ring",
                                                       "_fill_small")),
                         (cuda_graph._Graph, ("replay",))):
        for a in attrs:
            monkeypatch.setattr(owner, a, getattr(owner, a))
    return spec_timeline


def test_tree_timelines_on_the_cpu(timeline_module, tmp_path):
    from gpu_tree import build_llm

    from speculant.bench import random_prompts

    args = types.SimpleNamespace(geometry="tiny", layers=1, init="dummy", dtype="float32",
                                 device="cpu", prompt_len=16, kv_cache_gib=0.05)
    llm, _ = build_llm(args, tmp_path, 200)
    prompt = random_prompts(1, 16, llm.engine.vocab_size, seed=0)[0]
    tl = timeline_module.Timeline()
    timeline_module.instrument(tl)
    out = timeline_module.tree_timelines(llm.engine, prompt, [(6, 2), (6, 3)], 40, tl, warmup=8)
    assert list(out) == ["chain k=6", "tree 6:2", "tree 6:3"]  # one chain for both trees
    for name, row in out.items():
        assert row["steps"] > 0 and row["median_step_ms"] > 0
        marks = {r["interval"] for r in row["intervals"] if r["median_us"] is not None}
        assert any(m.startswith("propose> ->") for m in marks), name
        assert any(m.startswith("check> ->") for m in marks), name
        # every level accepted: a tree step compacts the accepted path, a chain never does
        assert any("compact>" in m for m in marks) == name.startswith("tree"), (name, marks)
    assert sys.modules["spec_timeline"] is timeline_module
