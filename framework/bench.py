"""``speculant bench``: plain decoding and each speculation strategy on the same model, prompts and
engine (one process, one model load, one KV cache), measured per batch size.

For every (strategy, batch size) it reports decode throughput (tokens/s over all sequences),
seconds per output token of one sequence (the ``time_generation`` figure), the speedup over plain
decoding at that batch size, the measured acceptance ``a`` (probability a draft token is accepted
given the earlier ones were, counted exactly per draft), ``tokens_per_step`` (tokens per sequence
decode step, drafting or not), vLLM's ``mean_accepted_length`` (1 + accepted / drafts, over the
steps that drafted), ``draft_fraction`` ``f`` (the share of sequence decode steps that drafted), the
proposer cost ratio ``c`` and the theoretical speedup: Leviathan et al.'s
``(1 - a^(k+1)) / ((1 - a)(k c + 1))`` generalised to strategies that draft only on some steps
(``theoretical_speedup``; docs/metrics.md):

    (f (1 - a^(L+1)) / (1 - a) + (1 - f)) / (g k c + 1)

with ``L`` the mean draft length (``num_draft_tokens / num_drafts``: k for a strategy whose drafts
are always k long) and ``g`` the share of decode steps that called the proposer (1 unless
speculation was switched off: auto_disable, disable_by_batch_size). With f = g = 1 and L = k it is
Leviathan's formula. As in that formula, ``c`` is the cost of ONE draft run (one draft token)
relative to one plain target decode step: ``k c`` is what proposing costs per speculative step, so
``c = (propose time per step / k) / plain step time``. The propose time per step is the steady
state: calls that carry some sequence's first propose (a draft model's prefill of the prompt, once
per request) are left out of it and reported as ``first_propose_s``; ``c_all`` is the same ratio
over every call, those included.

Timing: every interval is read on the host clock after ``torch.cuda.synchronize()`` (the decode
loop itself also waits for each step's tokens), so no asynchronous GPU work is left out. Oracle
strategies without references get the greedy continuation recorded by a plain pass first; their
rows record how the oracle drew its corruptions (``draws``: by default ``"stratified"``, whose
short runs match the formula's acceptance law without the luck of independent draws, see
``speculant.plugins.oracle``).
"""

from __future__ import annotations

import gc
import json
import logging
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from speculant.hookspecs import hookimpl
from speculant.outputs import SpecMetrics
from speculant.spec_types import DraftTree

logger = logging.getLogger("speculant")


def expected_tokens(a: float, length: float) -> float:
    """Expected tokens of a step that verifies a draft of ``length`` tokens, each accepted with
    probability ``a`` given the earlier ones were: (1 - a^(L+1)) / (1 - a), L + 1 at a = 1."""
    return length + 1 if a >= 1.0 else (1 - a ** (length + 1)) / (1 - a)


def theoretical_speedup(a: float, k: int, c: float, draft_fraction: float = 1.0,
                        draft_len: float | None = None, propose_fraction: float = 1.0) -> float:
    """Leviathan et al. (2211.17192) eq. 1, the expected speedup of k drafts with acceptance a
    and proposer cost c, generalised to strategies that draft on a share ``draft_fraction`` (f)
    of the steps only, with drafts of mean length ``draft_len`` (L, default k), and call the
    proposer on a share ``propose_fraction`` (g) of them:
    (f (1 - a^(L+1)) / (1 - a) + 1 - f) / (g k c + 1). The defaults give eq. 1."""
    length = k if draft_len is None else draft_len
    tokens = draft_fraction * expected_tokens(a, length) + (1.0 - draft_fraction)
    return tokens / (propose_fraction * k * c + 1)


