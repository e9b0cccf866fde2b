"""``speculant demo``: plain vs speculative decoding on the embedded default model.

How it times (the same work for both sides, so the comparison stays honest on a busy machine):

* every engine is loaded and warmed up before any timing;
* each prompt is generated ``repeats`` times by each configuration (plain decoding and every
  method), the configurations interleaved and their order rotated from one repeat to the next, so
  a neighbour's burst of CPU use lands on both sides alike;
* a configuration's time for a prompt is its fastest run (the run least disturbed by other
  processes; greedy runs of one prompt do the same work every time, and every run's output is
  checked to be the same as plain decoding's);
* a method whose fastest run of a category is still slower than plain decoding's gets that
  category re-timed, both sides again interleaved, ``retime`` more repeats at most; what is
  reported is then the best of all repeats for both sides, and a category still slower is
  flagged as such, never hidden;
* every run is timed by the wall clock and by the CPU time the process used. The figures are
  wall-clock ones, unless the engine runs one thread (torch's and the C kernels') and the
  process got less than ``STARVED`` of a CPU over the runs (more CPU-bound processes than cores:
  a run's wall time is then mostly waiting for a core, in bursts that no number of repeats
  evens out); then they are CPU times,
  the same work on both sides and what it takes on a free core, and the output says so and
  gives the wall-clock figures too.

On the CPU the engine runs with the thread count ``EngineConfig.cpu_threads`` chooses (1 unless
the user set one, ``engine/cpu_threads.py``): with torch's default of one thread per core, a
neighbour process on a 2-core machine made plain decoding ~2x slower and n-gram speculation come
out at 0.72-0.96x of it. The C kernels' products take a helper thread on a second CPU where there
is one, for plain decoding as for speculation (``cpu_kernels.set_threads``).
"""

from __future__ import annotations

import copy
import gc
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

CODE = '''def moving_average(values, window):
    result = []
    for i in range(len(values)):
        start = max(0, i - window + 1)
        chunk = values[start:i + 1]
        result.append(sum(chunk) / len(chunk))
    return result
'''

PASSAGE = (
    "The Rhine is a river that begins in the Swiss Alps, flows along the German border with "
    "France, and reaches the North Sea in the Netherlands. It is one of the most important "
    "waterways in Europe: barges carry coal, grain and containers between Basel, Cologne and "
    "Rotterdam, and the river has been a trade route since Roman times."
)

DEMO_PROMPTS = [
    ("code edit", f"Rename the function moving_average to rolling_mean and return the code:\n\n{CODE}"),
    ("rewrite", f"Repeat this paragraph exactly, word for word:\n\n{PASSAGE}"),
    ("summarize", f"Summarize this paragraph in two sentences:\n\n{PASSAGE}"),
    ("qa", f"{PASSAGE}\n\nWhere does the Rhine begin and where does it end?"),
]


WALL, CPU = 0, 1  # the two clocks of a run
STARVED = 0.8  # CPU time / wall time below which a 1-thread engine was mostly waiting for a core


@dataclass
class Timings:
    """(wall, CPU) seconds of every timed run of one configuration, per prompt."""

    runs: list[list[tuple[float, float]]]
    outputs: list = field(default_factory=list)  # the last RequestOutput of each prompt

    def best(self, clock: int = WALL) -> list[float]:
        return [min(r[clock] for r in runs) for runs in self.runs]


def cpu_share(timings: list[Timings]) -> float:
    """CPU time / wall time over every run: ~1 for a 1-thread engine that had a core to itself."""
    wall = sum(r[WALL] for t in timings for runs in t.runs for r in runs)
    cpu = sum(r[CPU] for t in timings for runs in t.runs for r in runs)
    return cpu / wall if wall > 0 else 1.0


def speedups(plain: list[float], spec: list[float]) -> tuple[list[float], float]:
    """Per-prompt speedups (plain time / speculative time) and the overall one (total plain time /
    total speculative time: the same tokens on both sides, as greedy outputs are equal)."""
    per = [p / s for p, s in zip(plain, spec)]
    return per, sum(plain) / sum(spec)


def slower(names: list[str], per: list[float], overall: float) -> list[str]:
    """What came out slower than plain decoding: "category (0.97x)" items, "overall" included."""
    out = [f"{n} ({x:.2f}x)" for n, x in zip(names, per) if x < 1.0]
    if overall < 1.0:
        out.append(f"overall ({overall:.2f}x)")
    return out


def _run(llm, prompt: str, params):
    gc.collect()  # not inside the timed region
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.chat([[{"role": "user", "content": prompt}]], params, use_tqdm=False)
    return outs[0], (time.perf_counter() - t0, time.process_time() - c0)


