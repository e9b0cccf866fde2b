"""Programmatic dependent launch (``_triton_utils.pdl_enabled`` / ``pdl_launch``).

A kernel launched with PDL may start before the kernel ahead of it has finished, so each one
that takes part must wait (``gdc_wait``) before it reads anything written on the GPU. The CPU
tests check when it is on and, in the source of every kernel with a ``GDC`` constexpr, that the
wait comes before any load other than a weight prefetch; the CUDA test runs a decode-layer chain
in a CUDA graph with PDL on and off and wants the same bits (Hopper or later)."""

from __future__ import annotations

import importlib
import inspect
import math
import re

import pytest
import torch

from speculant.kernels import _triton_utils as tu
from speculant.models import fused

# the modules (speculant.kernels re-exports functions of the same names)
gemv_mod = importlib.import_module("speculant.kernels.gemv")
logprobs = importlib.import_module("speculant.kernels.logprobs")
paged_attention = importlib.import_module("speculant.kernels.paged_attention")

HAS_CUDA = torch.cuda.is_available()
SM90 = HAS_CUDA and torch.cuda.get_device_capability()[0] >= 9

KERNELS = {
    "_gemv_kernel": gemv_mod,
    "_split_reduce_kernel": gemv_mod,
    "_split_reduce_norm_kernel": gemv_mod,
    "_paged_attn_kernel": paged_attention,
    "_paged_attn_reduce_kernel": paged_attention,
    "_partial_kernel": logprobs,
    "_combine_kernel": logprobs,
    "_rms_norm_kernel": fused,
    "_rope_kernel": fused,
    "_silu_mul_kernel": fused,
}


def test_pdl_off_on_cpu_and_under_the_interpreter(monkeypatch):
    cpu = torch.device("cpu")
    assert not tu.pdl_enabled(cpu)
    assert tu.pdl_launch(cpu) == {"GDC": False}  # never launch_pdl without the wait
    if HAS_CUDA:
        dev = torch.device("cuda")
        assert tu.pdl_launch(dev) == ({"GDC": True, "launch_pdl": True} if SM90 else {"GDC": False})
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert not tu.pdl_enabled(dev)


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_every_gdc_kernel_waits_before_reading_inputs(name):
    """The wait is the first thing the kernel does when ``GDC`` is set, except for the GEMV's
    prefetch of its first weight tile (the weight is never written on the GPU)."""
    src = inspect.getsource(getattr(KERNELS[name], name).fn)
    assert "GDC: tl.constexpr" in src, f"{name} takes no GDC constexpr"
    body = src.split("):\n", 1)[1]  # after the signature
    before, sep, _ = body.partition("tl.extra.cuda.gdc_wait()")
    assert sep, f"{name} never calls gdc_wait"
    if "TRIGGER_FIRST: tl.constexpr" in src:  # a trigger-first reduce: the trigger alone may come
        # first, and only under the constexpr (nothing is read before the wait either way)
        trigger = re.compile(r"if TRIGGER_FIRST:\s*\n\s*tl\.extra\.cuda\.gdc_launch_dependents\(\)")
        assert trigger.search(before), name
        before = trigger.sub("", before)
    assert "gdc_launch_dependents" not in before
    loads = re.findall(r"tl\.load\(([^,]+)", before)
    assert all(arg.strip() == "w_rows + offs_k0" for arg in loads), (name, loads)
    assert "tl.store" not in before and "tl.atomic" not in before


def test_every_pdl_launch_passes_gdc():
    """A launcher that passes ``launch_pdl`` takes it from ``pdl_launch`` (which sets GDC with
    it), never on its own."""
    for mod in {id(m): m for m in KERNELS.values()}.values():
        src = inspect.getsource(mod)
        assert "launch_pdl=" not in src, mod.__name__
        assert "pdl_launch(" in src, mod.__name__


