"""Token trees on one GPU, Llama-3-8B geometry, batch 1 (issue 36's speed goals).

    python bench/gpu_tree.py --out OUT [--layers N] [--budget-s 540]
    python bench/gpu_tree.py --out OUT --skip strategies
    python bench/gpu_tree.py --out OUT --replot OUT/gpu_tree.json      # the figure only, no GPU
    python bench/gpu_tree.py --device cpu --geometry tiny --out OUT    # the CPU smoke run

The target is gpu_tp.py's: ``LLM(load_format="dummy")`` on a folder holding only config.json,
the weights rescaled on the GPU after loading (``--init scaled``, gpu_8b.py's SCALED init: the
LM head a permutation of the embeddings, so bf16 rounding never flips a greedy token and the
oracle's recorded continuation holds); ``--init dummy`` (the CPU's) keeps the raw weights. The
run is a sequence of phases, each in a process of its own started by this script with a time
limit (``--budget-s`` in all), so that a phase that fails or hangs is recorded and the next one
still runs; gpu_tree.json is rewritten after every phase, a phase's part file after every cell:

* ``step_cost``: ms per target step (median over the run's steps) of plain decoding, of chains
  (the oracle at alpha 1, k = n: every draft accepted) and of oracle trees of the same node
  count n, a chain and its trees in ``--step-repeats`` rounds of one run each (a tree's cost
  over its chain: the median over rounds of the two runs' ratio); trees of ``--shapes``
  N:W, W siblings per level, N // W levels, the true token's rank drawn uniformly: every level accepted, so the accepted path moves and its K/V is compacted on
  nearly every step); a tree and its chain run the same number of tokens from the same prompt
  (the same context sweep). Each step's ratio to plain and the tree / chain ratio (goal <=
  1.03). Then the tree pieces alone: the host's tree mask build (``tree_step_rows``), one
  layer's tree attention against causal attention on the same rows (x layers), and the K/V
  compaction (``compact_tree_kv`` on a cache of the target's layers, kernel alone and with the
  host tensors ModelRunner.compact_tree builds);
* ``e2e``: ``speculant.bench.run_bench`` (plain, then the oracle) at each ``--alphas`` value:
  chains of ``--e2e-chains`` k at that alpha and trees of ``--e2e-trees`` N:W whose rank
  probabilities are the oracle's default ``alpha (1 - alpha)^j`` (so the rank-0 sibling is right
  as often as a chain's token): tokens/s, speedup over plain, best tree / best chain (goal >=
  1.15) and the measured speedup against the theoretical one (docs/trees.md, "Theoretical
  speedup of a tree"; ``theoretical_tree_speedup``), from the formula's expected tokens per step,
  the step-cost phase's measured ratio of that shape and the run's proposer cost;
* ``strategies``: the strategies' tree modes at batch 1, one timed run each (EAGLE-1 and
  EAGLE-3 with random synthetic heads: a dynamic tree, ``eagle_topk`` 4 x 4 levels,
  ``num_draft_tokens`` 16, and a static ``speculative_token_tree`` of 5 nodes; n-gram
  ``tree_branches`` 3 on a prompt with repeated segments): they must run and give plain's
  tokens (acceptance ~0 for the heads).

Every cell records what the engine did: target steps that replayed a CUDA graph (chain / tree)
and those that ran eagerly (``graph_counts``). On CUDA the default engine replays tree steps
of up to 63 nodes (64 rows per sequence, the root included), and chain steps of as many
tokens, in CUDA graphs: up to 16 rows in a verification graph's query bucket, 17-64 rows in a
decode-shaped graph of a ``WIDE_QUERY_BUCKETS`` bucket (framework/engine/cuda_graph.py); on
the CPU every step runs eagerly. Every cell's greedy tokens are compared with plain decoding's.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_tp  # noqa: E402
from gpu_tp import LLAMA3_8B, TINY, compare_greedy, install_loader  # noqa: E402

GEOMETRIES = {"8b": LLAMA3_8B, "tiny": TINY}
GOALS = {"tree_over_chain_step_cost_max": 1.03, "tree_over_chain_e2e_min": 1.15,
         "measured_over_theoretical_min": 0.90}
SHAPES = "15:3,15:5,16:2,16:4,16:8,32:2,32:4,32:8,62:2,60:4,63:9"
E2E_CHAINS = "4,8,15"
E2E_TREES = "8:2,15:3,15:5,16:4"
ALPHAS = "0.6,0.8"
MAX_TREE_NODES = 63  # speculant's limit (tree_bits: one int64 per row, the root included)


# ------------------------------------------------------------------------ theory (pure)
def sibling_ranks(parents: list[int]) -> list[int]:
    """Each node's rank among its parent's children (index order, as the verifier tries them)."""
    seen: dict[int, int] = {}
    ranks = []
    for p in parents:
        ranks.append(seen.get(p, 0))
        seen[p] = ranks[-1] + 1
    return ranks


def path_probabilities(parents: list[int], rank_probs: list[float]) -> list[float]:
    """P(node i is on the accepted path) when, after every accepted node (the root included),
    the target's greedy token is its child of rank j with probability ``rank_probs[j]``
    independently of the levels before (none of them with the rest): the product of
    ``rank_probs`` over the ranks on the node's root path (0 past the list)."""
    probs: list[float] = []
    for p, r in zip(parents, sibling_ranks(parents)):
        pr = rank_probs[r] if r < len(rank_probs) else 0.0
        probs.append(pr * (probs[p] if p >= 0 else 1.0))
    return probs


def expected_accepted(parents: list[int], rank_probs: list[float]) -> float:
    """Expected accepted nodes of a static tree: the sum of its nodes' path probabilities."""
    return sum(path_probabilities(parents, rank_probs))


def oracle_tree_levels(width: int, budget: int) -> tuple[int, int]:
    """(levels, nodes) of the oracle's tree mode for ``tree_width`` W and a budget of
    ``budget`` nodes: min(W, budget) siblings per level, budget // that many levels."""
    w = min(width, budget)
    levels = budget // w
    return levels, levels * w


def oracle_parents(width: int, budget: int, ranks: list[int] | None = None) -> list[int]:
    """The parents of one tree the oracle's tree mode builds (W siblings per level, the next
    level under the true sibling: rank ``ranks[level]``, 0 when not given or none is true)."""
    levels, _ = oracle_tree_levels(width, budget)
    w = min(width, budget)
    ranks = ranks or [0] * levels
    return [-1 if lv == 0 else (lv - 1) * w + max(ranks[lv - 1], 0)
            for lv in range(levels) for _ in range(w)]


def expected_tokens_oracle_tree(width: int, budget: int, rank_probs: list[float]) -> float:
    """Expected tokens per step (accepted nodes + the bonus token) of the oracle's tree mode:
    each level is accepted with q = sum(rank_probs[:W]) given the ones before, so
    1 + q + q^2 + ... + q^L for L levels (a chain: W = 1, q = alpha)."""
    levels, _ = oracle_tree_levels(width, budget)
    q = sum(rank_probs[: min(width, budget)])
    return float(levels + 1) if q >= 1.0 else (1.0 - q ** (levels + 1)) / (1.0 - q)


