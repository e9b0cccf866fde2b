"""Start-up CUDA-graph capture against capture on first use, Llama-3-8B geometry.

    python bench/graph_capture.py --out OUT_DIR --mode startup|lazy [--layers 32]
        [--strategies oracle,eagle3,draft]

The synthetic target of ``bench/gpu_8b.py`` (bf16, weights made on the GPU), plain decoding and
then each of ``--strategies``: the oracle (a = 0.8, k = 4, replaying the plain runs' tokens:
verification steps), an EAGLE-3 head and a Llama-3.2-1B-geometry draft model (k = 3; synthetic
checkpoints as in gpu_8b.py: their own graphs, the ``capture_graphs`` hook, come on top of the
target's verification graphs), ``cuda_graph_capture`` = ``--mode`` (a swapped-in strategy is
captured by ``engine.capture_graphs()`` in start-up mode). It times building the engine (start-up capture included),
then a sequence of requests that each meet step shapes for the first time (batch 1, 3 and 8,
128-token prompts, 32 greedy tokens), each run twice: the first run's wall time minus the second's is what
capturing on first use costs that request. Run each mode in its own process, after one warm-up
process (Triton's on-disk kernel cache then serves both alike). Writes graph_capture_<mode>.json;
``--plot A.json B.json --out DIR`` draws graph_capture.png from the two.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

CASES = ((1, 128), (3, 128), (8, 128))
TOKENS = 32


def run(args) -> dict:
    import tempfile

    import torch
    from gpu_8b import LLAMA32_1B, eagle3_checkpoint, synthetic_target, write_config

    from speculant.bench import _decode_run, _set_strategy, random_prompts

    t0 = time.perf_counter()
    llm = synthetic_target(args.layers, 512, "speculant-capture-", cuda_graph_capture=args.mode)
    torch.cuda.synchronize()
    engine = llm.engine
    result = {"mode": args.mode, "device": torch.cuda.get_device_name(), "layers": args.layers,
              "engine_s": time.perf_counter() - t0,
              "graphs_at_start": len(engine.runner.graphs.graphs), "rows": []}
    print(f"engine up in {result['engine_s']:.1f}s with {result['graphs_at_start']} graphs",
          flush=True)
    refs, recorded = [], {}
    tmp = Path(tempfile.mkdtemp(prefix="speculant-capture-heads-"))
    specs = {
        "oracle a=0.8 k=4": lambda: {"method": "oracle", "alpha": 0.8,
                                     "num_speculative_tokens": 4, "references": refs},
        "eagle3 k=3": lambda: {"method": "eagle3", "num_speculative_tokens": 3,
                               "model": str(eagle3_checkpoint(tmp / "eagle3"))},
        "draft 1B k=3": lambda: {"method": "draft_model", "num_speculative_tokens": 3,
                                 "model": str(write_config(tmp / "draft-1b", LLAMA32_1B, 1)),
                                 "kv_cache_memory": 2 << 30},
    }
    wanted = {"oracle": "oracle a=0.8 k=4", "eagle3": "eagle3 k=3", "draft": "draft 1B k=3"}
    for name in ["plain"] + [wanted[w] for w in args.strategies.split(",") if w]:
        t = time.perf_counter()
        if name != "plain":  # the oracle replays the plain runs' greedy tokens
            _set_strategy(engine, specs[name]())
            if args.mode == "startup":
                engine.capture_graphs()  # a strategy swapped in: its own graphs and shapes
        setup_s = time.perf_counter() - t
        strat = engine.spec.strategy if engine.spec else None

        def own_graphs(strat=strat) -> int:
            """The strategy's graphs: its GraphCache's and a draft model's own runner's."""
            caches = [getattr(strat, "graphs", None), getattr(getattr(strat, "runner", None),
                                                              "graphs", None)]
            return sum(len(c.graphs) for c in caches if c is not None)

        for batch, plen in CASES:
            prompts = random_prompts(batch, plen, engine.vocab_size, seed=batch)
            n0, s0 = len(engine.runner.graphs.graphs), own_graphs()
            spec0 = engine.spec.total.num_spec_steps if engine.spec else 0
            runs = []
            for _ in range(2):
                t = time.perf_counter()
                out = _decode_run(engine, prompts, TOKENS)
                runs.append((time.perf_counter() - t, out["prefill_s"], out["tokens"]))
            if name == "plain":
                recorded[batch] = runs[0][2]
                refs += [{"prompt_token_ids": p, "output_token_ids": list(o)}
                         for p, o in zip(prompts, runs[0][2])]
            row = {"strategy": name, "batch": batch, "prompt": plen, "tokens": TOKENS,
                   "first_s": runs[0][0], "repeat_s": runs[1][0],
                   "first_ttft_s": runs[0][1], "repeat_ttft_s": runs[1][1],
                   "graphs_captured": len(engine.runner.graphs.graphs) - n0,
                   "strategy_graphs_captured": own_graphs() - s0,
                   "strategy_graphs": own_graphs(),
                   "same_tokens": runs[0][2] == runs[1][2] == recorded[batch],
                   "strategy_setup_s": setup_s,
                   "verification_steps": (engine.spec.total.num_spec_steps - spec0
                                          if engine.spec else 0)}
            result["rows"].append(row)
            print(f"{name:17s} b{batch} first {row['first_s'] * 1e3:8.1f} ms repeat "
                  f"{row['repeat_s'] * 1e3:8.1f} ms (ttft {row['first_ttft_s'] * 1e3:7.1f} / "
                  f"{row['repeat_ttft_s'] * 1e3:6.1f}) new graphs {row['graphs_captured']} + "
                  f"{row['strategy_graphs_captured']} of the strategy (setup {setup_s:.2f} s), "
                  f"{row['verification_steps']} verification steps, same tokens "
                  f"{row['same_tokens']}", flush=True)
            setup_s = 0.0
    return result


def plot(paths: list[str], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [json.loads(Path(p).read_text()) for p in paths]
    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [f"{r['strategy']} b{r['batch']}" for r in runs[0]["rows"]]
    width = 0.8 / len(runs)
    for i, res in enumerate(runs):
        extra = [1e3 * (r["first_s"] - r["repeat_s"]) for r in res["rows"]]
        xs = [j + i * width for j in range(len(extra))]
        ax.bar(xs, extra, width, label=f"{res['mode']} (engine up in {res['engine_s']:.0f} s)")
    ax.set_xticks([j + width * (len(runs) - 1) / 2 for j in range(len(labels))], labels)
    ax.set_ylabel("first request minus repeat (ms)")
    ax.set_title(f"CUDA-graph capture cost per request, {runs[0]['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "graph_capture.png", dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--mode", choices=("startup", "lazy"), default="startup")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--strategies", default="oracle",
                    help="after plain decoding, comma list of oracle, eagle3, draft")
    ap.add_argument("--plot", nargs=2, metavar="JSON", help="plot two runs' JSON and stop")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.plot:
        plot(args.plot, out)
        return 0
    result = run(args)
    path = out / f"graph_capture_{args.mode}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