def _time_round(configs: list, prompts: list[str], which: list[int], params, rnd: int,
                timings: list[Timings]) -> None:
    """One repeat of the prompts ``which`` by every configuration, interleaved per prompt, the
    configurations' order rotated by ``rnd``."""
    n = len(configs)
    for i in which:
        for j in range(n):
            c = (j + rnd) % n
            out, dt = _run(configs[c], prompts[i], params)
            timings[c].runs[i].append(dt)
            timings[c].outputs[i] = out


def untrained_medusa_head(folder: Path, hidden: int, vocab: int, heads: int, seed: int = 0) -> Path:
    """Random-weight Medusa-1 heads in FasterDecoding's layout (config.json +
    medusa_lm_head.safetensors, float16), shaped for a target of this hidden size and vocabulary:
    what the demo runs ``medusa`` with when no trained head is given. Untrained: they exercise the
    strategy at the target's real size, and their drafts are almost never accepted."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(heads):
        tensors[f"{i}.0.linear.weight"] = (torch.randn(hidden, hidden, generator=g) * 0.02).half()
        tensors[f"{i}.0.linear.bias"] = torch.zeros(hidden, dtype=torch.float16)
        tensors[f"{i}.1.weight"] = (torch.randn(vocab, hidden, generator=g) / hidden**0.5).half()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"medusa_num_heads": heads,
                                                    "medusa_num_layers": 1}))
    save_file(tensors, str(folder / "medusa_lm_head.safetensors"))
    return folder


DEFAULT_K = 5  # num_speculative_tokens of a method without its own (n-gram, a checkpoint path)


def _method_config(method: str, k: int | None, base, scratch: Path) -> tuple[str, dict]:
    """(label, speculative_config) of one ``--methods`` entry, ``name`` or ``name=CHECKPOINT``.
    ``k`` None: a shipped head's own ``num_speculative_tokens`` (the draft steps it was trained
    for), else ``DEFAULT_K``; a shipped head also gets its ``prompt_lookup_min`` and ``confidence_stop``
    (``ShippedHead.demo_options``). ``medusa`` without a checkpoint runs untrained heads built here for
    the target (label ``medusa*``)."""
    from speculant.spec_registry.shipped import SHIPPED

    name, _, checkpoint = method.partition("=")
    config = {"method": name, "num_speculative_tokens": DEFAULT_K}
    if checkpoint in SHIPPED:  # its draft steps and prompt lookup
        config.update(SHIPPED[checkpoint].demo_options)
    if k is not None:
        config["num_speculative_tokens"] = k
    if checkpoint:  # a shipped head is labelled by its name
        return checkpoint if checkpoint in SHIPPED else name, {**config, "model": checkpoint}
    if name == "medusa":
        from speculant.spec_registry import get_strategy

        get_strategy(name)  # not installed: say so before writing the heads
        head = untrained_medusa_head(scratch / "medusa", base.engine.hf_config.hidden_size,
                                     base.engine.vocab_size, k)
        return "medusa*", {**config, "model": str(head)}
    return name, config


def default_methods(model: str | None) -> list[str]:
    """What the demo compares with plain decoding when ``--methods`` is not given: n-gram, and
    every shipped head trained for ``model`` that is in the repository (spec_registry/shipped.py),
    as ``method=name``."""
    from speculant.models.loader import DEFAULT_MODEL_ALIASES
    from speculant.spec_registry.shipped import available_heads

    default = model is None or str(model).lower() in DEFAULT_MODEL_ALIASES
    return ["ngram"] + [f"{h.method}={h.name}" for h in available_heads()
                        if (h.target == "default" and default) or h.target == str(model)]


def run_demo(model: str | None = None, max_tokens: int = 128, k: int | None = None,
             methods: list[str] | None = None, repeats: int = 3, retime: int = 3) -> int:
    from speculant import LLM, SamplingParams

    methods = methods or default_methods(model)
    repeats = max(1, repeats)
    names = [c for c, _ in DEMO_PROMPTS]
    prompts = [p for _, p in DEMO_PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    base = LLM(model=model)
    threads = base.engine.cpu_threads
    where = str(base.engine.device)
    if threads:
        helper = (getattr(base.engine, "cpu_kernel_threads", None) or 1) > 1
        where = (f"CPU, {threads} thread{'s' if threads != 1 else ''}"
                 + (", the C kernels' products on 2" if helper else ""))
        threads = max(threads, 2) if helper else threads
    print(f"speculant demo: {len(prompts)} prompts, greedy, max_tokens={max_tokens}, one at a time "
          f"({where}); each prompt {repeats}x per configuration, interleaved, fastest run kept")
    configs = [base]
    with tempfile.TemporaryDirectory(prefix="speculant-demo-") as scratch:
        labeled = [_method_config(m, k, base, Path(scratch)) for m in methods]
        for _, spec in labeled:
            configs.append(LLM(model=model, speculative_config=spec))
    methods = [label for label, _ in labeled]
    print("k (num_speculative_tokens): " + ", ".join(
        f"{label} {spec['num_speculative_tokens']}" for label, spec in labeled))
    for label, spec in labeled:
        if spec.get("prompt_lookup_min"):
            print(f"{label}: with prompt lookup (prompt_lookup_min {spec['prompt_lookup_min']}): "
                  "where the reply's last tokens occurred earlier, their continuation is drafted "
                  "instead of the head's")
        if spec.get("confidence_stop"):
            print(f"{label}: with a confidence stop ({spec['confidence_stop']}): a draft chain ends "
                  "where the product of the head's probabilities for its drafts falls under it")
    if "medusa*" in methods:
        print("medusa*: untrained Medusa heads, random weights built for this model (no trained "
              "head given; --methods medusa=PATH runs one): their drafts are almost never "
              "accepted")
    warm = SamplingParams(temperature=0.0, max_tokens=8)
    for llm in configs:
        _run(llm, prompts[0], warm)
        if llm.engine.spec is not None:
            llm.engine.spec.total.__init__()
    timings = [Timings([[] for _ in prompts], [None] * len(prompts)) for _ in configs]
    everything = list(range(len(prompts)))
    same = [True] * len(configs)
    ref = [None] * len(prompts)
    metrics = [None] * len(configs)
    for rnd in range(repeats):
        _time_round(configs, prompts, everything, params, rnd, timings)
        if rnd == 0:  # acceptance over one pass of the prompts (re-timed ones would weigh more)
            metrics = [copy.deepcopy(llm.get_metrics()) for llm in configs]
        for i in everything:
            ref[i] = ref[i] or timings[0].outputs[i].outputs[0].token_ids
            for c in range(len(configs)):
                same[c] &= timings[c].outputs[i].outputs[0].token_ids == ref[i]
    share = cpu_share(timings)
    clock = CPU if threads == 1 and share < STARVED else WALL
    # a category where a method's fastest run is slower than plain decoding's: more repeats of
    # both sides (noise from other processes is the usual cause), all kept; untrained heads
    # (label ending in *) are slower by construction and do not ask for any
    retimed: dict[int, int] = {}
    trained = [t for t, m in zip(timings[1:], methods) if not m.endswith("*")]
    for extra in range(retime):
        plain_best = timings[0].best(clock)
        todo = sorted({i for t in trained
                       for i, (p, s) in enumerate(zip(plain_best, t.best(clock))) if s > p})
        if not todo:
            break
        for i in todo:
            retimed[i] = retimed.get(i, 0) + 1
        _time_round(configs, prompts, todo, params, repeats + extra, timings)
        for i in todo:
            for c in range(len(configs)):
                same[c] &= timings[c].outputs[i].outputs[0].token_ids == ref[i]

    plain_best = timings[0].best(clock)
    ntok = [len(t) for t in ref]
    if clock == CPU:
        walls = ", ".join(f"{name} {sum(ntok) / sum(t.best(WALL)):.1f}"
                          for name, t in zip(["none"] + methods, timings))
        print(f"\nthis process got {share:.0%} of a CPU over the runs (more CPU-bound processes "
              "than cores): times below are the CPU time of each run, the same work on both "
              "sides and what it takes on a free core (wall-clock tokens/s, mostly waiting for a "
              f"core: {walls})")
    print(f"\n{'method':<14}{'tokens/s':>10}{'speedup':>9}{'accept':>8}{'mean len':>10}"
          "  per-position acceptance")
    print(f"{'none':<14}{sum(ntok) / sum(plain_best):>10.1f}{1.0:>9.2f}{'-':>8}{'1.00':>10}")
    all_ok = same[0]
    flagged = []
    for c, method in enumerate(methods, start=1):
        best = timings[c].best(clock)
        per, overall = speedups(plain_best, best)
        m = metrics[c]
        all_ok &= same[c]
        pos = " ".join(f"{x:.2f}" for x in m.per_position_acceptance)
        print(f"{method:<14}{sum(ntok) / sum(best):>10.1f}{overall:>9.2f}{m.acceptance_rate:>8.2f}"
              f"{m.mean_accepted_length:>10.2f}  [{pos}]")
        for i, cat in enumerate(names):
            rm = timings[c].outputs[i].metrics.spec
            note = f"  (timed {repeats + retimed[i]}x)" if i in retimed else ""
            print(f"    {cat:<11} {per[i]:>5.2f}x  accepted {rm.num_accepted_tokens}/"
                  f"{rm.num_draft_tokens}  mean len {rm.mean_accepted_length:.2f}{note}")
        print(f"    greedy output identical to plain decoding: {'yes' if same[c] else 'NO'}")
        bad = slower(names, per, overall)
        if bad and not method.endswith("*"):
            flagged.append(f"{method}: {', '.join(bad)}")
    if flagged:
        print("\nSLOWER than plain decoding (the machine may be too busy to tell; "
              "run it again): " + "; ".join(flagged))
    print("\nfirst reply (plain):",
          timings[0].outputs[0].outputs[0].text[:300].replace("\n", "\n    "))
    return 0 if all_ok else 1