def theoretical_tree_speedup(tokens_per_step: float, step_cost_ratio: float,
                             propose_ratio: float = 0.0) -> float:
    """Expected speedup over plain decoding: tokens per step / (the verification step's cost
    relative to a plain step + the proposer's cost per step relative to a plain step). With a
    step cost of 1 and ``propose_ratio = k c`` it is Leviathan et al.'s formula."""
    return tokens_per_step / (step_cost_ratio + propose_ratio)


def default_rank_probs(alpha: float, width: int) -> list[float]:
    """The oracle's default rank probabilities: alpha (1 - alpha)^j."""
    return [alpha * (1.0 - alpha) ** j for j in range(width)]


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"16:2,32:4"`` -> [(16, 2), (32, 4)]: (node budget, siblings per level)."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        n, _, w = item.partition(":")
        try:
            shape = (int(n), int(w))
        except ValueError:
            raise ValueError(f"tree shape {item!r}: write NODES:WIDTH, e.g. 16:2") from None
        if not (2 <= shape[1] <= shape[0] <= MAX_TREE_NODES):
            raise ValueError(f"tree shape {item!r}: need 2 <= WIDTH <= NODES <= "
                             f"{MAX_TREE_NODES}")
        out.append(shape)
    return out


def parse_ints(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s.strip()]


# ------------------------------------------------------------------------ summary (pure)
def _step_cells(ph: dict) -> list[dict]:
    return [c for c in ph.get("cells", []) if c.get("ms_per_step") is not None]


def step_cost_summary(ph: dict) -> dict:
    """Per tree cell: its step cost, its chain's (same node count, same tokens), plain's, the
    ratios, the goal, and the share of its tree steps that replayed a CUDA graph."""
    cells = _step_cells(ph)
    plain = {c["tokens"]: c for c in cells if c["kind"] == "plain"}
    chains = {(c["nodes"], c["tokens"]): c for c in cells if c["kind"] == "chain"}
    rows = []
    for c in cells:
        if c["kind"] == "plain":
            continue
        p = plain.get(c["tokens"])
        row = {k: c.get(k) for k in ("kind", "name", "nodes", "width", "levels", "tokens",
                                     "ms_per_step", "same_tokens_as_plain")}
        row["over_plain"] = c["ms_per_step"] / p["ms_per_step"] if p else None
        gc = c.get("graph_counts") or {}
        steps = gc.get("tree_steps", 0) if c["kind"] == "tree" else gc.get("chain_steps", 0)
        graphed = (gc.get("tree_graph_steps", 0) if c["kind"] == "tree"
                   else gc.get("chain_graph_steps", 0))
        row["graph_steps_fraction"] = graphed / steps if steps else None
        if c["kind"] == "tree":
            ch = chains.get((c["nodes"], c["tokens"]))
            row["chain_ms_per_step"] = ch["ms_per_step"] if ch else None
            rounds = c.get("over_chain_rounds")
            row["over_chain_rounds"] = rounds
            # measured in rounds: the median of the per-round ratios (tree run / chain run)
            row["over_chain"] = (statistics.median(rounds) if rounds else
                                 c["ms_per_step"] / ch["ms_per_step"] if ch else None)
            row["goal_met"] = (row["over_chain"] <= GOALS["tree_over_chain_step_cost_max"]
                               if row["over_chain"] is not None else None)
        rows.append(row)
    return {"rows": rows, "pieces": ph.get("pieces", {})}


def _ratio_lookup(step_rows: list[dict]) -> dict[tuple, float]:
    """(kind, nodes, width) -> the step's cost over plain (the first measurement of each)."""
    out: dict[tuple, float] = {}
    for r in step_rows:
        if r["over_plain"] is not None:
            out.setdefault((r["kind"], r["nodes"], r.get("width") or 1), r["over_plain"])
    return out


def e2e_summary(ph: dict, step_rows: list[dict]) -> dict:
    """Per oracle row of the e2e phase: the formula's expected tokens per step, the step-cost
    ratio of its shape (from ``step_rows``), the proposer's cost, the theoretical speedup and the
    measured one over it; per alpha, the best tree against the best chain (and trees against
    the chain of the same node count)."""
    meta = ph.get("meta", {})
    cost = _ratio_lookup(step_rows)
    rows = []
    for r in ph.get("runs", []):
        m = meta.get(r["name"])
        if r["method"] == "plain" or m is None:
            continue
        plain = next((p for p in ph["runs"] if p["method"] == "plain"
                      and p["batch_size"] == r["batch_size"]), None)
        w = m.get("width", 1)
        probs = m.get("rank_probs") or [m["alpha"]]
        tokens = expected_tokens_oracle_tree(w, m["nodes"], probs)
        levels, nodes = oracle_tree_levels(w, m["nodes"])
        key = ("tree" if w > 1 else "chain", nodes, w)  # the step-cost row of this shape
        ratio = cost.get(key)
        pr = (r["propose_s_per_step"] / plain["step_s"]
              if plain and r.get("propose_s_per_step") is not None else 0.0)
        theo = theoretical_tree_speedup(tokens, ratio, pr) if ratio else None
        acc = r.get("acceptance")
        measured_tokens = (expected_tokens_oracle_tree(1, levels, [acc])
                           if acc is not None else None)
        rows.append({
            "name": r["name"], "kind": key[0], "alpha": m["alpha"], "nodes": nodes,
            "width": w, "levels": levels, "rank_probs": probs,
            "tokens_per_s": r["tokens_per_s"], "speedup": r["speedup"],
            "expected_tokens_per_step": tokens,
            "measured_tokens_per_step": r.get("mean_accepted_length"),
            "level_acceptance": acc, "expected_level_acceptance": sum(probs[:w]),
            "step_cost_ratio": ratio, "propose_ratio": pr,
            "theoretical_speedup": theo,
            "theoretical_speedup_measured_acceptance": (
                theoretical_tree_speedup(measured_tokens, ratio, pr)
                if ratio and measured_tokens else None),
            "theoretical_speedup_free_verification": theoretical_tree_speedup(tokens, 1.0, pr),
            "speedup_vs_theoretical": r["speedup"] / theo if theo else None,
            "same_tokens_as_plain": r.get("same_tokens_as_plain"),
            "graph_counts": ph.get("graph_counts", {}).get(r["name"]),
        })
    for row in rows:
        if row["speedup_vs_theoretical"] is not None:
            row["goal_met"] = row["speedup_vs_theoretical"] >= GOALS["measured_over_theoretical_min"]
    best = {}
    for a in sorted({r["alpha"] for r in rows}):
        trees = [r for r in rows if r["alpha"] == a and r["kind"] == "tree"]
        chains = [r for r in rows if r["alpha"] == a and r["kind"] == "chain"]
        if not trees or not chains:
            continue
        t = max(trees, key=lambda r: r["tokens_per_s"])
        c = max(chains, key=lambda r: r["tokens_per_s"])
        same = {}
        for tr in trees:
            ch = next((x for x in chains if x["nodes"] == tr["nodes"]), None)
            if ch:
                same[tr["name"]] = {"chain": ch["name"],
                                    "ratio": tr["tokens_per_s"] / ch["tokens_per_s"]}
        ratio = t["tokens_per_s"] / c["tokens_per_s"]
        best[str(a)] = {"best_tree": t["name"], "best_chain": c["name"],
                        "tree_tokens_per_s": t["tokens_per_s"],
                        "chain_tokens_per_s": c["tokens_per_s"], "ratio": ratio,
                        "goal_met": ratio >= GOALS["tree_over_chain_e2e_min"],
                        "same_node_count": same}
    return {"rows": rows, "tree_vs_chain": best}


