"""Every speculation strategy on the embedded default model (SmolLM2-135M-Instruct, CPU, fp32,
greedy), on the demo prompts of ``speculant demo`` (code edit, rewrite, summarize, qa).

Per strategy: tokens per target step (tokens emitted per target forward in decoding), acceptance
rate, per-position acceptance, drafts / draft tokens / accepted tokens, tokens/s, speedup against
plain decoding measured right before it in the same run (the CPU is shared: pairs taken close in
time), and whether the greedy output equals plain decoding token for token.

Strategies (k = 5 drafted tokens everywhere):

- ``ngram``: prompt lookup, the plugin's defaults otherwise.
- ``draft_model_random``: a random 2-layer Llama (hidden 64) with SmolLM2's vocabulary and
  tokenizer, written in the real HF layout (config.json, model.safetensors, tokenizer files).
- ``draft_model_self``: SmolLM2 as its own draft. Under greedy every draft is accepted (acceptance
  ~1.0), but the draft costs as much as the target: a correctness showcase, not a speedup.
- ``mlp_speculator``, ``eagle`` (EAGLE-1), ``eagle3``: RANDOM heads in the published checkpoint
  formats, sized for SmolLM2 (hidden 576). Nobody has trained such heads for SmolLM2; random ones
  are (almost) never accepted, so these rows measure the plumbing and the cost of drafting at a
  real size, and their acceptance near zero is the expected result.
- ``ngram_batch4`` and ``ngram_disable_by_batch_size``: the four prompts as one batch, n-gram
  without and with ``disable_by_batch_size=3`` (speculation off while more than 3 sequences run;
  it comes back on when the shortest reply finishes). Compared with plain decoding of the same
  batch.

The checkpoints come from tests/checkpoints.py, the writers the tests use. One prompt at a time
(except the batch rows), torch threads 1 by default.

    python bench/strategies_smollm2.py [--max-tokens 64] [--threads 1] [--repeats 1]
        [--strategies ngram,eagle,...]

Writes bench/results/strategies_smollm2.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # tests/checkpoints.py: the checkpoint writers

from checkpoints import make_mlp, make_tiny_checkpoint, smollm_eagle_heads  # noqa: E402

RESULTS = ROOT / "bench" / "results"
K = 5


@dataclass
class Strategy:
    name: str
    shown: str  # the options as shown in the table (checkpoint paths replaced by what they are)
    note: str
    config: Callable[[Path, object], dict]  # (checkpoint folder, plain LLM) -> speculative_config
    batch: bool = False  # the four prompts as one batch (else one prompt at a time)


def _random_draft(d: Path, plain) -> dict:
    path = make_tiny_checkpoint(d / "draft-tiny-llama", "llama", vocab_size=plain.engine.vocab_size,
                                seed=1, max_position_embeddings=8192)
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": K}


def _mlp(d: Path, plain) -> dict:
    hidden = plain.engine.hf_config.hidden_size
    path = make_mlp(d / "mlp-speculator", emb_dim=hidden, vocab=plain.engine.vocab_size,
                    n_predict=K, inner_dim=hidden, tie=True, scale_input=True, seed=0)
    return {"method": "mlp_speculator", "model": str(path), "num_speculative_tokens": K}


def _eagle(version: int) -> Callable[[Path, object], dict]:
    def make(d: Path, plain) -> dict:
        e1, e3 = smollm_eagle_heads(d / "eagle", plain.engine.hf_config, plain.engine.vocab_size)
        return {"method": "eagle3" if version == 3 else "eagle",
                "model": str(e3 if version == 3 else e1), "num_speculative_tokens": K}

    return make


RANDOM_HEAD = "RANDOM weights (nothing trained for SmolLM2): acceptance ~0 is expected"
STRATEGIES = [
    Strategy("ngram", f"k={K}", "prompt lookup, plugin defaults otherwise",
             lambda d, p: {"method": "ngram", "num_speculative_tokens": K}),
    Strategy("draft_model_random", f"k={K}, random 2-layer Llama (hidden 64), SmolLM2 vocab",
             "random draft in the HF layout (config.json, model.safetensors, tokenizer)",
             _random_draft),
    Strategy("draft_model_self", f"k={K}, model=SmolLM2-135M itself",
             "correctness showcase: acceptance ~1.0 under greedy, the draft costs a target step",
             lambda d, p: {"method": "draft_model", "model": str(p.engine.model_path),
                           "num_speculative_tokens": K}),
    Strategy("mlp_speculator", f"k={K}, n_predict={K}, tied, scale_input, inner 576",
             "MLPSpeculator, IBM layout (speculator.-prefixed safetensors); " + RANDOM_HEAD, _mlp),
    Strategy("eagle", f"k={K}, 1 layer, pytorch_model.bin", "EAGLE-1 head; " + RANDOM_HEAD,
             _eagle(1)),
    Strategy("eagle3", f"k={K}, draft vocab 4096, layers (2, 15, 27), model.safetensors",
             "EAGLE-3 head; " + RANDOM_HEAD, _eagle(3)),
    Strategy("ngram_batch4", f"k={K}, batch of 4", "n-gram with the four prompts as one batch",
             lambda d, p: {"method": "ngram", "num_speculative_tokens": K}, batch=True),
    Strategy("ngram_disable_by_batch_size", f"k={K}, disable_by_batch_size=3, batch of 4",
             "speculation off while > 3 sequences run, back on when one finishes",
             lambda d, p: {"method": "ngram", "num_speculative_tokens": K,
                           "disable_by_batch_size": 3}, batch=True),
]


# --------------------------------------------------------------------------------------------
# measuring
# --------------------------------------------------------------------------------------------
def timed_chat(llm, prompts: list[str], params) -> tuple[list, float]:
    t0 = time.perf_counter()
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    return outs, time.perf_counter() - t0


def run_pass(llm, prompts: list[str], params, batch: bool) -> list[tuple[object, float]]:
    """[(RequestOutput, seconds)] per prompt; a batch pass gives every prompt the batch's time."""
    if batch:
        outs, dt = timed_chat(llm, prompts, params)
        return [(o, dt) for o in outs]
    return [(o[0], dt) for o, dt in (timed_chat(llm, [p], params) for p in prompts)]


