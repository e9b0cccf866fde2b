"""Run-to-run spread of batch-1 decoding at Llama-3-8B scale: GPU time or host time?

    python bench/run_variance.py --out OUT_DIR [--rounds 8] [--tokens 256] [--layers 32]

``bench/gpu_8b.py`` times each batch-1 cell several times and reports the run of median step
time, because whole runs of the same cell differ by up to ~7% on the lent machines (an H100 run:
oracle a = 0.6, k = 5 runs of 6.17 / 6.21 / 6.36 / 6.57 / 6.63 ms a step). This script tells
where that spread comes from. On the synthetic Llama-3-8B target of ``gpu_8b.py`` it alternates,
``--rounds`` times, a plain greedy run and an oracle run (a = 0.6 and 0.8, k = 5) of ``--tokens``
tokens, and for every verification step records two CUDA events: one queued just before the
target's forward is launched and one just after the verifier's read-back returns. Their distance
is the step's GPU span (launch to tokens on the host); the rest of the step's wall time is host
time during which the GPU waits (bookkeeping, propose, staging, launch).

The host time from the forward's call to the read-back's (``enqueue_ms``: launching the graph
segments and the verifier's kernels; ``enqueue_cpu_ms``: the main thread's CPU time in it, and
the time of each call in it) tells, for a stalled step (GPU span over 1.5x the run's median),
whether the host was still launching the step while the GPU stalled (host-side) or had long
finished (device-side). Per run it reports the mean step wall time, the mean GPU span and the
mean host gap, the SM clock (NVML, where available) at the run's end, and the Python garbage
collector's passes during the run (per generation, and the longest pause). ``--gc-modes
default,freeze,off`` repeats the rounds with the collector as Python sets it, after
``gc.freeze()``, and disabled. ``--head-modes on,off`` alternates, within each round, the
oracle runs with the verification graphs that end with the LM head and the greedy pack (``on``,
the default: the host launches nothing after the forward's segments and verifies on the host)
and without them (``off``: a head-graph row limit of 0 and no greedy pack, so the LM head
and the rejection kernels are launched from the host after the graph, as before the nineteenth
session). Writes run_variance.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_8b import copy_bandwidth, synthetic_target  # noqa: E402


class StepEvents:
    """CUDA events around each verification step: before the target forward, after the
    verifier's read-back."""

    def __init__(self, engine) -> None:
        import speculant.plugins.rejection_sampler as rs

        self.pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.enqueue_ms: list[float] = []  # host: forward called -> read-back called
        self.enqueue_cpu_ms: list[float] = []  # the main thread's CPU time in that window
        self.phases: list[dict[str, float]] = []  # host ms per call inside that window
        self.cur: dict[str, float] = {}
        self.start: torch.cuda.Event | None = None
        self.t0 = self.c0 = 0.0
        self.on = False
        self.old_verify = False  # --head-modes off: score without the greedy pack
        runner, read_back = engine.runner, rs.read_back
        score = runner.score  # every verification step's forward (head graph or not)

        def timed_score(*a, **k):
            if self.old_verify:  # as before head graphs: no greedy pack, the rejection kernels
                k["greedy"] = False
            if self.on:
                self.start = torch.cuda.Event(enable_timing=True)
                self.start.record()
                self.t0 = time.perf_counter()
                self.c0 = time.thread_time()
                self.cur = {}
            return score(*a, **k)

        def timed_read_back(t):
            queued, cpu = time.perf_counter(), time.thread_time()
            out = read_back(t)
            if self.on and self.start is not None:
                self.enqueue_ms.append(1e3 * (queued - self.t0))
                self.enqueue_cpu_ms.append(1e3 * (cpu - self.c0))
                self.phases.append(self.cur)
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self.pairs.append((self.start, end))
                self.start = None
            return out

        runner.score = timed_score
        rs.read_back = timed_read_back
        # the host calls of the enqueue window, each timed (where a stalled step spends it)
        from speculant.engine import cuda_graph

        for owner, attr in [(runner, "logits"), (rs, "process_logits"), (rs, "to_device"),
                            (rs, "uniforms"), (rs, "rejection_sample"), (rs, "token_logprobs"),
                            (rs, "verify_greedy"),
                            (cuda_graph.CudaGraphRunner, "_stage_ring"),
                            (cuda_graph.CudaGraphRunner, "plan")]:
            self._time(owner, attr)
        ev = self

        def timed_replay(graph):
            for i, g in enumerate(graph.graphs):
                t = time.perf_counter()
                g.replay()
                key = f"segment{i}"
                ev.cur[key] = ev.cur.get(key, 0.0) + 1e3 * (time.perf_counter() - t)

        cuda_graph._Graph.replay = timed_replay

    def _time(self, owner, attr: str) -> None:
        fn = getattr(owner, attr)
        ev = self

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                ev.cur[attr] = ev.cur.get(attr, 0.0) + 1e3 * (time.perf_counter() - t)

        setattr(owner, attr, timed)

    def spans_ms(self) -> list[float]:
        torch.cuda.synchronize()
        return [a.elapsed_time(b) for a, b in self.pairs]


