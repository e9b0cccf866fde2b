"""Engine A/B of paged-attention launch variants at Llama-3-8B scale, alternated in one process.

    python bench/attention_engine_ab.py --out OUT_DIR [--prompt-len 128] [--verify]

Kernel timings of attention calls back to back (``bench_kernels.py --steady-sweep``) miss what
a variant does to its neighbours inside a decode graph under programmatic dependent launch (the
GEMV after attention launches early and shares the multiprocessors). This script builds the
synthetic target of ``bench/gpu_8b.py``, overrides ``choose_launch_config`` for decode tiles
(or, with ``--verify``, for the verification tiles of up to 16 query tokens) with each variant
of ``VARIANTS`` in turn, recaptures the engine's CUDA graphs, and times 256-token greedy runs:
plain batch 1 and 8 and the oracle (a = 0.8, k = 5) at batch 1, four rounds in rotation.
Writes attention_engine_ab_ctx<prompt-len>[_verify].json (every run's mean step time, and
whether the tokens equal the default's) and prints the medians.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_8b import synthetic_target  # noqa: E402

VARIANTS = {
    "default": None,
    "bt_ahead": dict(bt_ahead=True),  # 2 stages: one K/V buffer, as the default
    "bt_ahead_bn32_s3": dict(bt_ahead=True, block_n=32, num_stages=3),  # 2 x 16 KB K/V buffers
    "bt_ahead_bn64_s3": dict(bt_ahead=True, block_n=64, num_stages=3),  # 2 x 32 KB
    "bn64_s3": dict(block_n=64, num_stages=3),  # one buffer (the index load takes a stage)
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--verify", action="store_true", help="vary the verification tiles instead")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pa = importlib.import_module("speculant.kernels.paged_attention")
    orig = pa.choose_launch_config
    cur: dict = {"ov": None}

    def patched(**kw):
        cfg = orig(**kw)
        multi = cfg["block_q"] > 1
        if cur["ov"] and multi == args.verify and (not multi or kw["max_query_len"] <= 16):
            cfg.update(cur["ov"])
        return cfg

    pa.choose_launch_config = patched
    from speculant.bench import _decode_run, _set_strategy, random_prompts

    llm = synthetic_target(32, args.prompt_len + 256 + 64, "speculant-attn-ab-",
                           cuda_graph_capture="lazy")
    engine = llm.engine
    prompts = random_prompts(8, args.prompt_len, engine.vocab_size, seed=0)
    _set_strategy(engine, None)
    rec = _decode_run(engine, prompts[:1], 256 + 8)["tokens"][0]
    refs = [{"prompt_token_ids": prompts[0], "output_token_ids": rec}]
    spec = dict(method="oracle", alpha=0.8, num_speculative_tokens=5, references=refs)

    def timed(bs: int) -> dict:
        _decode_run(engine, prompts[:bs], 16)  # captures this variant's graphs
        r = _decode_run(engine, prompts[:bs], 256)
        return dict(step_ms=1e3 * r["decode_s"] / r["steps"], steps=r["steps"],
                    same=r["tokens"][0] == rec[:256])

    rows = []
    for rnd in range(args.rounds):
        for name, ov in VARIANTS.items():
            cur["ov"] = ov
            engine.runner.graphs.graphs.clear()  # recaptured with this variant
            engine.runner.graphs.pool = None
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            _set_strategy(engine, None)
            for bs in () if args.verify else (1, 8):
                rows.append(dict(round=rnd, variant=name, run=f"plain b{bs}", **timed(bs)))
            _set_strategy(engine, spec)
            rows.append(dict(round=rnd, variant=name, run="oracle a=0.8 k=5 b1", **timed(1)))
            _set_strategy(engine, None)
            print(rows[-1], flush=True)
    suffix = "_verify" if args.verify else ""
    (out / f"attention_engine_ab_ctx{args.prompt_len}{suffix}.json").write_text(
        json.dumps(rows, indent=1))
    runs: dict = {}
    for r in rows:
        runs.setdefault((r["run"], r["variant"]), []).append(r["step_ms"])
    for (run, v), xs in sorted(runs.items()):
        print(f"{run:<22} {v:<18} " + " ".join(f"{x:.4f}" for x in xs)
              + f"   median {statistics.median(xs):.4f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
