"""Kernel profile of batch-1 plain and oracle (a = 0.8, k = 5) steps at Llama-3-8B scale.

    python bench/step_profile.py --out OUT_DIR [--layers 32]

The same synthetic target as ``bench/gpu_8b.py``; ``kernel_profile`` from there (torch.profiler,
CUDA activity) for 16 plain steps and 40 oracle steps. Besides the profiler's own kernel times
it reports each kernel's *effective* time (``effective_kernel_time``: what it adds to the GPU
timeline), the figure that stays meaningful with programmatic dependent launch, where a kernel's
own duration includes its wait for the one before. Run it twice (``SPECULANT_PDL=0`` and 1) for
an A/B. Writes step_profile.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_8b import LLAMA3_8B, kernel_profile, synthetic_loader, write_config  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--layers", type=int, default=32)
    args = ap.parse_args()
    import speculant.engine.llm_engine as llm_engine
    import speculant.models.loader as loader
    from speculant import LLM
    from speculant.bench import _decode_run, _set_strategy, random_prompts

    loader.load_model = synthetic_loader(loader.load_model)
    llm_engine.load_model = loader.load_model
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="speculant-prof-"))
    target = write_config(tmp / "target", dict(LLAMA3_8B, num_hidden_layers=args.layers), 0)
    llm = LLM(
        model=str(target),
        dtype="bfloat16",
        skip_tokenizer_init=True,
        max_num_seqs=8,
        max_model_len=512,
        kv_cache_memory=4 << 30,
    )
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