def _sync(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


class _AcceptanceCounter:
    """A pluggy wrapper around ``verify`` counting draft acceptance (the timed run's only hook:
    no synchronisation)."""

    def __init__(self) -> None:
        self.trials = 0  # draft positions reached (all earlier drafts of the step accepted)
        self.accepted = 0

    @hookimpl(wrapper=True)
    def verify(self, batch, proposal, scores):
        result = yield
        for drafts, acc in zip(proposal.token_ids, result.num_accepted):
            # a token tree: the levels reached (its depth bounds the accepted path)
            n = max(drafts.depths(), default=0) if isinstance(drafts, DraftTree) else len(drafts)
            self.trials += min(n, acc + 1)
            self.accepted += acc
        return result

    @property
    def acceptance(self) -> float | None:
        """P(draft token j accepted | tokens < j accepted), pooled over positions."""
        return self.accepted / self.trials if self.trials else None


class _StepTimer:
    """A pluggy wrapper around ``propose`` (synchronised wall time: the proposer's whole cost) and
    ``score`` (host time to issue it). Its synchronisations cost a step time of their own (two
    device syncs, ~0.1-0.2 ms per step on the H100 machine), so it runs in a separate pass of
    its own after the timed run (``run_bench``), never inside it."""

    def __init__(self, device) -> None:
        self.device = device
        self.propose_s = 0.0
        self.propose_max_s = 0.0  # the slowest call (a catch-up, a compile, a graph capture)
        self.propose_calls = 0
        # calls that carry some sequence's FIRST propose: a draft model's prefill of the prompt
        # (EAGLE's catch-up over it), a one-off per request, reported apart from the per-step
        # cost (``_summarise``: c is the steady-state figure, c_all the mean over every call)
        self.first_s = 0.0
        self.first_calls = 0
        self._seen: set[int] = set()
        self.score_s = 0.0
        self.score_calls = 0
        self.steps = 0  # decode steps of the pass (set by _cost_pass)

    @hookimpl(wrapper=True)
    def propose(self, batch):
        _sync(self.device)
        t0 = time.perf_counter()
        result = yield
        _sync(self.device)
        dt = time.perf_counter() - t0
        self.propose_s += dt
        self.propose_max_s = max(self.propose_max_s, dt)
        self.propose_calls += 1
        ids = {s.seq_id for s in batch.seqs}
        if not ids <= self._seen:
            self._seen |= ids
            self.first_s += dt
            self.first_calls += 1
        return result

    @hookimpl(wrapper=True)
    def score(self, batch, proposal):
        # NOT synchronised: on CUDA the engine queues verification behind the target forward
        # while the GPU runs it. This is the host time to issue the scoring forward.
        t0 = time.perf_counter()
        result = yield
        self.score_s += time.perf_counter() - t0
        self.score_calls += 1
        return result


def _decode_run(engine, prompts: list[list[int]], max_tokens: int) -> dict:
    """Prefill ``prompts`` together, then time the decode steps until all finish."""
    from speculant.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    reqs = [engine.add_request(f"bench-{i}-{time.monotonic_ns()}", None, p, params)
            for i, p in enumerate(prompts)]
    outs = {}
    _sync(engine.device)
    t0 = time.perf_counter()
    while not all(s.num_output_tokens >= 1 for r in reqs for s in r.seqs):
        outs.update({o.request_id: o for o in engine.step()})
    _sync(engine.device)
    t1 = time.perf_counter()
    step_times = []  # host wall time of each step (on CUDA: up to its own token read-back)
    while engine.has_unfinished_requests():
        ts = time.perf_counter()
        outs.update({o.request_id: o for o in engine.step()})
        step_times.append(time.perf_counter() - ts)
    _sync(engine.device)
    t2 = time.perf_counter()
    tokens = [outs[r.request_id].outputs[0].token_ids for r in reqs]
    decode_tokens = sum(len(t) - 1 for t in tokens)
    return {"tokens": tokens, "prefill_s": t1 - t0, "decode_s": t2 - t1, "steps": len(step_times),
            "decode_tokens": decode_tokens, "step_times": step_times}


SLOW_STEP = 5.0  # a step this many times the median step is counted as a stall
# steps over TRIM_STEP x the median are left out of the trimmed figures (*_trimmed): on the lent
# H100 machines single steps of 10-20 ms against a 6 ms median, whose GPU time itself is 2-3x
# the usual (the device is busy elsewhere), in about one run of three
TRIM_STEP = 1.5


def step_stats(step_times: list[float]) -> dict:
    """Median and max step time, the number of stalls (steps over SLOW_STEP x the median: a
    kernel compile or graph capture inside the timed window shows up here), and the mean step
    time without the steps over TRIM_STEP x the median (``step_s_trimmed``; ``trimmed_steps``
    of them left out)."""
    if not step_times:
        return {"median_step_s": None, "max_step_s": None, "slow_steps": 0, "slow_steps_s": 0.0,
                "step_s_trimmed": None, "trimmed_steps": 0}
    med = statistics.median(step_times)
    slow = [t for t in step_times if t > SLOW_STEP * med]
    kept = [t for t in step_times if t <= TRIM_STEP * med]
    return {"median_step_s": med, "max_step_s": max(step_times), "slow_steps": len(slow),
            "slow_steps_s": sum(slow), "step_s_trimmed": sum(kept) / len(kept),
            "trimmed_steps": len(step_times) - len(kept)}


def _set_strategy(engine, spec_config: dict | None):
    from speculant.engine.spec_decode import SpecDecoder

    if engine.spec is not None:
        engine.spec = None
        gc.collect()
        if engine.device.type == "cuda":
            import torch

            torch.cuda.empty_cache()
    if spec_config is not None:
        engine.spec = SpecDecoder(engine, spec_config)
    return engine.spec


def _label(spec: dict | None) -> str:
    if spec is None:
        return "plain"
    name = spec.get("name") or spec["method"]
    if spec["method"] == "oracle" and "name" not in spec:
        name = f"oracle a={spec['alpha']}"
    return f"{name} k={spec.get('num_speculative_tokens', '?')}"


def random_prompts(n: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(length)] for _ in range(n)]


