"""The CPU forward paths of the Llama family agree: the numpy one-token decode loop, the flat torch
loop (models/cpu_forward.py) and the module path, on the same weights and cache contents."""

from __future__ import annotations

import pytest
import torch

from speculant import LLM, SamplingParams
from speculant.models import cpu_kernels, layers


def _run(llm, prompt, n, mode):
    model = llm.engine.model
    plan = model._cpu_plan
    saved = plan.np_layers
    if mode == "torch":
        plan.np_layers = None
    elif mode == "module":
        model._cpu_plan = False
    try:
        hid = []
        runner = llm.engine.runner
        orig = runner.forward

        def spy(seqs, new_tokens, *a, **k):
            h, aux = orig(seqs, new_tokens, *a, **k)
            if len(new_tokens[0]) == 1:
                hid.append(h.clone())  # [1, hidden]
            return h, aux

        runner.forward = spy
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
        return out[0].outputs[0].token_ids, torch.cat(hid)
    finally:
        runner.forward = orig
        plan.np_layers = saved
        model._cpu_plan = plan


@pytest.mark.parametrize("kernels", ["on", "off"])
def test_cpu_decode_paths_agree(tiny_llama, monkeypatch, kernels):
    """Both CPU product back-ends: our C kernels (default where built) and, as on a machine
    without them, numpy's / torch's BLAS with the numpy attention loop."""
    monkeypatch.setattr(layers, "choose_gemv", lambda linears: True)  # numpy's, not a timing
    if kernels == "off":
        monkeypatch.setattr(cpu_kernels, "_ext", False)  # as where the extension is not built
    elif not cpu_kernels.available():
        pytest.skip("CPU kernels not built")
    llm = LLM(model=str(tiny_llama), max_num_seqs=4)
    plan0 = llm.engine.model
    assert any(
        (getattr(m, "wb", None) is not None) == (kernels == "on")
        for m in plan0.modules()
        if type(m).__name__ == "CpuLinear"
    )
    prompt = [1] + list(range(100, 130))
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=2), use_tqdm=False)
    plan = llm.engine.model._cpu_plan
    assert plan and plan.np_layers is not None  # prepared CPU Linears: both fast paths on
    tok_np, h_np = _run(llm, prompt, 24, "numpy")
    tok_t, h_t = _run(llm, prompt, 24, "torch")
    tok_m, h_m = _run(llm, prompt, 24, "module")
    assert tok_np == tok_t == tok_m
    torch.testing.assert_close(h_t, h_m, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h_np, h_m, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernels", ["on", "off"])
def test_cpu_speculation_equals_plain_on_both_backends(tiny_llama, monkeypatch, kernels):
    """Verification passes (several rows of one sequence through cpu_forward._forward_seq) give
    the plain greedy tokens with and without the C kernels."""
    monkeypatch.setattr(layers, "choose_gemv", lambda linears: True)  # off: the numpy loop
    if kernels == "off":
        monkeypatch.setattr(cpu_kernels, "_ext", False)
    elif not cpu_kernels.available():
        pytest.skip("CPU kernels not built")
    prompt = [1] + list(range(100, 120)) * 3  # repeats: n-gram drafts get proposed
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    plain = LLM(model=str(tiny_llama), max_num_seqs=2)
    spec = LLM(
        model=str(tiny_llama),
        max_num_seqs=2,
        speculative_config={"method": "ngram", "num_speculative_tokens": 5},
    )
    a = plain.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
    b = spec.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
    assert spec.engine.model._cpu_plan.np_layers is not None  # cpu_forward._forward_seq ran
    assert b.metrics.spec.num_draft_tokens > 0
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
