"""``speculant demo``: plain vs speculative decoding on the embedded default model."""

from __future__ import annotations

import time

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


def _run(llm, prompts, params):
    t0 = time.perf_counter()
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    ntok = sum(len(o.outputs[0].token_ids) for o in outs)
    return outs, dt, ntok


def run_demo(model: str | None = None, max_tokens: int = 128, k: int = 5,
             methods: list[str] | None = None) -> int:
    from speculant import LLM, SamplingParams

    methods = methods or ["ngram"]
    prompts = [p for _, p in DEMO_PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    print(f"speculant demo: {len(prompts)} prompts, greedy, max_tokens={max_tokens}, one at a time")
    base = LLM(model=model)
    _run(base, prompts[:1], SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
    plain = []
    for p in prompts:
        plain.append(_run(base, [p], params))
    plain_tok = sum(n for _, _, n in plain)
    plain_s = sum(dt for _, dt, _ in plain)
    print(f"\n{'method':<14}{'tokens/s':>10}{'speedup':>9}{'accept':>8}{'mean len':>10}  per-position acceptance")
    print(f"{'none':<14}{plain_tok / plain_s:>10.1f}{1.0:>9.2f}{'-':>8}{'1.00':>10}")
    all_ok = True
    for method in methods:
        llm = LLM(model=model, speculative_config={"method": method, "num_speculative_tokens": k})
        _run(llm, prompts[:1], SamplingParams(temperature=0.0, max_tokens=8))
        llm.engine.spec.total.__init__()
        runs = [_run(llm, [p], params) for p in prompts]
        tok = sum(n for _, _, n in runs)
        sec = sum(dt for _, dt, _ in runs)
        m = llm.get_metrics()
        same = all(r[0][0].outputs[0].token_ids == b[0][0].outputs[0].token_ids for r, b in zip(runs, plain))
        all_ok &= same
        pos = " ".join(f"{x:.2f}" for x in m.per_position_acceptance)
        print(f"{method:<14}{tok / sec:>10.1f}{plain_s / sec:>9.2f}{m.acceptance_rate:>8.2f}"
              f"{m.mean_accepted_length:>10.2f}  [{pos}]")
        for (cat, _), r, b in zip(DEMO_PROMPTS, runs, plain):
            rm = r[0][0].metrics
            print(f"    {cat:<11} {b[1] / r[1]:>5.2f}x  accepted {rm.spec.num_accepted_tokens}/"
                  f"{rm.spec.num_draft_tokens}  mean len {rm.spec.mean_accepted_length:.2f}")
        print(f"    greedy output identical to plain decoding: {'yes' if same else 'NO'}")
    print("\nfirst reply (plain):", plain[0][0][0].outputs[0].text[:300].replace("\n", "\n    "))
    return 0 if all_ok else 1
