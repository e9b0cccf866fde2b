"""Same-process A/B of a draft model's greedy propose graph under environment variants.

Run on a CUDA machine from the repository root::

    python bench/draft_graph_ab.py --variant off:SPECULANT_QKV_ROPE=0 \\
        --variant on:SPECULANT_QKV_ROPE=1 [--batches 1,4,8,16] [--out OUT_DIR]

What it times: ``plugins/draft_graph.propose_graph``, the function the draft-model strategy
captures for its greedy propose (the catch-up forward, the gather of each sequence's last row,
then K - 1 further one-token forwards, each followed by the LM head restricted to a token map
and its argmax), on a Llama-3.2-1B-geometry draft with synthetic bf16 weights made on the GPU
(``bench/gpu_8b.py``'s loader: nothing downloaded), a 32768-id token map, K = 3, one catch-up
token per sequence and ``--ctx`` cached tokens (random K/V) per sequence, block tables as wide
as the engine's graphs at ``gpu_8b.py``'s lengths.

Each variant is a name and ``NAME=VALUE`` environment settings, applied while its graph is
captured (launch choices are read then; a graph keeps them). All variants' graphs live in one
process and their replays alternate (order reversed every round), so a lent machine's drift
falls on all of them alike; the GPU time of each replay is taken with CUDA events and the
median reported, with the drafts compared against the first variant's (``same_drafts``). Host
work (staging, launch, read-back) is not in these figures: ``gpu_8b.py --only draft`` measures
the whole propose. Writes ``draft_graph_ab.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _checkout import use_checkout  # bench/
from _graph_timing import capture_output  # bench/

use_checkout()


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """``name:A=1,B=x`` -> (name, {A: 1, B: x}); ``name`` alone: no settings."""
    name, _, rest = text.partition(":")
    env = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise SystemExit(f"bad variant {text!r}: settings are NAME=VALUE, comma-separated")
        env[key.strip()] = value.strip()
    if not name:
        raise SystemExit(f"bad variant {text!r}: it needs a name before ':'")
    return name, env


class _State:  # what draft_graph.fused_ints reads of a draft sequence
    def __init__(self, table: list[int], cached: int) -> None:
        self.block_table, self.num_cached_tokens = table, cached


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", action="append", required=True, help="name:NAME=VALUE,...")
    ap.add_argument("--batches", default="1,4,8,16")
    ap.add_argument("--ctx", type=int, default=256, help="cached tokens per sequence")
    ap.add_argument("--rounds", type=int, default=200, help="replays of each graph")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    variants = [parse_variant(v) for v in args.variant]
    if len({n for n, _ in variants}) != len(variants):
        raise SystemExit("variant names must differ")
    if not torch.cuda.is_available():
        print("draft_graph_ab: no CUDA device here; this benchmark runs on a GPU only")
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpu_8b

    import speculant.engine.llm_engine as llm_engine
    import speculant.models.loader as loader
    from speculant import LLM
    from speculant.plugins import draft_graph as dg
    from speculant.drafting.token_map import HotHead

    loader.load_model = gpu_8b.synthetic_loader(loader.load_model)
    llm_engine.load_model = loader.load_model
    folder = gpu_8b.write_config(Path(tempfile.mkdtemp()) / "draft", gpu_8b.LLAMA32_1B, 1)
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(model=str(folder), dtype="bfloat16", skip_tokenizer_init=True,
              max_num_seqs=max(batches), max_model_len=128 + 256 + 64, kv_cache_memory=2 << 30)
    eng = llm.engine
    model, kv, bs, W = eng.model, eng.runner.kv_caches, eng.block_size, eng.runner.graphs.W
    K, Q = 3, 1
    with torch.no_grad():
        for k_cache, v_cache in kv:
            k_cache.normal_()
            v_cache.normal_()
    gen = torch.Generator(device="cuda").manual_seed(0)
    vocab = model.lm_head.weight.shape[0]
    hot = HotHead(model.lm_head.weight, torch.randperm(vocab, device="cuda", generator=gen)[:32768],
                  vocab)
    blocks = -(-(args.ctx + Q + K) // bs)
    if blocks > W:
        raise SystemExit(f"--ctx {args.ctx} does not fit the graphs' {W}-block tables")

    def build(B: int, env: dict[str, str]):
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            states = [_State(list(range(r * blocks + 1, (r + 1) * blocks + 1)), args.ctx)
                      for r in range(B)]
            host = torch.zeros(sum(dg._sizes(B, Q, K, W)), dtype=torch.long).pin_memory()
            dg.fused_ints(host.numpy(), states, [[5 + r] for r in range(B)], [K] * B, B, Q, K, W,
                          bs)
            ints = host.cuda()

            def fn():
                return dg.propose_graph(model, kv, ints, B, Q, K, W, bs, hot.greedy)

            with torch.no_grad():
                graph, out = capture_output(fn)  # warm-ups compile this variant's kernels
            return graph, out, ints  # ints: the graph reads it, keep it alive
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    t0 = time.perf_counter()
    result = {"device": torch.cuda.get_device_name(), "ctx": args.ctx, "k": K,
              "token_map": 32768, "variants": {n: e for n, e in variants}, "batches": {}}
    names = [n for n, _ in variants]
    for B in batches:
        graphs = {n: build(B, e) for n, e in variants}
        for g, _, _ in graphs.values():
            g.replay()
        torch.cuda.synchronize()
        first = graphs[names[0]][1].clone()
        events = {n: [] for n in names}
        for i in range(args.rounds):
            for n in names if i % 2 == 0 else names[::-1]:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graphs[n][0].replay()
                end.record()
                events[n].append((start, end))
        torch.cuda.synchronize()
        row = {}
        for n in names:
            us = sorted(a.elapsed_time(b) * 1e3 for a, b in events[n])
            row[n] = {"median_us": statistics.median(us), "p10_us": us[len(us) // 10],
                      "p90_us": us[9 * len(us) // 10],
                      "same_drafts": bool(torch.equal(graphs[n][1], first))}
        base = row[names[0]]["median_us"]
        for n in names:
            row[n]["ratio"] = row[n]["median_us"] / base
        result["batches"][str(B)] = row
        print(f"batch {B}: " + " | ".join(
            f"{n} {row[n]['median_us']:.1f} us ({row[n]['ratio']:.3f})"
            + ("" if row[n]["same_drafts"] else " DRAFTS DIFFER") for n in names), flush=True)
        del graphs
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "draft_graph_ab.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / 'draft_graph_ab.json'} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
