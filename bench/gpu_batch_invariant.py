"""The cost of ``EngineConfig.batch_invariant`` on the Llama-3-8B synthetic target, and its check.

    python bench/gpu_batch_invariant.py --out bench/results --stem gpu_batch_invariant_h200
        [--layers 32] [--batch-sizes 1,8,64] [--gemm cublas|triton]

One engine per mode (off, on): bench/gpu_8b.py's synthetic target (Llama-3-8B geometry, bf16,
random weights made on the GPU, nothing downloaded; CUDA graphs, captured at start-up). Per mode:

* cost: plain greedy decoding of ``--max-tokens`` tokens after ``--prompt-len``-token prompts at
  each batch size, timed as ``speculant.bench`` times its plain rows (prefill excluded; batch 1
  ``--repeats`` times, the run of median step time reported): tokens/s, and with the mode the
  ratio to the mode off;
* check: the first ``--check-requests`` prompts decoded (``--check-tokens`` tokens, with their
  log-probabilities, which are a function of the whole logits row) alone, in a batch of 8 and
  within a batch of 64: with the mode every request's tokens and log-probabilities must be the
  same bit for bit at every batch size; without it the script reports how many differ. With the
  mode, n-gram speculation (k = 3) on prompts that repeat their own continuation (so it drafts)
  must give the plain batch-1 tokens and log-probabilities too, at batch 1 and 64.

The synthetic target's LM head makes greedy choices win by a wide margin (bench/gpu_8b.py
``_permutation_head``): the tokens agree in either mode, the log-probabilities tell. Writes
``--stem``.json to ``--out``; exits 1 if a check with the mode fails. About 2 minutes on
an H100.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_8b import LLAMA3_8B, synthetic_loader, write_config  # noqa: E402


def _loader(original):
    """bench/gpu_8b.py's ``synthetic_loader`` for the synthetic folder; any other load (and the
    engine's keyword arguments, e.g. ``load_format``) goes to ``original``."""
    synthetic = synthetic_loader(original)

    def load_model(folder, config, dtype, device, max_positions, **kw):
        if getattr(config, "speculant_synthetic", False):
            return synthetic(folder, config, dtype, device, max_positions)
        return original(folder, config, dtype, device, max_positions, **kw)

    return load_model


def _engine(target: Path, invariant: bool, max_num_seqs: int, max_model_len: int):
    from speculant import LLM

    return LLM(model=str(target), dtype="bfloat16", skip_tokenizer_init=True,
               max_num_seqs=max_num_seqs, max_model_len=max_model_len,
               kv_cache_memory=4 << 30, batch_invariant=invariant)


def _outputs(llm, prompts: list[list[int]], batch: int, tokens: int) -> list[tuple]:
    """Each prompt's (tokens, log-probability of each) decoded greedily, ``batch`` at a time."""
    from speculant import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, logprobs=0)
    outs = []
    for i in range(0, len(prompts), batch):
        group = [{"prompt_token_ids": p} for p in prompts[i : i + batch]]
        for o in llm.generate(group, sp, use_tqdm=False):
            c = o.outputs[0]
            outs.append((tuple(c.token_ids),
                         tuple(d[t].logprob for t, d in zip(c.token_ids, c.logprobs))))
    return outs


def _timed(engine, prompts, max_tokens: int, warmup: int, repeats: int) -> dict:
    from speculant.bench import _decode_run, step_stats

    _decode_run(engine, prompts, warmup)
    runs = [_decode_run(engine, prompts, max_tokens) for _ in range(repeats)]
    per_step = [r["decode_s"] / max(r["steps"], 1) for r in runs]
    r = runs[per_step.index(statistics.median_low(per_step))]
    return {"batch_size": len(prompts), "tokens_per_s": r["decode_tokens"] / r["decode_s"],
            "step_s": r["decode_s"] / max(r["steps"], 1), "steps": r["steps"],
            "step_s_runs": per_step, **step_stats(r["step_times"])}


def _check(llm, prompts, n: int, tokens: int) -> dict:
    """The first ``n`` requests decoded alone, in a batch of 8 and among all ``prompts``."""
    alone = _outputs(llm, prompts[:n], 1, tokens)
    res = {}
    for batch, got in ((8, _outputs(llm, prompts[:8], 8, tokens)[:n]),
                       (len(prompts), _outputs(llm, prompts, len(prompts), tokens)[:n])):
        res[f"batch_{batch}"] = {
            "tokens_differ": sum(a[0] != b[0] for a, b in zip(alone, got)),
            "logprobs_differ": sum(a != b for a, b in zip(alone, got)),
            "requests": n,
        }
    return {"by_batch": res, "identical": all(not v["logprobs_differ"] for v in res.values()),
            "alone": alone}


