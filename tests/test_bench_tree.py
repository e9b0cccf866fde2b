"""bench/gpu_tree.py (the token-tree GPU benchmark) on the CPU: the theoretical-speedup formula
of docs/trees_speedup.md against Monte-Carlo runs of the oracle's own trees and the greedy tree
verifier, the summary of a made-up run (step-cost ratios, e2e comparison, goals), the JSON +
figure writing and --replot, its argument checks and documented commands, and (slow) the whole
smoke run on a tiny model."""

from __future__ import annotations

import json
import math
import random
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import gpu_tree  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------ the formula
def test_static_tree_formula_by_hand():
    parents = [-1, -1, 0, 1, 1]
    assert gpu_tree.sibling_ranks(parents) == [0, 1, 0, 0, 1]
    probs = gpu_tree.path_probabilities(parents, [0.6, 0.3])
    assert probs == pytest.approx([0.6, 0.3, 0.36, 0.18, 0.09])
    assert gpu_tree.expected_accepted(parents, [0.6, 0.3]) == pytest.approx(1.53)
    # a rank past the list is never right
    assert gpu_tree.expected_accepted([-1, -1, -1], [0.5, 0.2]) == pytest.approx(0.7)


def test_oracle_formula_is_the_static_one_on_the_full_tree():
    """The oracle's W x L tree accepts as the full W-ary tree of depth L would."""
    for width, levels, probs in ((2, 3, [0.5, 0.3]), (3, 2, [0.4, 0.2, 0.1]), (1, 5, [0.7])):
        parents, frontier = [], [-1]
        for _ in range(levels):
            nxt = []
            for p in frontier:
                for _ in range(width):
                    parents.append(p)
                    nxt.append(len(parents) - 1)
            frontier = nxt
        full = gpu_tree.expected_accepted(parents, probs) + 1
        oracle = gpu_tree.expected_tokens_oracle_tree(width, width * levels, probs)
        assert oracle == pytest.approx(full)
    # a chain: Leviathan's (1 - a^(k+1)) / (1 - a); q = 1: every level
    assert gpu_tree.expected_tokens_oracle_tree(1, 5, [0.8]) == pytest.approx(
        (1 - 0.8**6) / 0.2)
    assert gpu_tree.expected_tokens_oracle_tree(4, 16, [0.25] * 4) == 5.0
    assert gpu_tree.oracle_tree_levels(3, 16) == (5, 15)
    assert gpu_tree.oracle_tree_levels(8, 5) == (1, 5)  # the width is capped by the budget


def test_theoretical_speedup_reduces_to_leviathan():
    from speculant.bench import expected_tokens, theoretical_speedup

    a, k, c = 0.8, 5, 0.02
    tokens = gpu_tree.expected_tokens_oracle_tree(1, k, [a])
    assert tokens == pytest.approx(expected_tokens(a, k))
    assert gpu_tree.theoretical_tree_speedup(tokens, 1.0, k * c) == pytest.approx(
        theoretical_speedup(a, k, c))
    assert gpu_tree.theoretical_tree_speedup(4.0, 1.25, 0.05) == pytest.approx(4.0 / 1.3)


def _oracle(width: int, rank_probs: list[float], seed: int):
    from speculant.plugins.oracle import OracleConfig, OracleStrategy
    from speculant.spec_types import StrategyContext

    cfg = OracleConfig(num_speculative_tokens=16, alpha=rank_probs[0], seed=seed,
                       references=[{"prompt_token_ids": [1], "output_token_ids": [2]}],
                       tree_width=width, rank_probs=rank_probs)
    ctx = StrategyContext(target_model=None, target_config=None, vocab_size=64,
                          device=torch.device("cpu"), dtype=torch.float32, block_size=16,
                          max_model_len=256, max_num_seqs=1)
    return OracleStrategy(cfg, ctx)


@pytest.mark.parametrize("width,budget,rank_probs", [(2, 8, [0.6, 0.24]), (3, 15, [0.5, 0.2, 0.2]),
                                                     (4, 8, [0.3, 0.3, 0.1, 0.05])])