class GcPauses:
    """Python garbage-collector passes (generation, ms) while ``on`` (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.passes: list[tuple[int, float]] = []
        self.on = False
        self._t0 = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self.on:
            self.passes.append((info["generation"], 1e3 * (time.perf_counter() - self._t0)))


def sm_clock_mhz() -> int | None:
    try:
        return int(torch.cuda.clock_rate())
    except Exception:  # noqa: BLE001 - NVML missing: no clock
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument(
        "--gc-modes",
        default="default",
        help="comma-separated, run in this order in one process: default (the collector as "
        "Python sets it), freeze (gc.freeze() first: what exists now is never scanned again), "
        "off (gc.disable())",
    )
    ap.add_argument(
        "--head-modes",
        default="on",
        help="comma-separated, alternated within each round for the oracle runs: on "
        "(verification graphs end with the LM head and the greedy pack), off "
        "(head-graph row limit 0: LM head and rejection kernels launched after the graph)",
    )
    args = ap.parse_args()
    modes = [m for m in args.gc_modes.split(",") if m]
    unknown = [m for m in modes if m not in ("default", "freeze", "off")]
    if unknown or not modes:
        ap.error(f"--gc-modes: expected some of default, freeze, off; got {args.gc_modes!r}")
    heads = [m for m in args.head_modes.split(",") if m]
    if not heads or any(m not in ("on", "off") for m in heads):
        ap.error(f"--head-modes: expected some of on, off; got {args.head_modes!r}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0

    from speculant.bench import _decode_run, _set_strategy, random_prompts
    from speculant.engine import cuda_graph

    head_rows = {"on": cuda_graph.HEAD_MAX_ROWS, "off": 0}

    def head_mode(h: str) -> None:  # the target runner's head-graph row limit
        engine.runner.graphs.head_rows = head_rows[h]
        ev.old_verify = h == "off"

    bw = copy_bandwidth()
    llm = synthetic_target(args.layers, args.prompt_len + args.tokens + 64, "speculant-rv-")
    engine = llm.engine
    prompts = random_prompts(1, args.prompt_len, engine.vocab_size, seed=0)
    rec = _decode_run(engine, prompts, args.tokens + 8)["tokens"][0]
    refs = [{"prompt_token_ids": prompts[0], "output_token_ids": rec}]
    specs = {
        "plain": None,
        "oracle a=0.6 k=5": dict(method="oracle", alpha=0.6, num_speculative_tokens=5,
                                 references=refs),
        "oracle a=0.8 k=5": dict(method="oracle", alpha=0.8, num_speculative_tokens=5,
                                 references=refs),
    }
    # (label, strategy, head mode): plain once a round, each oracle once per head mode
    cells = [(name if spec is None or len(heads) == 1 else f"{name} head {h}", name, h)
             for name, spec in specs.items() for h in (heads[:1] if spec is None else heads)]
    ev = StepEvents(engine)
    pauses = GcPauses()
    decoders = {}
    for name, spec in specs.items():  # build and warm each once (graphs, kernels)
        decoders[name] = _set_strategy(engine, spec)
        for h in heads:
            head_mode(h)
            _decode_run(engine, prompts, 32)
    runs = []
    t_start = time.perf_counter()
    for mode in modes:
        if mode == "freeze":
            gc.collect()
            gc.freeze()
        elif mode == "off":
            gc.disable()
        for rnd in range(args.rounds):
            for label, name, h in cells:
                head_mode(h)
                dec = decoders[name]
                engine.spec = dec
                if dec is not None:
                    dec.reset()
                ev.pairs, ev.enqueue_ms, ev.enqueue_cpu_ms, ev.phases = [], [], [], []
                ev.on = True
                pauses.passes, pauses.on = [], True
                r = _decode_run(engine, prompts, args.tokens)
                ev.on = pauses.on = False
                spans = ev.spans_ms()
                wall = [1e3 * t for t in r["step_times"]]
                row = {
                    "gc": mode,
                    "round": rnd,
                    "name": label,
                    "head": h,
                    "steps": r["steps"],
                    "step_ms": 1e3 * r["decode_s"] / max(r["steps"], 1),
                    "median_step_ms": statistics.median(wall),
                    "max_step_ms": max(wall),
                    "steps_over_1.5x_median": sum(w > 1.5 * statistics.median(wall) for w in wall),
                    "gc_passes": [sum(g == gen for g, _ in pauses.passes) for gen in range(3)],
                    "gc_max_ms": max((ms for _, ms in pauses.passes), default=0.0),
                    "gc_ms": sum(ms for _, ms in pauses.passes),
                    "sm_clock_mhz": sm_clock_mhz(),
                }
                if spans:
                    gpu = statistics.mean(spans)
                    med = statistics.median(spans)
                    row.update(gpu_span_ms=gpu, median_gpu_span_ms=med,
                               max_gpu_span_ms=max(spans), host_gap_ms=row["step_ms"] - gpu,
                               median_enqueue_ms=statistics.median(ev.enqueue_ms),
                               median_enqueue_cpu_ms=statistics.median(ev.enqueue_cpu_ms))
                    # stalled steps: is the host still enqueueing the step when it stalls?
                    typical = {k: statistics.median(p.get(k, 0.0) for p in ev.phases)
                               for k in set().union(*ev.phases)}
                    row["typical_phases_ms"] = {k: round(v, 3) for k, v in typical.items()}
                    row["stalls"] = [
                        {"gpu_span_ms": round(sp, 3), "enqueue_ms": round(eq, 3),
                         "enqueue_cpu_ms": round(cpu, 3),
                         "phases_ms": {k: round(v, 3) for k, v in ph.items()
                                       if v > 2 * typical.get(k, 0.0) + 0.5}}
                        for sp, eq, cpu, ph in zip(spans, ev.enqueue_ms, ev.enqueue_cpu_ms,
                                                   ev.phases) if sp > 1.5 * med
                    ]
                runs.append(row)
                print(json.dumps(row), flush=True)
    engine.spec = None
    head_mode("on")
    gc.enable()
    gc.unfreeze()
    summary = {}
    for mode in modes:
        for name, _, _ in cells:
            rows = [r for r in runs if r["name"] == name and r["gc"] == mode]
            s = {"step_ms": [round(r["step_ms"], 4) for r in rows],
                 "max_step_ms": [round(r["max_step_ms"], 2) for r in rows],
                 "gc_max_ms": [round(r["gc_max_ms"], 2) for r in rows]}
            if "gpu_span_ms" in rows[0]:
                s["gpu_span_ms"] = [round(r["gpu_span_ms"], 4) for r in rows]
                s["host_gap_ms"] = [round(r["host_gap_ms"], 4) for r in rows]
                s["median_enqueue_ms"] = [round(r["median_enqueue_ms"], 4) for r in rows]
                s["stalled_steps"] = [len(r["stalls"]) for r in rows]
            summary[f"{name} | gc {mode}"] = s
            print(f"{name} | gc {mode}", json.dumps(s), flush=True)
    doc = {
        "python_threads": [t.name for t in threading.enumerate()],
        "os_threads": len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else None,
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "device": torch.cuda.get_device_name(),
        "copy_bandwidth_Bps": bw,
        "layers": args.layers,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "gc_modes": modes,
        "head_modes": heads,
        "runs": runs,
        "summary": summary,
        "wall_s": time.perf_counter() - t_start,
    }
    (out / "run_variance.json").write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
