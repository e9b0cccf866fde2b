"""Programmatic dependent launch (PDL) on the one-row decode chain: A/B in one process.

Run on a CUDA machine (Hopper or later) from the repository root::

    python bench/bench_pdl.py [--out OUT_DIR] [--geometries 8b,1b]

A batch-1 decode step is a chain of ~7 kernels per layer (qkv GEMV with RMSNorm, RoPE + K/V
store, split-K paged attention and its merge, o_proj, gate/up GEMV with RMSNorm, down GEMV with
SiLU * up), each reading a few MB to tens of MB of weights. Between two kernels the GPU drains
the first and ramps the second; with PDL (``kernels/_triton_utils.pdl_enabled``) the next
kernel's programs start during the tail of the one before and load their first weight tile
before waiting for it.

This script builds that chain exactly as ``LlamaDecoderLayer.forward_gemv`` runs it (the same
kernels and launchers: ``gemv``, ``fused.rope_store_``, ``paged_attention``) on synthetic bf16
weights of the given geometry (Llama-3-8B: 32 layers, hidden 4096, ffn 14336; Llama-3.2-1B: 16
layers, hidden 2048, ffn 8192, head_dim 64) with a final RMSNorm + LM head GEMV, a 384-token
context per layer, and captures it in one CUDA graph per variant: PDL off / on, and with the
GEMVs' first-weight-tile prefetch (``GemvConfig.prefetch``) off / on. Back-to-back replays timed
with CUDA events (median), against weight bytes / the copy bandwidth measured in the same run.
Every variant's logits must equal the first variant's bit for bit. Writes pdl.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from _checkout import use_checkout  # bench/
from _graph_timing import capture, replay_median_ms  # bench/

use_checkout()

GEOMETRIES = {
    "8b": dict(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336),
    "1b": dict(layers=16, hidden=2048, heads=32, kv_heads=8, head_dim=64, ffn=8192),
}
VOCAB = 128256
BLOCK = 16


def copy_bandwidth(nbytes: int = 1 << 30, iters: int = 10) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        b.copy_(a)
    e.record()
    torch.cuda.synchronize()
    return 2 * nbytes * iters / (s.elapsed_time(e) / 1e3)


def build(geo: dict, ctx: int, seed: int = 0):
    """Weights, caches and inputs of a one-row decode step on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev, dt = "cuda", torch.bfloat16
    H, F_, D = geo["hidden"], geo["ffn"], geo["head_dim"]
    nq, nkv = geo["heads"], geo["kv_heads"]

    def w(*shape, std=0.02):
        return (torch.randn(*shape, generator=g, device=dev, dtype=torch.float32) * std).to(dt)

    blocks = -(-(ctx + 1) // BLOCK)
    layers = []
    for _ in range(geo["layers"]):
        layers.append(
            dict(
                ln1=1 + w(H, std=0.1),
                ln2=1 + w(H, std=0.1),
                qkv=w((nq + 2 * nkv) * D, H),
                o=w(H, nq * D, std=0.02 / 8),
                gate_up=w(2 * F_, H),
                down=w(H, F_, std=0.02 / 8),
                k_cache=w(blocks, BLOCK, nkv, D, std=1.0),
                v_cache=w(blocks, BLOCK, nkv, D, std=1.0),
            )
        )
    head = dict(norm=1 + w(H, std=0.1), lm_head=w(VOCAB, H))
    inputs = dict(
        h=w(1, H, std=1.0),
        positions=torch.tensor([ctx], device=dev),
        slots=torch.tensor([ctx], device=dev),
        block_tables=torch.arange(blocks, device=dev, dtype=torch.int32)[None],
        context_lens=torch.tensor([ctx + 1], device=dev, dtype=torch.int32),
        qsl=torch.tensor([0, 1], device=dev, dtype=torch.int32),
    )
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, device=dev, dtype=torch.float32) / D))
    freqs = torch.outer(torch.arange(ctx + 64, device=dev, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    inputs["cos"], inputs["sin"] = emb.cos().contiguous(), emb.sin().contiguous()
    nbytes = sum(
        t.numel() * t.element_size()
        for L in layers
        for k, t in L.items()
        if k not in ("k_cache", "v_cache")
    )
    nbytes += head["lm_head"].numel() * 2
    kv_bytes = geo["layers"] * (ctx + 1) * nkv * D * 2 * 2
    return layers, head, inputs, nbytes, kv_bytes


def step(geo, layers, head, inp, prefetch: bool) -> torch.Tensor:  # [1, VOCAB] logits
    """forward_gemv's kernels, layer after layer, then the final norm and the LM head."""
    from speculant.kernels.gemv import choose_config, gemv
    from speculant.kernels.paged_attention import paged_attention
    from speculant.models import fused

    D, nq, nkv = geo["head_dim"], geo["heads"], geo["kv_heads"]
    dev = inp["h"].device

    def cfg(x, wt, prologue):
        c = choose_config(x.shape[0], wt.shape[0], wt.shape[1], prologue, dev)
        return replace(c, prefetch=prefetch)

    def normed(x, wt, norm, res):  # (RMSNorm(x + res) * norm @ wt.T, x + res)
        return gemv(
            x, wt, prologue="rmsnorm", norm_weight=norm, residual=res, config=cfg(x, wt, "rmsnorm")
        )

    h, residual = inp["h"], torch.zeros_like(inp["h"])  # layer 0: h + 0 (the model adds none)
    for L in layers:
        qkv, residual = normed(h, L["qkv"], L["ln1"], residual)
        q, k, v = qkv.view(1, nq + 2 * nkv, D).split([nq, nkv, nkv], dim=1)
        fused.rope_store_(
            inp["positions"],
            q,
            k,
            v,
            inp["cos"],
            inp["sin"],
            L["k_cache"],
            L["v_cache"],
            inp["slots"],
        )
        a = paged_attention(
            q,
            L["k_cache"],
            L["v_cache"],
            inp["block_tables"],
            inp["context_lens"],
            inp["qsl"],
            1.0 / math.sqrt(D),
            max_query_len=1,
        )
        o = gemv(a.reshape(1, nq * D), L["o"], config=cfg(h, L["o"], "none"))
        gu, residual = normed(o, L["gate_up"], L["ln2"], residual)
        h = gemv(gu, L["down"], prologue="silu_mul", config=cfg(o, L["down"], "silu_mul"))
    return normed(h, head["lm_head"], head["norm"], residual)[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--geometries", default="8b,1b")
    ap.add_argument("--ctx", type=int, default=384, help="cached tokens per layer")
    ap.add_argument("--rep", type=int, default=50)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_pdl: no CUDA device, nothing to do")
        return 0
    from speculant.kernels._triton_utils import pdl_enabled

    t0 = time.perf_counter()
    bw = copy_bandwidth()
    name = torch.cuda.get_device_name()
    print(f"{name}: copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    result = {"device": name, "copy_bandwidth_Bps": bw, "ctx": args.ctx, "geometries": {}}
    variants = [
        ("pdl off", "0", False),
        ("pdl on", "1", False),
        ("pdl off + prefetch", "0", True),
        ("pdl on + prefetch", "1", True),
    ]
    for gname in args.geometries.split(","):
        geo = GEOMETRIES[gname]
        layers, head, inp, nbytes, kv_bytes = build(geo, args.ctx)
        roof_ms = (nbytes + kv_bytes) / bw * 1e3
        rows, ref = [], None
        for label, env, prefetch in variants:
            os.environ["SPECULANT_PDL"] = env
            on = pdl_enabled(torch.device("cuda"))
            out = {}

            def fn(out=out, prefetch=prefetch, model=(geo, layers, head, inp)):
                out["logits"] = step(*model, prefetch)

            graph = capture(fn)
            graph.replay()
            torch.cuda.synchronize()
            same = None if ref is None else bool(torch.equal(out["logits"], ref))
            if ref is None:
                ref = out["logits"].clone()
            ms = replay_median_ms(graph, args.rep, 5)
            rows.append(
                dict(
                    variant=label,
                    pdl=on,
                    prefetch=prefetch,
                    ms=ms,
                    fraction_of_copy_bw=roof_ms / ms,
                    logits_equal_first=same,
                )
            )
            print(
                f"{gname} {label:20s} pdl={on!s:5s} {ms * 1e3:8.1f} us/step  "
                f"{100 * roof_ms / ms:5.1f}% of copy BW  equal={same}",
                flush=True,
            )
            del graph
        result["geometries"][gname] = dict(
            geometry=geo, weight_bytes=nbytes, kv_bytes=kv_bytes, roofline_ms=roof_ms, rows=rows
        )
        del layers, head, inp
        torch.cuda.empty_cache()
    os.environ.pop("SPECULANT_PDL", None)
    result["wall_s"] = time.perf_counter() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pdl.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / 'pdl.json'} ({result['wall_s']:.0f} s)")
    bad = [
        r
        for g in result["geometries"].values()
        for r in g["rows"]
        if r["logits_equal_first"] is False
    ]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