def test_formula_against_the_oracle_and_the_verifier(width, budget, rank_probs):
    """Monte Carlo: the oracle's own trees (OracleStrategy._tree) verified by the greedy tree
    rule against a target whose greedy continuation is the oracle's true tokens: the mean
    accepted length is the formula's within 4 standard errors."""
    from speculant.drafting import verify_tree_greedy

    oracle = _oracle(width, rank_probs, seed=7)
    rng = random.Random(3)
    vocab, trials, accepted = 64, 3000, []
    for _ in range(trials):
        true = [rng.randrange(vocab) for _ in range(budget)]
        tree = oracle._tree(true, budget)
        depths = tree.depths()
        target = torch.zeros(tree.num_nodes + 1, vocab)  # [n + 1, vocab]
        target[0, true[0]] = 1.0  # after the root: the first true token
        for i, d in enumerate(depths):  # after node i (depth d): the true token d + 1
            target[i + 1, true[d] if d < budget else 0] = 1.0
        accepted.append(verify_tree_greedy(tree, target).num_accepted)
    mean = sum(accepted) / trials
    sd = math.sqrt(sum((a - mean) ** 2 for a in accepted) / (trials - 1))
    expect = gpu_tree.expected_tokens_oracle_tree(width, budget, rank_probs) - 1
    assert abs(mean - expect) <= 4 * sd / math.sqrt(trials) + 1e-9, (mean, expect)


def test_static_formula_against_the_verifier():
    """Monte Carlo on a fixed irregular tree: at each node the target's greedy token is the
    child of rank j with probability p_j (else a token no child holds); the greedy verifier's
    mean accepted length is the static formula's within 4 standard errors."""
    from speculant.drafting import verify_tree_greedy
    from speculant.spec_types import DraftTree

    parents = [-1, -1, -1, 0, 0, 1, 3, 3, 6]
    probs = [0.5, 0.25, 0.15]
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    tree = DraftTree([10 + i for i in range(len(parents))], parents)  # distinct tokens
    rng = random.Random(5)
    trials, accepted = 4000, []
    for _ in range(trials):
        target = torch.zeros(len(parents) + 1, 64)  # [n + 1, vocab]
        for row, node in enumerate([-1, *range(len(parents))]):
            kids = children.get(node, [])
            u, acc, tok = rng.random(), 0.0, 1  # token 1: no child holds it
            for j, kid in enumerate(kids):
                acc += probs[j] if j < len(probs) else 0.0
                if u < acc:
                    tok = 10 + kid
                    break
            target[row, tok] = 1.0
        accepted.append(verify_tree_greedy(tree, target).num_accepted)
    mean = sum(accepted) / trials
    sd = math.sqrt(sum((a - mean) ** 2 for a in accepted) / (trials - 1))
    expect = gpu_tree.expected_accepted(parents, probs)
    assert abs(mean - expect) <= 4 * sd / math.sqrt(trials), (mean, expect)


def test_oracle_parents_and_shapes():
    assert gpu_tree.oracle_parents(2, 6) == [-1, -1, 0, 0, 2, 2]
    assert gpu_tree.oracle_parents(2, 6, [1, 0, 1]) == [-1, -1, 1, 1, 2, 2]
    assert gpu_tree.parse_shapes("16:2, 63:9") == [(16, 2), (63, 9)]
    for bad in ("16", "64:2", "4:8", "x:2"):
        with pytest.raises(ValueError):
            gpu_tree.parse_shapes(bad)
    args = gpu_tree.parser().parse_args(["--shapes", "16:4,15:3", "--e2e-trees", "8:2,15:3",
                                         "--e2e-chains", "4"])
    trees, chains = gpu_tree.step_cells(args)
    assert trees == [(16, 4, 4, 16), (15, 3, 5, 15), (8, 2, 4, 8)]
    assert chains == [4, 8, 15, 16, 32, 64]  # --chains: 16,32,64 by default
    assert gpu_tree.step_tokens(args, 63) == 1024 and gpu_tree.step_tokens(args, 4) == 256