def summarize(result: dict) -> dict:
    """The figures issue 36 asks for, from the phases' parts (pure: ``--replot`` and the tests
    call it on saved results)."""
    phases = result.get("phases", {})
    s: dict = {"goals": GOALS}
    step_rows: list[dict] = []
    if phases.get("step_cost", {}).get("cells"):
        s["step_cost"] = step_cost_summary(phases["step_cost"])
        step_rows = s["step_cost"]["rows"]
    if phases.get("e2e", {}).get("runs"):
        s["e2e"] = e2e_summary(phases["e2e"], step_rows)
    st = phases.get("strategies", {})
    if st.get("runs") or st.get("errors"):
        s["strategies"] = [
            {k: r.get(k) for k in ("name", "method", "tokens_per_s", "speedup", "acceptance",
                                   "mean_accepted_length", "same_tokens_as_plain")}
            | {"graph_counts": st.get("graph_counts", {}).get(r["name"])}
            for r in st.get("runs", []) if r["method"] != "plain"]
    eq: dict[str, bool] = {}  # every cell / row: its greedy tokens equal plain's
    for name, ph in phases.items():
        for c in ph.get("cells", []):
            if c.get("same_tokens_as_plain") is not None:
                eq[f"{name}:{c['name']} T={c['tokens']}"] = c["same_tokens_as_plain"]
        for r in ph.get("runs", []):
            if r["method"] != "plain":
                eq[f"{name}:{r['name']}"] = r["same_tokens_as_plain"]
        for key, cmp in ph.get("greedy", {}).items():
            eq[f"{name}:{key} (second decode)"] = cmp["equal_prompts"] == cmp["prompts"]
    if eq:
        s["greedy_vs_plain"] = eq
        s["greedy_all_equal"] = all(eq.values())
    return s


def report(result: dict) -> str:
    """The summary as a few lines of text (the run's log: the JSON holds everything)."""
    s = result.get("summary") or summarize(result)
    lines = [f"== gpu_tree: {result.get('mode')} geometry, batch 1, {result.get('device')}"]
    for r in s.get("step_cost", {}).get("rows", []):
        if r["kind"] != "tree":
            continue
        oc = r.get("over_chain")
        g = r.get("graph_steps_fraction")
        lines.append(
            f"step_cost: {r['name']}: {r['ms_per_step']:.3f} ms/step, "
            f"{_fmt(r['over_plain'])}x plain, "
            + (f"{oc:.3f}x its chain ({r['chain_ms_per_step']:.3f} ms; goal <= "
               f"{GOALS['tree_over_chain_step_cost_max']}: {r['goal_met']})" if oc else
               "no chain")
            + f", tree steps in graphs {_fmt(g)}, same tokens {r['same_tokens_as_plain']}")
    for a, b in s.get("e2e", {}).get("tree_vs_chain", {}).items():
        lines.append(f"e2e a={a}: best tree {b['best_tree']} {b['tree_tokens_per_s']:.1f} tok/s"
                     f" / best chain {b['best_chain']} {b['chain_tokens_per_s']:.1f} = "
                     f"{b['ratio']:.3f} (goal >= {GOALS['tree_over_chain_e2e_min']}: "
                     f"{b['goal_met']})")
    for r in s.get("e2e", {}).get("rows", []):
        lines.append(f"  {r['name']}: speedup {r['speedup']:.3f}, theoretical "
                     f"{_fmt(r['theoretical_speedup'])} (step cost {_fmt(r['step_cost_ratio'])}"
                     f"), measured/theoretical {_fmt(r['speedup_vs_theoretical'])}, tokens/step "
                     f"{_fmt(r['measured_tokens_per_step'])} (expected "
                     f"{r['expected_tokens_per_step']:.3f}), same tokens "
                     f"{r['same_tokens_as_plain']}")
    for r in s.get("strategies", []):
        lines.append(f"strategy {r['name']}: {r['tokens_per_s']:.1f} tok/s, speedup "
                     f"{r['speedup']:.3f}, acceptance {_fmt(r['acceptance'])}, same tokens "
                     f"{r['same_tokens_as_plain']}, graphs {r.get('graph_counts')}")
    if "greedy_all_equal" in s:
        lines.append(f"greedy equal to plain everywhere: {s['greedy_all_equal']}")
    for name, ph in result.get("phases", {}).items():
        if ph.get("errors"):
            lines.append(f"errors in {name}: {ph['errors']}")
    return "\n".join(lines)


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3f}"


