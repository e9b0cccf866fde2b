"""CPU benchmark on the embedded default model (SmolLM2-135M-Instruct, fp32), against HF
transformers in the same process and run.

(a) ``engine``: our greedy tokens/s vs HF ``generate`` on the same prompts, one prompt at a time
    and all prompts in one batch (HF: left padding). Goal: >= 2x HF.
(b) ``ngram``: n-gram speculation vs none on input-grounded prompts (the demo's code edit /
    rewrite / summarize / qa), side by side with HF's ``prompt_lookup_num_tokens``: speedup and
    tokens per target step (tokens per target forward in decoding) per category. Goal: ours beats
    HF's in every category and is never below 1.0. Also the speedup of the decoding phase alone
    (after the first token; HF's prefill timed by a 1-token run): the prefill is the same
    compute-bound work with and without speculation and dilutes the end-to-end ratio, more so
    for an engine whose plain decoding is fast.

The CPU is shared, so runs are interleaved (ours, HF, ours, HF, ...) and repeated; every figure is
the median over repeats, and ratios are taken per repeat before the median. Greedy outputs are
checked for equality (ours plain == ours ngram == HF plain, token for token).

    python bench/bench_cpu.py --threads 1 [--repeats 3] [--max-tokens 64] [-k 10] [--only engine|ngram]

Writes bench/results/cpu_engine.json, cpu_ngram.json and the figure docs/cpu_bench.png (``--out``
holds all three when given); with torch threads other
than 1 (``--threads 2``, or torch's default on a machine with more cores) the names get a suffix,
e.g. cpu_engine_2threads.json, so the 1-thread figures stay next to them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
DOCS = Path(__file__).resolve().parent.parent / "docs"  # the figure

PLAIN_PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a refrigerator works to a ten-year-old.",
    "List five tips for staying focused while studying.",
    "What are the main differences between cats and dogs as pets?",
]


def chat_ids(tok, prompt: str) -> list[int]:
    ids = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
    )
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


class ForwardCounter:
    """Counts HF model forwards (target passes) through a forward hook."""

    def __init__(self, model) -> None:
        self.n = 0
        model.register_forward_hook(self._hook)

    def _hook(self, *_):
        self.n += 1


def ours_run(llm, prompts: list[list[int]], max_tokens: int, ignore_eos: bool) -> dict:
    from speculant import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    toks = [o.outputs[0].token_ids for o in outs]
    spec = [o.metrics.spec for o in outs]
    ends = [o.metrics.finished_time for o in outs]
    firsts = [o.metrics.first_token_time for o in outs]
    return {
        "s": dt,
        # after the first token (the prefill's) until the last one: the decoding phase
        "decode_s": max(ends) - min(firsts) if None not in ends + firsts else None,
        "tokens": toks,
        "n": sum(len(t) for t in toks),
        "tokens_per_step": (
            statistics.mean(m.tokens_per_step for m in spec)
            if spec and spec[0].num_spec_steps
            else None
        ),
    }


def hf_run(
    model, tok, counter, prompts: list[list[int]], max_tokens: int, ignore_eos: bool, **gen_kw
) -> dict:
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    L = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (L - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    kw = dict(max_new_tokens=max_tokens, do_sample=False, pad_token_id=pad)
    if ignore_eos:
        kw["min_new_tokens"] = max_tokens
    counter.n = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, **kw, **gen_kw)
    dt = time.perf_counter() - t0
    toks = []
    for row in out[:, L:].tolist():
        if tok.eos_token_id in row and not ignore_eos:
            row = row[: row.index(tok.eos_token_id) + 1]
        toks.append([t for t in row if t != pad] if len(prompts) > 1 else row)
    n = sum(len(t) for t in toks)
    # decoding forwards only (the first forward is the prefill that gives the first token)
    mal = (n - len(prompts)) / (counter.n - 1) if counter.n > 1 else None
    return {"s": dt, "tokens": toks, "n": n, "forwards": counter.n, "tokens_per_step": mal}


def bandwidth(model) -> dict:
    """What one decode step must read (every Linear weight once, the LM head included) and how
    fast this core streams memory: a sum over a 512 MB buffer (a read-bandwidth ceiling) and
    the one-row GEMV over the model's own Linears as the engine runs it. The ratio bytes/bandwidth
    is the floor of a decode step's time: no engine can go faster on these cores."""
    from speculant.models.layers import CpuLinear

    lin = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in lin)
    buf = torch.ones(512 * 2**20 // 4)  # [128M] float32
    xs = {m.in_features: torch.randn(1, m.in_features) for m in lin}  # [1, in] each
    best_sum = best_gemv = float("inf")
    with torch.inference_mode():
        for _ in range(5):
            t0 = time.perf_counter()
            buf.sum()
            best_sum = min(best_sum, time.perf_counter() - t0)
            t0 = time.perf_counter()
            for m in lin:
                m(xs[m.in_features])
            best_gemv = min(best_gemv, time.perf_counter() - t0)
    stream = buf.numel() * 4 / best_sum / 1e9
    gemv = weight_bytes / best_gemv / 1e9
    return {
        "weight_bytes_per_step": weight_bytes,
        "stream_read_GBps": stream,
        "gemv_GBps": gemv,
        "floor_tok_s_stream": stream * 1e9 / weight_bytes,
        "floor_tok_s_gemv": gemv * 1e9 / weight_bytes,
        "gemv_backend": "speculant C kernel (blocked weight)"
        if any(getattr(m, "wb", None) is not None for m in lin if isinstance(m, CpuLinear))
        else "numpy/OpenBLAS"
        if any(getattr(m, "np_wt", None) is not None for m in lin if isinstance(m, CpuLinear))
        else "torch",
    }


def med(xs):
    return statistics.median(xs) if xs else None


def bench_engine(llm, hf, tok, counter, repeats: int, max_tokens: int) -> dict:
    prompts = [chat_ids(tok, p) for p in PLAIN_PROMPTS]
    rows = []
    per = {
        "single": {"ours": [], "hf": [], "ratio": []},
        "batch": {"ours": [], "hf": [], "ratio": []},
    }
    equal = True
    for r in range(repeats):
        for i, p in enumerate(prompts):
            a = ours_run(llm, [p], max_tokens, True)
            b = hf_run(hf, tok, counter, [p], max_tokens, True)
            equal &= a["tokens"] == b["tokens"]
            ta, tb = a["n"] / a["s"], b["n"] / b["s"]
            per["single"]["ours"].append(ta)
            per["single"]["hf"].append(tb)
            per["single"]["ratio"].append(ta / tb)
            rows.append({"repeat": r, "prompt": i, "ours_tok_s": ta, "hf_tok_s": tb})
            print(
                f"  single r{r} p{i}: ours {ta:6.1f} tok/s  hf {tb:6.1f} tok/s  "
                f"ratio {ta / tb:.2f}",
                flush=True,
            )
        a = ours_run(llm, prompts, max_tokens, True)
        b = hf_run(hf, tok, counter, prompts, max_tokens, True)
        ta, tb = a["n"] / a["s"], b["n"] / b["s"]
        per["batch"]["ours"].append(ta)
        per["batch"]["hf"].append(tb)
        per["batch"]["ratio"].append(ta / tb)
        print(
            f"  batch{len(prompts)} r{r}: ours {ta:6.1f} tok/s  hf {tb:6.1f} tok/s  "
            f"ratio {ta / tb:.2f}",
            flush=True,
        )
    summary = {mode: {k: med(v) for k, v in d.items()} for mode, d in per.items()}
    return {
        "max_tokens": max_tokens,
        "repeats": repeats,
        "num_prompts": len(prompts),
        "greedy_single_equal_to_hf": equal,
        "median": summary,
        "runs": rows,
        "batch_runs": per["batch"],
    }


def bench_ngram(
    llm, llm_ng, hf, tok, counter, repeats: int, max_tokens: int, k: int, hf_k: int
) -> dict:
    from speculant.demo import DEMO_PROMPTS

    cats = {}
    for cat, text in DEMO_PROMPTS:
        p = chat_ids(tok, text)
        d = {
            "ours_plain_s": [],
            "ours_ngram_s": [],
            "hf_plain_s": [],
            "hf_lookup_s": [],
            "ours_speedup": [],
            "hf_speedup": [],
            "ours_mal": [],
            "hf_mal": [],
            "ours_decode_speedup": [],
            "hf_decode_speedup": [],
        }
        same = True
        for r in range(repeats):
            a = ours_run(llm, [p], max_tokens, False)
            b = ours_run(llm_ng, [p], max_tokens, False)
            c = hf_run(hf, tok, counter, [p], max_tokens, False)
            e = hf_run(hf, tok, counter, [p], max_tokens, False, prompt_lookup_num_tokens=hf_k)
            pre = hf_run(hf, tok, counter, [p], 1, False)  # HF's prefill + first token
            same &= a["tokens"] == b["tokens"]
            # decoding phase only (after the first token): the prefill, the same compute-bound
            # work with and without speculation, dilutes the end-to-end ratio
            na, nb_ = a["n"] - 1, b["n"] - 1
            if a["decode_s"] and b["decode_s"] and na > 0 and nb_ > 0:
                d["ours_decode_speedup"].append((a["decode_s"] / na) / (b["decode_s"] / nb_))
            nc, ne = c["n"] - 1, e["n"] - 1
            if nc > 0 and ne > 0 and c["s"] > pre["s"] and e["s"] > pre["s"]:
                d["hf_decode_speedup"].append(
                    ((c["s"] - pre["s"]) / nc) / ((e["s"] - pre["s"]) / ne)
                )
            d["ours_plain_s"].append(a["s"] / a["n"])
            d["ours_ngram_s"].append(b["s"] / b["n"])
            d["hf_plain_s"].append(c["s"] / c["n"])
            d["hf_lookup_s"].append(e["s"] / e["n"])
            d["ours_speedup"].append((a["s"] / a["n"]) / (b["s"] / b["n"]))
            d["hf_speedup"].append((c["s"] / c["n"]) / (e["s"] / e["n"]))
            d["ours_mal"].append(b["tokens_per_step"] or 1.0)
            d["hf_mal"].append(e["tokens_per_step"] or 1.0)
            print(
                f"  {cat:<10} r{r}: ours x{d['ours_speedup'][-1]:.2f} (len "
                f"{d['ours_mal'][-1]:.2f})  hf x{d['hf_speedup'][-1]:.2f} (len "
                f"{d['hf_mal'][-1]:.2f})  tokens {b['n']}/{e['n']}  decode phase: ours "
                f"x{(d['ours_decode_speedup'] or [float('nan')])[-1]:.2f} hf "
                f"x{(d['hf_decode_speedup'] or [float('nan')])[-1]:.2f}",
                flush=True,
            )
        cats[cat] = {
            "median": {key: med(v) for key, v in d.items()},
            "runs": d,
            "ngram_equals_plain": same,
            "hf_equals_ours": c["tokens"] == a["tokens"],
        }
    return {
        "max_tokens": max_tokens,
        "repeats": repeats,
        "k": k,
        "hf_prompt_lookup_num_tokens": hf_k,
        "categories": cats,
    }


def plot(engine: dict | None, ngram: dict | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    if engine:
        ax = axes[0]
        modes = list(engine["median"])
        x = range(len(modes))
        ax.bar(
            [i - 0.2 for i in x],
            [engine["median"][m]["ours"] for m in modes],
            0.4,
            label="speculant",
        )
        ax.bar(
            [i + 0.2 for i in x],
            [engine["median"][m]["hf"] for m in modes],
            0.4,
            label="HF generate",
        )
        for i, m in enumerate(modes):
            ax.text(
                i,
                engine["median"][m]["ours"],
                f"x{engine['median'][m]['ratio']:.2f}",
                ha="center",
                va="bottom",
            )
        ax.set_xticks(
            list(x), [f"{m} ({'1' if m == 'single' else engine['num_prompts']} seq)" for m in modes]
        )
        ax.set_ylabel("greedy tokens/s (median)")
        ax.set_title("SmolLM2-135M fp32 CPU: engine vs HF")
        ax.legend()
    if ngram:
        ax = axes[1]
        cats = list(ngram["categories"])
        x = range(len(cats))
        ours = [ngram["categories"][c]["median"]["ours_speedup"] for c in cats]
        hf = [ngram["categories"][c]["median"]["hf_speedup"] for c in cats]
        ax.bar([i - 0.2 for i in x], ours, 0.4, label=f"speculant ngram k={ngram['k']}")
        ax.bar(
            [i + 0.2 for i in x],
            hf,
            0.4,
            label=f"HF prompt_lookup_num_tokens={ngram['hf_prompt_lookup_num_tokens']}",
        )
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(list(x), cats)
        ax.set_ylabel("speedup over own plain decoding (median)")
        ax.set_title("n-gram speculation, end to end (prefill included)")
        ax.legend()
        med_ = ngram["categories"][cats[0]]["median"]
        if med_.get("ours_decode_speedup") is not None:
            ax = axes[2]
            ours = [ngram["categories"][c]["median"]["ours_decode_speedup"] or 0 for c in cats]
            hf = [ngram["categories"][c]["median"]["hf_decode_speedup"] or 0 for c in cats]
            ax.bar([i - 0.2 for i in x], ours, 0.4, label="speculant ngram")
            ax.bar([i + 0.2 for i in x], hf, 0.4, label="HF prompt lookup")
            ax.axhline(1.0, color="k", lw=0.8)
            ax.set_xticks(list(x), cats)
            ax.set_ylabel("speedup of the decoding phase (median)")
            ax.set_title("n-gram speculation, after the first token")
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("-k", type=int, default=10, help="our ngram num_speculative_tokens")
    ap.add_argument(
        "--hf-k", type=int, default=10, help="HF prompt_lookup_num_tokens (HF default 10)"
    )
    ap.add_argument("--only", choices=["engine", "ngram"], default=None)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads for both engines (default: torch's choice); 1 avoids "
        "OpenMP barrier stalls when other processes share the cores",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the engine keeps a set count

    import transformers

    from speculant import LLM
    from speculant.models.loader import resolve_model

    transformers.logging.set_verbosity_error()
    folder = resolve_model(None)
    out = Path(args.out)
    sfx = "" if torch.get_num_threads() == 1 else f"_{torch.get_num_threads()}threads"
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "model": "SmolLM2-135M-Instruct (embedded GGUF, dequantized fp32)",
        "device": "cpu",
        "cpu": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        # other processes on the cores share the memory bandwidth the GEMVs are bound by
        "loadavg_1_5_15_at_start": os.getloadavg(),
    }
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    counter = ForwardCounter(hf)
    llm = LLM(max_num_seqs=16)
    warm = chat_ids(tok, "Hi")
    ours_run(llm, [warm], 8, True)
    hf_run(hf, tok, counter, [warm], 8, True)
    engine = ngram = None
    if args.only in (None, "engine"):
        print("(a) engine vs HF generate, greedy", flush=True)
        engine = bench_engine(llm, hf, tok, counter, args.repeats, args.max_tokens)
        engine["bandwidth"] = bandwidth(llm.engine.model)
        engine["loadavg_1_5_15_at_end"] = os.getloadavg()
        engine["hf_floor_note"] = (
            "HF reads the same weights per step; its tok/s over "
            "floor_tok_s_stream is its fraction of the ceiling"
        )
        (out / f"cpu_engine{sfx}.json").write_text(json.dumps({**meta, **engine}, indent=1))
    if args.only in (None, "ngram"):
        print("(b) ngram vs HF prompt lookup, greedy", flush=True)
        llm_ng = LLM(
            max_num_seqs=16,
            speculative_config={"method": "ngram", "num_speculative_tokens": args.k},
        )
        ours_run(llm_ng, [warm], 8, True)
        hf_run(hf, tok, counter, [warm], 8, True, prompt_lookup_num_tokens=args.hf_k)
        ngram = bench_ngram(
            llm, llm_ng, hf, tok, counter, args.repeats, args.max_tokens, args.k, args.hf_k
        )
        (out / f"cpu_ngram{sfx}.json").write_text(json.dumps({**meta, **ngram}, indent=1))
    if engine is None and (out / f"cpu_engine{sfx}.json").exists():
        engine = json.loads((out / f"cpu_engine{sfx}.json").read_text())
    if ngram is None and (out / f"cpu_ngram{sfx}.json").exists():
        ngram = json.loads((out / f"cpu_ngram{sfx}.json").read_text())
    plot(engine, ngram, (DOCS if out == RESULTS else out) / f"cpu_bench{sfx}.png")
    print("\nsummary")
    if engine:
        if "bandwidth" in engine:
            b = engine["bandwidth"]
            print(
                f"  bandwidth: {b['weight_bytes_per_step'] / 1e6:.0f} MB of weights per step; "
                f"stream {b['stream_read_GBps']:.1f} GB/s -> floor {b['floor_tok_s_stream']:.1f} "
                f"tok/s; one-row GEMV {b['gemv_GBps']:.1f} GB/s -> {b['floor_tok_s_gemv']:.1f} tok/s"
            )
        for m, v in engine["median"].items():
            print(
                f"  engine {m:<7} ours {v['ours']:.1f} tok/s  hf {v['hf']:.1f} tok/s  ratio {v['ratio']:.2f}"
            )
    if ngram:
        for c, v in ngram["categories"].items():
            m = v["median"]
            print(
                f"  ngram {c:<10} ours x{m['ours_speedup']:.2f} (len {m['ours_mal']:.2f}, "
                f"{1 / m['ours_ngram_s']:.1f} tok/s)  hf x{m['hf_speedup']:.2f} (len "
                f"{m['hf_mal']:.2f}, {1 / m['hf_lookup_s']:.1f} tok/s)  lossless "
                f"{v['ngram_equals_plain']}"
            )
            if m.get("ours_decode_speedup") is not None:
                print(
                    f"        decode phase only: ours x{m['ours_decode_speedup']:.2f}  hf "
                    f"x{m['hf_decode_speedup']:.2f}"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