def test_ngram_prompt_repeats_the_first_token_with_two_continuations():
    p = gpu_tree.ngram_prompt([5, 6, 7], [9, 10, 11, 12], vocab=100)
    assert p[:3] == [5, 6, 7] and p[-1] == 7
    at = [i for i, t in enumerate(p) if t == 9]
    assert len(at) >= 2 and len({p[i + 1] for i in at}) >= 2  # two different next tokens
    assert p[at[-1] + 1 : at[-1] + 4] == [10, 11, 12]


# ------------------------------------------------------------------------ summary
def _cell(kind, nodes, width, tokens, ms, tree_graph=0, same=True):
    name = "plain" if kind == "plain" else (f"chain k={nodes}" if kind == "chain"
                                            else f"tree n={nodes} w={width}")
    steps = 20
    gc = {"tree_steps": steps if kind == "tree" else 0, "tree_graph_steps": tree_graph,
          "tree_eager_steps": (steps - tree_graph) if kind == "tree" else 0,
          "chain_steps": steps if kind == "chain" else 0,
          "chain_graph_steps": steps if kind == "chain" else 0, "chain_eager_steps": 0,
          "tree_graphs_captured": 1 if tree_graph else 0}
    return {"kind": kind, "name": name, "nodes": nodes, "width": width, "levels": nodes // width,
            "tokens": tokens, "ms_per_step": ms, "same_tokens_as_plain": same,
            "graph_counts": gc}


def _run(name, method, tps, speedup, acceptance=None, propose=None, step=None, same=True,
         mal=None):
    return {"name": name, "method": method, "batch_size": 1, "tokens_per_s": tps,
            "speedup": speedup, "acceptance": acceptance, "propose_s_per_step": propose,
            "step_s": step, "same_tokens_as_plain": same, "mean_accepted_length": mal}


def fake_result() -> dict:
    """A made-up run: plain 6 ms, chain of 16 at 6.5 ms, trees of 16 at 6.6 ms (graphs) and
    9.0 ms (eager); e2e at a = 0.6 with a chain k=15 and a tree 15:3."""
    step = {"cells": [_cell("plain", 0, 1, 272, 6.0), _cell("chain", 16, 1, 272, 6.5),
                      _cell("tree", 16, 2, 272, 6.6, tree_graph=20),
                      _cell("tree", 16, 4, 272, 9.0),
                      _cell("plain", 0, 1, 256, 5.9), _cell("chain", 15, 1, 256, 6.4),
                      _cell("tree", 15, 3, 256, 6.5, tree_graph=20)],
            "pieces": {"compaction": [{"path_len": 4, "kernel_us": 5.0,
                                       "with_host_tensors_us": 30.0}],
                       "attention": [{"rows": 17, "width": 2, "causal_us": 4.0, "tree_us": 4.2,
                                      "tree_minus_causal_us_per_step": 6.4}],
                       "mask_build": [{"nodes": 16, "width": 2, "host_us": 12.0}]},
            "errors": {}}
    e2e = {"runs": [_run("plain", "plain", 170.0, 1.0, step=1 / 170),
                    _run("chain a=0.6 k=15", "oracle", 380.0, 380 / 170, 0.6, 0.06e-3,
                         mal=2.45),
                    _run("tree a=0.6 w=3 k=15", "oracle", 760.0, 760 / 170, 0.93, 0.06e-3,
                         mal=5.0)],
           "meta": {"chain a=0.6 k=15": {"alpha": 0.6, "nodes": 15, "width": 1},
                    "tree a=0.6 w=3 k=15": {"alpha": 0.6, "nodes": 15, "width": 3,
                                            "rank_probs": [0.6, 0.24, 0.096]}},
           "graph_counts": {"tree a=0.6 w=3 k=15": {"tree_steps": 50}}, "errors": {}}
    strat = {"runs": [_run("plain", "plain", 170.0, 1.0),
                      _run("eagle topk4 k=4", "eagle", 120.0, 0.7, 0.0, same=True)],
             "greedy": {"eagle topk4": {"prompts": 1, "equal_prompts": 1,
                                        "first_divergence": [None], "tokens_per_prompt": 96}},
             "graph_counts": {"eagle topk4 k=4": {"tree_steps": 40, "tree_graph_steps": 40}},
             "errors": {"eagle3": "RuntimeError: boom"}}
    return {"mode": "8b", "geometry": dict(gpu_tree.LLAMA3_8B), "init": "scaled",
            "device": "NVIDIA H100", "phases": {"step_cost": step, "e2e": e2e,
                                                 "strategies": strat}}