def run_bench(engine, prompts: list[list[int]], strategies: list[dict], max_tokens: int,
              batch_sizes: list[int], warmup_tokens: int = 8, cost_tokens: int | None = None,
              repeats: int | dict[int, int] = 1,
              progress: Callable[[dict], None] | None = None) -> dict:
    """Measure plain decoding and every strategy at every batch size on ``engine``.
    ``strategies``: speculative_config dicts (an optional ``name`` key labels the run).

    Each strategy's timed run carries only an acceptance counter. Its proposer cost (``c``) is
    measured in a second pass of ``cost_tokens`` tokens (default ``min(max_tokens, 64)``) with
    ``propose`` synchronised on both sides, so that the timing's own device syncs are not part
    of the timed speedup.

    ``repeats`` (an int, or per batch size a dict; default 1): timed runs per cell, plain
    included. The row reports the run whose mean step time is the median of them (not the
    fastest: the acceptance counted in each run stays that run's own), and every run's mean
    step time in ``step_s_runs``; the cost pass is repeated as often and its median taken. A
    single run on a shared machine can carry a few stalled steps (tens of milliseconds) that
    move a batch-1 row by several percent.

    Order: first, per batch size, the plain greedy recording (the oracle's references and the
    greedy-equivalence reference) and the plain rows; then each strategy over every batch size.
    A strategy other than the oracle (whose references differ per batch size) is built once and
    ``SpecDecoder.reset()`` between batch sizes: its weights, caches and CUDA graphs serve them
    all (rebuilt per cell, the 8B bench's draft models and heads recaptured their graphs every
    time, and an MLPSpeculator's synthetic set-up alone takes 5-6 s on an H100).
    Each row carries ``setup_s`` (building or resetting the strategy) and ``cell_s`` (the whole
    cell, warm-up and cost passes included); ``progress`` is called with each row. ``runs`` is
    ordered by batch size, then plain and the strategies in the order given."""
    cost_tokens = cost_tokens or min(max_tokens, 64)
    if max(batch_sizes) > len(prompts):
        raise ValueError(f"batch size {max(batch_sizes)} needs as many prompts, got {len(prompts)}")
    k_max = max([s.get("num_speculative_tokens", 1) for s in strategies] + [1])
    rows: dict[tuple[int, int], dict] = {}  # (strategy index (0: plain), batch size) -> row
    records: dict[int, dict] = {}
    plains: dict[int, dict] = {}

    def spec_cfg(spec: dict, bs: int) -> dict:
        cfg = {k: v for k, v in spec.items() if k != "name"}
        if cfg["method"] == "oracle" and not {"references", "reference_file"} & set(cfg):
            cfg["references"] = records[bs]["refs"]
        return cfg

    def cell(i: int, spec: dict | None, cfg: dict | None, bs: int, dec, setup_s: float,
             t0: float) -> None:
        warm = warmup_tokens
        if cfg is not None and cfg.get("auto_disable"):
            # auto-disable probes at intervals that depend on their cost: warm up over a
            # whole back-off cycle and as many tokens as the timed run, so that every
            # catch-up shape and context length a probe meets (Triton kernel variants, CUDA
            # graphs) is compiled / captured before timing: one-time costs of a
            # long-running server (an H100 run paid a 0.6 s kernel compile in a probe
            # whose context first crossed 256 tokens)
            warm = max(warmup_tokens, 2 * cfg.get("auto_disable_interval", 64) + 16,
                       max_tokens)
        _decode_run(engine, prompts[:bs], warm)  # warm-up: compile, capture graphs
        n_rep = max(1, repeats.get(bs, 1) if isinstance(repeats, dict) else int(repeats))
        timed = [_timed_run(engine, dec, prompts[:bs], max_tokens) for _ in range(n_rep)]
        step_s = [t[0]["decode_s"] / max(t[0]["steps"], 1) for t in timed]
        r, metrics, counter = timed[sorted(range(n_rep), key=step_s.__getitem__)[n_rep // 2]]
        timer = None
        if dec is not None:  # the proposer's cost, synchronised, in passes of their own
            timers = [_cost_pass(engine, dec, prompts[:bs], cost_tokens) for _ in range(n_rep)]
            timers.sort(key=lambda t: t.propose_s / max(t.propose_calls, 1))
            timer = timers[n_rep // 2]
        # greedy equivalence with the plain recording, over every timed run
        record = records[bs]
        same = all(t == ref[: len(t)]
                   for run, _, _ in timed for t, ref in zip(run["tokens"], record["tokens"]))
        row = _summarise(spec, bs, r, dec, metrics, counter, timer, plains.get(bs), same)
        row["step_s_runs"] = step_s
        row["setup_s"] = setup_s
        row["cell_s"] = time.perf_counter() - t0
        rows[(i, bs)] = row
        if spec is None:
            plains[bs] = row
        logger.info("bench %s", row)
        if progress is not None:
            progress(row)

    for bs in batch_sizes:
        # the plain greedy continuation at this batch size (bf16 results may depend on the batch
        # shape): the oracle's references and the reference for greedy equivalence
        t0 = time.perf_counter()
        _set_strategy(engine, None)
        record = _decode_run(engine, prompts[:bs], max_tokens + k_max)
        record["refs"] = [{"prompt_token_ids": p, "output_token_ids": t}
                          for p, t in zip(prompts, record["tokens"])]
        records[bs] = record
        cell(0, None, None, bs, None, 0.0, t0)
    for i, spec in enumerate(strategies, start=1):
        dec = None
        for bs in batch_sizes:
            t0 = time.perf_counter()
            cfg = spec_cfg(spec, bs)
            if dec is None or cfg["method"] == "oracle":
                dec = _set_strategy(engine, cfg)
            else:
                dec.reset()
            cell(i, spec, cfg, bs, dec, time.perf_counter() - t0, t0)
        _set_strategy(engine, None)
    runs = [rows[(i, bs)] for bs in batch_sizes for i in range(len(strategies) + 1)]
    return {"runs": runs, "max_tokens": max_tokens, "batch_sizes": batch_sizes,
            "prompt_len": len(prompts[0]), "device": device_name(engine.device),
            "dtype": str(engine.dtype).replace("torch.", ""), "model": str(engine.model_path)}


def _timed_run(engine, dec, prompts, max_tokens) -> tuple:
    """One timed decode run: (its ``_decode_run`` result, the strategy's metrics of this run
    only, its acceptance counter); (result, None, None) for plain decoding."""
    if dec is None:
        return _decode_run(engine, prompts, max_tokens), None, None
    dec.total = SpecMetrics(num_speculative_tokens=dec.k)  # count this run only
    counter = _AcceptanceCounter()
    dec.pm.register(counter, name="bench:acceptance")
    try:
        r = _decode_run(engine, prompts, max_tokens)
    finally:
        dec.pm.unregister(counter)
    metrics, dec.total = dec.total, SpecMetrics()
    return r, metrics, counter


def _cost_pass(engine, dec, prompts, tokens) -> _StepTimer:
    """A decode pass of ``tokens`` tokens with ``propose`` synchronised and timed."""
    timer = _StepTimer(engine.device)
    dec.pm.register(timer, name="bench:timer")
    try:
        timer.steps = _decode_run(engine, prompts, tokens)["steps"]
    finally:
        dec.pm.unregister(timer)
    return timer


def _summarise(spec, bs, r, dec, m, counter, timer, plain, same: bool) -> dict:
    step_s = r["decode_s"] / max(r["steps"], 1)
    per_seq_tokens = r["decode_tokens"] / bs
    row = {
        "name": _label(spec), "method": spec["method"] if spec else "plain", "batch_size": bs,
        "k": spec.get("num_speculative_tokens") if spec else 0,
        "tokens_per_s": r["decode_tokens"] / r["decode_s"],
        "s_per_token": r["decode_s"] / per_seq_tokens,
        "decode_s": r["decode_s"], "prefill_s": r["prefill_s"], "steps": r["steps"],
        "step_s": step_s, "decode_tokens": r["decode_tokens"],
        "same_tokens_as_plain": same,  # every timed run's tokens = the plain recording's
        **step_stats(r["step_times"]),
    }
    row["speedup"] = (row["tokens_per_s"] / plain["tokens_per_s"]) if plain else 1.0
    # the same figures without the stalled steps (TRIM_STEP): a secondary view, never the headline
    row["tokens_per_s_trimmed"] = r["decode_tokens"] / (r["steps"] * row["step_s_trimmed"])
    row["speedup_trimmed"] = (row["tokens_per_s_trimmed"] / plain["tokens_per_s_trimmed"]
                              if plain else 1.0)
    if m is None:
        row.update(mean_accepted_length=1.0, tokens_per_step=1.0, acceptance=None, c=None,
                   theoretical_speedup=None)
        return row
    k = dec.k
    a = counter.acceptance
    steady = timer.propose_calls - timer.first_calls
    propose_all = timer.propose_s / timer.propose_calls if timer.propose_calls else None
    # the per-step cost: calls without a sequence's first propose (a draft model's prompt
    # prefill, a one-off per request that the cost pass's few steps would spread over every
    # step: 10-17 ms over 63 steps at batch 16 on the H100); all calls if there are no others
    propose_step = (timer.propose_s - timer.first_s) / steady if steady else propose_all
    # Leviathan et al.'s c: one draft run (k of them per speculative step) / one plain step
    c = propose_step / (k * plain["step_s"]) if (plain and propose_step is not None) else None
    c_all = propose_all / (k * plain["step_s"]) if (plain and propose_all is not None) else None
    # the share of sequence decode steps that drafted (f), the mean draft length (L) and the
    # share of decode steps (the cost pass's) that called the proposer (g): the theoretical
    # speedup of a strategy that drafts only now and then (n-gram lookup, auto_disable)
    f = m.draft_fraction
    draft_len = m.num_draft_tokens / m.num_drafts if m.num_drafts else float(k)
    g = min(1.0, timer.propose_calls / timer.steps) if timer.steps else 1.0
    row.update(
        mean_accepted_length=m.mean_accepted_length, tokens_per_step=m.tokens_per_step,
        draft_fraction=f, mean_draft_length=draft_len, propose_fraction=g, acceptance=a,
        acceptance_rate=m.acceptance_rate, num_drafts=m.num_drafts, num_spec_steps=m.num_spec_steps,
        num_plain_steps=m.num_plain_steps, num_times_disabled=m.num_times_disabled,
        propose_s_per_step=propose_step,
        propose_s_per_step_all=propose_all,  # every call, the first proposes included
        first_propose_s=timer.first_s / timer.first_calls if timer.first_calls else None,
        c_all=c_all,
        max_propose_s=timer.propose_max_s if timer.propose_calls else None,
        score_issue_s_per_step=timer.score_s / timer.score_calls if timer.score_calls else None,
        c=c,
        theoretical_speedup=theoretical_speedup(a, k, c, f, draft_len, g)
        if (a is not None and c is not None and m.num_drafts) else None,
    )
    if getattr(dec.strategy_config, "draws", None) is not None:  # the oracle's
        row["draws"] = dec.strategy_config.draws
    if row["theoretical_speedup"]:
        row["speedup_vs_theoretical"] = row["speedup"] / row["theoretical_speedup"]
        row["speedup_vs_theoretical_trimmed"] = row["speedup_trimmed"] / row["theoretical_speedup"]
    return row


def device_name(device) -> str:
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def write_outputs(result: dict, out_dir: str | Path, stem: str = "bench") -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out / f"{stem}.json", out / f"{stem}.png"
    json_path.write_text(json.dumps(result, indent=1, default=str))
    plot(result, png_path)
    return json_path, png_path


def plot(result: dict, path: str | Path) -> None:
    """Left: decode throughput vs batch size per strategy. Right: measured vs theoretical speedup
    at the smallest batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    names = list(dict.fromkeys(r["name"] for r in runs))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.5))
    ax1.set_prop_cycle(color=plt.cm.tab20.colors)
    for n in names:
        pts = sorted((r["batch_size"], r["tokens_per_s"]) for r in runs if r["name"] == n)
        ax1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=n)
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xlabel("batch size")
    ax1.set_ylabel("decode tokens/s (all sequences)")
    ax1.legend(fontsize=7)
    ax1.grid(True, alpha=0.3)
    bs0 = min(r["batch_size"] for r in runs)
    first = [r for r in runs if r["batch_size"] == bs0 and r["method"] != "plain"]
    xs = range(len(first))
    ax2.bar([x - 0.2 for x in xs], [r["speedup"] for r in first], 0.4, label="measured")
    ax2.bar([x + 0.2 for x in xs], [r["theoretical_speedup"] or 0 for r in first], 0.4,
            label="theoretical (measured a, c, draft fraction)")
    ax2.axhline(1.0, color="k", lw=0.8)
    ax2.set_xticks(list(xs), [r["name"] for r in first], rotation=35, ha="right", fontsize=7)
    ax2.set_ylabel(f"speedup over plain decoding (batch {bs0})")
    ax2.legend(fontsize=8)
    fig.suptitle(f"speculant bench: {Path(result['model']).name} ({result['dtype']}) on "
                 f"{result['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(result: dict) -> str:
    cols = ("name", "batch_size", "tokens_per_s", "s_per_token", "speedup", "acceptance",
            "mean_accepted_length", "tokens_per_step", "draft_fraction", "c", "c_all",
            "theoretical_speedup", "speedup_vs_theoretical",
            "speedup_vs_theoretical_trimmed", "same_tokens_as_plain")
    lines = [" | ".join(cols)]
    for r in result["runs"]:
        cells = []
        for c in cols:
            v = r.get(c)
            cells.append(f"{v:.4g}" if isinstance(v, float) else str(v))
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def parse_strategies(text: str) -> list[dict]:
    """A JSON list of speculative_config dicts, or shorthands separated by commas:
    ``oracle:ALPHA:K`` and ``METHOD:K`` (e.g. ``oracle:0.8:5,ngram:3``)."""
    text = text.strip()
    if text.startswith("["):
        return json.loads(text)
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        bits = part.split(":")
        if bits[0] == "oracle":
            out.append({"method": "oracle", "alpha": float(bits[1]),
                        "num_speculative_tokens": int(bits[2])})
        else:
            out.append({"method": bits[0], "num_speculative_tokens": int(bits[1])})
    return out


def add_arguments(p) -> None:
    p.add_argument("--model", default=None, help="HF folder, .gguf file, hub id; default: the "
                   "embedded SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="auto", help="float32, float16 or bfloat16; auto: float32 "
                   "on the CPU, the checkpoint's float16/bfloat16 on a GPU (default: auto)")
    p.add_argument("--device", default="auto", help="cpu, cuda or cuda:N (default: auto)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts and the engine "
                   "(default: 0)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest sequence in tokens (default: the model's)")
    p.add_argument("--strategies", default="oracle:0.6:3,oracle:0.8:3,oracle:0.8:5,ngram:3",
                   help="JSON list of speculative_config dicts, or shorthands "
                   "'oracle:ALPHA:K,METHOD:K'")
    p.add_argument("--batch-sizes", default="1", help="comma-separated, e.g. 1,4,16,64")
    p.add_argument("--max-tokens", type=int, default=64,
                   help="tokens generated per sequence (default: 64)")
    p.add_argument("--prompt-len", type=int, default=32,
                   help="length in tokens of the random prompts (default: 32)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per cell; the row reports "
                   "the run of median step time (every run's step time in step_s_runs)")
    p.add_argument("--out", default="bench/results", help="folder for JSON and PNG")
    p.add_argument("--stem", default="bench", help="file name stem (STEM.json, STEM.png)")


def main(args) -> int:
    from speculant import LLM

    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    llm = LLM(model=args.model, dtype=args.dtype, device=args.device, seed=args.seed,
              max_model_len=args.max_model_len, max_num_seqs=max(batch_sizes),
              skip_tokenizer_init=True)
    engine = llm.engine
    prompts = random_prompts(max(batch_sizes), args.prompt_len, engine.vocab_size, args.seed)
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    result = run_bench(engine, prompts, parse_strategies(args.strategies), args.max_tokens,
                       batch_sizes, repeats=args.repeats)
    json_path, png_path = write_outputs(result, args.out, args.stem)
    print(table(result))
    print(f"wrote {json_path} and {png_path}")
    return 0