def pass_seconds(res: list[tuple[object, float]], batch: bool) -> float:
    return res[0][1] if batch else sum(dt for _, dt in res)


def token_ids(res) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o, _ in res]


def measure(strat: Strategy, plain, ckpt_dir: Path, prompts, cats, params, warm, repeats: int,
            plain_ref: list[list[int]]) -> dict:
    from speculant import LLM
    from speculant.outputs import SpecMetrics

    t0 = time.perf_counter()
    spec_cfg = strat.config(ckpt_dir, plain)
    t_ckpt = time.perf_counter() - t0
    llm = LLM(speculative_config=spec_cfg)
    t_load = time.perf_counter() - t0 - t_ckpt
    print(f"    checkpoint {t_ckpt:.1f} s, load {t_load:.1f} s; strategy {llm.engine.spec.name}, "
          f"k={llm.engine.spec.k}", flush=True)
    timed_chat(llm, prompts[:1], warm)
    run = llm.get_metrics()  # the engine's live run totals: copy the counters
    switches = (run.num_times_disabled, run.num_times_enabled)
    speedups, plain_secs, spec_secs, spec_runs = [], [], [], []
    plain_same = True
    for r in range(repeats):
        p_res = run_pass(plain, prompts, params, strat.batch)
        s_res = run_pass(llm, prompts, params, strat.batch)
        plain_same &= token_ids(p_res) == plain_ref
        p_s, s_s = pass_seconds(p_res, strat.batch), pass_seconds(s_res, strat.batch)
        plain_secs.append(p_s)
        spec_secs.append(s_s)
        speedups.append(p_s / s_s)
        spec_runs.append((p_res, s_res))
        print(f"    repeat {r + 1}/{repeats}: plain {p_s:.1f} s, speculative {s_s:.1f} s, "
              f"speedup {p_s / s_s:.2f}x", flush=True)
    identical = all(token_ids(s) == plain_ref for _, s in spec_runs)
    p_res, s_res = spec_runs[0]
    total = SpecMetrics()
    per_prompt = []
    for cat, (_, pdt), (so, sdt), ref in zip(cats, p_res, s_res, plain_ref):
        m = so.metrics.spec
        total.merge(m)
        per_prompt.append({
            "prompt": cat, "output_tokens": len(so.outputs[0].token_ids),
            "identical_to_plain": list(so.outputs[0].token_ids) == ref,
            **({} if strat.batch else {"plain_s": round(pdt, 3), "spec_s": round(sdt, 3),
                                        "speedup": round(pdt / sdt, 3)}),
            **m.as_dict(),
        })
    ntok = sum(len(o.outputs[0].token_ids) for o, _ in s_res)
    res = {
        "strategy": strat.name,
        "method": llm.engine.spec.name,
        "options": strat.shown,
        "note": strat.note,
        "mode": "batch of 4" if strat.batch else "one prompt at a time",
        "speculative_config": {k: (Path(v).name if k == "model" else v) for k, v in spec_cfg.items()},
        "k": llm.engine.spec.k,
        "tokens_per_step": round(total.tokens_per_step, 4),
        "acceptance_rate": round(total.acceptance_rate, 4),
        "per_position_acceptance": [round(x, 4) for x in total.per_position_acceptance],
        "num_drafts": total.num_drafts,
        "num_draft_tokens": total.num_draft_tokens,
        "num_accepted_tokens": total.num_accepted_tokens,
        "num_spec_steps": total.num_spec_steps,
        "num_plain_steps": total.num_plain_steps,
        "num_times_disabled": run.num_times_disabled - switches[0],
        "num_times_enabled": run.num_times_enabled - switches[1],
        "output_tokens": ntok,
        "tokens_per_s": round(ntok / statistics.median(spec_secs), 2),
        "plain_tokens_per_s": round(ntok / statistics.median(plain_secs), 2),
        "speedup": round(statistics.median(speedups), 3),
        "speedups": [round(x, 3) for x in speedups],
        "identical_to_plain": identical,
        "plain_deterministic": plain_same,
        "per_prompt": per_prompt,
        "checkpoint_s": round(t_ckpt, 1),
        "load_s": round(t_load, 1),
    }
    del llm
    gc.collect()
    return res


