"""Kernel profile of batch-1 plain and oracle (a = 0.8, k = 5) steps at Llama-3-8B scale.

    python bench/step_profile.py --out OUT_DIR [--layers 32]

The same synthetic target as ``bench/gpu_8b.py``; ``kernel_profile`` from there (torch.profiler,
CUDA activity) for 16 plain steps and 40 oracle steps. Besides the profiler's own kernel times
it reports each kernel's *effective* time (``effective_kernel_time``: what it adds to the GPU
timeline), the figure that stays meaningful with programmatic dependent launch, where a kernel's
own duration includes its wait for the one before. Writes step_profile.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_8b import kernel_profile, synthetic_target  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--layers", type=int, default=32)
    args = ap.parse_args()
    from speculant.bench import _decode_run, _set_strategy, random_prompts

    t0 = time.perf_counter()
    llm = synthetic_target(args.layers, 512, "speculant-prof-")
    engine = llm.engine
    prompts = random_prompts(1, 128, engine.vocab_size, seed=0)
    result = {"plain": kernel_profile(engine, prompts)}
    _set_strategy(engine, None)
    rec = _decode_run(engine, prompts[:1], 64)["tokens"][0]
    refs = [{"prompt_token_ids": prompts[0], "output_token_ids": rec}]
    oracle = dict(method="oracle", alpha=0.8, num_speculative_tokens=5, references=refs)
    result["oracle"] = kernel_profile(engine, prompts, 40, oracle)
    for name, r in result.items():
        print(
            f"== {name}: {r['steps']} steps, wall {r['wall_ms_per_decode_step_profiled']:.3f} "
            f"ms/step, kernels {r['gpu_ms_per_step']:.3f}, effective "
            f"{r['effective_ms_per_step']:.3f}, idle {r['gaps'].get('idle_ms_per_step', 0):.3f}"
        )
        for k in r["effective_top_kernels"][:14]:
            print(f"   {k['ms_per_step'] * 1e3:8.1f} us  {k['kernel'][:90]}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result["wall_s"] = time.perf_counter() - t0
    (out / "step_profile.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
