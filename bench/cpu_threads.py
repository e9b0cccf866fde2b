"""The C kernels' helper thread on the CPU (``cpu_kernels.set_threads``): one thread against a
helper on a second CPU, for (a) the products alone and (b) plain and speculative decoding of the
demo's prompts, on the embedded SmolLM2-135M-Instruct (fp32).

(a) ``products``: every weight of a SmolLM2-135M geometry (30 layers of qkv 960x576, o 576x576,
    gate/up 3072x576, down 576x1536, then the 49152x576 LM head; random, 0.54 GB, far beyond the
    caches, as in a decode step) multiplied with T = 1..8 rows, the two thread counts
    interleaved, best of ``--repeats``. Two cores stream the one-row pass faster than one, and
    one core does not overlap a multi-row pass's FMAs with its reads; the helper does.
(b) ``engine``: ``speculant demo``'s four prompts, greedy, one at a time: plain decoding, n-gram
    (k = 5) and the shipped EAGLE head (its demo options: k = 4, prompt lookup), each with the
    kernels on one thread and with the helper; configurations interleaved per prompt, fastest
    of ``--repeats`` runs kept; speedups are over plain decoding with the same thread count.
    Outputs are checked equal to plain decoding's.

    python bench/cpu_threads.py [--repeats 3] [--max-tokens 128] [--only products|engine]

Writes bench/results/cpu_threads.json and the figure docs/cpu_threads.png (docs/perf.md, "CPU";
``--out`` holds both when given).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

RESULTS = Path(__file__).resolve().parent / "results"
DOCS = Path(__file__).resolve().parent.parent / "docs"  # the figures
GEOMETRY = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
ROWS = (1, 2, 3, 4, 5, 6, 8)


def bench_products(repeats: int) -> dict:
    from speculant.models import cpu_kernels as ck

    torch.manual_seed(0)
    weights = [(o, ck.block_weight(torch.randn(o, i) * 0.05)) for o, i in GEOMETRY]
    rng = np.random.default_rng(0)
    xs = {T: {i: rng.standard_normal((T, i)).astype(np.float32) for i in (576, 1536)} for T in ROWS}
    best = {t: {T: float("inf") for T in ROWS} for t in (1, 2)}
    for _ in range(repeats):
        for threads in (1, 2):
            ck.set_threads(threads)
            for T in ROWS:
                t0 = time.perf_counter()
                for o, wb in weights:
                    ck.gemm(xs[T][wb.shape[1]], wb, o)
                best[threads][T] = min(best[threads][T], time.perf_counter() - t0)
    nbytes = sum(wb.nbytes for _, wb in weights)
    return {
        "weight_bytes": nbytes,
        "rows": list(ROWS),
        "ms": {str(t): [best[t][T] * 1e3 for T in ROWS] for t in (1, 2)},
        "ratio_to_one_row": {str(t): [best[t][T] / best[t][1] for T in ROWS] for t in (1, 2)},
        "one_row_gb_s": {str(t): nbytes / best[t][1] / 1e9 for t in (1, 2)},
    }


def bench_engine(repeats: int, max_tokens: int) -> dict:
    from speculant import LLM, SamplingParams
    from speculant.demo import DEMO_PROMPTS, _method_config
    from speculant.models import cpu_kernels as ck

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    base = LLM()
    labeled = [("none", None)] + [_method_config(m, None, base, Path("."))
                                  for m in ("ngram", "eagle=smollm2-eagle")]
    llms = [base] + [LLM(speculative_config=spec) for _, spec in labeled[1:]]
    configs = [(label, llm, t) for t in (1, 2) for (label, _), llm in zip(labeled, llms)]
    for _, llm, _ in configs[: len(llms)]:
        llm.chat([[{"role": "user", "content": "Hi"}]], SamplingParams(max_tokens=8), use_tqdm=False)
    best = {(label, t): [float("inf")] * len(DEMO_PROMPTS) for label, _, t in configs}
    ntok, same, fwd = [0] * len(DEMO_PROMPTS), {}, {}
    for r in range(repeats):
        for i, (_, prompt) in enumerate(DEMO_PROMPTS):
            order = configs[r % len(configs):] + configs[: r % len(configs)]
            for label, llm, t in order:
                ck.set_threads(t)
                spec = llm.engine.spec
                before = (spec.total.num_spec_steps + spec.total.num_plain_steps,
                          spec.total.num_emitted_tokens) if spec else None
                t0 = time.perf_counter()
                out = llm.chat([[{"role": "user", "content": prompt}]], params, use_tqdm=False)
                dt = time.perf_counter() - t0
                ids = out[0].outputs[0].token_ids
                best[label, t][i] = min(best[label, t][i], dt)
                same.setdefault((label, t), []).append(ids)
                if spec and r == 0:
                    steps = spec.total.num_spec_steps + spec.total.num_plain_steps - before[0]
                    fwd[label, t, i] = (spec.total.num_emitted_tokens - before[1]) / max(steps, 1)
                ntok[i] = len(ids)
    refs = same["none", 1][: len(DEMO_PROMPTS)]
    identical = all(ids == refs[n % len(DEMO_PROMPTS)] for runs in same.values()
                    for n, ids in enumerate(runs))
    cats = [c for c, _ in DEMO_PROMPTS]
    res = {"categories": cats, "tokens": ntok, "identical_to_plain": identical, "methods": {}}
    for label, _ in labeled:
        for t in (1, 2):
            s = best[label, t]
            plain = best["none", t]
            res["methods"][f"{label}@{t}"] = {
                "threads": t,
                "seconds": s,
                "tokens_per_s": sum(ntok) / sum(s),
                "speedup": [p / x for p, x in zip(plain, s)],
                "speedup_overall": sum(plain) / sum(s),
                "tokens_per_forward": [fwd.get((label, t, i)) for i in range(len(cats))],
            }
    ck.set_threads(2)
    return res


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    p = res.get("products")
    if p:
        ax = axes[0]
        for t, label in (("1", "one thread"), ("2", "with the helper")):
            ax.plot(p["rows"], p["ms"][t], "o-", label=label)
        ax.set_xlabel("rows T")
        ax.set_ylabel("ms for the whole model's products (best)")
        ax.set_title(f"SmolLM2-135M products, {p['weight_bytes'] / 1e9:.2f} GB of fp32 weights")
        ax.set_ylim(bottom=0)
        ax.legend()
    e = res.get("engine")
    if e:
        ax = axes[1]
        cats = e["categories"]
        names = [m for m in e["methods"] if not m.startswith("none")]
        w = 0.8 / len(names)
        for j, m in enumerate(names):
            ax.bar([i + (j - (len(names) - 1) / 2) * w for i in range(len(cats))],
                   e["methods"][m]["speedup"], w, label=m.replace("@1", ", one thread")
                   .replace("@2", ", helper"))
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(len(cats)), cats)
        ax.set_ylabel("speedup over plain decoding, same threads")
        ax.set_title("speculant demo prompts, end to end")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--only", choices=["products", "engine"], default=None)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    from speculant.models import cpu_kernels as ck

    if not ck.available() or (os.cpu_count() or 1) < 2:
        raise SystemExit("needs the C kernels and 2+ CPUs")
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"model": "SmolLM2-135M-Instruct (embedded GGUF, dequantized fp32)",
           "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
           "torch": torch.__version__, "torch_threads": 1,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "loadavg_1_5_15_at_start": os.getloadavg()}
    if args.only in (None, "products"):
        print("(a) products, one thread vs the helper", flush=True)
        res["products"] = bench_products(args.repeats)
        print(json.dumps(res["products"]["ratio_to_one_row"]), flush=True)
    if args.only in (None, "engine"):
        print("(b) the demo's prompts, one thread vs the helper", flush=True)
        res["engine"] = bench_engine(args.repeats, args.max_tokens)
        for m, v in res["engine"]["methods"].items():
            print(f"{m:28s} {v['tokens_per_s']:6.1f} tok/s  overall {v['speedup_overall']:.2f}x  "
                  + " ".join(f"{x:.2f}x" for x in v["speedup"]), flush=True)
        print("identical to plain:", res["engine"]["identical_to_plain"])
    res["loadavg_1_5_15_at_end"] = os.getloadavg()
    (out / "cpu_threads.json").write_text(json.dumps(res, indent=1))
    fig = (DOCS if out == RESULTS else out) / "cpu_threads.png"
    plot(res, fig)
    print(f"wrote {out / 'cpu_threads.json'} and {fig}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