# ------------------------------------------------------------------------ plot
def plot(result: dict, out_dir: str | Path, stem: str = "gpu_tree") -> Path:
    """Four panels: step cost over plain against node count (chains, trees per width); tree /
    chain step cost per shape against the goal; e2e speedup of chains and trees per alpha,
    measured against theoretical; the tree pieces' costs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    s = result.get("summary") or summarize(result)
    fig, axes = plt.subplots(2, 2, figsize=(13, 9.5))
    ax = axes[0][0]
    groups: dict[str, list] = {}
    for r in s.get("step_cost", {}).get("rows", []):
        if r["over_plain"] is None:
            continue
        label = "chain" if r["kind"] == "chain" else f"tree W={r['width']}"
        groups.setdefault(label, []).append((r["nodes"], r["over_plain"]))
    for i, (label, pts) in enumerate(sorted(groups.items())):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=f"C{i}", label=label)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xlabel("draft nodes verified per step")
    ax.set_ylabel("target step time / plain decode step")
    ax.set_title("step cost at batch 1 (oracle, every level accepted)", fontsize=9)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)

    ax = axes[0][1]
    rows = [r for r in s.get("step_cost", {}).get("rows", [])
            if r["kind"] == "tree" and r.get("over_chain")]
    if rows:
        xs = range(len(rows))
        ax.bar(list(xs), [r["over_chain"] for r in rows], 0.6,
               color=["C0" if r.get("graph_steps_fraction") else "C3" for r in rows])
        ax.axhline(GOALS["tree_over_chain_step_cost_max"], color="tab:red", ls=":",
                   label=f"goal {GOALS['tree_over_chain_step_cost_max']}")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(list(xs), [f"{r['nodes']}:{r['width']}" for r in rows], fontsize=7)
        ax.set_ylabel("tree step / chain step, same node count")
        ax.set_title("tree over chain, default engine (red bars: tree steps ran eagerly)",
                     fontsize=9)
        ax.legend(fontsize=7)

    ax = axes[1][0]
    e2e = s.get("e2e", {}).get("rows", [])
    if e2e:
        xs = range(len(e2e))
        ax.bar([x - 0.2 for x in xs], [r["speedup"] for r in e2e], 0.4,
               color=["C1" if r["kind"] == "tree" else "C0" for r in e2e],
               label="measured (orange: trees)")
        ax.bar([x + 0.2 for x in xs], [r["theoretical_speedup"] or 0 for r in e2e], 0.4,
               color="0.7", label="theoretical (formula x measured step cost)")
        ax.set_xticks(list(xs), [r["name"].replace("oracle ", "") for r in e2e], fontsize=6,
                      rotation=60, ha="right")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_ylabel("speedup over plain, batch 1")
        ax.set_title("oracle chains vs trees at the same rank-0 acceptance", fontsize=9)
        ax.legend(fontsize=7)

    ax = axes[1][1]
    pieces = s.get("step_cost", {}).get("pieces", {})
    comp = pieces.get("compaction", [])
    if comp:
        ax.plot([c["path_len"] for c in comp], [c["kernel_us"] for c in comp], marker="o",
                label="K/V compaction, kernel (all layers)")
        ax.plot([c["path_len"] for c in comp], [c["with_host_tensors_us"] for c in comp],
                marker="s", label="K/V compaction with host tensors")
    att = pieces.get("attention", [])
    if att:
        ax.plot([a["rows"] - 1 for a in att], [a["tree_minus_causal_us_per_step"] for a in att],
                marker="^", label="tree - causal attention, per step (all layers)")
    mask = pieces.get("mask_build", [])
    if mask:
        ax.plot([m["nodes"] for m in mask], [m["host_us"] for m in mask], marker="x",
                label="tree mask build (host)")
    if ax.get_legend_handles_labels()[0]:
        ax.set_xlabel("path length / nodes")
        ax.set_ylabel("microseconds")
        ax.set_title("tree pieces alone", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(True, alpha=0.3)
    layers = result.get("geometry", {}).get("num_hidden_layers", "?")
    fig.suptitle(f"Token trees on {result.get('device', '?')}: {result.get('mode', '?')} geometry"
                 f" ({layers} layers), synthetic weights ({result.get('init', '?')} init), batch 1",
                 fontsize=10)
    fig.tight_layout()
    path = out / f"{stem}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_result(result: dict, out_dir: str | Path, stem: str = "gpu_tree") -> tuple[Path, Path]:
    """gpu_tree.json (with its summary worked out now) and gpu_tree.png, as gpu_tp.py writes."""
    return gpu_tp.write_result(result, out_dir, stem, summarize_fn=summarize, plot_fn=plot)


def replot(json_path: str | Path, out_dir: str | Path) -> Path:
    return gpu_tp.replot(json_path, out_dir, summarize_fn=summarize, plot_fn=plot)


# ------------------------------------------------------------------------ what the engine did
class GraphCounter:
    """Counts, on one engine's target runner, the scored (verification) steps with and without
    a token tree and whether each replayed a CUDA graph: ``ModelRunner.score`` and the graph
    runner's ``_replay`` are wrapped on the instances (nothing of the engine is changed)."""

    KEYS = ("tree_steps", "tree_graph_steps", "tree_eager_steps", "chain_steps",
            "chain_graph_steps", "chain_eager_steps", "tree_graphs_captured")

    def __init__(self, engine) -> None:
        self.n = dict.fromkeys(self.KEYS, 0)
        self.replays = 0
        runner = engine.runner
        self.graphs = runner.graphs
        if self.graphs is not None:
            replay = self.graphs._replay

            def _replay(*args, **kwargs):
                self.replays += 1
                return replay(*args, **kwargs)

            self.graphs._replay = _replay
        score = runner.score

        def _score(seqs, new_tokens, *args, **kwargs):
            trees = kwargs.get("trees")
            tree = trees is not None and any(t is not None for t in trees)
            before = self.replays
            out = score(seqs, new_tokens, *args, **kwargs)
            kind = "tree" if tree else "chain"
            self.n[f"{kind}_steps"] += 1
            self.n[f"{kind}_{'graph' if self.replays > before else 'eager'}_steps"] += 1
            return out

        runner.score = _score

    def snapshot(self) -> dict:
        if self.graphs is not None:
            self.n["tree_graphs_captured"] = len(self.graphs.tree_graphs)
        return dict(self.n)

    @staticmethod
    def delta(a: dict, b: dict) -> dict:
        return {k: b[k] - a[k] if k != "tree_graphs_captured" else b[k] for k in b}


# ------------------------------------------------------------------------ engine phases
def _part_path(args) -> Path:
    return Path(args.part_dir) / f"{args.phase_name}.json"


def _save_part(args, part: dict) -> None:
    gpu_tp.save_json(_part_path(args), part)


def build_llm(args, tmp: Path, max_tokens: int):
    from speculant import LLM

    cfg = dict(GEOMETRIES[args.geometry])
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    target = tmp / "target"
    target.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps(
        dict(cfg, speculant_tp_init=args.init, speculant_seed=0)))
    llm = LLM(model=str(target), load_format="dummy", dtype=args.dtype, device=args.device,
              skip_tokenizer_init=True, max_num_seqs=2,
              max_model_len=args.prompt_len + max_tokens + 2 * MAX_TREE_NODES + 16,
              kv_cache_memory=int(args.kv_cache_gib * (1 << 30)))
    return llm, cfg


def _oracle_spec(refs, nodes: int, width: int = 1, alpha: float = 1.0,
                 rank_probs: list[float] | None = None, name: str | None = None) -> dict:
    spec = dict(method="oracle", alpha=alpha, num_speculative_tokens=nodes, references=refs)
    if width > 1:
        spec.update(tree_width=width, rank_probs=rank_probs or default_rank_probs(alpha, width))
    if name:
        spec["name"] = name
    return spec