def test_summary_of_a_made_up_run():
    s = gpu_tree.summarize(fake_result())
    rows = {r["name"]: r for r in s["step_cost"]["rows"]}
    t = rows["tree n=16 w=2"]
    assert t["over_chain"] == pytest.approx(6.6 / 6.5) and t["goal_met"] is True
    assert t["over_plain"] == pytest.approx(6.6 / 6.0) and t["graph_steps_fraction"] == 1.0
    eager = rows["tree n=16 w=4"]
    assert eager["goal_met"] is False and eager["graph_steps_fraction"] == 0.0
    assert rows["chain k=16"]["over_plain"] == pytest.approx(6.5 / 6.0)
    assert rows["tree n=15 w=3"]["chain_ms_per_step"] == 6.4  # the chain of the same tokens
    e = {r["name"]: r for r in s["e2e"]["rows"]}
    tree = e["tree a=0.6 w=3 k=15"]
    tokens = gpu_tree.expected_tokens_oracle_tree(3, 15, [0.6, 0.24, 0.096])
    pr = 0.06e-3 * 170
    assert tree["expected_tokens_per_step"] == pytest.approx(tokens)
    assert tree["step_cost_ratio"] == pytest.approx(6.5 / 5.9)
    assert tree["theoretical_speedup"] == pytest.approx(tokens / (6.5 / 5.9 + pr))
    assert tree["speedup_vs_theoretical"] == pytest.approx((760 / 170) / tree["theoretical_speedup"])
    assert tree["graph_counts"] == {"tree_steps": 50}
    chain = e["chain a=0.6 k=15"]
    assert chain["theoretical_speedup"] == pytest.approx(
        gpu_tree.expected_tokens_oracle_tree(1, 15, [0.6]) / (6.4 / 5.9 + pr))
    best = s["e2e"]["tree_vs_chain"]["0.6"]
    assert best["ratio"] == pytest.approx(2.0) and best["goal_met"] is True
    assert best["same_node_count"]["tree a=0.6 w=3 k=15"]["ratio"] == pytest.approx(2.0)
    assert s["strategies"][0]["graph_counts"] == {"tree_steps": 40, "tree_graph_steps": 40}
    assert s["greedy_all_equal"] is True
    text = gpu_tree.report(dict(fake_result(), summary=s))
    assert "tree n=16 w=4: 9.000 ms/step" in text and "goal <= 1.03: False" in text
    assert "e2e a=0.6: best tree tree a=0.6 w=3 k=15 760.0 tok/s" in text
    assert "errors in strategies: {'eagle3': 'RuntimeError: boom'}" in text
    bad = fake_result()
    bad["phases"]["step_cost"]["cells"][2]["same_tokens_as_plain"] = False
    assert gpu_tree.summarize(bad)["greedy_all_equal"] is False


def test_a_failed_phase_still_summarises_and_plots(tmp_path):
    r = fake_result()
    r["phases"]["step_cost"] = {"errors": {"timeout": "killed after 240s (time limit)"},
                                "timed_out": True}
    s = gpu_tree.summarize(r)
    assert "step_cost" not in s
    assert all(row["theoretical_speedup"] is None for row in s["e2e"]["rows"])
    json_path, png = gpu_tree.write_result(r, tmp_path)
    assert png.read_bytes()[:8] == PNG and "plot_error" not in json.loads(json_path.read_text())


