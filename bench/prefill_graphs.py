"""Time to first token with prefill CUDA graphs against eager prefill, Llama-3-8B geometry.

    python bench/prefill_graphs.py --out OUT_DIR [--layers 32] [--repeats 5]

The synthetic target of ``bench/gpu_8b.py`` (bf16, weights made on the GPU). For each case
(batch x prompt length) it times the engine's prefill step (prompt in, first token read back:
``speculant.bench._decode_run``'s ``prefill_s``) with prefill graphs (the first call, which
captures the bucket's graph, apart from the median of the later ones) and eagerly (the same
engine with ``CudaGraphRunner.max_prefill = 0``, which sends prefill down the eager path), in
alternation, and checks that both give the same greedy tokens (16 of them). Writes
prefill_graphs.json and prefill_graphs.png (time to first token, eager / graph).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_8b import synthetic_target  # noqa: E402

CASES = ((1, 16), (1, 128), (1, 500), (1, 1000), (1, 2000), (4, 128), (8, 128), (8, 250))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    import torch

    from speculant.bench import _decode_run, random_prompts

    t0 = time.perf_counter()
    llm = synthetic_target(args.layers, 2048 + 64, "speculant-prefill-")
    engine = llm.engine
    graphs = engine.runner.graphs
    if graphs is None:
        raise SystemExit("prefill_graphs.py needs CUDA graphs: a CUDA device, not enforce_eager")
    limit = graphs.max_prefill
    print(f"target loaded after {time.perf_counter() - t0:.0f}s; prefill graph limit {limit}",
          flush=True)
    warm = random_prompts(1, 64, engine.vocab_size, seed=99)
    graphs.max_prefill = 0
    _decode_run(engine, warm, 4)  # compiles the eager kernels outside the timings
    reserved0 = torch.cuda.memory_reserved() / 2**30
    rows = []
    for batch, plen in CASES:
        prompts = random_prompts(batch, plen, engine.vocab_size, seed=plen)
        tokens = {}
        times: dict[str, list[float]] = {"graph": [], "eager": []}
        first_graph = None
        for r in range(args.repeats + 1):
            for mode in ("graph", "eager"):
                graphs.max_prefill = limit if mode == "graph" else 0
                run = _decode_run(engine, prompts, 16)
                if mode == "graph" and r == 0:
                    first_graph = run["prefill_s"]  # includes this bucket's capture
                elif r > 0 or mode == "eager":
                    times[mode].append(run["prefill_s"])
                tokens.setdefault(mode, run["tokens"])
        graphs.max_prefill = limit
        total = batch * plen
        row = {
            "batch": batch,
            "prompt_len": plen,
            "tokens": total,
            "graph_used": total <= limit,
            "ttft_graph_ms": 1e3 * statistics.median(times["graph"]),
            "ttft_eager_ms": 1e3 * statistics.median(times["eager"]),
            "first_graph_call_ms": 1e3 * first_graph,
            "same_tokens": tokens["graph"] == tokens["eager"],
            # the allocator's reserve after this case: the graph pool grows with the largest
            # prefill bucket captured so far
            "memory_reserved_gib": torch.cuda.memory_reserved() / 2**30,
        }
        row["speedup"] = row["ttft_eager_ms"] / row["ttft_graph_ms"]
        rows.append(row)
        print(
            f"b{batch} x {plen:5d} tokens: eager {row['ttft_eager_ms']:7.2f} ms, graph "
            f"{row['ttft_graph_ms']:7.2f} ms ({row['speedup']:.2f}x; first call with its capture "
            f"{row['first_graph_call_ms']:.0f} ms), same tokens {row['same_tokens']}",
            flush=True,
        )
        torch.cuda.empty_cache()
    result = {
        "device": torch.cuda.get_device_name(),
        "layers": args.layers,
        "prefill_graph_limit": limit,
        "repeats": args.repeats,
        "memory_reserved_gib_before": reserved0,
        "rows": rows,
        "wall_s": time.perf_counter() - t0,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefill_graphs.json").write_text(json.dumps(result, indent=1))
    _plot(rows, out / "prefill_graphs.png", result["device"])
    print(f"wrote {out / 'prefill_graphs.json'} in {result['wall_s']:.0f}s", flush=True)
    return 0 if all(r["same_tokens"] for r in rows) else 1


def _plot(rows: list[dict], path: Path, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"b{r['batch']}x{r['prompt_len']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.bar([i - 0.2 for i in x], [r["ttft_eager_ms"] for r in rows], 0.4, label="eager prefill")
    ax.bar([i + 0.2 for i in x], [r["ttft_graph_ms"] for r in rows], 0.4, label="prefill graph")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("time to first token, ms")
    ax.set_title(f"Llama-3-8B geometry, bf16, {device}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