def _cell(engine, counter: GraphCounter, prompt, spec: dict | None, tokens: int, repeats: int,
          reference: list[int], warmup: int) -> dict:
    """One step-cost cell: a warm-up, then ``repeats`` timed runs of ``tokens`` tokens; the run
    of median step time is reported (median over its steps)."""
    import statistics

    from speculant.bench import _decode_run, _set_strategy

    dec = _set_strategy(engine, {k: v for k, v in spec.items() if k != "name"} if spec else None)
    _decode_run(engine, [prompt], warmup)
    before = counter.snapshot()
    runs = []
    for _ in range(max(1, repeats)):
        r = _decode_run(engine, [prompt], tokens)
        runs.append((statistics.median(r["step_times"]) if r["step_times"] else None, r))
    gc = GraphCounter.delta(before, counter.snapshot())
    runs.sort(key=lambda x: x[0] or 0.0)
    med, r = runs[len(runs) // 2]
    cmps = [compare_greedy([reference[: len(t)]], [t])
            for t in (run["tokens"][0] for _, run in runs)]  # every timed run's tokens
    cmp = next((c for c in cmps if c["equal_prompts"] != 1), cmps[0])
    out = {"ms_per_step": 1e3 * med if med else None,
           "ms_per_step_mean": 1e3 * r["decode_s"] / max(r["steps"], 1),
           "ms_per_step_runs": [1e3 * m for m, _ in runs if m],
           "steps": r["steps"], "decode_tokens": r["decode_tokens"],
           "same_tokens_as_plain": cmp["equal_prompts"] == 1,
           "first_divergence": cmp["first_divergence"][0], "graph_counts": gc}
    if dec is not None:
        out["num_tree_drafts"] = dec.total.num_tree_drafts
    return out


def tree_pieces(engine, shapes: list[tuple[int, int]], paths: list[int], ctx: int = 512,
                iters: int = 50) -> dict:
    """The tree pieces alone: host mask build per shape; one layer's paged attention over the
    rows of a tree against causal rows (x the target's layers); K/V compaction of paths of
    ``paths`` lengths on a cache of the target's layers."""
    import torch

    from speculant.engine.model_runner import tree_step_rows

    dev = engine.device
    cuda = dev.type == "cuda"
    layers = engine.model.num_layers

    def timed(fn, n=iters) -> float:  # microseconds per call
        for _ in range(3):
            fn()
        if cuda:
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        if cuda:
            torch.cuda.synchronize(dev)
        return 1e6 * (time.perf_counter() - t0) / n

    out: dict = {"context": ctx, "layers": layers, "mask_build": [], "attention": [],
                 "compaction": []}
    seq = type("Seq", (), {"num_cached_tokens": ctx})()
    for nodes, width in shapes:
        parents = oracle_parents(width, nodes)
        n = len(parents)
        us = timed(lambda p=parents: tree_step_rows([seq], [len(p) + 1], [p]), 200)
        out["mask_build"].append({"nodes": n, "width": width, "host_us": us})
    out["attention"] = _attention_cost(engine, shapes, ctx, timed)
    out["compaction"] = _compaction_cost(engine, paths, ctx, timed)
    if cuda:
        torch.cuda.empty_cache()
    return out


def _attention_cost(engine, shapes, ctx: int, timed) -> list[dict]:
    """One layer's paged attention over a tree's rows with its tree bits against the same rows
    causal, over ``ctx`` cached tokens; the difference times the layers is per step."""
    from functools import partial

    import torch

    from speculant.kernels.paged_attention import paged_attention
    from speculant.kernels.tree_kv import tree_row_bits

    dev, dtype = engine.device, engine.dtype
    nkv, d = engine.model.kv_cache_shape()
    heads = engine.hf_config.num_attention_heads
    bs = engine.block_size
    nb = -(-(ctx + 2 * MAX_TREE_NODES) // bs) + 1
    kc = torch.randn(nb, bs, nkv, d, device=dev).to(dtype)  # [blocks, block, kv heads, d]
    vc = torch.randn(nb, bs, nkv, d, device=dev).to(dtype)
    table = torch.arange(nb, dtype=torch.int32, device=dev)[None]  # [1, blocks]
    out = []
    for nodes, width in shapes:
        parents = oracle_parents(width, nodes)
        rows = len(parents) + 1
        q = torch.randn(rows, heads, d, device=dev).to(dtype)  # [rows, heads, d]
        lens = torch.tensor([ctx + rows], dtype=torch.int32, device=dev)
        qsl = torch.tensor([0, rows], dtype=torch.int32, device=dev)
        bits = torch.tensor(tree_row_bits(parents), dtype=torch.int64, device=dev)  # [rows]
        call = partial(paged_attention, q, kc, vc, table, lens, qsl, d ** -0.5, rows)
        causal = timed(call)
        tree = timed(partial(call, tree_bits=bits))
        out.append({"rows": rows, "width": width, "causal_us": causal, "tree_us": tree,
                    "tree_minus_causal_us_per_step": engine.model.num_layers * (tree - causal)})
    return out


def _compaction_cost(engine, paths: list[int], ctx: int, timed) -> list[dict]:
    """``compact_tree_kv`` on a cache of the target's layers (a tensor of its own, not the
    engine's) for accepted paths of ``paths`` lengths (rows 2, 4, 6, ...: a width-2 tree's
    rank-1 path), the kernel alone and with the host tensors ModelRunner.compact_tree builds."""
    from functools import partial

    import torch

    from speculant.kernels.tree_kv import compact_tree_kv

    dev, dtype = engine.device, engine.dtype
    nkv, d = engine.model.kv_cache_shape()
    layers, bs = engine.model.num_layers, engine.block_size
    nbc = -(-(ctx + MAX_TREE_NODES + 1) // bs) + 1
    # [layers, 2, blocks, block, kv heads, d]
    cache = torch.zeros(layers, 2, nbc, bs, nkv, d, dtype=dtype, device=dev)
    tables = torch.arange(nbc, dtype=torch.int32, device=dev)[None]  # [1, blocks]
    starts = torch.tensor([ctx], dtype=torch.int64, device=dev)  # [1]

    def with_host(rows_l: list[int]) -> None:
        t = torch.tensor([list(range(nbc))], dtype=torch.int32, device=dev)
        s0 = torch.tensor([ctx], dtype=torch.int64, device=dev)
        r = torch.tensor([rows_l], dtype=torch.int64, device=dev)
        compact_tree_kv(cache, t, s0, r)

    out = []
    for p in paths:
        rows_l = [2 * i + 2 for i in range(p) if 2 * i + 2 <= MAX_TREE_NODES]
        path = torch.tensor([rows_l], dtype=torch.int64, device=dev)  # [1, path]
        out.append({"path_len": len(rows_l),
                    "kernel_us": timed(partial(compact_tree_kv, cache, tables, starts, path)),
                    "with_host_tensors_us": timed(partial(with_host, rows_l))})
    return out


def step_cells(args) -> tuple[list[tuple[int, int, int, int]], list[int]]:
    """The step-cost phase's trees (budget, width, levels, nodes: ``--shapes`` and the e2e
    trees) and chain lengths (every tree's node count, the e2e chains and ``--chains``)."""
    shapes = parse_shapes(args.shapes)
    shapes += [s for s in parse_shapes(args.e2e_trees) if s not in shapes]
    trees = [(n, w) + oracle_tree_levels(w, n) for n, w in shapes]
    chains = {t[3] for t in trees} | set(parse_ints(args.e2e_chains)) | set(parse_ints(args.chains))
    return trees, sorted(chains)


def step_tokens(args, nodes: int) -> int:
    """Tokens of a step-cost run for ``nodes`` draft nodes: >= 16 chain steps (the same for a
    tree and its chain: the same context sweep)."""
    return max(args.step_tokens, 16 * (nodes + 1))


def _merge_round(cell: dict, got: dict) -> dict:
    """Add one round's timed run (``got``, a ``_cell`` of one repeat) to ``cell``: its runs, the
    median over them, graph counts summed, tokens equal to plain only if every round's were."""
    import statistics

    if not cell:
        cell.update(got)
        cell["ms_per_step_runs"] = list(got.get("ms_per_step_runs", []))
        return cell
    cell["ms_per_step_runs"] = cell.get("ms_per_step_runs", []) + got.get("ms_per_step_runs", [])
    if cell["ms_per_step_runs"]:
        cell["ms_per_step"] = statistics.median(cell["ms_per_step_runs"])
    for k, v in (got.get("graph_counts") or {}).items():  # a count per run, or a total so far
        gc = cell.setdefault("graph_counts", {})
        gc[k] = v if k == "tree_graphs_captured" else gc.get(k, 0) + v
    if "error" in got:
        cell.setdefault("error", got["error"])
    cell["same_tokens_as_plain"] = bool(cell.get("same_tokens_as_plain")) and bool(
        got.get("same_tokens_as_plain"))
    return cell


def step_cost_phase(args, part: dict, engine, counter: GraphCounter, prompt) -> None:
    from speculant.bench import _decode_run, _set_strategy

    trees, node_counts = step_cells(args)
    tokens_for = partial(step_tokens, args)
    longest = max(tokens_for(n) for n in node_counts)
    _set_strategy(engine, None)
    reference = _decode_run(engine, [prompt], longest + 2 * MAX_TREE_NODES + 8)["tokens"][0]
    refs = [{"prompt_token_ids": prompt, "output_token_ids": reference}]
    part["plain_tokens"] = reference[:64]
    part["cells"] = []
    t0 = time.perf_counter()

    def measure(spec: dict | None, T: int, meta: dict, repeats: int) -> dict:
        cell = dict(meta, tokens=T)
        try:
            cell.update(_cell(engine, counter, prompt, spec, T, repeats, reference,
                              args.warmup_tokens))
        except Exception as e:  # noqa: BLE001 - reported in the JSON
            cell["error"] = f"{type(e).__name__}: {e}"
            part["errors"][meta["name"]] = cell["error"]
            traceback.print_exc()
        finally:
            _set_strategy(engine, None)
        return cell

    def report(cell: dict, note: str = "") -> None:
        _save_part(args, part)
        print(f"[{args.phase_name} {time.perf_counter() - t0:5.0f}s] {cell['name']:>16} "
              f"T={cell['tokens']}{note} {_fmt(cell.get('ms_per_step'))} ms/step, same "
              f"{cell.get('same_tokens_as_plain')}, graphs {cell.get('graph_counts')}", flush=True)

    for T in sorted({tokens_for(n) for n in node_counts}):
        cell = measure(None, T, {"kind": "plain", "name": "plain", "nodes": 0}, args.step_repeats)
        part["cells"].append(cell)
        report(cell)
    # a chain and the trees of its node count in rounds: each round times one run of each, and
    # a tree's cost over its chain is the median over rounds of its run / the chain's run of
    # the same round, so that a drift over the run (the GPU's clocks, the host's load, the
    # process's heap) weighs on a tree and its chain alike
    for n in node_counts:
        T = tokens_for(n)
        chain_meta = {"kind": "chain", "name": f"chain k={n}", "nodes": n, "width": 1,
                      "levels": n}
        group = [(_oracle_spec(refs, n), chain_meta)]
        for budget, w, levels, nodes in trees:
            if nodes == n:
                group.append((_oracle_spec(refs, budget, w, rank_probs=[1.0 / w] * w),
                              {"kind": "tree", "name": f"tree n={n} w={w}", "nodes": n,
                               "width": w, "levels": levels, "budget": budget}))
        cells: list[dict] = [{} for _ in group]
        for rnd in range(max(1, args.step_repeats) if len(group) > 1 else 1):
            chain_ms = None
            for (spec, meta), cell in zip(group, cells):
                got = measure(spec, T, meta, 1 if len(group) > 1 else args.step_repeats)
                _merge_round(cell, got)
                ms = got.get("ms_per_step")
                if meta["kind"] == "chain":
                    chain_ms = ms
                elif ms and chain_ms:
                    cell.setdefault("over_chain_rounds", []).append(ms / chain_ms)
                if rnd == 0:
                    part["cells"].append(cell)
                report(cell, f" round {rnd + 1}")
    if args.phase_name == "step_cost":
        try:
            paths = sorted({min(lv, 31) for _, _, lv, _ in trees} | {1, 4})
            part["pieces"] = tree_pieces(engine, [(n, w) for _, w, _, n in trees], paths)
            print(f"[{args.phase_name}] pieces {json.dumps(part['pieces'])}", flush=True)
        except Exception as e:  # noqa: BLE001 - reported in the JSON
            part["errors"]["pieces"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        _save_part(args, part)


def _bench_rows(args, part: dict, engine, counter: GraphCounter, prompts, specs: list[dict],
                tokens: int, compare: bool = False, repeats: int | None = None) -> None:
    """``run_bench`` of every spec in one call (plain measured once), each row and its graph
    counts (the steps of its whole cell: warm-up, timed and cost passes) saved as it comes; if
    the call fails, each spec not yet measured gets a call of its own (a failing one is
    recorded, the rest still run). ``compare``: also decode the prompts once more with each
    strategy and record where its greedy tokens first differ from plain's."""
    from speculant.bench import _decode_run, _set_strategy, run_bench

    part.setdefault("runs", [])
    part.setdefault("graph_counts", {})
    part.setdefault("greedy", {})
    t0 = time.perf_counter()
    last = [counter.snapshot()]

    def progress(row: dict) -> None:
        now = counter.snapshot()
        if row["method"] != "plain":
            part["graph_counts"][row["name"]] = GraphCounter.delta(last[0], now)
        last[0] = now
        if row["method"] != "plain" or not any(r["method"] == "plain" for r in part["runs"]):
            part["runs"].append(row)
        _save_part(args, part)
        print(f"[{args.phase_name} {time.perf_counter() - t0:5.0f}s] {row['name']:>28} "
              f"{row['tokens_per_s']:8.1f} tok/s speedup {row['speedup']:.3f} acceptance "
              f"{_fmt(row.get('acceptance'))} same {row['same_tokens_as_plain']} graphs "
              f"{part['graph_counts'].get(row['name'])}", flush=True)

    def bench(which: list[dict]) -> None:
        run_bench(engine, prompts[:1], which, tokens, [1], warmup_tokens=args.warmup_tokens,
                  repeats=args.repeats if repeats is None else repeats, progress=progress)

    try:
        bench(specs)
    except Exception as e:  # noqa: BLE001 - reported in the JSON; then one call per spec
        part["errors"]["together"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
        done = {r["name"] for r in part["runs"]}
        for spec in specs:
            if any(n.startswith(spec.get("name", spec["method"]) + " k=") for n in done):
                continue
            try:
                bench([spec])
            except Exception as e2:  # noqa: BLE001 - reported in the JSON
                part["errors"][spec.get("name", spec["method"])] = f"{type(e2).__name__}: {e2}"
                traceback.print_exc()
    finally:
        _set_strategy(engine, None)
    _save_part(args, part)
    if not compare:
        return
    plain_tokens = _decode_run(engine, prompts, tokens)["tokens"]
    part["plain_tokens"] = plain_tokens
    for spec in specs:
        name = spec.get("name", spec["method"])
        try:
            _set_strategy(engine, {k: v for k, v in spec.items() if k != "name"})
            mine = _decode_run(engine, prompts, tokens)["tokens"]
            part["greedy"][name] = compare_greedy(plain_tokens, mine)
        except Exception as e:  # noqa: BLE001 - reported in the JSON
            part["errors"][f"{name} greedy"] = f"{type(e).__name__}: {e}"
        finally:
            _set_strategy(engine, None)
    _save_part(args, part)


def e2e_phase(args, part: dict, engine, counter: GraphCounter, prompt) -> None:
    from speculant.bench import _decode_run, _set_strategy

    longest = args.e2e_tokens + 2 * MAX_TREE_NODES + 8
    _set_strategy(engine, None)
    reference = _decode_run(engine, [prompt], longest)["tokens"][0]
    refs = [{"prompt_token_ids": prompt, "output_token_ids": reference}]
    specs, meta = [], {}
    for a in (float(x) for x in args.alphas.split(",") if x.strip()):
        for k in parse_ints(args.e2e_chains):
            name = f"chain a={a}"
            specs.append(_oracle_spec(refs, k, alpha=a, name=name))
            meta[f"{name} k={k}"] = {"alpha": a, "nodes": k, "width": 1}
        for n, w in parse_shapes(args.e2e_trees):
            probs = default_rank_probs(a, w)
            name = f"tree a={a} w={w}"
            specs.append(_oracle_spec(refs, n, w, a, probs, name=name))
            meta[f"{name} k={n}"] = {"alpha": a, "nodes": n, "width": w, "rank_probs": probs}
    part["meta"] = meta
    _bench_rows(args, part, engine, counter, [prompt], specs, args.e2e_tokens)


def eagle_checkpoint(folder: Path, cfg: dict, version: int, device: str, seed: int) -> Path:
    """A random EAGLE-1 (one layer over [embedding, hidden]) or EAGLE-3 (midlayer over 2H,
    fc 3H -> H, its own head over a reduced vocabulary mapped through d2t) head for a target of
    geometry ``cfg`` (gpu_8b.eagle1_checkpoint / eagle3_checkpoint's shapes at 8B)."""
    import torch
    from safetensors.torch import save_file

    H, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * (H // cfg["num_attention_heads"])
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    attn_in = H if version == 1 else 2 * H
    p = "layers.0." if version == 1 else "midlayer."
    shapes = {p + "self_attn.q_proj.weight": (H, attn_in),
              p + "self_attn.k_proj.weight": (kv, attn_in),
              p + "self_attn.v_proj.weight": (kv, attn_in),
              p + "self_attn.o_proj.weight": (H, H), p + "mlp.gate_proj.weight": (F, H),
              p + "mlp.up_proj.weight": (F, H), p + "mlp.down_proj.weight": (H, F),
              p + "post_attention_layernorm.weight": (H,)}
    extra = {}
    if version == 1:
        shapes.update({"fc.weight": (H, 2 * H), "fc.bias": (H,)})
        out_cfg = dict(cfg, num_hidden_layers=1, bias=True)
    else:
        draft_vocab = min(32000, V // 2)
        shapes.update({"fc.weight": (H, 3 * H), p + "input_layernorm.weight": (H,),
                       p + "hidden_norm.weight": (H,), "norm.weight": (H,),
                       "lm_head.weight": (draft_vocab, H)})
        sel = torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:draft_vocab]
        extra["d2t"] = sel.sort().values - torch.arange(draft_vocab)
        out_cfg = dict(cfg, num_hidden_layers=1, architectures=["LlamaForCausalLMEagle3"],
                       draft_vocab_size=draft_vocab)
    out_cfg.pop("speculant_tp_init", None)
    gen = torch.Generator(device).manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items():
        t = torch.empty(shape, dtype=dtype, device=device)
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        elif name.endswith("bias"):
            t.zero_()
        else:
            t.normal_(0.0, 0.02, generator=gen)
        tensors[name] = t.cpu()
    tensors.update(extra)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(out_cfg))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def ngram_prompt(prompt: list[int], continuation: list[int], vocab: int, seed: int = 0
                 ) -> list[int]:
    """A prompt with repeated segments for n-gram trees: ``prompt``, then the first token of its
    greedy ``continuation`` followed by wrong tokens, then that token followed by the rest of
    the continuation, then ``prompt``'s last token again. When the next token only depends on
    the current one (the scaled synthetic weights: the LM head is a permutation of the
    embeddings), the first generated token is ``continuation[0]``, whose two earlier
    occurrences with different next tokens make the n-gram lookup's first draft a tree with the
    right branch in it."""
    import random

    rng = random.Random(seed)
    c0 = continuation[0]
    wrong = [3 + rng.randrange(vocab - 3) for _ in range(8)]
    return prompt + [c0] + wrong + [c0] + continuation[1:12] + [prompt[-1]]


def strategies_phase(args, part: dict, engine, counter: GraphCounter, prompt, tmp: Path,
                     cfg: dict) -> None:
    from speculant.bench import _decode_run, _set_strategy

    _set_strategy(engine, None)
    cont = _decode_run(engine, [prompt], 16)["tokens"][0]
    prompts = [ngram_prompt(prompt, cont, cfg["vocab_size"])]
    specs = []
    names = set(filter(None, args.strategies.split(",")))
    if "ngram" in names:
        specs.append(dict(name="ngram tree3", method="ngram", num_speculative_tokens=12,
                          tree_branches=3, prompt_lookup_min=1, adaptive=False))
    for version, key in ((1, "eagle"), (3, "eagle3")):
        if key in names:
            try:
                folder = eagle_checkpoint(tmp / key, cfg, version, args.device, 10 + version)
                specs.append(dict(name=f"{key} topk4", method=key, model=str(folder),
                                  num_speculative_tokens=4, eagle_topk=4, num_draft_tokens=16))
                specs.append(dict(name=f"{key} static", method=key, model=str(folder),
                                  num_speculative_tokens=5,
                                  speculative_token_tree=[(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]))
                if version == 3 and cfg["num_hidden_layers"] < 8:  # the default needs >= 8
                    for sp in specs[-2:]:
                        sp["aux_hidden_layers"] = [0, 1, cfg["num_hidden_layers"] - 1]
            except Exception as e:  # noqa: BLE001 - reported in the JSON
                part["errors"][key] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
    # one timed run each: the heads are random (acceptance ~0); what counts is that they run,
    # in which graphs, and give plain's tokens
    _bench_rows(args, part, engine, counter, prompts, specs, args.strategy_tokens,
                compare=True, repeats=1)


def engine_phase(args) -> None:
    from speculant.bench import device_name, random_prompts

    tmp = Path(tempfile.mkdtemp(prefix=f"speculant-tree-{args.phase_name}-"))
    part: dict = {"phase": args.phase_name, "errors": {}}
    t0 = time.perf_counter()
    longest = max(max(step_tokens(args, n) for n in step_cells(args)[1]), args.e2e_tokens,
                  args.strategy_tokens + 64)
    llm, cfg = build_llm(args, tmp, longest + 2 * MAX_TREE_NODES + 16)
    engine = llm.engine
    part.update(startup_s=time.perf_counter() - t0, device=device_name(engine.device),
                geometry=cfg, dtype=str(engine.dtype).replace("torch.", ""),
                cuda_graphs=engine.runner.graphs is not None)
    print(f"[{args.phase_name}] up in {part['startup_s']:.0f}s on {part['device']}", flush=True)
    _save_part(args, part)
    counter = GraphCounter(engine)
    prompt = random_prompts(1, args.prompt_len, engine.vocab_size, seed=0)[0]
    if args.phase_name == "step_cost":
        step_cost_phase(args, part, engine, counter, prompt)
    elif args.phase_name == "e2e":
        e2e_phase(args, part, engine, counter, prompt)
    else:
        strategies_phase(args, part, engine, counter, prompt, tmp, cfg)
    part["wall_s"] = time.perf_counter() - t0
    _save_part(args, part)
    llm.close()


# ------------------------------------------------------------------------ orchestration
def run_phase(name: str, extra: list[str], args, timeout_s: float) -> dict:
    """One phase in a process of its own (its own process group, killed at ``timeout_s``);
    returns its part with the exit status and wall time. Its output goes to
    ``parts/NAME.log``; the progress lines are echoed, the log's tail too when it failed."""
    part_dir = Path(args.out) / "parts"
    part_dir.mkdir(parents=True, exist_ok=True)
    path, log = part_dir / f"{name}.json", part_dir / f"{name}.log"
    path.unlink(missing_ok=True)
    argv = [sys.executable, str(Path(__file__).resolve()), *args.argv, *extra,
            "--phase-name", name, "--part-dir", str(part_dir)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    timed_out = False
    try:
        rc = proc.wait(timeout=max(timeout_s, 1))
    except subprocess.TimeoutExpired:
        timed_out, rc = True, None
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    wall = time.perf_counter() - t0
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    for line in lines:
        if line.startswith("["):
            print(line[:400])
    if timed_out or rc != 0:
        print(f"--- {log.name}: last 30 lines")
        for line in lines[-30:]:
            print(line[-300:])
    part = json.loads(path.read_text()) if path.exists() else {}
    part.setdefault("errors", {})
    part.update(rc=rc, timed_out=timed_out, phase_wall_s=wall)
    if timed_out:
        part["errors"]["timeout"] = f"killed after {timeout_s:.0f}s (time limit)"
    elif rc != 0:
        part["errors"]["exit"] = f"exit status {rc} (log: {log})"
    print(f"=== phase {name}: {'timed out' if timed_out else f'rc {rc}'} in {wall:.0f}s",
          flush=True)
    return part


def plan(args) -> list[tuple[str, list[str], float]]:
    """The phases of a run: (name, extra argv, time limit in s)."""
    skip = set(filter(None, args.skip.split(",")))
    phases = [("step_cost", [], 360), ("e2e", [], 150), ("strategies", [], 150)]
    return [p for p in phases if p[0] not in skip]


def orchestrate(args) -> int:
    out = Path(args.out)
    t_start = time.perf_counter()
    cfg = dict(GEOMETRIES[args.geometry])
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    result: dict = {"mode": args.geometry, "geometry": cfg, "init": args.init,
                    "dtype": args.dtype, "device": args.device, "args": vars(args), "phases": {}}
    for name, extra, limit in plan(args):
        left = args.budget_s - (time.perf_counter() - t_start)
        if left < 30:
            result["phases"][name] = {"errors": {"phase": "not run: the time budget was spent"}}
            continue
        part = run_phase(name, extra, args, min(limit, left - 10))
        if part.get("device"):
            result["device"] = part["device"]
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
    ap.add_argument("--out", default="gpu_tree_out")
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), default="8b",
                    help="8b: Llama-3-8B; tiny: the CPU smoke test's model")
    ap.add_argument("--layers", type=int, default=None, help="target layers (default 32)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--init", choices=("scaled", "dummy"), default=None,
                    help="synthetic weights (default scaled on CUDA, dummy on the CPU)")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--shapes", default=SHAPES,
                    help="step-cost trees, NODES:WIDTH,... (each against the chain of its node "
                    "count; the e2e trees are added)")
    ap.add_argument("--chains", default="16,32,64",
                    help="step-cost chains beside those of the trees' node counts (issue 36's "
                    "baseline: chains of 16 / 32 / 64 at 1.09x / 1.20x / 1.28x a plain step)")
    ap.add_argument("--step-tokens", type=int, default=256,
                    help="tokens per step-cost run (at least 16 x (nodes + 1))")
    ap.add_argument("--alphas", default=ALPHAS, help="e2e: the chains' alpha = the trees' "
                    "rank-0 probability")
    ap.add_argument("--e2e-chains", default=E2E_CHAINS, help="e2e chain lengths k")
    ap.add_argument("--e2e-trees", default=E2E_TREES, help="e2e trees NODES:WIDTH")
    ap.add_argument("--e2e-tokens", type=int, default=256)
    ap.add_argument("--strategies", default="ngram,eagle,eagle3")
    ap.add_argument("--strategy-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per e2e / strategy cell")
    ap.add_argument("--step-repeats", type=int, default=2,
                    help="step-cost rounds: each times one run (its median step) of a chain "
                    "and of every tree of its node count (plain and tree-less chains: this "
                    "many runs)")
    ap.add_argument("--warmup-tokens", type=int, default=24)
    ap.add_argument("--kv-cache-gib", type=float, default=4.0)
    ap.add_argument("--skip", default="",
                    help="phases to leave out: step_cost, e2e, strategies")
    ap.add_argument("--budget-s", type=float, default=540.0,
                    help="wall-clock budget of the whole run; a phase is killed at the end of "
                    "it (or of its own limit)")
    ap.add_argument("--replot", metavar="JSON", default=None,
                    help="only redraw the figure of a saved gpu_tree.json into --out (no GPU)")
    # internal: one phase's process (started by the run itself)
    ap.add_argument("--phase-name", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--part-dir", default=None, help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    args.argv = argv
    if args.replot:
        print(f"wrote {replot(args.replot, args.out)}")
        return 0
    args.init = args.init or ("scaled" if args.device == "cuda" else "dummy")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.init == "scaled" and args.device == "cpu":
        ap.error("--init scaled needs CUDA (the CPU path packs its weights at load time); use "
                 "--init dummy on the CPU")
    try:
        for text in (args.shapes, args.e2e_trees):
            parse_shapes(text)
        if any(not 1 <= k <= 64 for k in parse_ints(args.e2e_chains) + parse_ints(args.chains)):
            raise ValueError("--chains / --e2e-chains: chain lengths are 1 to 64 (the oracle's "
                             "num_speculative_tokens)")
        [float(a) for a in args.alphas.split(",") if a.strip()]
    except ValueError as e:
        ap.error(str(e))
    unknown = set(filter(None, args.strategies.split(","))) - {"ngram", "eagle", "eagle3"}
    if unknown:
        ap.error(f"--strategies: unknown {sorted(unknown)}; use ngram,eagle,eagle3")
    logging.basicConfig(level=logging.WARNING)
    if args.phase_name is None:
        return orchestrate(args)
    install_loader()
    try:
        engine_phase(args)
    except Exception as e:
        path = _part_path(args)
        part = json.loads(path.read_text()) if path.exists() else {}
        part.setdefault("errors", {})["phase"] = f"{type(e).__name__}: {e}"
        _save_part(args, part)
        raise
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