@pytest.mark.slow
def test_write_result_and_replot(tmp_path):
    json_path, png = gpu_tree.write_result(fake_result(), tmp_path / "run")
    saved = json.loads(json_path.read_text())
    assert saved["summary"]["e2e"]["tree_vs_chain"]["0.6"]["ratio"] == pytest.approx(2.0)
    assert png.read_bytes()[:8] == PNG and "plot_error" not in saved
    png.unlink()
    assert gpu_tree.main(["--replot", str(json_path), "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "gpu_tree.png").read_bytes()[:8] == PNG


# ------------------------------------------------------------------------ command line
def test_plan():
    args = gpu_tree.parser().parse_args([])
    assert [p[0] for p in gpu_tree.plan(args)] == ["step_cost", "e2e", "strategies"]
    assert all(extra == [] for _, extra, _ in gpu_tree.plan(args))
    args = gpu_tree.parser().parse_args(["--skip", "strategies"])
    assert [p[0] for p in gpu_tree.plan(args)] == ["step_cost", "e2e"]
    args = gpu_tree.parser().parse_args(["--skip", "e2e,strategies"])
    assert [p[0] for p in gpu_tree.plan(args)] == ["step_cost"]


def test_the_documented_commands_parse():
    """Every ``python bench/gpu_tree.py ...`` line of docs/perf.md uses options the script has."""
    text = (BENCH.parent / "docs" / "perf.md").read_text().replace("\\\n", " ")
    lines = [ln.split("#")[0] for ln in text.splitlines()
             if ln.startswith("python bench/gpu_tree.py")]
    assert any("--device cpu" in ln for ln in lines)  # continuation lines joined
    assert len(lines) >= 3
    for line in lines:
        gpu_tree.parser().parse_args(shlex.split(line)[2:])  # exits 2 on an unknown option


def test_argument_errors(capsys):
    with pytest.raises(SystemExit) as e:
        gpu_tree.main(["--device", "cpu", "--init", "scaled"])
    assert e.value.code == 2 and "--init dummy" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        gpu_tree.main(["--shapes", "16"])
    assert e.value.code == 2 and "NODES:WIDTH" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        gpu_tree.main(["--chains", "16,65"])
    assert e.value.code == 2 and "1 to 64" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        gpu_tree.main(["--strategies", "ngram,medusa"])
    assert e.value.code == 2 and "medusa" in capsys.readouterr().err


# ------------------------------------------------------------------------ the whole run
@pytest.mark.slow  # three phases, each a process with its own tiny engine (~35 s on 2 cores)
def test_whole_run_on_the_cpu(tmp_path):
    """The bench's main path on the CPU: tiny Llama, 3 layers: every phase ends without errors,
    every cell's greedy tokens equal plain's, tree steps ran (counted, eagerly on the CPU), the
    tree pieces were timed, and the e2e rows carry a theoretical speedup."""
    out = tmp_path / "run"
    cmd = [sys.executable, str(BENCH / "gpu_tree.py"), "--device", "cpu", "--geometry", "tiny",
           "--layers", "3", "--out", str(out), "--prompt-len", "16", "--shapes", "4:2,6:3",
           "--e2e-chains", "2,4", "--e2e-trees", "4:2", "--chains", "3",
           "--alphas", "0.6", "--step-tokens", "16", "--e2e-tokens", "24",
           "--strategy-tokens", "16", "--repeats", "1", "--step-repeats", "2",
           "--warmup-tokens", "2", "--kv-cache-gib", "0.01", "--budget-s", "500"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "gpu_tree.json").read_text())
    assert (out / "gpu_tree.png").read_bytes()[:8] == PNG
    for name, ph in result["phases"].items():
        assert ph["rc"] == 0 and not ph["errors"], (name, ph.get("errors"))
    s = result["summary"]
    assert s["greedy_all_equal"] is True
    trees = [r for r in s["step_cost"]["rows"] if r["kind"] == "tree"]
    assert {(r["nodes"], r["width"]) for r in trees} == {(4, 2), (6, 3)}
    assert all(r["over_chain"] and r["graph_steps_fraction"] == 0.0 for r in trees)  # CPU: eager
    assert all(len(r["over_chain_rounds"]) == 2 for r in trees)  # two rounds of chain and trees
    pieces = s["step_cost"]["pieces"]
    assert pieces["compaction"] and pieces["attention"] and pieces["mask_build"]
    e2e = {r["kind"]: r for r in s["e2e"]["rows"]}
    assert e2e["tree"]["theoretical_speedup"] > 0 and e2e["chain"]["theoretical_speedup"] > 0
    assert "0.6" in s["e2e"]["tree_vs_chain"]
    names = [r["name"] for r in s["strategies"]]
    assert names == ["ngram tree3 k=12", "eagle topk4 k=4", "eagle static k=5",
                     "eagle3 topk4 k=4", "eagle3 static k=5"]
    for r in s["strategies"][1:]:
        assert r["graph_counts"]["tree_steps"] > 0, r


def test_e2e_row_takes_the_step_cost_of_its_real_node_count():
    """A tree budget the width does not divide (15 nodes, W = 2: 7 levels, 14 nodes) is paired
    with the step-cost row of the 14-node tree."""
    step = {"cells": [_cell("plain", 0, 1, 256, 6.0), _cell("tree", 14, 2, 256, 6.6)]}
    rows = gpu_tree.step_cost_summary(step)["rows"]
    e2e = {"runs": [_run("plain", "plain", 170.0, 1.0, step=1 / 170),
                    _run("tree a=0.6 w=2 k=15", "oracle", 500.0, 500 / 170, 0.84, 0.0)],
           "meta": {"tree a=0.6 w=2 k=15": {"alpha": 0.6, "nodes": 15, "width": 2,
                                            "rank_probs": [0.6, 0.24]}}}
    (row,) = gpu_tree.e2e_summary(e2e, rows)["rows"]
    assert (row["nodes"], row["levels"]) == (14, 7)
    assert row["step_cost_ratio"] == pytest.approx(1.1)
    assert row["theoretical_speedup"] == pytest.approx(
        gpu_tree.expected_tokens_oracle_tree(2, 15, [0.6, 0.24]) / 1.1)


def test_step_cost_rounds_merge_and_the_ratio_is_the_median_over_rounds():
    cell: dict = {}
    for ms, same in ((6.5, True), (6.9, True), (6.6, True)):
        gpu_tree._merge_round(cell, {"name": "tree n=16 w=2", "kind": "tree", "nodes": 16,
                                     "tokens": 272, "ms_per_step": ms, "ms_per_step_runs": [ms],
                                     "same_tokens_as_plain": same,
                                     "graph_counts": {"tree_steps": 10, "tree_graph_steps": 10,
                                                      "tree_graphs_captured": 5}})
    assert cell["ms_per_step"] == pytest.approx(6.6) and len(cell["ms_per_step_runs"]) == 3
    assert cell["graph_counts"] == {"tree_steps": 30, "tree_graph_steps": 30,
                                    "tree_graphs_captured": 5}  # a total, not summed
    gpu_tree._merge_round(cell, {"error": "boom", "same_tokens_as_plain": False})
    assert cell["error"] == "boom" and not cell["same_tokens_as_plain"]
    # the summary takes the median of the per-round ratios, not the ratio of the medians
    chain = {"name": "chain k=16", "kind": "chain", "nodes": 16, "tokens": 272,
             "ms_per_step": 6.0}
    tree = {"name": "tree n=16 w=2", "kind": "tree", "nodes": 16, "tokens": 272, "width": 2,
            "ms_per_step": 9.0, "over_chain_rounds": [1.01, 1.05, 1.02]}
    (_, row) = gpu_tree.step_cost_summary({"cells": [chain, tree]})["rows"]
    assert row["over_chain"] == pytest.approx(1.02) and row["goal_met"] is True

