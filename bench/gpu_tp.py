"""Tensor parallelism on lent GPUs with synthetic weights (issues 35 and 38).

Llama-3-8B at TP 1 against TP N (issue 35), Llama-3-70B at TP 4 (issue 38):

    python bench/gpu_tp.py --out OUT [--tp 2] [--layers N] [--max-tokens T] [--batch-sizes 1,4,16,64]
    python bench/gpu_tp.py --out OUT --geometry 70b --tp 4 [--layers N]
    python bench/gpu_tp.py --out OUT --replot OUT/gpu_tp.json         # figures only, no GPU

The run is a sequence of phases, each in processes of its own started by this script with a time
limit (``--budget-s`` in all: one lent call), so that a phase that fails or hangs is recorded and
the next one still runs; gpu_tp.json is rewritten after every phase (and a phase's part file
after every cell it measures):

* ``collectives``: one process per GPU: each GPU's copy bandwidth (bytes read + written per second
  of a large device-to-device copy, gpu_8b.copy_bandwidth), then ``speculant.distributed``'s
  ``all_reduce`` (and NCCL's ``dist.all_reduce`` beside it, and the fused all-reduce + residual
  add + RMSNorm of kernels/tp_allreduce.py) on [1, H] and [64, H] bf16 rows, eager and replayed
  from a CUDA graph: microseconds per call, and the per-step cost of the 2 x layers all-reduces
  of a decode step;
* engine phases (8B: ``tp1``, ``tpN``): an ``LLM(load_format="dummy", tensor_parallel_size=...)``
  on a folder holding only config.json: plain decoding over the batch sweep, the oracle (a = 0.8,
  k = 5) over it, and at TP N each strategy (n-gram, a Llama-3.2-1B-geometry draft model, EAGLE-1,
  EAGLE-3, MLPSpeculator: gpu_8b's synthetic checkpoints; drafters run on rank 0) at batch 1,
  each in a ``speculant.bench.run_bench`` call of its own (a failing one is recorded, the rest
  still run); the greedy tokens of a few prompts;
* ``equality_tp1`` / ``equality_tpN``: greedy tokens of the same prompts on the raw dummy weights
  (below), eager, in float32 (``--equality-dtype``): where TP 1 and TP N first differ. One process each: ``LLM(...)`` starts the
  other ranks itself, as it does for a user.

70B mode (``--geometry 70b --tp 4``): ``collectives``; ``70b_tp4``: plain sweep, the oracle at
a in {0.6, 0.8} x k in {3, 5} (measured against theoretical speedup) and an MLPSpeculator sized
like ibm-ai-platform/llama3-70b-accelerator at batch 1; ``8b_tp1`` / ``8b_tp4``: the 8B EAGLE-1
example, its speed and greedy tokens at TP 4 against TP 1.

The other phases' ranks are started as torchrun starts them (RANK / WORLD_SIZE / LOCAL_RANK /
MASTER_ADDR / MASTER_PORT in each process's environment, every rank running this script; rank r
on cuda:r): ``LLM(...)`` then starts no processes of its own, and every rank runs this script's
loader wrapper (:func:`install_loader`). That is how the weights get ``--init scaled``: the dummy
weights (normal, std DUMMY_STD, norms 1: load_format="dummy", identical at every TP size) are
rescaled in place on each rank after loading, as gpu_8b.py's SCALED init: o_proj / down_proj
by 1 / sqrt(2 x layers), the token embedding to std EMBED_STD and the LM head a permutation of
the embeddings (gpu_8b._permutation_head). Every step is elementwise on a shard or on the
replicated embedding / LM head, so TP 1 and TP N hold the same model. Without it a 32-layer
random bf16 network is chaotic (greedy tokens flip on rounding differences within a few steps),
the oracle's recorded continuation is lost and its speedups mean little; ``--init dummy`` keeps
the raw weights (the ``equality_*`` phases use them: there, the layers decide every token, so a
sharding error shows at once).

Roofline of plain batch-1 decoding at TP N: bytes of the weights rank 0 reads per step (its
shard of every layer, the final norm and its share of the LM head: 1 / N of its rows where the
head graphs split it by vocabulary, else all of it; the input embedding's one row left out) /
the slowest GPU's copy bandwidth; ``roofline_with_allreduce`` adds the measured all-reduce time
of a step (2 x layers calls of [1, H], replayed from a CUDA graph).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_8b import (  # noqa: E402
    EMBED_STD,
    LLAMA3_8B,
    LLAMA32_1B,
    _batch_axis,
    _permutation_head,
    eagle1_checkpoint,
    eagle3_checkpoint,
    mlp_speculator_checkpoint,
    synthetic_loader,
    weight_bytes_per_step,
    write_config,
)

LLAMA3_70B = dict(
    LLAMA3_8B,
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
)
# the CPU smoke test's model (tests/test_bench_tp.py): tiny, fp32
TINY = dict(
    LLAMA3_8B,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
    torch_dtype="float32",
)
GEOMETRIES = {"8b": LLAMA3_8B, "70b": LLAMA3_70B, "tiny": TINY}
# ibm-ai-platform/llama3-70b-accelerator: emb_dim 8192 and vocab 128256 (Llama-3-70B's); its
# inner_dim and n_predict are assumed as the published ibm-fms/llama2-70b-accelerator config
# (inner_dim 8192, n_predict 4): --mlp-inner-dim changes it
MLP_70B = dict(emb_dim=8192, inner_dim=8192, n_predict=4)
STRATEGIES = ("ngram", "draft", "eagle", "eagle3", "mlp")
ORACLE_8B = "0.8:5"
ORACLE_70B = "0.6:3,0.6:5,0.8:3,0.8:5"
GOALS = {"tp_speedup_b1": 1.7, "tp_speedup_b64": 1.8, "oracle_ratio_tolerance": 0.10}


# ------------------------------------------------------------------------ pure figures
def weight_bytes_per_gpu(cfg: dict, tp: int, dtype_bytes: int = 2,
                         vocab_parallel: bool = False) -> dict:
    """Bytes of the weights one plain decode step reads on each GPU at TP ``tp`` (Megatron
    shards: q heads, KV heads (one each when fewer KV heads than ranks, as vLLM), MLP width;
    norms and embedding replicated): ``rank0`` with the LM head (rank 0 computes the
    logits; with ``vocab_parallel`` 1 / tp of it, as every rank), ``worker`` without it. The
    input embedding's one row per token is left out."""
    h, f, v, n_layers = (cfg[k] for k in ("hidden_size", "intermediate_size", "vocab_size",
                                          "num_hidden_layers"))
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // heads
    q_local = heads // tp * d
    kv_local = max(kv // tp, 1) * d
    layer = (q_local + 2 * kv_local) * h + q_local * h + 3 * (f // tp) * h + 2 * h
    worker = (n_layers * layer + h) * dtype_bytes
    if vocab_parallel:
        worker += v // tp * h * dtype_bytes
        return {"rank0": worker, "worker": worker}
    return {"rank0": worker + v * h * dtype_bytes, "worker": worker}


def roofline(bandwidth_Bps: float, bytes_per_step: float, allreduce_s_per_step: float = 0.0) -> float:
    """Tokens per second of one sequence when a step costs reading ``bytes_per_step`` at
    ``bandwidth_Bps`` plus ``allreduce_s_per_step`` of collectives."""
    return 1.0 / (bytes_per_step / bandwidth_Bps + allreduce_s_per_step)


def compare_greedy(a: list[list[int]], b: list[list[int]]) -> dict:
    """Per prompt: equal, or the index of the first differing token."""
    first = []
    for x, y in zip(a, b):
        diff = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), None)
        if diff is None and len(x) != len(y):
            diff = min(len(x), len(y))
        first.append(diff)
    return {
        "prompts": len(first),
        "equal_prompts": sum(d is None for d in first),
        "first_divergence": first,
        "tokens_per_prompt": min((len(x) for x in a), default=0),
    }