# --------------------------------------------------------------------------------------------
# reporting
# --------------------------------------------------------------------------------------------
def markdown(results: list[dict]) -> str:
    rows = ["| strategy | options | tokens per target step | acceptance | speedup | identical to plain |",
            "| --- | --- | --- | --- | --- | --- |"]
    for r in results:
        rows.append(f"| {r['strategy']} | {r['options']} | {r['tokens_per_step']:.2f} | "
                    f"{r['acceptance_rate']:.3f} | {r['speedup']:.2f}x | "
                    f"{'yes' if r['identical_to_plain'] else 'NO'} |")
    rows += ["", "| strategy | tokens/s (plain) | drafts | draft tokens | accepted | "
             "per-position acceptance | spec / plain steps |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        pos = " ".join(f"{x:.2f}" for x in r["per_position_acceptance"])
        rows.append(f"| {r['strategy']} | {r['tokens_per_s']:.1f} ({r['plain_tokens_per_s']:.1f}) | "
                    f"{r['num_drafts']} | {r['num_draft_tokens']} | {r['num_accepted_tokens']} | "
                    f"{pos} | {r['num_spec_steps']} / {r['num_plain_steps']} |")
    return "\n".join(rows)


def git_state() -> dict:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout

    return {"commit": git("rev-parse", "--short", "HEAD").strip(),
            "dirty_files": [ln[3:] for ln in git("status", "--porcelain").splitlines()]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="plain/speculative pairs per strategy; speedup = median of the ratios")
    ap.add_argument("--strategies", default=",".join(s.name for s in STRATEGIES),
                    help="comma-separated subset of: " + ", ".join(s.name for s in STRATEGIES))
    ap.add_argument("--out", type=Path, default=RESULTS / "strategies_smollm2.json")
    args = ap.parse_args()
    by_name = {s.name: s for s in STRATEGIES}
    chosen = [n.strip() for n in args.strategies.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in by_name]
    if unknown:
        ap.error(f"unknown strategies {unknown}; choose from {list(by_name)}")

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the engine keeps a set count
    from speculant import LLM, SamplingParams
    from speculant.demo import DEMO_PROMPTS

    t_start = time.perf_counter()
    load_start = os.getloadavg()
    cats = [c for c, _ in DEMO_PROMPTS]
    prompts = [p for _, p in DEMO_PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    warm = SamplingParams(temperature=0.0, max_tokens=8)
    print(f"strategies on SmolLM2-135M-Instruct (CPU fp32, greedy, torch threads {args.threads}, "
          f"max_tokens {args.max_tokens}, k={K}): {len(chosen)} strategies x {len(prompts)} "
          f"prompts, load average {load_start[0]:.1f}", flush=True)
    plain = LLM()
    timed_chat(plain, prompts[:1], warm)
    refs = {}
    for batch in sorted({by_name[n].batch for n in chosen}):
        res = run_pass(plain, prompts, params, batch)
        refs[batch] = token_ids(res)
        print(f"plain reference ({'batch of 4' if batch else 'one at a time'}): "
              f"{sum(map(len, refs[batch]))} tokens in {pass_seconds(res, batch):.1f} s", flush=True)
    if True in refs and False in refs and refs[True] != refs[False]:
        print("note: plain batched output differs from plain one-at-a-time output", flush=True)

    results = []
    with tempfile.TemporaryDirectory(prefix="speculant-strategies-") as tmp:
        for i, name in enumerate(chosen, 1):
            strat = by_name[name]
            print(f"[{i}/{len(chosen)}] {name} ({strat.shown})", flush=True)
            r = measure(strat, plain, Path(tmp), prompts, cats, params, warm, args.repeats,
                        refs[strat.batch])
            pos = " ".join(f"{x:.2f}" for x in r["per_position_acceptance"])
            print(f"    tokens per target step {r['tokens_per_step']:.2f}, acceptance "
                  f"{r['acceptance_rate']:.3f} [{pos}], {r['tokens_per_s']:.1f} tok/s, speedup "
                  f"{r['speedup']:.2f}x, identical to plain: "
                  f"{'yes' if r['identical_to_plain'] else 'NO'}", flush=True)
            results.append(r)

    table = markdown(results)
    report = {
        "model": "SmolLM2-135M-Instruct (embedded default), CPU, fp32, greedy",
        "prompts": cats,
        "max_tokens": args.max_tokens,
        "k": K,
        "torch_threads": args.threads,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "load_average_start_end": [round(load_start[0], 2), round(os.getloadavg()[0], 2)],
        "wall_s": round(time.perf_counter() - t_start, 1),
        "git": git_state(),
        "definitions": {
            "tokens_per_step": "tokens emitted per target forward in decode steps "
                                    "(accepted drafts + 1; plain steps count 1)",
            "acceptance_rate": "accepted draft tokens / proposed draft tokens",
            "speedup": "plain seconds / speculative seconds over the same prompts, measured "
                       "back to back in this run (median over repeats)",
        },
        "results": results,
        "table_markdown": table,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print()
    print(table)
    print(f"\nwrote {args.out} in {report['wall_s']:.0f} s")
    return 0 if all(r["identical_to_plain"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
