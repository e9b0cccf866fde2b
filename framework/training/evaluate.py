"""``eval_acceptance``: how well a speculation strategy drafts for its target on a prompt set
(default: the held-out prompts), per category: acceptance by draft position, tokens per target
forward (the mean accepted length, the bonus token included), and the wall-clock speedup over
plain greedy decoding of the same prompts, one request at a time; greedy outputs are checked
equal to plain. One table, a JSON file and a plot."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

from speculant.training.prompts import CATEGORIES, prompt_set


def _delta(after, before) -> dict[str, Any]:
    """Spec metrics of one category: the engine's totals after it minus those before it."""
    def sub(a: list[int], b: list[int]) -> list[int]:
        b = list(b) + [0] * (len(a) - len(b))
        return [x - y for x, y in zip(a, b)]

    acc = sub(after.accepted_per_position, before.accepted_per_position)
    prop = sub(after.proposed_per_position, before.proposed_per_position)
    steps = (after.num_decode_steps - before.num_decode_steps)
    emitted = after.num_emitted_tokens - before.num_emitted_tokens
    drafts = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    return {
        "tokens_per_forward": round(emitted / steps, 4) if steps else 0.0,
        "acceptance_rate": round(accepted / drafts, 4) if drafts else 0.0,
        "per_position_acceptance": [round(a / p, 4) if p else 0.0 for a, p in zip(acc, prop)],
        "draft_tokens": drafts,
        "accepted_tokens": accepted,
        "decode_steps": steps,
    }


def _run(llm, texts: list[str], params) -> tuple[list[list[int]], float]:
    outs, t0 = [], time.perf_counter()
    for text in texts:  # one request at a time: the latency setting speculation is for
        o = llm.chat([[{"role": "user", "content": text}]], params, use_tqdm=False)[0]
        outs.append(list(o.outputs[0].token_ids))
    return outs, time.perf_counter() - t0


def eval_acceptance(spec: dict[str, Any], model: str | None = None, split: str = "held-out",
                    num_prompts: int | None = None, max_tokens: int = 128,
                    out: str | Path | None = None, device: str = "auto",
                    progress: bool = True) -> dict[str, Any]:
    """Measure ``spec`` (a speculative_config) against plain greedy decoding on the first
    ``num_prompts`` prompts of each category of ``split``. Returns (and with ``out`` writes as
    ``out/acceptance.json`` + ``out/acceptance.png``) ``{"spec", "categories": {category:
    {tokens_per_forward, per_position_acceptance, speedup, identical, ...}}, "all": {...}}``."""
    from speculant import LLM, SamplingParams

    prompts = prompt_set(split)
    by_cat = {c: [p.text for p in prompts if p.category == c][:num_prompts] for c in CATEGORIES}
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    plain = LLM(model=model, device=device)
    base = {c: _run(plain, texts, params) for c, texts in by_cat.items()}
    del plain
    llm = LLM(model=model, device=device, speculative_config=spec)
    result: dict[str, Any] = {"spec": spec, "split": split, "max_tokens": max_tokens,
                              "categories": {}}
    total_plain = total_spec = 0.0
    for c, texts in by_cat.items():
        before = copy.deepcopy(llm.get_metrics())
        outs, wall = _run(llm, texts, params)
        row = _delta(llm.get_metrics(), before)
        row.update(prompts=len(texts), speedup=round(base[c][1] / wall, 3) if wall else 0.0,
                   identical=outs == base[c][0], plain_s=round(base[c][1], 2),
                   spec_s=round(wall, 2))
        result["categories"][c] = row
        total_plain, total_spec = total_plain + base[c][1], total_spec + wall
    everything = _delta(llm.get_metrics(), type(llm.get_metrics())())
    everything.update(speedup=round(total_plain / total_spec, 3) if total_spec else 0.0,
                      identical=all(r["identical"] for r in result["categories"].values()))
    result["all"] = everything
    if progress:
        print(format_table(result))
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "acceptance.json").write_text(json.dumps(result, indent=2) + "\n")
        plot_acceptance(result, out / "acceptance.png")
    return result


def format_table(result: dict[str, Any]) -> str:
    rows = [*result["categories"].items(), ("all", result["all"])]
    k = max((len(r["per_position_acceptance"]) for _, r in rows), default=0)
    head = (f"{'category':<14} {'tok/fwd':>7} {'speedup':>7} {'same':>5}  "
            + " ".join(f"pos{j + 1:<3}" for j in range(k)))
    lines = [f"spec: {json.dumps(result['spec'])}", head]
    for name, r in rows:
        acc = " ".join(f"{a:6.2f}" for a in r["per_position_acceptance"])
        lines.append(f"{name:<14} {r['tokens_per_forward']:7.2f} {r['speedup']:7.2f} "
                     f"{'yes' if r['identical'] else 'NO':>5}  {acc}")
    return "\n".join(lines)


def plot_acceptance(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, r in [*result["categories"].items(), ("all", result["all"])]:
        acc = r["per_position_acceptance"]
        a.plot(range(1, len(acc) + 1), acc, marker="o", label=name)
    a.set_xlabel("draft position"), a.set_ylabel("acceptance"), a.legend()
    a.set_title(str(result["spec"].get("method", "")))
    names = [*result["categories"], "all"]
    cats = [*result["categories"].values(), result["all"]]
    b.bar(names, [r["tokens_per_forward"] for r in cats], label="tokens / target forward")
    b.plot(names, [r["speedup"] for r in cats], "ko", label="speedup")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