def parse_oracle_grid(text: str) -> list[tuple[float, int]]:
    """``"0.6:3,0.8:5"`` -> [(0.6, 3), (0.8, 5)]; ``""`` -> []."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        a, _, k = item.partition(":")
        try:
            out.append((float(a), int(k)))
        except ValueError:
            raise ValueError(f"--oracle {item!r}: write ALPHA:K, e.g. 0.8:5") from None
    return out


def _plain(runs: list[dict]) -> dict[int, dict]:
    return {r["batch_size"]: r for r in runs if r["method"] == "plain"}


def summarize(result: dict) -> dict:
    """The figures the issues ask for, from the phases' parts (pure: ``--replot`` and the tests
    call it on saved results)."""
    phases = result.get("phases", {})
    tp, cfg = result["tp"], result["geometry"]
    n_layers = cfg["num_hidden_layers"]
    s: dict = {"goals": GOALS}
    coll = phases.get("collectives", {})
    ranks = coll.get("ranks", [])
    bws = [r["copy_bandwidth_Bps"] for r in ranks if r.get("copy_bandwidth_Bps")]
    if bws:
        s["copy_bandwidth_Bps_per_gpu"] = bws
    bw = min(bws) if bws else None
    ar = coll.get("allreduce", {})
    one_row = ar.get("rows_1", {}).get("speculant_graph_us")
    if ar:
        s["allreduce_us"] = {
            rows: {k: v for k, v in row.items() if k.endswith("_us")} for rows, row in ar.items()
        }
        s["allreduce_per_step_ms"] = {
            rows: {k.replace("_us", "_ms"): 2 * n_layers * v / 1e3
                   for k, v in row.items() if k.endswith("_us") and v is not None}
            for rows, row in ar.items()
        }
    if coll.get("lm_head"):  # replicated against vocab-parallel (lm_head_split), us per call
        s["lm_head_us"] = coll["lm_head"]
    per_tp = {}
    for name, ph in phases.items():
        if "runs" not in ph:  # the collectives, the equality phases, a phase that failed early
            continue
        plain = _plain(ph["runs"])
        n = ph["tp"]
        g = ph["geometry"]
        analytic = weight_bytes_per_gpu(g, n, ph.get("dtype_bytes", 2),
                                        bool(ph.get("vocab_parallel")))
        wbytes = ph.get("weight_bytes_rank0") or analytic["rank0"]
        row = {
            "phase": name,
            "tp": n,
            "weight_bytes_per_gpu_rank0": wbytes,
            "weight_bytes_per_gpu_analytic": analytic,
            "plain_tokens_per_s": {b: r["tokens_per_s"] for b, r in sorted(plain.items())},
            "plain_step_ms": {b: 1e3 * r["step_s"] for b, r in sorted(plain.items())},
        }
        if bw:
            row["roofline_tokens_per_s"] = roofline(bw, wbytes)
            if n > 1 and one_row is not None and g["hidden_size"] == cfg["hidden_size"]:
                # the collectives phase measured rows of the run's geometry's hidden size
                row["roofline_with_allreduce_tokens_per_s"] = roofline(
                    bw, wbytes, 2 * g["num_hidden_layers"] * one_row * 1e-6)
            if 1 in plain:
                row["plain_b1_fraction_of_roofline"] = plain[1]["tokens_per_s"] / row[
                    "roofline_tokens_per_s"]
        oracle = [r for r in ph["runs"] if r["method"] == "oracle"]
        if oracle:
            row["oracle"] = [
                {k: r.get(k) for k in ("name", "batch_size", "speedup", "theoretical_speedup",
                                       "speedup_vs_theoretical", "acceptance", "c",
                                       "tokens_per_s", "same_tokens_as_plain")}
                for r in oracle
            ]
        strat = ph.get("strategy_runs", [])
        if strat or ph.get("errors"):
            plain_s = _plain(strat)
            row["strategies"] = [
                {k: r.get(k) for k in ("name", "method", "batch_size", "tokens_per_s", "speedup",
                                       "acceptance", "mean_accepted_length", "c",
                                       "same_tokens_as_plain")}
                for r in strat if r["method"] != "plain"
            ]
            row["strategy_plain_b1_tokens_per_s"] = plain_s.get(1, {}).get("tokens_per_s")
            row["errors"] = ph.get("errors", {})
        per_tp[name] = row
    s["per_phase"] = per_tp
    # TP N against TP 1 (8B mode)
    one, many = phases.get("tp1"), phases.get(f"tp{tp}")
    if tp > 1 and one and many and "runs" in one and "runs" in many:
        p1, pn = _plain(one["runs"]), _plain(many["runs"])
        ratio = {b: pn[b]["tokens_per_s"] / p1[b]["tokens_per_s"] for b in sorted(p1) if b in pn}
        s["tp_speedup_plain"] = ratio
        if 1 in ratio:
            s["goal_tp_speedup_b1_met"] = ratio[1] >= GOALS["tp_speedup_b1"]
        if 64 in ratio:
            s["goal_tp_speedup_b64_met"] = ratio[64] >= GOALS["tp_speedup_b64"]
        o1 = {(r["name"], r["batch_size"]): r for r in one["runs"] if r["method"] == "oracle"}
        on = {(r["name"], r["batch_size"]): r for r in many["runs"] if r["method"] == "oracle"}
        rows = []
        for key in o1:
            if key in on:
                r = on[key]["speedup"] / o1[key]["speedup"]
                rows.append({"name": key[0], "batch_size": key[1],
                             "speedup_tp1": o1[key]["speedup"], f"speedup_tp{tp}": on[key]["speedup"],
                             "ratio": r,
                             "within_goal": abs(r - 1) <= GOALS["oracle_ratio_tolerance"]})
        if rows:
            s["oracle_tp_vs_tp1"] = rows
    # 70B mode: the 8B EAGLE example, TP N against TP 1 (plain and each strategy, batch 1)
    one, many = phases.get("8b_tp1"), phases.get(f"8b_tp{tp}")
    if tp > 1 and one and many and "runs" in one and "runs" in many:
        p1, pn = _plain(one["runs"]), _plain(many["runs"])
        s["8b_example_tp_speedup"] = {
            "plain": {b: pn[b]["tokens_per_s"] / p1[b]["tokens_per_s"] for b in p1 if b in pn},
        }
        s1 = {(r["name"], r["batch_size"]): r for r in one.get("strategy_runs", [])
              if r["method"] != "plain"}
        for r in many.get("strategy_runs", []):
            key = (r["name"], r["batch_size"])
            if r["method"] != "plain" and key in s1:
                s["8b_example_tp_speedup"][f"{key[0]} b{key[1]}"] = {
                    "tokens_per_s_tp1": s1[key]["tokens_per_s"],
                    f"tokens_per_s_tp{tp}": r["tokens_per_s"],
                    "ratio": r["tokens_per_s"] / s1[key]["tokens_per_s"],
                    "speedup_over_plain_tp1": s1[key]["speedup"],
                    f"speedup_over_plain_tp{tp}": r["speedup"],
                }
    # greedy equality: every pair of phases at TP 1 and TP N on the same model
    eq = {}
    for a_name, b_name in _equality_pairs(phases, tp):
        a, b = phases[a_name], phases[b_name]
        for key in sorted(b.get("greedy", {})):
            eq[f"{b_name}:{key} vs {a_name}:plain"] = dict(
                compare_greedy(a["greedy"]["plain"], b["greedy"][key]),
                dtype=b.get("dtype"), init=b.get("init"))
    if eq:
        s["greedy_equality"] = eq
    return s


def report(result: dict) -> str:
    """The summary as a few lines of text (the run's log: the JSON holds everything)."""
    s = result.get("summary") or summarize(result)
    lines = [f"== gpu_tp: {result.get('mode')} geometry, TP {result['tp']}, {result.get('device')}"]
    if s.get("copy_bandwidth_Bps_per_gpu"):
        bws = ", ".join(f"{b / 1e12:.3f}" for b in s["copy_bandwidth_Bps_per_gpu"])
        lines.append(f"copy bandwidth per GPU: {bws} TB/s")
    for rows, row in s.get("allreduce_us", {}).items():
        per_step = s.get("allreduce_per_step_ms", {}).get(rows, {})
        cells = [f"{k[:-3]} {v:.1f} us ({per_step.get(k[:-3] + '_ms', 0):.2f} ms/step)"
                 for k, v in row.items() if v is not None]
        lines.append(f"all-reduce {rows}: " + "; ".join(cells))
    for name, row in s.get("per_phase", {}).items():
        plain = ", ".join(f"b{b} {v:.1f}" for b, v in row["plain_tokens_per_s"].items())
        roof = row.get("roofline_tokens_per_s")
        lines.append(
            f"{name}: {row['weight_bytes_per_gpu_rank0'] / 1e9:.2f} GB/step on rank 0"
            + (f", roofline {roof:.1f} tok/s" if roof else "")
            + (f" ({row['roofline_with_allreduce_tokens_per_s']:.1f} with all-reduces)"
               if row.get("roofline_with_allreduce_tokens_per_s") else "")
            + (f", b1 at {row['plain_b1_fraction_of_roofline']:.1%} of it"
               if row.get("plain_b1_fraction_of_roofline") else "")
            + f"; plain tok/s {plain}")
        for o in row.get("oracle", []):
            theo = o.get("theoretical_speedup")
            lines.append(f"  {o['name']} b{o['batch_size']}: speedup {o['speedup']:.3f}"
                         + (f" (theoretical {theo:.3f})" if theo else "")
                         + f", acceptance {o.get('acceptance')}, same tokens "
                         f"{o.get('same_tokens_as_plain')}")
        for st in row.get("strategies", []):
            acc = st.get("acceptance")
            lines.append(f"  {st['name']} b{st['batch_size']}: {st['tokens_per_s']:.1f} tok/s, "
                         f"speedup {st['speedup']:.3f}, acceptance "
                         f"{'-' if acc is None else f'{acc:.3f}'}, same tokens "
                         f"{st.get('same_tokens_as_plain')}")
    if s.get("tp_speedup_plain"):
        ratio = ", ".join(f"b{b} {v:.3f}" for b, v in s["tp_speedup_plain"].items())
        lines.append(f"plain TP {result['tp']} / TP 1: {ratio} (goals: b1 >= "
                     f"{GOALS['tp_speedup_b1']}: {s.get('goal_tp_speedup_b1_met')}, b64 >= "
                     f"{GOALS['tp_speedup_b64']}: {s.get('goal_tp_speedup_b64_met')})")
    for o in s.get("oracle_tp_vs_tp1", []):
        lines.append(f"oracle {o['name']} b{o['batch_size']}: TP {result['tp']} / TP 1 speedup "
                     f"ratio {o['ratio']:.3f} (within 10%: {o['within_goal']})")
    for key, v in s.get("8b_example_tp_speedup", {}).items():
        lines.append(f"8B example {key}: TP {result['tp']} / TP 1 "
                     + (", ".join(f"b{b} {r:.3f}" for b, r in v.items()) if key == "plain"
                        else f"{v['ratio']:.3f}"))
    for key, eq in s.get("greedy_equality", {}).items():
        lines.append(f"greedy {key} ({eq.get('init')} init, {eq.get('dtype')}): "
                     f"{eq['equal_prompts']}/{eq['prompts']} prompts equal over "
                     f"{eq['tokens_per_prompt']} tokens; first divergence {eq['first_divergence']}")
    for name, ph in result.get("phases", {}).items():
        if ph.get("errors"):
            lines.append(f"errors in {name}: {ph['errors']}")
    return "\n".join(lines)


def _equality_pairs(phases: dict, tp: int) -> list[tuple[str, str]]:
    pairs = []
    for base in ("", "equality_", "8b_"):
        a, b = f"{base}tp1", f"{base}tp{tp}"
        if a in phases and b in phases and "plain" in phases[a].get("greedy", {}):
            pairs.append((a, b))
    return pairs


# ------------------------------------------------------------------------ plots
def plot(result: dict, out_dir: str | Path, stem: str = "gpu_tp") -> Path:
    """One figure, four panels: plain tokens/s over the batch sweep per TP size (rooflines
    dotted); TP N / TP 1 per batch size against the goals (8B) or the oracle measured against
    theoretical speedup (70B); the oracle's speedup per TP size; the all-reduce cost per call."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    s = result.get("summary") or summarize(result)
    tp = result["tp"]
    fig, axes = plt.subplots(2, 2, figsize=(13, 9.5))
    ax = axes[0][0]
    for i, (name, row) in enumerate(s.get("per_phase", {}).items()):
        pts = sorted((int(b), v) for b, v in row["plain_tokens_per_s"].items())
        if not pts:
            continue
        color = f"C{i}"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=color,
                label=f"{name}: plain")
        if row.get("roofline_tokens_per_s"):
            ax.axhline(row["roofline_tokens_per_s"], color=color, ls=":", lw=1,
                       label=f"{name}: batch-1 roofline {row['roofline_tokens_per_s']:.0f} tok/s")
    batches = sorted({int(b) for row in s.get("per_phase", {}).values()
                      for b in row["plain_tokens_per_s"]})
    if batches:
        _batch_axis(ax, batches)
    ax.set_yscale("log")
    ax.set_ylabel("decode tokens/s (all sequences)")
    ax.set_title("plain decoding", fontsize=9)
    ax.grid(True, alpha=0.3, which="both")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)

    ax = axes[0][1]
    if s.get("tp_speedup_plain"):
        pts = sorted((int(b), v) for b, v in s["tp_speedup_plain"].items())
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"TP {tp} / TP 1")
        ax.axhline(GOALS["tp_speedup_b1"], color="tab:red", ls=":", lw=1,
                   label=f"goal at batch 1: {GOALS['tp_speedup_b1']}")
        ax.axhline(GOALS["tp_speedup_b64"], color="tab:purple", ls=":", lw=1,
                   label=f"goal at batch 64: {GOALS['tp_speedup_b64']}")
        ax.axhline(tp, color="k", lw=0.8, label=f"ideal: {tp}")
        _batch_axis(ax, [p[0] for p in pts])
        ax.set_ylabel("plain tokens/s, TP N over TP 1")
        ax.set_title("tensor-parallel scaling of plain decoding", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(True, alpha=0.3)
    else:
        oracle = [o for row in s.get("per_phase", {}).values() for o in row.get("oracle", [])
                  if o["batch_size"] == 1]
        if oracle:
            xs = range(len(oracle))
            ax.bar([x - 0.2 for x in xs], [o["speedup"] for o in oracle], 0.4, label="measured")
            ax.bar([x + 0.2 for x in xs], [o["theoretical_speedup"] or 0 for o in oracle], 0.4,
                   label="theoretical (measured a and c)")
            ax.set_xticks(list(xs), [o["name"].replace("oracle ", "") for o in oracle], fontsize=8)
            ax.axhline(1.0, color="k", lw=0.8)
            ax.set_ylabel("speedup over plain, batch 1")
            ax.set_title(f"oracle at TP {tp}", fontsize=9)
            ax.legend(fontsize=7)

    ax = axes[1][0]
    drawn = False
    for i, (name, row) in enumerate(s.get("per_phase", {}).items()):
        for oname in dict.fromkeys(o["name"] for o in row.get("oracle", [])):
            pts = sorted((o["batch_size"], o["speedup"]) for o in row["oracle"]
                         if o["name"] == oname)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=f"C{i}",
                    label=f"{name}: {oname}")
            drawn = True
        for st in row.get("strategies", []):
            ax.scatter([st["batch_size"]], [st["speedup"]], marker="x", color=f"C{i}")
            ax.annotate(st["name"].split(" k=")[0], (st["batch_size"], st["speedup"]),
                        fontsize=6, xytext=(3, 2), textcoords="offset points")
            drawn = True
    if drawn:
        _batch_axis(ax, sorted({int(x) for line in ax.get_lines() for x in line.get_xdata()}
                               | {1}))
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_ylabel("speedup over plain at that TP size")
        ax.set_title("oracle (lines) and strategies (x: random drafters, acceptance ~0)",
                     fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(True, alpha=0.3)

    ax = axes[1][1]
    ar = s.get("allreduce_us", {})
    if ar:
        kinds = sorted({k for row in ar.values() for k, v in row.items() if v is not None})
        labels = list(ar)
        width = 0.8 / max(len(kinds), 1)
        for j, kind in enumerate(kinds):
            ax.bar([i + j * width for i in range(len(labels))],
                   [ar[lab].get(kind) or 0 for lab in labels], width,
                   label=kind.replace("_us", ""))
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))],
                      [f"[{lab.split('_')[1]}, H]" for lab in labels])
        ax.set_ylabel("microseconds per all-reduce")
        ax.set_title(f"all-reduce over {tp} ranks ({result.get('dtype', 'bfloat16')})",
                     fontsize=9)
        ax.legend(fontsize=7)
    layers = result["geometry"]["num_hidden_layers"]
    fig.suptitle(
        f"Tensor parallelism on {result.get('device', '?')}: {result.get('mode', '?')} geometry "
        f"({layers} layers), {result.get('dtype', 'bfloat16')}, synthetic weights "
        f"({result.get('init', '?')} init)",
        fontsize=10,
    )
    fig.tight_layout()
    path = out / f"{stem}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_result(result: dict, out_dir: str | Path, stem: str = "gpu_tp", summarize_fn=None,
                 plot_fn=None) -> tuple[Path, Path]:
    """gpu_tp.json (with its summary worked out now) and gpu_tp.png; ``summarize_fn`` /
    ``plot_fn``: another benchmark's (bench/gpu_tree.py writes its results the same way)."""
    summarize_fn, plot_fn = summarize_fn or summarize, plot_fn or plot
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result["summary"] = summarize_fn(result)
    path = out / f"{stem}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    try:
        png = plot_fn(result, out, stem)
    except Exception as e:  # noqa: BLE001 - the JSON stays; the figure can be redrawn (--replot)
        result["plot_error"] = f"{type(e).__name__}: {e}"
        path.write_text(json.dumps(result, indent=1, default=str))
        png = out / f"{stem}.png"
    return path, png


def replot(json_path: str | Path, out_dir: str | Path, summarize_fn=None, plot_fn=None) -> Path:
    """The figure of a saved gpu_tp.json (no GPU needed); its summary is worked out again."""
    summarize_fn, plot_fn = summarize_fn or summarize, plot_fn or plot
    result = json.loads(Path(json_path).read_text())
    result["summary"] = summarize_fn(result)
    return plot_fn(result, out_dir, Path(json_path).stem)


# ------------------------------------------------------------------------ synthetic weights
def scaled_init(model, n_layers: int, seed: int = 0, allow_cpu: bool = False) -> None:
    """gpu_8b.py's SCALED init made from a dummy-loaded model in place (on this rank's shard):
    o_proj / down_proj times 1 / sqrt(2 layers), the embedding to std EMBED_STD, the LM head
    row pi(t) = c x embedding(t) (a seeded permutation, the same on every rank). On the CPU
    only for tests (``allow_cpu``): the CPU path's packed weight copies keep the old values."""
    import torch

    from speculant.models.loader import DUMMY_STD

    device = model.embed_tokens.weight.device
    if device.type != "cuda" and not allow_cpu:
        raise ValueError("--init scaled needs CUDA (the CPU path packs its weights at load time); "
                         "use --init dummy on the CPU")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.mul_(1.0 / math.sqrt(2 * n_layers))
        model.embed_tokens.weight.mul_(EMBED_STD / DUMMY_STD)
        if not model.tie_word_embeddings:
            _permutation_head(model, torch.Generator(device).manual_seed(seed))


def install_loader() -> None:
    """Wrap ``speculant.models.loader.load_model`` (and the bindings of it already imported) in
    every rank's process: a config with ``speculant_synthetic`` (gpu_8b's drafter configs) gets
    gpu_8b's synthetic weights; a config with ``speculant_tp_init: "scaled"`` is loaded as usual
    (load_format="dummy") and then :func:`scaled_init`-ed."""
    import speculant.models.loader as loader
    from speculant.distributed.parallel import set_tensor_parallel, tensor_parallel

    original = loader.load_model
    if getattr(original, "_gpu_tp", False):
        return
    synth = synthetic_loader(original)

    def load_model(folder, config, *args, **kwargs):
        if getattr(config, "speculant_synthetic", False):  # a drafter of gpu_8b's
            names = ("dtype", "device", "max_positions", "load_format", "seed", "tp")
            given = dict(zip(names, args)) | kwargs
            prev = tensor_parallel()
            # gpu_8b builds the model itself: under the tensor-parallel state the caller asked
            # for (a drafter: none), else the current one (the engine's unsharded() context)
            set_tensor_parallel(given.get("tp") or prev)
            try:
                return synth(folder, config, *(given[k] for k in names[:3]))
            finally:
                set_tensor_parallel(prev)
        model = original(folder, config, *args, **kwargs)
        if getattr(config, "speculant_tp_init", None) == "scaled":
            scaled_init(model, config.num_hidden_layers, int(getattr(config, "speculant_seed", 0)))
        return model

    load_model._gpu_tp = True
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("speculant") and (
            getattr(mod, "load_model", None) is original
        ):
            mod.load_model = load_model


def mlp_speculator_70b(folder: Path, emb_dim: int, inner_dim: int, n_predict: int) -> Path:
    """An MLPSpeculator of ibm-ai-platform/llama3-70b-accelerator's kind (tied stages) for a
    target of hidden size ``emb_dim``: random bf16 weights."""
    return mlp_speculator_checkpoint(folder, n_predict, emb_dim, inner_dim,
                                     LLAMA3_70B["vocab_size"])


def strategy_spec(name: str, tmp: Path, args) -> dict:
    """The speculative_config of one strategy of ``--strategies`` (checkpoints written to
    ``tmp``; the drafters are for the 8B target except ``mlp`` in the 70B geometry)."""
    if name == "ngram":
        return dict(name="ngram", method="ngram", num_speculative_tokens=3)
    if name == "draft":
        if args.geometry == "tiny":  # the CPU smoke test: a one-layer draft of the tiny model
            d = write_config(tmp / "draft-tiny", dict(TINY, num_hidden_layers=1), 1)
            return dict(name="draft tiny", method="draft_model", model=str(d),
                        num_speculative_tokens=3, kv_cache_memory=1 << 22)
        d = write_config(tmp / "draft-1b", LLAMA32_1B, 1)
        return dict(name="draft 1B", method="draft_model", model=str(d),
                    num_speculative_tokens=3, kv_cache_memory=2 << 30)
    if name == "eagle":
        return dict(name="eagle", method="eagle", model=str(eagle1_checkpoint(tmp / "eagle")),
                    num_speculative_tokens=3)
    if name == "eagle3":
        return dict(name="eagle3", method="eagle3",
                    model=str(eagle3_checkpoint(tmp / "eagle3")), num_speculative_tokens=3)
    if name == "mlp":
        if args.geometry == "70b":
            m = mlp_speculator_70b(tmp / "mlp70b", LLAMA3_70B["hidden_size"], args.mlp_inner_dim,
                                   MLP_70B["n_predict"])
        else:
            m = mlp_speculator_checkpoint(tmp / "mlp")
        return dict(name="mlp_speculator", method="mlp_speculator", model=str(m),
                    num_speculative_tokens=4)
    raise ValueError(f"--strategies: unknown {name!r}; use ngram, draft, eagle, eagle3, mlp")


# ------------------------------------------------------------------------ phases
def _world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1") or 1)


def _part_path(args, rank: int = 0) -> Path:
    suffix = "" if rank == 0 else f".rank{rank}"
    return Path(args.part_dir) / f"{args.phase_name}{suffix}.json"


def save_json(path: Path, data: dict) -> None:
    """Write ``data`` to ``path`` atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, default=str))
    tmp.replace(path)


def _save_part(args, part: dict, rank: int = 0) -> None:
    save_json(_part_path(args, rank), part)


def cpu_copy_bandwidth(nbytes: int = 256 << 20, iters: int = 5) -> float:
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / sorted(times)[len(times) // 2]


def _time_calls(fn, n: int, cuda: bool) -> float:
    """Seconds per call of ``fn`` over ``n`` calls (device time on CUDA)."""
    import torch

    if cuda:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3 / n
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def collectives_phase(args) -> None:
    """One rank: copy bandwidth of its GPU, then all-reduce timings (rank 0 writes them)."""
    import torch
    import torch.distributed as dist

    from speculant.distributed import (
        all_reduce,
        comm,
        init_tensor_parallel,
        shutdown_tensor_parallel,
    )

    rank, size = _world()
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    part: dict = {"rank": rank, "size": size, "errors": {}}
    if cuda:
        from gpu_8b import copy_bandwidth

        torch.cuda.set_device(device)
        part["device"] = torch.cuda.get_device_name(device)
        part["copy_bandwidth_Bps"] = copy_bandwidth()
    else:
        part["device"] = "cpu"
        part["copy_bandwidth_Bps"] = cpu_copy_bandwidth()
    print(f"rank {rank}: copy bandwidth {part['copy_bandwidth_Bps'] / 1e12:.3f} TB/s", flush=True)
    _save_part(args, part, rank)
    if size == 1:
        return
    tp = init_tensor_parallel(rank, size, device)
    part["one_shot_symmetric_memory"] = getattr(comm, "_one_shot", None) is not None
    hidden = GEOMETRIES[args.geometry]["hidden_size"]
    dtype = torch.bfloat16 if cuda else torch.float32
    res = {}
    try:
        for rows in (1, 64, 384):
            row: dict = {"shape": [rows, hidden], "dtype": str(dtype).replace("torch.", "")}
            x = torch.full((rows, hidden), float(rank + 1), dtype=dtype, device=device)
            y = all_reduce(x)
            row["correct"] = bool((y == size * (size + 1) / 2).all())
            x.zero_()

            def ours(x=x):
                all_reduce(x)

            def nccl(x=x):  # torch.distributed on the device group: NCCL (gloo on the CPU)
                dist.all_reduce(x, group=tp.group)

            for label, fn in (("speculant", ours), ("dist", nccl)):
                _time_both(row, label, fn, args, tp, device, cuda)
            res[f"rows_{rows}"] = row
            if rank == 0:
                print(f"all-reduce {row}", flush=True)
    except Exception as e:  # noqa: BLE001 - reported in the JSON
        part["errors"]["allreduce"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    part["allreduce"] = res
    _save_part(args, part, rank)
    if cuda and not part["errors"]:
        try:  # the fused one-shot all-reduce + residual add + RMSNorm (kernels/tp_allreduce.py)
            from speculant.kernels.tp_allreduce import SymmetricAllReduce

            weight = torch.ones(hidden, dtype=dtype, device=device)
            # rows: a decode / verification step (k = 5) of batch 1, 64 / 16 (96 rows) / 64;
            # the Lamport form takes up to 32 rows, the flag form (lamport_rows=0) is timed
            # beside it at 1 and 64 (docs/tensor_parallel.md: where each one is faster)
            fused = SymmetricAllReduce(tp.group, device, 512, hidden, dtype)
            flags = SymmetricAllReduce(tp.group, device, 512, hidden, dtype, lamport_rows=0)
            for rows, label, ar in ((1, "fused_allreduce_norm", fused),
                                    (1, "fused_allreduce_norm_flags", flags),
                                    (64, "fused_allreduce_norm", fused),
                                    (64, "fused_allreduce_norm_lamport", SymmetricAllReduce(
                                        tp.group, device, 64, hidden, dtype, lamport_rows=64)),
                                    (96, "fused_allreduce_norm", fused),
                                    (384, "fused_allreduce_norm", fused)):
                x = torch.zeros(rows, hidden, dtype=dtype, device=device)
                resid = torch.zeros_like(x)
                slot = [0]

                def call(x=x, resid=resid, slot=slot, ar=ar):
                    slot[0] += 1
                    ar(x, slot[0], resid, weight)

                _time_both(res.setdefault(f"rows_{rows}", {"shape": [rows, hidden]}),
                           label, call, args, tp, device, cuda)
            _save_part(args, part, rank)
        except Exception as e:  # noqa: BLE001 - reported in the JSON
            part["errors"]["fused_allreduce_norm"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            _save_part(args, part, rank)
    if cuda and not part["errors"]:
        try:
            part["lm_head"] = lm_head_split(args, tp, device, dtype, hidden)
            _save_part(args, part, rank)
        except Exception as e:  # noqa: BLE001 - reported in the JSON
            part["errors"]["lm_head"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            _save_part(args, part, rank)
    shutdown_tensor_parallel()


def lm_head_split(args, tp, device, dtype, hidden: int) -> dict:
    """The LM head replicated (rank 0 alone computes ``[rows, vocab]``, as the engine does)
    against vocab-parallel (each rank ``vocab / size`` rows of it, then an NCCL all-gather of
    the float32 shards and their interleave into ``[rows, vocab]``), both as the engine
    computes logits (``compute_logits``: the GEMV kernel for 1 and >= 3 rows, then float32),
    in CUDA graphs: microseconds per call."""
    import torch
    import torch.distributed as dist

    from speculant.kernels.gemv import gemv
    from speculant.models import fused

    vocab = GEOMETRIES[args.geometry]["vocab_size"]
    size = tp.size
    shard = vocab // size
    gen = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(vocab, hidden, dtype=dtype, device=device, generator=gen) * 0.02  # [V, H]
    ws = w[:shard]  # [V / size, H]: this rank's vocab rows (contiguous)

    def logits(h, weight):  # compute_logits: [rows, H] -> [rows, V'] float32
        if fused.gemv_enabled(h) or (h.shape[0] >= 3 and fused.gemv_in_enabled(h)):
            return gemv(h, weight).float()
        return torch.nn.functional.linear(h, weight).float()

    out: dict = {"vocab": vocab, "shard_rows": shard}
    for rows in (1, 64, 384):
        h = torch.randn(rows, hidden, dtype=dtype, device=device, generator=gen)  # [rows, H]
        gathered = torch.empty(size, rows, shard, dtype=torch.float32, device=device)

        def full(h=h):
            logits(h, w)

        def split(h=h, g=gathered):
            part = logits(h, ws)  # [rows, V / size]
            dist.all_gather_into_tensor(g, part, group=tp.group)
            g.permute(1, 0, 2).reshape(h.shape[0], size * shard)  # [rows, V]

        def gather_only(h=h, g=gathered):
            dist.all_gather_into_tensor(g, g[tp.rank], group=tp.group)

        row: dict = {}
        for label, fn in (("replicated", full), ("vocab_parallel", split),
                          ("all_gather", gather_only)):
            _time_both(row, label, fn, args, tp, device, True)
        out[f"rows_{rows}"] = row
        if tp.rank == 0:
            print(f"lm head rows {rows}: {row}", flush=True)
    return out


def _time_both(row: dict, label: str, fn, args, tp, device, cuda: bool) -> None:
    """``row[label + "_eager_us"]``: microseconds per call of ``fn`` called one by one;
    ``row[label + "_graph_us"]``: per call of 32 calls captured in one CUDA graph, replayed
    (None on the CPU)."""
    import torch
    import torch.distributed as dist

    for _ in range(10):
        fn()
    if cuda:
        torch.cuda.synchronize(device)
    dist.barrier(group=tp.cpu_group)
    row[f"{label}_eager_us"] = 1e6 * _time_calls(fn, args.allreduce_iters, cuda)
    if not cuda:
        row[f"{label}_graph_us"] = None
        return
    reps = 32  # all-reduces per graph (a layer stack's worth)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize(device)
    dist.barrier(group=tp.cpu_group)
    per_replay = _time_calls(graph.replay, max(args.allreduce_iters // reps, 5), True)
    row[f"{label}_graph_us"] = 1e6 * per_replay / reps


def engine_phase(args) -> None:
    """Every rank builds the LLM (ranks > 0 serve rank 0 inside ``LLM(...)`` and exit there);
    rank 0 measures and writes the part file after every cell."""
    import torch

    from speculant import LLM
    from speculant.bench import _decode_run, _set_strategy, device_name, random_prompts, run_bench

    rank, size = _world()
    if args.gemv_max_rows is not None:  # A/B of the one-row GEMV path, on every rank
        import speculant.models.fused as fused

        fused.GEMV_MAX_ROWS = args.gemv_max_rows
    cfg = dict(GEOMETRIES[args.geometry])
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    tmp = Path(tempfile.mkdtemp(prefix=f"speculant-{args.phase_name}-r{rank}-"))
    target = tmp / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(
        dict(cfg, speculant_tp_init=args.init, speculant_seed=0)))
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    n_seqs = max(batch_sizes + [args.equality_prompts])
    cuda = args.device == "cuda"
    part: dict = {
        "tp": args.tp, "geometry": cfg, "geometry_name": args.geometry, "init": args.init,
        "eager": args.eager, "errors": {},
    }
    t0 = time.perf_counter()
    llm = LLM(
        model=str(target),
        load_format="dummy",
        tensor_parallel_size=args.tp,
        dtype=args.dtype,
        device=args.device,
        skip_tokenizer_init=True,
        max_num_seqs=n_seqs,
        max_model_len=args.prompt_len + args.max_tokens + 64,
        kv_cache_memory=int(args.kv_cache_gib * (1 << 30)),
        enforce_eager=args.eager,
    )
    # ranks > 0 never come here: they serve rank 0's calls inside LLM(...) and exit
    engine = llm.engine
    part["startup_s"] = time.perf_counter() - t0
    part["device"] = device_name(engine.device)
    model = engine.model
    part["weight_bytes_rank0"] = weight_bytes_per_step(model)
    # the head graphs split the LM head by vocabulary (CUDA graphs at TP > 1)
    part["vocab_parallel"] = bool(getattr(engine.runner.graphs, "decode_head", False))
    if part["vocab_parallel"]:  # a batch-1 step reads 1 / N of the LM head on each rank
        head = model.lm_head.weight
        part["weight_bytes_rank0"] -= head.numel() * head.element_size() * (args.tp - 1) // args.tp
    part["dtype_bytes"] = engine.dtype.itemsize
    part["dtype"] = str(engine.dtype).replace("torch.", "")
    print(f"[{args.phase_name}] TP {args.tp} up in {part['startup_s']:.0f}s, "
          f"{part['weight_bytes_rank0'] / 1e9:.2f} GB per step on rank 0", flush=True)
    prompts = random_prompts(n_seqs, args.prompt_len, engine.vocab_size, seed=0)
    eq = prompts[: args.equality_prompts]
    _set_strategy(engine, None)
    part["greedy"] = {"plain": _decode_run(engine, eq, args.equality_tokens)["tokens"]}
    _save_part(args, part)
    tmp_ck = tmp / "drafters"

    def progress(row: dict) -> None:
        print(f"[{args.phase_name} {time.perf_counter() - t0:5.0f}s] {row['name']:>24} "
              f"b{row['batch_size']:<3} {row['tokens_per_s']:9.1f} tok/s  speedup "
              f"{row['speedup']:.3f}  acceptance {row.get('acceptance')}", flush=True)

    repeats = {1: max(1, args.repeats)}
    if not args.no_perf:
        oracles = [dict(method="oracle", alpha=a, num_speculative_tokens=k)
                   for a, k in parse_oracle_grid(args.oracle or "")]
        if args.disable_by_batch_size:
            for o in oracles:
                o["disable_by_batch_size"] = args.disable_by_batch_size
        obs = [int(b) for b in (args.oracle_batch_sizes or args.batch_sizes).split(",")]
        together = bool(oracles) and obs == batch_sizes  # one run_bench: plain measured once
        failed_together = False
        try:
            res = run_bench(engine, prompts, oracles if together else [], args.max_tokens,
                            batch_sizes, warmup_tokens=args.warmup_tokens, repeats=repeats,
                            progress=progress)
            part["runs"] = res["runs"]
        except Exception as e:  # noqa: BLE001 - reported in the JSON
            part["errors"]["oracle" if together else "plain"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            failed_together = together
        _save_part(args, part)
        if failed_together:  # the plain sweep alone
            try:
                part["runs"] = run_bench(engine, prompts, [], args.max_tokens, batch_sizes,
                                         warmup_tokens=args.warmup_tokens, repeats=repeats,
                                         progress=progress)["runs"]
            except Exception as e:  # noqa: BLE001 - reported in the JSON
                part["errors"]["plain"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
            _save_part(args, part)
        elif oracles and not together:  # other batch sizes: plain measured again beside them
            try:
                res = run_bench(engine, prompts, oracles, args.max_tokens, obs,
                                warmup_tokens=args.warmup_tokens, repeats=repeats,
                                progress=progress)
                part.setdefault("runs", []).extend(r for r in res["runs"] if r["method"] != "plain")
                part["oracle_plain_runs"] = [r for r in res["runs"] if r["method"] == "plain"]
            except Exception as e:  # noqa: BLE001 - reported in the JSON
                part["errors"]["oracle"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
            _save_part(args, part)
        part["strategy_runs"] = []
        sbs = [int(b) for b in args.strategy_batch_sizes.split(",")]
        for name in filter(None, (args.strategies or "").split(",")):
            try:
                spec = strategy_spec(name, tmp_ck, args)
                res = run_bench(engine, prompts, [spec], args.max_tokens, sbs,
                                warmup_tokens=args.warmup_tokens, repeats=repeats,
                                progress=progress)
                part["strategy_runs"] += res["runs"]
                if name in args.greedy_strategies.split(","):
                    _set_strategy(engine, {k: v for k, v in spec.items() if k != "name"})
                    part["greedy"][name] = _decode_run(engine, eq, args.equality_tokens)["tokens"]
            except Exception as e:  # noqa: BLE001 - reported in the JSON
                part["errors"][name] = f"{type(e).__name__}: {e}"
                print(f"[{args.phase_name}] {name} failed: {e}", flush=True)
                traceback.print_exc()
            finally:
                _set_strategy(engine, None)
                if cuda:
                    torch.cuda.empty_cache()
            _save_part(args, part)
    if args.profile and cuda:  # rank 0's kernels of plain and oracle steps (its all-reduces too)
        for b in [int(x) for x in args.profile_batch.split(",")]:
            try:
                _profile(engine, prompts, b, part, args.phase_name)
            except Exception as e:  # noqa: BLE001 - reported in the JSON
                part["errors"][f"profile_b{b}"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
            _save_part(args, part)
    part["wall_s"] = time.perf_counter() - t0
    _save_part(args, part)
    llm.close()


def _profile(engine, prompts, b: int, part: dict, phase: str) -> None:
    """Kernel profiles of plain and oracle (a = 0.8, k = 5) decode steps of ``b`` requests on
    rank 0 (``part["profile_b{b}"]`` / ``part["profile_oracle_b{b}"]``)."""
    from gpu_8b import kernel_profile

    from speculant.bench import _decode_run, _set_strategy

    prompts = [prompts[i % len(prompts)] for i in range(b)]
    part[f"profile_b{b}"] = prof = kernel_profile(engine, prompts, 16, batch=b)
    _print_profile(f"[{phase}] profile b{b}", prof, own=True)
    # oracle (a = 0.8, k = 5) steps: a verification step's kernels and gaps
    _set_strategy(engine, None)
    recs = _decode_run(engine, prompts, 64)["tokens"]
    refs = [{"prompt_token_ids": p, "output_token_ids": r} for p, r in zip(prompts, recs)]
    spec = dict(method="oracle", alpha=0.8, num_speculative_tokens=5, references=refs)
    part[f"profile_oracle_b{b}"] = prof = kernel_profile(engine, prompts, 40, spec, batch=b)
    _print_profile(f"[{phase}] profile oracle b{b}", prof, own=False)


def _print_profile(title: str, prof: dict, own: bool) -> None:
    print(f"{title}: wall {prof['wall_ms_per_decode_step_profiled']:.3f} ms/step, kernels "
          f"{prof['gpu_ms_per_step']:.3f}, effective {prof['effective_ms_per_step']:.3f}, idle "
          f"{prof['gaps'].get('idle_ms_per_step', 0):.3f}", flush=True)
    for k in prof["effective_top_kernels"][:16]:
        print(f"   {k['ms_per_step'] * 1e3:8.1f} us  {k['kernel'][:90]}", flush=True)
    for k in prof["top_kernels"][:16] if own else []:
        print(f"   own {k['ms_per_step'] * 1e3:8.1f} us x{k['calls_per_step']:.0f}  "
              f"{k['kernel'][:90]}", flush=True)
    for g in prof["gaps"].get("idle_by_pair_us_per_step", [])[:6]:
        print(f"   idle {g['us_per_step']:8.1f} us x{g['count_per_step']:.1f}  {g['pair']}",
              flush=True)


# ------------------------------------------------------------------------ orchestration
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_phase(name: str, kind: str, ranks: int, extra: list[str], args, timeout_s: float) -> dict:
    """Start ``ranks`` processes of this script for one phase, as torchrun would (its
    environment variables; rank r on cuda:r), wait up to ``timeout_s`` (then kill the phase's
    process group), and return rank 0's part (plus the other ranks' for ``collectives``) with
    the phase's exit status and wall time. Each rank's output goes to ``parts/NAME.rankR.log``;
    the run's own output gets the progress lines, and each log's tail when the phase failed."""
    part_dir = Path(args.out) / "parts"
    part_dir.mkdir(parents=True, exist_ok=True)
    for old in [*part_dir.glob(f"{name}.*json"), *part_dir.glob(f"{name}.rank*.log")]:
        old.unlink()
    argv = [sys.executable, str(Path(__file__).resolve()), *args.argv, *extra,
            "--phase", kind, "--phase-name", name, "--part-dir", str(part_dir)]
    port = _free_port()
    procs: list[subprocess.Popen] = []
    logs = [part_dir / f"{name}.rank{rank}.log" for rank in range(ranks)]
    t0 = time.perf_counter()
    for rank in range(ranks):
        # never NVLink multicast (NVLS) on a lent machine (speculant.distributed sets the same)
        env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
                   PYTHONUNBUFFERED="1")  # a killed phase still leaves its last lines
        if ranks > 1:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks),
                       LOCAL_WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port))
        else:
            for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
                env.pop(key, None)
        # one process group for the phase (rank 0 leads it), killed whole on a time-out
        # (setpgid in the child: Popen's process_group argument needs Python 3.11)
        group = 0 if rank == 0 else procs[0].pid
        with open(logs[rank], "w") as log:
            procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          preexec_fn=lambda g=group: os.setpgid(0, g)))
    rc: int | None = None
    timed_out = False
    try:
        rc = procs[0].wait(timeout=max(timeout_s, 1))
        for p in procs[1:]:  # they leave when rank 0 closes its LLM
            p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        timed_out = rc is None
    finally:
        if any(p.poll() is None for p in procs):  # the phase's own processes, by group id
            try:
                os.killpg(procs[0].pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            for p in procs:
                p.wait()
    wall = time.perf_counter() - t0
    _echo_logs(logs, failed=timed_out or rc != 0)
    path = part_dir / f"{name}.json"
    part = json.loads(path.read_text()) if path.exists() else {}
    if kind == "collectives":
        ranks_parts = [part] + [
            json.loads((part_dir / f"{name}.rank{r}.json").read_text())
            for r in range(1, ranks) if (part_dir / f"{name}.rank{r}.json").exists()
        ]
        part = {"ranks": ranks_parts, "allreduce": part.get("allreduce", {}),
                "lm_head": part.get("lm_head"),
                "one_shot_symmetric_memory": part.get("one_shot_symmetric_memory"),
                "errors": part.get("errors", {})}
    part.update(rc=rc if not timed_out else None, timed_out=timed_out, phase_wall_s=wall)
    if timed_out:
        part.setdefault("errors", {})["timeout"] = f"killed after {timeout_s:.0f}s (time limit)"
    elif rc != 0:
        part.setdefault("errors", {})["exit"] = f"exit status {rc} (log: {logs[0]})"
    print(f"=== phase {name}: {'timed out' if timed_out else f'rc {rc}'} in {wall:.0f}s",
          flush=True)
    return part


PROGRESS = ("[", "rank ", "all-reduce ")  # the lines of a phase's log worth echoing


def _echo_logs(logs: list[Path], failed: bool, tail: int = 30) -> None:
    """Rank 0's progress lines; after a failure, the last lines of every rank's log too."""
    for rank, log in enumerate(logs):
        if not log.exists():
            continue
        lines = log.read_text(errors="replace").splitlines()
        if rank == 0 or failed:
            for line in lines:
                if line.startswith(PROGRESS) and not line.startswith("[transformers]"):
                    print(line[:300])
        if failed:
            print(f"--- {log.name}: last {tail} lines")
            for line in lines[-tail:]:
                print(line[-300:])
    sys.stdout.flush()


def plan(args) -> list[tuple[str, str, int, list[str], float]]:
    """The phases of a run: (name, kind, ranks, extra argv, time limit in s)."""
    n = args.tp
    skip = set(filter(None, args.skip.split(",")))
    phases = []
    if "collectives" not in skip:
        phases.append(("collectives", "collectives", n, [], 120))
    if args.geometry == "70b":
        main_70b = ["--oracle", ORACLE_70B if args.oracle is None else args.oracle,
                    "--oracle-batch-sizes", args.oracle_batch_sizes or "1",
                    "--strategies", "mlp" if args.strategies is None else args.strategies]
        phases.append((f"70b_tp{n}", "engine", n, ["--tp", str(n), *main_70b], 420))
        for tp in (1, n):
            eagle = ["--geometry", "8b", "--tp", str(tp), "--oracle", "", "--batch-sizes", "1",
                     "--strategies", "eagle", "--greedy-strategies", "eagle"]
            if not args.layers:
                eagle += ["--layers", "32"]
            phases.append((f"8b_tp{tp}", "engine", tp, eagle, 240))
        return [p for p in phases if p[0] not in skip]
    common = ["--oracle", args.oracle if args.oracle is not None else ORACLE_8B]
    phases.append(("tp1", "engine", 1, ["--tp", "1", *common, "--strategies", ""], 300))
    phases.append((f"tp{n}", "engine", n, ["--tp", str(n), *common, "--strategies",
                                             args.strategies if args.strategies is not None
                                             else "ngram,draft,eagle,eagle3,mlp"], 330))
    if "equality" not in skip:
        # one process: LLM(tensor_parallel_size=N) starts its own workers (the usual path;
        # the raw dummy weights need no loader wrapper on the other ranks)
        for tp in (1, n):
            phases.append((f"equality_tp{tp}", "engine", 1,
                           ["--tp", str(tp), "--init", "dummy", "--eager", "--no-perf",
                            "--dtype", args.equality_dtype], 150))
    return [p for p in phases if p[0] not in skip]


def orchestrate(args) -> int:
    out = Path(args.out)
    t_start = time.perf_counter()
    cfg = dict(GEOMETRIES[args.geometry])
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    result: dict = {
        "mode": args.geometry, "tp": args.tp, "geometry": cfg, "init": args.init,
        "dtype": args.dtype,
        "device": args.device, "args": vars(args), "phases": {},
        "mlp_speculator_70b_assumed": dict(MLP_70B, inner_dim=args.mlp_inner_dim)
        if args.geometry == "70b" else None,
    }
    for name, kind, ranks, extra, limit in plan(args):
        left = args.budget_s - (time.perf_counter() - t_start)
        if left < 20:
            result["phases"][name] = {"errors": {"phase": "not run: the time budget was spent"}}
            continue
        part = run_phase(name, kind, ranks, extra, args, min(limit, left - 10))
        if part.get("device"):
            result["device"] = part["device"]
        elif part.get("ranks") and part["ranks"][0].get("device"):
            result["device"] = part["ranks"][0]["device"]
        result["phases"][name] = part
        result["wall_s"] = time.perf_counter() - t_start
        write_result(result, out)
    result["wall_s"] = time.perf_counter() - t_start
    json_path, png = write_result(result, out)
    print(report(result), flush=True)
    print(f"wrote {json_path} {png} in {result['wall_s']:.0f}s")
    return 0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), default="8b",
                    help="8b: Llama-3-8B, TP 1 vs TP N; 70b: Llama-3-70B at TP N (issue 38); "
                    "tiny: the CPU smoke test's model")
    ap.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default 2; 4 "
                    "with --geometry 70b)")
    ap.add_argument("--layers", type=int, default=None,
                    help="target layers (default: the geometry's, 32 / 80)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--init", choices=("scaled", "dummy"), default=None,
                    help="synthetic weights (module docstring; default scaled on CUDA, dummy "
                    "on the CPU)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--batch-sizes", default="1,4,16,64")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per batch-1 cell")
    ap.add_argument("--warmup-tokens", type=int, default=16)
    ap.add_argument("--oracle", default=None,
                    help=f"ALPHA:K,... oracle configurations (default {ORACLE_8B}; 70b: "
                    f"{ORACLE_70B}); '' for none")
    ap.add_argument("--oracle-batch-sizes", default=None,
                    help="batch sizes of the oracle runs (default: --batch-sizes; 70b: 1)")
    ap.add_argument("--disable-by-batch-size", type=int, default=None)
    ap.add_argument("--strategies", default=None,
                    help="at TP N, from ngram,draft,eagle,eagle3,mlp (default all; 70b: mlp)")
    ap.add_argument("--strategy-batch-sizes", default="1")
    ap.add_argument("--greedy-strategies", default="",
                    help="strategies whose greedy tokens are recorded too (70b: eagle)")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                    help="the target's dtype (default bfloat16 on CUDA, float32 on the CPU)")
    ap.add_argument("--equality-dtype", choices=("bfloat16", "float32"), default="float32",
                    help="the equality phases' dtype: in float32 the different summation "
                    "order of TP N (all-reduce) rarely flips a greedy token of the raw weights; "
                    "in bfloat16 it does within some tokens even when the sharding is right")
    ap.add_argument("--equality-prompts", type=int, default=4)
    ap.add_argument("--equality-tokens", type=int, default=48)
    ap.add_argument("--kv-cache-gib", type=float, default=4.0, help="KV cache per rank")
    ap.add_argument("--mlp-inner-dim", type=int, default=MLP_70B["inner_dim"],
                    help="the 70B MLPSpeculator's inner_dim (assumed: see MLP_70B)")
    ap.add_argument("--allreduce-iters", type=int, default=640)
    ap.add_argument("--profile", action="store_true",
                    help="also kernel profiles (torch.profiler) of plain and oracle steps on rank 0")
    ap.add_argument("--profile-batch", default="1",
                    help="batch sizes to profile with --profile (comma-separated)")
    ap.add_argument("--gemv-max-rows", type=int, default=None,
                    help="experiment: rows up to which the one-row GEMV layer path runs "
                    "(models/fused.py GEMV_MAX_ROWS; 0: batch 1 takes the few-row path)")
    ap.add_argument("--skip", default="",
                    help="phases to leave out: collectives, equality, or a phase name")
    ap.add_argument("--budget-s", type=float, default=560.0,
                    help="wall-clock budget of the whole run; a phase is killed at the end of "
                    "it (or of its own limit)")
    ap.add_argument("--replot", metavar="JSON", default=None,
                    help="only redraw the figure of a saved gpu_tp.json into --out (no GPU)")
    # internal: one phase's process (started by the run itself)
    ap.add_argument("--phase", choices=("collectives", "engine"), default=None,
                    help=argparse.SUPPRESS)
    ap.add_argument("--phase-name", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--part-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--eager", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-perf", action="store_true", help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    args.argv = argv  # what the phases' processes are started with (plus their own flags)
    if args.replot:
        print(f"wrote {replot(args.replot, args.out)}")
        return 0
    if args.tp is None:
        args.tp = 4 if args.geometry == "70b" else 2
    args.init = args.init or ("scaled" if args.device == "cuda" else "dummy")
    if args.tp < 1:
        ap.error(f"--tp {args.tp}: the tensor-parallel size is at least 1")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.init == "scaled" and args.device == "cpu":
        ap.error("--init scaled needs CUDA (the CPU path packs its weights at load time); use "
                 "--init dummy on the CPU")
    try:
        parse_oracle_grid(args.oracle or "")
    except ValueError as e:
        ap.error(str(e))
    unknown = set(filter(None, (args.strategies or "").split(","))) - set(STRATEGIES)
    if unknown:
        ap.error(f"--strategies: unknown {sorted(unknown)}; use {','.join(STRATEGIES)}")
    logging.basicConfig(level=logging.WARNING)
    if args.phase is None:
        if args.device == "cuda":
            import torch

            have = torch.cuda.device_count()
            if have < args.tp:
                ap.error(f"--tp {args.tp} needs {args.tp} CUDA devices, {have} visible; use a "
                         "smaller --tp, a machine with more GPUs, or --device cpu")
        return orchestrate(args)
    install_loader()
    try:
        (collectives_phase if args.phase == "collectives" else engine_phase)(args)
    except Exception as e:
        rank, _ = _world()
        if rank == 0:
            path = _part_path(args)
            part = json.loads(path.read_text()) if path.exists() else {}
            part.setdefault("errors", {})["phase"] = f"{type(e).__name__}: {e}"
            _save_part(args, part)
        raise
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