def _chain(x, layers, caches, meta, scale):
    """One-row decode layers as forward_gemv runs them: qkv GEMV with RMSNorm, RoPE + K/V store,
    attention (split-K), o_proj, gate/up GEMV with RMSNorm, down GEMV with SiLU * up (split-K);
    then the final RMSNorm + head GEMV and its argmax."""
    from speculant.kernels.gemv import GemvConfig, gemv
    from speculant.kernels.logprobs import row_argmax
    from speculant.kernels.paged_attention import paged_attention as attn

    pos, slots, tables, ctx, qsl, cos, sin = meta
    split = GemvConfig(block_n=4, block_k=128, split_k=2, use_dot=False)
    h, res = x, torch.zeros_like(x)
    for (ln1, wqkv, wo, ln2, wgu, wd), (kc, vc) in zip(layers, caches):
        qkv, res = gemv(h, wqkv, prologue="rmsnorm", norm_weight=ln1, residual=res)
        q, k, v = qkv.view(1, 6, 32).split([4, 1, 1], dim=1)
        fused.rope_store_(pos, q, k, v, cos, sin, kc, vc, slots)
        o = gemv(attn(q, kc, vc, tables, ctx, qsl, scale).reshape(1, 128), wo)
        gu, res = gemv(o, wgu, prologue="rmsnorm", norm_weight=ln2, residual=res)
        # K in two: a split-K reduce follows (it triggers the next GEMV before its wait)
        h = gemv(gu, wd, prologue="silu_mul", config=split)
    logits = gemv(h, layers[0][1][:96], prologue="rmsnorm", norm_weight=layers[0][0], residual=res)[
        0
    ]
    return logits, row_argmax(logits.float())


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs a CUDA device of compute capability >= 9")
def test_pdl_graph_matches_plain_launches(monkeypatch):
    g = torch.Generator(device="cuda").manual_seed(0)
    dev, dt, H, ctx_len = "cuda", torch.bfloat16, 128, 700

    def w(*s, std=0.05):
        return (torch.randn(*s, generator=g, device=dev) * std + 0.01).to(dt)

    layers = [(1 + w(H), w(192, H), w(H, 128), 1 + w(H), w(512, H), w(H, 256)) for _ in range(4)]
    nblk = -(-(ctx_len + 1) // 16)
    caches = [(w(nblk, 16, 1, 32, std=1), w(nblk, 16, 1, 32, std=1)) for _ in range(4)]
    ar = torch.arange(ctx_len + 8, device=dev, dtype=torch.float32)
    inv = 1.0 / (10000.0 ** (torch.arange(0, 32, 2, device=dev, dtype=torch.float32) / 32))
    emb = torch.cat([torch.outer(ar, inv)] * 2, dim=-1)
    meta = (
        torch.tensor([ctx_len], device=dev),
        torch.tensor([ctx_len], device=dev),
        torch.arange(nblk, device=dev, dtype=torch.int32)[None],
        torch.tensor([ctx_len + 1], device=dev, dtype=torch.int32),
        torch.tensor([0, 1], device=dev, dtype=torch.int32),
        emb.cos(),
        emb.sin(),
    )
    x = w(1, H, std=1)
    outs = {}
    pdl_enabled = tu.pdl_enabled
    for label in ("off", "on"):
        # "on" as the engine launches (the split-K reduces and the attention merge of the one-row
        # steps trigger the next kernel before they wait); "off" as on a GPU without PDL
        monkeypatch.setattr(tu, "pdl_enabled", pdl_enabled if label == "on" else lambda d: False)
        assert tu.pdl_launch(torch.device(dev))["GDC"] == (label == "on")
        eager = _chain(x, layers, caches, meta, 1 / math.sqrt(32))
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            _chain(x, layers, caches, meta, 1 / math.sqrt(32))
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = _chain(x, layers, caches, meta, 1 / math.sqrt(32))
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        outs[label] = (eager, captured)
    for a, b in zip(outs["off"][0] + outs["off"][1], outs["on"][0] + outs["on"][1]):
        assert torch.equal(a, b)
    assert torch.equal(outs["off"][0][0], outs["off"][1][0])


class _Recorder:
    """Stands in for a Triton kernel: ``kernel[grid](*args, **kw)`` records ``kw``."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.calls.append(kw)

        return launch


def test_trigger_first_only_before_one_row_gemvs(monkeypatch, device):
    """The launchers ask a reduce to trigger the next kernel before its wait only where that
    next kernel is a one-row GEMV: after a one-row GEMV's split-K reduce and after the attention
    merge of a single query token; never after a few-row (dot) GEMV or a multi-token merge."""
    from speculant.kernels.gemv import GemvConfig, gemv

    rec = _Recorder()
    monkeypatch.setattr(gemv_mod, "_split_reduce_kernel", rec)
    monkeypatch.setattr(gemv_mod, "_split_reduce_norm_kernel", rec)
    w = torch.randn(48, 64, device=device)
    one = GemvConfig(block_n=8, block_k=16, split_k=2, use_dot=False)
    dot = GemvConfig(block_n=16, block_k=16, split_k=2, use_dot=True)
    gemv(torch.randn(1, 64, device=device), w, force_triton=True, config=one)
    gemv(torch.randn(3, 64, device=device), w, force_triton=True, config=dot)
    nw = torch.ones(48, device=device)
    gemv(torch.randn(3, 64, device=device), w, force_triton=True, config=dot, out_norm_weight=nw,
         out_residual=torch.randn(3, 48, device=device))
    assert [c["TRIGGER_FIRST"] for c in rec.calls] == [True, False, False]

    merge = _Recorder()
    monkeypatch.setattr(paged_attention, "_paged_attn_reduce_kernel", merge)
    kc = torch.randn(4, 16, 2, 32, device=device)
    vc = torch.randn(4, 16, 2, 32, device=device)
    bt = torch.arange(4, dtype=torch.int32, device=device)[None]
    for n in (1, 3):
        q = torch.randn(n, 4, 32, device=device)
        paged_attention.paged_attention(
            q, kc, vc, bt, torch.tensor([60], dtype=torch.int32, device=device),
            torch.tensor([0, n], dtype=torch.int32, device=device), 0.2, num_splits=2, force_triton=True,
        )
    assert [c["TRIGGER_FIRST"] for c in merge.calls] == [True, False]