def _ngram_check(llm, prompts, n: int, tokens: int) -> dict:
    """n-gram speculation on prompts that repeat their plain continuation (drafts get accepted):
    tokens and log-probabilities against plain decoding alone, at batch 1 and all together."""
    from speculant.bench import _set_strategy

    plain_c = _outputs(llm, prompts[:n], 1, tokens)
    rep = [p + list(c[0]) + p for p, c in zip(prompts[:n], plain_c)]
    rep += prompts[n:]  # the rest of the batch: ordinary prompts
    ref = _outputs(llm, rep[:n], 1, tokens)
    dec = _set_strategy(llm.engine, {"method": "ngram", "num_speculative_tokens": 3})
    try:
        res = {}
        for batch in (1, len(rep)):
            got = _outputs(llm, rep if batch > 1 else rep[:n], batch, tokens)[:n]
            res[f"batch_{batch}"] = {
                "tokens_differ": sum(a[0] != b[0] for a, b in zip(ref, got)),
                "logprobs_differ": sum(a != b for a, b in zip(ref, got)), "requests": n}
        m = dec.total
        drafts = {"num_draft_tokens": m.num_draft_tokens,
                  "num_accepted_tokens": m.num_accepted_tokens}
    finally:
        _set_strategy(llm.engine, None)
    return {"by_batch": res, "drafts": drafts,
            "identical": all(not v["logprobs_differ"] for v in res.values())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--stem", default="gpu_batch_invariant",
                    help="output file name without .json (README cites gpu_batch_invariant_h200: the card of the run)")
    ap.add_argument("--layers", type=int, default=32, help="target layers (32: Llama-3-8B)")
    ap.add_argument("--batch-sizes", default="1,8,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64, help="timed decode tokens")
    ap.add_argument("--warmup-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs at batch 1")
    ap.add_argument("--check-requests", type=int, default=8)
    ap.add_argument("--check-tokens", type=int, default=32)
    ap.add_argument("--gemm", choices=("cublas", "triton"), default=None,
                    help="the mode's GEMMs (models/batch_invariant.GEMM; default: the module's)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    t_start = time.perf_counter()

    import speculant.engine.llm_engine as llm_engine
    import speculant.models.loader as loader
    from speculant.bench import device_name, random_prompts
    from speculant.models import batch_invariant

    if args.gemm:
        batch_invariant.GEMM = args.gemm

    loader.load_model = _loader(loader.load_model)
    llm_engine.load_model = loader.load_model
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    n_prompts = max(batch_sizes + [64])
    max_len = 2 * args.prompt_len + 2 * args.check_tokens + args.max_tokens + 64
    target = write_config(Path(tempfile.mkdtemp(prefix="speculant-bi-")) / "target",
                          dict(LLAMA3_8B, num_hidden_layers=args.layers), 0)
    prompts = random_prompts(n_prompts, args.prompt_len, LLAMA3_8B["vocab_size"], seed=0)
    result: dict = {"device": device_name(torch.device("cuda")), "layers": args.layers,
                    "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                    "gemm": batch_invariant.GEMM, "modes": {}}
    ok = True
    for invariant in (False, True):
        mode = "batch_invariant" if invariant else "default"
        t0 = time.perf_counter()
        llm = _engine(target, invariant, n_prompts, max_len)
        setup = time.perf_counter() - t0
        rows = [_timed(llm.engine, prompts[:b], args.max_tokens, args.warmup_tokens,
                       args.repeats if b == 1 else 1) for b in batch_sizes]
        check = _check(llm, prompts, args.check_requests, args.check_tokens)
        entry = {"setup_s": setup, "plain": rows,
                 "check": {k: v for k, v in check.items() if k != "alone"}}
        if invariant:
            entry["ngram_check"] = _ngram_check(llm, prompts, args.check_requests,
                                                args.check_tokens)
            ok = check["identical"] and entry["ngram_check"]["identical"]
            base = {r["batch_size"]: r for r in result["modes"]["default"]["plain"]}
            for r in rows:
                r["vs_default"] = r["tokens_per_s"] / base[r["batch_size"]]["tokens_per_s"]
        result["modes"][mode] = entry
        for r in rows:
            extra = f"  x{r['vs_default']:.3f} of default" if "vs_default" in r else ""
            print(f"{mode:16s} batch {r['batch_size']:3d}: {r['tokens_per_s']:9.1f} tok/s "
                  f"({r['step_s'] * 1e3:.2f} ms/step){extra}", flush=True)
        print(f"{mode:16s} check: {json.dumps(entry['check']['by_batch'])}", flush=True)
        if invariant:
            print(f"{mode:16s} n-gram: {json.dumps(entry['ngram_check'])}", flush=True)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    result["checks_pass"] = ok
    result["wall_s"] = time.perf_counter() - t_start
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{args.stem}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path} after {result['wall_s']:.0f}s; checks with the mode "
          f"{'pass' if ok else 'FAIL'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
