"""The CPU forward paths of the Llama family agree: the numpy one-token decode loop, the flat torch
loop (models/cpu_forward.py) and the module path, on the same weights and cache contents."""

from __future__ import annotations

import torch

from speculant import LLM, SamplingParams


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


def test_cpu_decode_paths_agree(tiny_llama, monkeypatch):
    monkeypatch.setenv("SPECULANT_CPU_GEMV", "numpy")  # the load-time timing may pick torch's
    llm = LLM(model=str(tiny_llama), max_num_seqs=4)
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
