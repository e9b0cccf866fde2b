"""Host timeline of speculative steps at Llama-3-8B scale: where the GPU waits for the host.

    python bench/spec_timeline.py --out OUT_DIR [--layers 32] [--tokens 128] [--trees 16:2,16:8]

A verification step cannot be launched before the previous step's accepted tokens are known, so
everything the host does between reading them back and launching the next forward leaves the GPU
idle. This script builds the same synthetic Llama-3-8B target as ``bench/gpu_8b.py``, times plain
batch-1 decoding and the oracle (a = 0.8, k = 5 and a = 0.9, k = 3) exactly as ``speculant
bench`` does, then reruns the oracle with timestamps (``time.perf_counter_ns``) at the entry and
exit of each phase of the step (engine step, propose, staging, graph launch, verify) and reports
the median time between consecutive marks. Writes spec_timeline.json.

``--trees N:W,...``: token trees (issue 36) against chains of as many nodes, each with every
level accepted (oracle, alpha 1; W siblings a level, the true token's rank drawn uniformly), one
timeline each (``tree_timelines``, with the tree step's own marks: ``check``, ``compact``): the
median step of each and the host work between a step's read-back and the next launch that only
the tree steps do.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_8b import copy_bandwidth, synthetic_target  # noqa: E402


class Timeline:
    """Named timestamps, one list per engine step."""

    def __init__(self) -> None:
        self.steps: list[list[tuple[str, int]]] = []
        self.on = False

    def mark(self, name: str) -> None:
        if self.on and self.steps:
            self.steps[-1].append((name, time.perf_counter_ns()))

    def wrap(self, owner, attr: str, name: str) -> None:
        fn = getattr(owner, attr)
        tl = self

        @functools.wraps(fn)  # keeps pluggy's hookimpl marker
        def wrapped(*args, **kwargs):
            tl.mark(name + ">")
            try:
                return fn(*args, **kwargs)
            finally:
                tl.mark(name + "<")

        setattr(owner, attr, wrapped)

    def intervals(self) -> list[dict]:
        """Median time from each mark to the next, over steps with the most common mark sequence
        (the verification steps), the last mark of a step wrapping around to the next step's
        first."""
        seqs = [tuple(n for n, _ in s) for s in self.steps if s]
        common = max(set(seqs), key=seqs.count)
        rows: dict[str, list[float]] = {}
        kept = [s for s in self.steps if tuple(n for n, _ in s) == common]
        for i, s in enumerate(kept):
            nxt = kept[i + 1] if i + 1 < len(kept) else None
            for j, (name, t) in enumerate(s):
                if j + 1 < len(s):
                    to, t2 = s[j + 1]
                elif nxt is not None:
                    to, t2 = "next " + nxt[0][0], nxt[0][1]
                else:
                    continue
                rows.setdefault(f"{name} -> {to}", []).append((t2 - t) / 1e3)
        return [
            {"interval": k, "median_us": statistics.median(v), "n": len(v)} for k, v in rows.items()
        ] + [{"interval": "steps with this sequence", "median_us": None, "n": len(kept)}]


def instrument(tl: Timeline) -> None:
    from speculant.engine import cuda_graph, llm_engine, model_runner, spec_decode
    from speculant.plugins import rejection_sampler

    orig_step = llm_engine.LLMEngine.step

    def step(self):
        if tl.on:
            tl.steps.append([])
        tl.mark("step>")
        try:
            return orig_step(self)
        finally:
            tl.mark("step<")

    llm_engine.LLMEngine.step = step
    tl.wrap(spec_decode.SpecDecoder, "_propose", "propose")
    tl.wrap(spec_decode.SpecDecoder, "_apply", "apply")
    tl.wrap(rejection_sampler.RejectionSampler, "verify", "verify")
    tl.wrap(spec_decode.TargetScorer, "score", "score")
    tl.wrap(model_runner.ModelRunner, "score", "runner_score")
    tl.wrap(model_runner.ModelRunner, "forward", "forward")
    tl.wrap(cuda_graph.CudaGraphRunner, "run", "run")
    tl.wrap(cuda_graph.CudaGraphRunner, "run_head", "run_head")
    tl.wrap(cuda_graph.CudaGraphRunner, "_stage", "stage")
    tl.wrap(cuda_graph.CudaGraphRunner, "_stage_ring", "ring")
    fill = cuda_graph.CudaGraphRunner._fill_small
    cuda_graph.CudaGraphRunner._fill_small = lambda *a, **k: (fill(*a, **k), tl.mark("filled"))[0]

    def replay(self):
        tl.mark("launch>")
        self.graphs[0].replay()
        tl.mark("seg0<")
        for g in self.graphs[1:]:
            g.replay()
        tl.mark("launch<")

    cuda_graph._Graph.replay = replay


def tree_timelines(engine, prompt: list[int], shapes: list[tuple[int, int]], tokens: int,
                   tl: Timeline, warmup: int = 32) -> dict:
    """For each (nodes N, width W) of ``shapes``: the oracle's chain of N and its tree N:W at
    alpha 1 over the same recorded continuation, ``tokens`` tokens each after ``warmup``: median
    step (ms) and the timeline's intervals. ``instrument(tl)`` must have run; this adds the tree
    marks. Works on any device (the CPU smoke test)."""
    from gpu_tree import default_rank_probs

    from speculant.bench import _decode_run, _set_strategy
    from speculant.engine import spec_decode

    for attr, name in (("_compact", "compact"), ("_check", "check")):
        if not hasattr(getattr(spec_decode.SpecDecoder, attr), "__wrapped__"):
            tl.wrap(spec_decode.SpecDecoder, attr, name)
    _set_strategy(engine, None)
    longest = max(n for n, _ in shapes) + 1
    rec = _decode_run(engine, [prompt], warmup + tokens + 2 * longest)["tokens"][0]
    refs = [{"prompt_token_ids": prompt, "output_token_ids": rec}]
    out: dict = {}
    for n, w in shapes:
        for name, extra in ((f"chain k={n}", {}),
                            (f"tree {n}:{w}", {"tree_width": w,
                                               "rank_probs": default_rank_probs(1.0, w)})):
            if name in out:
                continue
            _set_strategy(engine, dict(method="oracle", alpha=1.0, num_speculative_tokens=n,
                                       references=refs, **extra))
            _decode_run(engine, [prompt], warmup)
            tl.steps, tl.on = [], True
            r = _decode_run(engine, [prompt], tokens)
            tl.on = False
            times = sorted(r["step_times"])
            out[name] = {"median_step_ms": 1e3 * times[len(times) // 2] if times else None,
                         "steps": r["steps"], "intervals": tl.intervals()}
            print(f"\n== {name}: {r['steps']} steps, median {out[name]['median_step_ms']:.3f} ms")
            for row in out[name]["intervals"]:
                us = row["median_us"]
                print(f"  {row['interval']:<40} {'' if us is None else f'{us:9.1f} us'}")
    _set_strategy(engine, None)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--trees", default="", help="N:W,...: also token trees against chains of N "
                    "(see the module doc), e.g. 16:2,16:8")
    args = ap.parse_args()
    from gpu_tree import parse_shapes

    trees = parse_shapes(args.trees)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from speculant.bench import _decode_run, random_prompts, run_bench, table

    bw = copy_bandwidth()
    longest = max((n for n, _ in trees), default=0) + 1
    llm = synthetic_target(args.layers, args.prompt_len + 2 * args.tokens + 4 * longest + 64,
                           "speculant-tl-")
    engine = llm.engine
    prompts = random_prompts(1, args.prompt_len, engine.vocab_size, seed=0)
    specs = [
        dict(method="oracle", alpha=0.8, num_speculative_tokens=5),
        dict(method="oracle", alpha=0.9, num_speculative_tokens=3),
    ]
    result = run_bench(engine, prompts, specs, args.tokens, [1], warmup_tokens=16)
    print(table(result), flush=True)

    tl = Timeline()
    instrument(tl)
    from speculant.bench import _set_strategy

    rec = _decode_run(engine, prompts, args.tokens + 8)["tokens"][0]
    timelines = {}
    for spec in specs:
        refs = [{"prompt_token_ids": prompts[0], "output_token_ids": rec}]
        _set_strategy(engine, dict(spec, references=refs))
        _decode_run(engine, prompts, 16)  # warm-up
        tl.steps, tl.on = [], True
        t0 = time.perf_counter()
        r = _decode_run(engine, prompts, args.tokens)
        wall = time.perf_counter() - t0
        tl.on = False
        name = f"oracle a={spec['alpha']} k={spec['num_speculative_tokens']}"
        timelines[name] = {
            "intervals": tl.intervals(),
            "steps": r["steps"],
            "step_ms": 1e3 * r["decode_s"] / max(r["steps"], 1),
            "wall_s": wall,
        }
        print(
            f"\n== {name}: {r['steps']} steps, {timelines[name]['step_ms']:.3f} ms per step "
            "(instrumented)"
        )
        for row in timelines[name]["intervals"]:
            us = row["median_us"]
            print(f"  {row['interval']:<40} {'' if us is None else f'{us:9.1f} us'}  n={row['n']}")
    _set_strategy(engine, None)
    if trees:
        timelines["trees"] = tree_timelines(engine, prompts[0], trees, args.tokens, tl)
    doc = {
        "copy_bandwidth_Bps": bw,
        "device": torch.cuda.get_device_name(),
        "bench": result,
        "timelines": timelines,
    }
    (out / "spec_timeline.json").write_text(json.dumps(doc, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
