"""Token-map coverage on a real model: SmolLM2-135M-Instruct drafting for itself, on the CPU.

    python bench/token_map_smollm2.py [--sizes 1024,2048,4096,8192] [--corpus FILE ...]

A self-draft (the target as its own draft model) accepts every draft, so with a token map the
acceptance it loses is exactly the share of the target's tokens that fall outside the hot set:
a direct measure of what a map costs in acceptance. The maps are built with
``build_token_map_from_corpus`` (what ``speculant token-map`` runs) from ``--corpus`` (default:
this repository's README.md and docs/*.md, English technical prose), with the embedded model's
tokenizer; the prompts are the four ``speculant demo`` prompts (code edit, verbatim rewrite,
summary, question answering: partly other text than the corpus), chat template, greedy, k = 5.
Writes token_map_smollm2.json (acceptance rate, tokens per target step, share of output tokens in
the hot set, tokens/s, and whether the output equals plain decoding).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from _checkout import use_checkout  # bench/, the script's folder

use_checkout()

from speculant import LLM, SamplingParams  # noqa: E402
from speculant.demo import DEMO_PROMPTS  # noqa: E402
from speculant.drafting.token_map import build_token_map_from_corpus, save_token_map  # noqa: E402
from speculant.models.loader import resolve_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _generate(llm: LLM, max_tokens: int) -> tuple[list[list[int]], float]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    t = time.perf_counter()
    outs = llm.chat([[{"role": "user", "content": p}] for _, p in DEMO_PROMPTS], params,
                    use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1024,2048,4096,8192")
    ap.add_argument("--corpus", nargs="+", default=None, help="default: README.md, docs/*.md")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    corpus = args.corpus or [str(ROOT / "README.md"), *map(str, sorted((ROOT / "docs").glob("*.md")))]
    model = str(resolve_model(None))
    base = LLM(model=model, device="cpu")
    plain, t_plain = _generate(base, args.max_tokens)
    n_plain = sum(map(len, plain))
    rows = [{"token_map": None, "tokens_per_s": n_plain / t_plain}]
    tok = base.get_tokenizer()
    tmp = Path(tempfile.mkdtemp(prefix="token-map-"))
    for size in [None, *(int(s) for s in args.sizes.split(","))]:
        spec = {"method": "draft_model", "model": model, "num_speculative_tokens": args.k}
        row: dict = {"token_map": size}
        hot = None
        if size is not None:
            ids, counts = build_token_map_from_corpus(tok, corpus, size, progress=False)
            hot = set(ids.tolist())
            spec["token_map"] = str(save_token_map(ids, tmp / f"hot{size}.pt"))
            row["corpus_tokens"] = int(counts.sum())
            row["corpus_distinct_tokens"] = int((counts > 0).sum())
        llm = LLM(model=model, device="cpu", speculative_config=spec)
        out, dt = _generate(llm, args.max_tokens)
        m = llm.get_metrics()
        row.update(
            acceptance_rate=m.acceptance_rate,
            tokens_per_step=m.tokens_per_step,
            tokens_per_s=sum(map(len, out)) / dt,
            same_as_plain=out == plain,
            output_tokens=sum(map(len, out)),
        )
        if hot is not None:
            row["output_tokens_in_hot_set"] = sum(t in hot for o in out for t in o) / max(
                1, sum(map(len, out))
            )
        rows.append(row)
        print(json.dumps(row), flush=True)
        del llm
    result = {
        "model": "SmolLM2-135M-Instruct (embedded GGUF), CPU fp32, self-draft",
        "k": args.k,
        "max_tokens": args.max_tokens,
        "corpus": [str(Path(c).relative_to(ROOT)) if c.startswith(str(ROOT)) else c for c in corpus],
        "rows": rows,
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "token_map_smollm2.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out_dir / 'token_map_smollm2.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
