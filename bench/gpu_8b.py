"""Speculative decoding at Llama-3-8B scale on one GPU, with synthetic weights made on the device.

    python bench/gpu_8b.py --out OUT_DIR [--layers N] [--max-tokens T] [--batch-sizes 1,4,16,64]
    python bench/gpu_8b.py --out OUT_DIR --only draft,eagle,mlp     # proposer costs only

In one process: HBM copy bandwidth; the target (Llama-3-8B geometry, bf16, random weights
initialised on the GPU: nothing is downloaded); plain decoding vs the oracle at a in {0.6, 0.8,
0.9} x k in {3, 5}, n-gram, a Llama-3.2-1B-geometry draft model, an EAGLE-1 head (full-vocabulary
LM head shared with the target), an EAGLE-3 head (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B geometry:
32000-token draft vocabulary) and an MLPSpeculator sized for the target (synthetic checkpoints
written to a temporary folder), the draft, EAGLE-1 and MLPSpeculator also with a 32768-token
token map (``--token-map``), over a batch sweep with ``disable_by_batch_size``; CUDA graphs vs eager; Hugging Face transformers
``generate`` on the same weights (shared, zero-copy). Writes gpu_8b.json, gpu_8b_oracle.png and
gpu_8b_proposers.png (``--replot JSON`` redraws the figures of a saved run, without a GPU).
At batch size 1 every cell is timed ``--repeats`` times (default 5) and reports the run of median
step time: a lent machine's occasional stalled steps move a single batch-1 run by several percent
(an H100 run with three repeats reported a stalled run for the oracle at a = 0.6, k = 3: two of its
three runs had steps of up to 22 ms against a 6.1 ms median).

Roofline of plain batch-1 decoding: bytes of the weights one decode step reads (every parameter
but the input embedding table, of which one row is read) / measured copy bandwidth (bytes read +
bytes written per second of a large device-to-device copy).
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

import torch

LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    hidden_act="silu",
    tie_word_embeddings=False,
    bos_token_id=128000,
    eos_token_id=128001,
    torch_dtype="bfloat16",
)
LLAMA32_1B = dict(
    LLAMA3_8B,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    tie_word_embeddings=True,
)
INIT_STD = 0.02
# GPT-2 / Megatron "scaled init": the projections that write into the residual stream (o_proj,
# down_proj) get std 0.02 / sqrt(2 * layers). With plain N(0, 0.02) everywhere a 32-layer random
# network is chaotic: bf16 rounding differences (batch shape, split-K, query length) change the
# greedy token within a few steps (seen on the H100: the oracle's recorded continuation was lost
# after ~2 tokens), which no confident trained model does. With SCALED the token embedding
# dominates the residual stream and the LM head is a permutation of the embeddings (see
# _permutation_head). SCALED=False restores plain N(0, 0.02).
SCALED = True
EMBED_STD = 4.0  # with SCALED: the token embedding dominates the residual stream


# ------------------------------------------------------------------------ synthetic weights
def synthetic_loader(original):
    """``load_model`` replacement: folders whose config.json says ``speculant_synthetic`` get
    random weights made on the device (normal(0, 0.02), norms 1); others load normally."""

    def load_model(folder, config, dtype, device, max_positions):
        if not getattr(config, "speculant_synthetic", False):
            return original(folder, config, dtype, device, max_positions)
        from speculant.models import model_class_for
        from speculant.models.layers import RotaryEmbedding

        with torch.device("meta"):
            model = model_class_for(config, str(folder))(config, max_positions).to(dtype)
        model = model.to_empty(device=device)
        if getattr(model, "tie_word_embeddings", False):
            model.lm_head.weight = model.embed_tokens.weight
        for mod in model.modules():
            if isinstance(mod, RotaryEmbedding):
                mod.reset(config, max_positions, device)
        gen = torch.Generator(device).manual_seed(int(getattr(config, "speculant_seed", 0)))
        out_std = INIT_STD / (2 * config.num_hidden_layers) ** 0.5 if SCALED else INIT_STD
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 1:
                    p.fill_(1.0)
                else:
                    std = (
                        out_std
                        if name.endswith(("o_proj.weight", "down_proj.weight"))
                        else INIT_STD
                    )
                    std = EMBED_STD if (SCALED and name.endswith("embed_tokens.weight")) else std
                    p.normal_(0.0, std, generator=gen)
            if SCALED and not model.tie_word_embeddings:
                _permutation_head(model, gen)
        return model.eval()

    return load_model


def _permutation_head(model, gen) -> None:
    """LM head row pi(t) = c * embedding(t): the next token is pi(current token) by a margin of
    tens of logits (like a confident trained model), so bf16 rounding never flips a greedy choice;
    every layer still runs on real random weights."""
    emb, head = model.embed_tokens.weight, model.lm_head.weight  # [vocab, hidden] each
    perm = torch.randperm(emb.shape[0], generator=gen, device=emb.device)
    c = 20.0 * 1.2 / (EMBED_STD * emb.shape[1])  # top logit about 20
    head[perm] = (emb.float() * c).to(head.dtype)


def write_config(folder: Path, cfg: dict, seed: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(
        json.dumps(dict(cfg, speculant_synthetic=True, speculant_seed=seed))
    )
    return folder


def synthetic_target(layers: int, max_model_len: int, prefix: str, **engine_kw):
    """An LLM on the synthetic Llama-3-8B target (``layers`` layers; loader patched to make the
    weights on the GPU), batch up to 8, 4 GiB of KV cache: the engine of the small 8B scripts
    (spec_timeline.py, step_profile.py). ``engine_kw``: more LLM arguments."""
    import speculant.engine.llm_engine as llm_engine
    import speculant.models.loader as loader
    from speculant import LLM

    loader.load_model = synthetic_loader(loader.load_model)
    llm_engine.load_model = loader.load_model
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    target = write_config(tmp / "target", dict(LLAMA3_8B, num_hidden_layers=layers), 0)
    return LLM(
        model=str(target),
        dtype="bfloat16",
        skip_tokenizer_init=True,
        max_num_seqs=8,
        max_model_len=max_model_len,
        kv_cache_memory=4 << 30,
        **engine_kw,
    )


def write_tensors(
    folder: Path,
    cfg: dict,
    shapes: dict[str, tuple[int, ...]],
    seed: int,
    extra: dict[str, torch.Tensor] | None = None,
) -> Path:
    """A small checkpoint (config.json + model.safetensors) of random bf16 tensors (plus
    ``extra`` tensors as given)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    gen = torch.Generator("cuda").manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items():
        t = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
        if name.endswith(("norm.weight", "ln.0.weight")):
            t.fill_(1.0)
        elif name.endswith("bias"):
            t.zero_()
        else:
            t.normal_(0.0, INIT_STD, generator=gen)
        tensors[name] = t.cpu()
    tensors.update(extra or {})
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def eagle1_checkpoint(folder: Path) -> Path:
    H, F, kv = 4096, 14336, 1024
    p = "layers.0."
    shapes = {
        "fc.weight": (H, 2 * H),
        "fc.bias": (H,),
        p + "self_attn.q_proj.weight": (H, H),
        p + "self_attn.k_proj.weight": (kv, H),
        p + "self_attn.v_proj.weight": (kv, H),
        p + "self_attn.o_proj.weight": (H, H),
        p + "mlp.gate_proj.weight": (F, H),
        p + "mlp.up_proj.weight": (F, H),
        p + "mlp.down_proj.weight": (H, F),
        p + "post_attention_layernorm.weight": (H,),
    }
    return write_tensors(folder, dict(LLAMA3_8B, num_hidden_layers=1, bias=True), shapes, 11)


def eagle3_checkpoint(folder: Path, draft_vocab: int = 32000) -> Path:
    """yuhuili/EAGLE3-LLaMA3.1-Instruct-8B geometry: one midlayer over [embeds, fused hidden]
    (2H wide attention input), fc 3H -> H, its own 32000-token head mapped through d2t."""
    H, F, kv, V = 4096, 14336, 1024, 128256
    p = "midlayer."
    shapes = {
        "fc.weight": (H, 3 * H),
        p + "input_layernorm.weight": (H,),
        p + "hidden_norm.weight": (H,),
        p + "self_attn.q_proj.weight": (H, 2 * H),
        p + "self_attn.k_proj.weight": (kv, 2 * H),
        p + "self_attn.v_proj.weight": (kv, 2 * H),
        p + "self_attn.o_proj.weight": (H, H),
        p + "mlp.gate_proj.weight": (F, H),
        p + "mlp.up_proj.weight": (F, H),
        p + "mlp.down_proj.weight": (H, F),
        p + "post_attention_layernorm.weight": (H,),
        "norm.weight": (H,),
        "lm_head.weight": (draft_vocab, H),
    }
    gen = torch.Generator().manual_seed(13)
    sel = torch.randperm(V, generator=gen)[:draft_vocab].sort().values
    d2t = sel - torch.arange(draft_vocab)  # target id = draft id + d2t[draft id]
    cfg = dict(
        LLAMA3_8B,
        num_hidden_layers=1,
        architectures=["LlamaForCausalLMEagle3"],
        draft_vocab_size=draft_vocab,
    )
    return write_tensors(folder, cfg, shapes, 14, extra={"d2t": d2t})


def mlp_speculator_checkpoint(folder: Path, n_predict: int = 4, emb_dim: int = 4096,
                              inner_dim: int = 3072, vocab: int = 128256) -> Path:
    """An MLPSpeculator with tied stages and random bf16 weights; the defaults are
    ibm-ai-platform/llama3-8b-accelerator's geometry (emb 4096, inner 3072)."""
    V, H, inner = vocab, emb_dim, inner_dim
    shapes = {
        "emb.0.weight": (V, inner),
        "proj.0.weight": (inner, H),
        "proj.1.weight": (inner, inner),
        "head.0.weight": (V, inner),
        "ln.0.weight": (inner,),
        "ln.0.bias": (inner,),
    }
    cfg = {
        "architectures": ["MLPSpeculatorPreTrainedModel"],
        "model_type": "mlp_speculator",
        "n_predict": n_predict,
        "emb_dim": H,
        "inner_dim": inner,
        "vocab_size": V,
        "tie_weights": True,
        "scale_input": True,
        "top_k_tokens_per_head": [1] * n_predict,
    }
    return write_tensors(folder, cfg, shapes, 12)


# ------------------------------------------------------------------------ measurements
def copy_bandwidth(nbytes: int = 4 << 30, iters: int = 20) -> float:
    """Bytes read + written per second of a device-to-device copy (median of ``iters``)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    times = []
    for i in range(iters + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / sorted(times)[len(times) // 2]


def weight_bytes_per_step(model) -> int:
    skip = set() if model.tie_word_embeddings else {id(model.embed_tokens.weight)}
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen and id(p) not in skip:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def hf_sharing(model, config):
    """A transformers LlamaForCausalLM whose parameters are views of ours (no copy)."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        hf = LlamaForCausalLM(config)

    def P(t):
        return torch.nn.Parameter(t, requires_grad=False)

    hf.model.embed_tokens.weight = P(model.embed_tokens.weight)
    for hl, ol in zip(hf.model.layers, model.layers):
        a, m = ol.self_attn, ol.mlp
        q, kv = a.q_size, a.kv_size
        w = a.qkv_proj.weight  # [q + 2 kv, hidden]
        hl.self_attn.q_proj.weight = P(w[:q])
        hl.self_attn.k_proj.weight = P(w[q : q + kv])
        hl.self_attn.v_proj.weight = P(w[q + kv :])
        hl.self_attn.o_proj.weight = P(a.o_proj.weight)
        gu = m.gate_up_proj.weight  # [2 inter, hidden]
        hl.mlp.gate_proj.weight = P(gu[: m.inter])
        hl.mlp.up_proj.weight = P(gu[m.inter :])
        hl.mlp.down_proj.weight = P(m.down_proj.weight)
        hl.input_layernorm.weight = P(ol.input_layernorm.weight)
        hl.post_attention_layernorm.weight = P(ol.post_attention_layernorm.weight)
    hf.model.norm.weight = P(model.norm.weight)
    hf.lm_head.weight = P(model.lm_head.weight)
    dev = model.lm_head.weight.device
    with torch.device(dev):
        hf.model.rotary_emb = type(hf.model.rotary_emb)(config=config)
    left = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"HF model still has meta tensors: {left[:4]}")
    return hf.eval()


def hf_generate(hf, prompt: list[int], max_new: int) -> dict:
    ids = torch.tensor([prompt], device="cuda")
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        hf.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=max_new, min_new_tokens=max_new, **kw)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    return {"tokens_per_s": max_new / dt, "s": dt, "tokens": out[0, len(prompt) :].tolist()}


def graph_check(engine, prompts, max_tokens: int) -> dict:
    """CUDA graphs vs eager: same greedy tokens (batch 1 and 8), and the eager speed."""
    from speculant.bench import _decode_run, _set_strategy

    _set_strategy(engine, None)
    res = {}
    for bs in (1, 8):
        _decode_run(engine, prompts[:bs], 4)  # warm-up (graph capture)
        fast = _decode_run(engine, prompts[:bs], max_tokens)
        graphs, engine.runner.graphs = engine.runner.graphs, None
        try:
            _decode_run(engine, prompts[:bs], 4)
            slow = _decode_run(engine, prompts[:bs], max_tokens)
        finally:
            engine.runner.graphs = graphs
        same = [a == b for a, b in zip(fast["tokens"], slow["tokens"])]
        res[f"batch_{bs}"] = {
            "same_tokens": all(same),
            "seqs_same": sum(same),
            "seqs": len(same),
            "graph_tokens_per_s": fast["decode_tokens"] / fast["decode_s"],
            "eager_tokens_per_s": slow["decode_tokens"] / slow["decode_s"],
        }
    return res


# ------------------------------------------------------------------------ plots
# Issue 6's budgets for c (the cost of one draft run relative to one plain target step).
C_BUDGET = {
    "ngram": 0.02,
    "mlp_speculator": 0.05,
    "eagle": 0.08,
    "eagle3": 0.08,
    "draft_model": 0.2,
}
_FAMILY_COLOR = {
    "ngram": "tab:gray",
    "draft_model": "tab:blue",
    "eagle": "tab:orange",
    "eagle3": "tab:green",
    "mlp_speculator": "tab:red",
}
_RANDOM_HEADS = (
    "draft 1B, EAGLE-1, EAGLE-3 and MLPSpeculator: random weights, so acceptance 0 "
    "(these rows measure cost only)"
)


def plot(result: dict, out_dir: str | Path, stem: str = "gpu_8b") -> list[Path]:
    """The run as two readable figures instead of one chart of every row:

    * ``{stem}_oracle.png``: the oracle (acceptance forced to a) at batch 1, measured against
      theoretical speedup, and its speedup over the batch sweep;
    * ``{stem}_proposers.png`` (``gpu_8b_proposers.png`` for ``--only`` runs): each proposer's cost c against batch size with its budget, and
      the speedup over plain of the random-weight proposers with and without auto-disable.

    A figure without rows for it (``--only`` runs have no oracle) is not written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs = result["runs"]
    extra = result.get("extra", {})
    layers = extra.get("layers", 32)
    target = f"Llama-3-8B geometry ({layers} layers), bf16, synthetic weights"
    where = f"{result.get('device', '?')}"
    written = []

    oracle = [r for r in runs if r["method"] == "oracle"]
    if oracle:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.2))
        b1 = [r for r in oracle if r["batch_size"] == 1]
        xs = range(len(b1))
        ax1.bar([x - 0.2 for x in xs], [r["speedup"] for r in b1], 0.4, label="measured")
        ax1.bar(
            [x + 0.2 for x in xs],
            [r["theoretical_speedup"] or 0 for r in b1],
            0.4,
            label="theoretical (Leviathan et al., measured a and c)",
        )
        for x, r in zip(xs, b1):
            if r.get("theoretical_speedup"):
                ratio = r["speedup"] / r["theoretical_speedup"]
                ax1.text(
                    x, r["theoretical_speedup"] + 0.08, f"{ratio:.0%}", ha="center", fontsize=8
                )
        ax1.axhline(1.0, color="k", lw=0.8)
        ax1.set_xticks(list(xs), [r["name"].replace("oracle ", "") for r in b1], fontsize=8)
        ax1.set_ylabel("speedup over plain decoding, batch 1")
        ax1.set_title("batch 1: measured / theoretical above the bars", fontsize=9)
        ax1.legend(fontsize=8, loc="upper left")
        batches = sorted({r["batch_size"] for r in oracle})
        shades = {0.6: "tab:blue", 0.8: "tab:orange", 0.9: "tab:green"}
        for name in dict.fromkeys(r["name"] for r in oracle):
            pts = sorted((r["batch_size"], r["speedup"]) for r in oracle if r["name"] == name)
            row = next(r for r in oracle if r["name"] == name)
            a = float(name.split("a=")[1].split()[0]) if "a=" in name else None
            ax2.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                marker="o",
                color=shades.get(a, "k"),
                ls="-" if row.get("k") == 5 else "--",
                label=name.replace("oracle ", ""),
            )
        ax2.axhline(1.0, color="k", lw=0.8)
        _batch_axis(ax2, batches)
        ax2.set_ylabel("speedup over plain decoding at that batch size")
        ax2.set_title(
            "batch sweep (speculation switched off above batch 16: disable_by_batch_size)",
            fontsize=9,
        )
        ax2.legend(fontsize=8, ncol=2)
        ax2.grid(True, alpha=0.3)
        fig.suptitle(
            f"Oracle proposer on {where}: target {target}.\nAcceptance forced by the oracle: "
            "each draft token is the target's own next token with probability a (no trained "
            "drafter involved)",
            fontsize=10,
        )
        fig.tight_layout()
        path = out / f"{stem}_oracle.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    costs = [r for r in extra.get("proposer_cost", []) if r["method"] != "oracle"]
    costs = [r for r in costs if "+auto" not in r["name"]]
    if costs:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 6.6))
        for name in dict.fromkeys(r["name"] for r in costs):
            rows = sorted((r for r in costs if r["name"] == name), key=lambda r: r["batch_size"])
            fam = rows[0]["method"]
            ax1.plot(
                [r["batch_size"] for r in rows],
                [r["c_per_draft"] for r in rows],
                marker="o",
                color=_FAMILY_COLOR.get(fam, "k"),
                ls="--" if "+tm" in name else "-",
                label=name,
            )
        budgets: dict[float, list[str]] = {}
        for fam in dict.fromkeys(r["method"] for r in costs):
            if fam in C_BUDGET:
                budgets.setdefault(C_BUDGET[fam], []).append(fam)
        for value, fams_at in budgets.items():
            ax1.axhline(
                value,
                color=_FAMILY_COLOR.get(fams_at[0], "k"),
                lw=1.0,
                ls=":",
                label=f"budget {value:g}: {', '.join(fams_at)}",
            )
        _batch_axis(ax1, sorted({r["batch_size"] for r in costs}))
        ax1.set_yscale("log")
        ax1.set_ylabel("c: one draft run / one plain target step")
        ax1.set_title("proposer cost c (dashed: with a 32k token map; dotted: budgets)", fontsize=9)
        ax1.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3)
        ax1.grid(True, alpha=0.3, which="both")
        fams = [r for r in runs if r["method"] in _FAMILY_COLOR and "+tm" not in r["name"]]
        for name in dict.fromkeys(r["name"] for r in fams):
            rows = sorted((r for r in fams if r["name"] == name), key=lambda r: r["batch_size"])
            auto = "+auto" in name
            ax2.plot(
                [r["batch_size"] for r in rows],
                [r["speedup"] for r in rows],
                marker="x" if auto else "o",
                color=_FAMILY_COLOR[rows[0]["method"]],
                ls="-" if auto else "--",
                label=name,
            )
        ax2.axhline(0.95, color="k", lw=0.8, ls=":")
        _batch_axis(ax2, sorted({r["batch_size"] for r in fams}))
        ax2.set_ylabel("speedup over plain decoding")
        ax2.set_title(
            "drafts that never match: without (dashed) and with auto_disable (solid); dotted: 0.95",
            fontsize=9,
        )
        ax2.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3)
        ax2.grid(True, alpha=0.3)
        fig.suptitle(f"Proposers on {where}: target {target}.\n{_RANDOM_HEADS}", fontsize=10)
        fig.tight_layout()
        # an --only run's stem is gpu_8b_proposers already
        name = f"{stem}.png" if stem.endswith("_proposers") else f"{stem}_proposers.png"
        path = out / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _batch_axis(ax, batches: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.minorticks_off()
    ax.set_xlabel("batch size")


def replot(json_path: str | Path, out_dir: str | Path) -> list[Path]:
    """The figures of a saved result (no GPU needed): ``gpu_8b_*.png``, or
    ``gpu_8b_proposers_*.png`` for an ``--only`` run."""
    result = json.loads(Path(json_path).read_text())
    has_oracle = any(r["method"] == "oracle" for r in result["runs"])
    return plot(result, out_dir, "gpu_8b" if has_oracle else "gpu_8b_proposers")


# ------------------------------------------------------------------------ main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--layers", type=int, default=32, help="target layers (32: Llama-3-8B)")
    ap.add_argument("--max-tokens", type=int, default=None, help="default 256 (64 with --only)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--batch-sizes", default=None, help="default 1,4,8,16,64 (1,8 with --only)")
    ap.add_argument("--warmup-tokens", type=int, default=16)
    ap.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="timed runs per batch-1 cell (other batch sizes: one); each row reports the run of "
        "median step time, every run's step time in step_s_runs",
    )
    ap.add_argument("--disable-by-batch-size", type=int, default=16)
    ap.add_argument(
        "--skip", default="", help="comma-separated: hf,draft,eagle,eagle3,mlp,ngram,check"
    )
    ap.add_argument(
        "--only",
        default="",
        help="quick proposer-cost mode, comma-separated from draft,eagle,eagle3,mlp,ngram: "
        "only these strategies (no oracle sweep, graph check or HF generate); "
        "default batch sizes 1,8 and 64 tokens; writes gpu_8b_proposers.json",
    )
    ap.add_argument(
        "--no-auto",
        action="store_true",
        help="skip the auto_disable=True rows of the n-gram, draft, EAGLE and MLP strategies",
    )
    ap.add_argument(
        "--host-profile",
        action="store_true",
        help="also run plain and oracle a=0.8 k=5 decoding at batch 1 under cProfile (host "
        "time per function; the .tolist() rows show where the host waits for the GPU) and "
        "write host_profile.txt",
    )
    ap.add_argument(
        "--token-map",
        type=int,
        default=32768,
        help="also run the draft, EAGLE-1 and MLPSpeculator strategies with a token map of this "
        "many ids (FR-Spec: the draft's output layer restricted to them; here ids 0..N-1, "
        "the weights being random); 0: no such rows",
    )
    ap.add_argument(
        "--async-scheduling",
        choices=("auto", "on", "off"),
        default="auto",
        help="overlapped plain decode steps (EngineConfig.async_scheduling; auto: on with CUDA "
        "graphs)",
    )
    ap.add_argument(
        "--replot",
        metavar="JSON",
        default=None,
        help="only redraw the figures of a saved gpu_8b JSON into --out (no GPU needed)",
    )
    args = ap.parse_args()
    if args.replot:
        for path in replot(args.replot, args.out):
            print(f"wrote {path}")
        return 0
    logging.basicConfig(level=logging.WARNING)
    skip = set(filter(None, args.skip.split(",")))
    only = set(filter(None, args.only.split(",")))
    if only:
        unknown = only - {"draft", "eagle", "eagle3", "mlp", "ngram"}
        if unknown:
            ap.error(f"--only: unknown {sorted(unknown)}")
        skip |= {"hf", "check", "oracle"} | ({"draft", "eagle", "eagle3", "mlp", "ngram"} - only)
        args.no_auto = True
    args.batch_sizes = args.batch_sizes or ("1,8" if only else "1,4,8,16,64")
    args.max_tokens = args.max_tokens or (64 if only else 256)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    import speculant.engine.llm_engine as llm_engine
    import speculant.models.loader as loader
    from speculant import LLM
    from speculant.bench import random_prompts, run_bench, table, write_outputs
    from speculant.engine.spec_decode import SpecDecoder

    loader.load_model = synthetic_loader(loader.load_model)  # the draft model imports it late
    llm_engine.load_model = loader.load_model

    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="speculant-8b-"))
    target = write_config(tmp / "target", dict(LLAMA3_8B, num_hidden_layers=args.layers), 0)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    max_len = args.prompt_len + args.max_tokens + 64
    llm = LLM(
        model=str(target),
        dtype="bfloat16",
        skip_tokenizer_init=True,
        max_num_seqs=max(batch_sizes + [8]),
        max_model_len=max_len,
        kv_cache_memory=8 << 30,
        async_scheduling={"auto": None, "on": True, "off": False}[args.async_scheduling],
    )
    engine = llm.engine
    wbytes = weight_bytes_per_step(engine.model)
    roofline = bw / wbytes
    print(
        f"target loaded ({wbytes / 1e9:.2f} GB read per step, roofline {roofline:.1f} tok/s) "
        f"after {time.perf_counter() - t_start:.0f}s",
        flush=True,
    )
    prompts = random_prompts(max(batch_sizes + [8]), args.prompt_len, engine.vocab_size, seed=0)

    extra: dict = {
        "copy_bandwidth_Bps": bw,
        "weight_bytes_per_step": wbytes,
        "roofline_tokens_per_s": roofline,
        "layers": args.layers,
        "errors": {},
    }
    if "check" not in skip:
        extra["cuda_graph_check"] = graph_check(engine, prompts, min(args.max_tokens, 128))
        print("graph check", extra["cuda_graph_check"], flush=True)

    dis = {"disable_by_batch_size": args.disable_by_batch_size}
    strategies = (
        []
        if "oracle" in skip
        else [
            dict(method="oracle", alpha=a, num_speculative_tokens=k, **dis)
            for a in (0.6, 0.8, 0.9)
            for k in (3, 5)
        ]
    )
    if "ngram" not in skip:
        strategies.append(dict(method="ngram", num_speculative_tokens=3, **dis))
    optional = []
    if "draft" not in skip:
        d = write_config(tmp / "draft-1b", LLAMA32_1B, 1)
        optional.append(
            dict(
                name="draft 1B",
                method="draft_model",
                model=str(d),
                num_speculative_tokens=3,
                kv_cache_memory=2 << 30,
                **dis,
            )
        )
    if "eagle" not in skip:
        optional.append(
            dict(
                name="eagle",
                method="eagle",
                model=str(eagle1_checkpoint(tmp / "eagle")),
                num_speculative_tokens=3,
                **dis,
            )
        )
    if "eagle3" not in skip:
        optional.append(
            dict(
                name="eagle3",
                method="eagle3",
                model=str(eagle3_checkpoint(tmp / "eagle3")),
                num_speculative_tokens=3,
                **dis,
            )
        )
    if "mlp" not in skip:
        optional.append(
            dict(
                name="mlp_speculator",
                method="mlp_speculator",
                model=str(mlp_speculator_checkpoint(tmp / "mlp")),
                num_speculative_tokens=4,
                **dis,
            )
        )
    if args.token_map:
        tm_file = tmp / f"token_map_{args.token_map}.pt"
        torch.save(torch.arange(args.token_map), tm_file)
        optional += [
            dict(sp, name=f"{sp['name']} +tm{args.token_map // 1024}k", token_map=str(tm_file))
            for sp in list(optional)
            if sp["method"] in ("draft_model", "eagle", "mlp_speculator")
        ]
    if "ngram" in {s["method"] for s in strategies}:
        optional.insert(0, dict(name="ngram", method="ngram", num_speculative_tokens=3, **dis))
        strategies = [s for s in strategies if s["method"] != "ngram"]
    auto = []
    for spec in optional:  # keep only strategies that can be built from synthetic checkpoints
        try:
            SpecDecoder(engine, {k: v for k, v in spec.items() if k != "name"})
            strategies.append(spec)
            if not args.no_auto and "token_map" not in spec:
                # the same strategy with the engine's auto-disable: its drafts never match here
                # (random weights / random prompts), so these rows show what a user pays for a
                # strategy that does not fit the workload
                auto.append(dict(spec, name=spec["name"] + " +auto", auto_disable=True))
        except Exception as e:  # noqa: BLE001 - reported in the JSON
            extra["errors"][spec["name"]] = f"{type(e).__name__}: {e}"
            print(f"skipping {spec['name']}: {e}", flush=True)
        torch.cuda.empty_cache()
    strategies += auto

    def progress(row: dict) -> None:
        print(
            f"[{time.perf_counter() - t_start:5.0f}s] {row['name']:>28} b{row['batch_size']:<3} "
            f"speedup {row['speedup']:.3f}  cell {row['cell_s']:5.1f}s (set-up "
            f"{row['setup_s']:.1f}s)",
            flush=True,
        )

    result = run_bench(
        engine,
        prompts,
        strategies,
        args.max_tokens,
        batch_sizes,
        warmup_tokens=args.warmup_tokens,
        repeats={1: max(1, args.repeats)},
        progress=progress,
    )
    plain1 = next(r for r in result["runs"] if r["method"] == "plain" and r["batch_size"] == 1)
    extra["plain_batch1_fraction_of_roofline"] = plain1["tokens_per_s"] / roofline
    extra["proposer_cost"] = proposer_costs(result["runs"])
    for row in extra["proposer_cost"]:
        print(
            f"{row['name']:>22} b{row['batch_size']:<3} propose {row['propose_ms']:.3f} ms "
            f"({row['propose_ms_per_draft']:.3f} ms per draft run, plain step "
            f"{row['plain_step_ms']:.3f} ms): c = {row['c_per_draft']:.3f} "
            f"(every call: {row['c_per_draft_all']:.3f}; first {row['first_propose_ms']:.2f} ms)",
            flush=True,
        )
    stem = "gpu_8b_proposers" if only else "gpu_8b"

    def save() -> tuple[Path, list[Path]]:
        json_path, png_path = write_outputs(result, out, stem)
        png_path.unlink(missing_ok=True)  # the generic chart of every row; plot() splits it
        return json_path, plot(result, out, stem)

    result["extra"] = extra  # written now as well: a run cut off during HF keeps the bench
    save()
    if "hf" not in skip:
        hf = hf_sharing(engine.model, engine.hf_config)
        h = hf_generate(hf, prompts[0], min(args.max_tokens, 128))
        mine = _first_tokens(engine, prompts[0], len(h["tokens"]))
        n_same = next((i for i, (a, b) in enumerate(zip(h["tokens"], mine)) if a != b), len(mine))
        extra["hf_generate"] = {
            "tokens_per_s": h["tokens_per_s"],
            "s": h["s"],
            "fraction_of_roofline": h["tokens_per_s"] / roofline,
            "matching_prefix_tokens": n_same,
            "tokens": len(mine),
        }
        del hf
    result["extra"] = extra
    result["wall_s"] = time.perf_counter() - t_start
    if only:
        try:
            extra["proposer_device_time_b1"] = profile_proposers(
                engine, prompts, [s for s in strategies if s["method"] != "ngram"]
            )
            for row in extra["proposer_device_time_b1"]:
                print("profile", json.dumps(row), flush=True)
        except Exception as e:  # noqa: BLE001 - reported in the JSON
            extra["errors"]["profile"] = f"{type(e).__name__}: {e}"
    if args.host_profile:
        extra["plain_kernel_profile"] = kernel_profile(
            engine, prompts, trace=out / "trace_plain.json"
        )
        print("plain kernel profile", json.dumps(extra["plain_kernel_profile"]), flush=True)
        from speculant.bench import _decode_run, _set_strategy

        _set_strategy(engine, None)
        rec = _decode_run(engine, prompts[:1], 64)["tokens"][0]
        refs = [{"prompt_token_ids": prompts[0], "output_token_ids": rec}]
        oracle = dict(method="oracle", alpha=0.8, num_speculative_tokens=5, references=refs)
        extra["oracle_kernel_profile"] = kernel_profile(
            engine, prompts, 40, oracle, trace=out / "trace_oracle.json"
        )
        print("oracle kernel profile", json.dumps(extra["oracle_kernel_profile"]), flush=True)
        profiled = [
            sp
            for sp in strategies
            if sp["method"] in ("eagle3", "draft_model") and not sp.get("auto_disable")
        ]
        (out / "host_profile.txt").write_text(
            host_profile(engine, prompts, min(args.max_tokens, 128), profiled)
        )
    json_path, pngs = save()
    print(table(result))
    print(json.dumps({k: v for k, v in extra.items() if k != "cuda_graph_check"}, default=str))
    print(f"wrote {json_path} {' '.join(map(str, pngs))} in {result['wall_s']:.0f}s")
    return 0


class ProposeProfiler:
    """A pluggy wrapper around ``propose``: GPU kernel time of each call (torch.profiler, CUDA
    activity only), to tell GPU-bound proposers from host-bound ones."""

    def __init__(self) -> None:
        self.device_ms: list[float] = []
        self.kernels: dict[str, float] = {}

    def make_hook(self):
        from speculant import hookimpl

        prof_self = self

        class _Hook:
            @hookimpl(wrapper=True)
            def propose(self, batch):
                from torch.profiler import ProfilerActivity, profile

                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    result = yield
                    torch.cuda.synchronize()
                total = 0.0
                for e in prof.key_averages():
                    us = getattr(e, "self_device_time_total", None)
                    us = us if us is not None else getattr(e, "self_cuda_time_total", 0.0)
                    total += us
                    prof_self.kernels[e.key] = prof_self.kernels.get(e.key, 0.0) + us
                prof_self.device_ms.append(total / 1e3)
                return result

        return _Hook()


def profile_proposers(engine, prompts, specs: list[dict], steps: int = 12) -> list[dict]:
    """Batch 1: GPU kernel time per propose call (median over ``steps`` calls after warm-up)."""
    from speculant.bench import _decode_run, _set_strategy

    out = []
    for spec in specs:
        dec = _set_strategy(engine, {k: v for k, v in spec.items() if k != "name"})
        _decode_run(engine, prompts[:1], 8)  # warm-up
        p = ProposeProfiler()
        dec.pm.register(p.make_hook(), name="bench:profiler")
        _decode_run(engine, prompts[:1], steps)
        ms = sorted(p.device_ms[2:] or p.device_ms)
        calls = max(len(p.device_ms), 1)
        top = sorted(p.kernels.items(), key=lambda kv: -kv[1])[:6]
        out.append(
            {
                "name": spec.get("name", spec["method"]),
                "device_ms_per_propose": ms[len(ms) // 2] if ms else None,
                "top_kernels_ms_per_propose": {k[:80]: v / 1e3 / calls for k, v in top},
            }
        )
    _set_strategy(engine, None)
    return out


def host_profile(engine, prompts, max_tokens: int, specs: list[dict] = ()) -> str:
    """cProfile of batch-1 decoding, plain, with the oracle (a = 0.8, k = 5) and with each of
    ``specs``: where the host spends a step's time (the synchronising reads show up as the time
    the host waits)."""
    import cProfile
    import io
    import pstats

    from speculant.bench import _decode_run, _set_strategy

    _set_strategy(engine, None)
    rec = _decode_run(engine, prompts[:1], max_tokens + 8)
    refs = [{"prompt_token_ids": prompts[0], "output_token_ids": rec["tokens"][0]}]
    oracle = dict(method="oracle", alpha=0.8, num_speculative_tokens=5, references=refs)
    buf = io.StringIO()
    for cfg in (None, oracle, *[{k: v for k, v in sp.items() if k != "name"} for sp in specs]):
        _set_strategy(engine, cfg)
        _decode_run(engine, prompts[:1], 16)  # warm-up
        prof = cProfile.Profile()
        prof.enable()
        r = _decode_run(engine, prompts[:1], max_tokens)
        prof.disable()
        buf.write(
            f"\n=== {cfg['method'] if cfg else 'plain'}: {r['steps']} steps, "
            f"{1e3 * r['decode_s'] / r['steps']:.3f} ms per step (under cProfile)\n"
        )
        st = pstats.Stats(prof, stream=buf)
        st.sort_stats("tottime").print_stats(30)
        st.sort_stats("cumulative").print_stats(40)
    _set_strategy(engine, None)
    return buf.getvalue()


def gpu_gaps(prof, steps: int, top: int = 12) -> dict:
    """Where the GPU sits idle in a profile: the union of kernel / copy intervals against their
    span, and the idle time summed per (previous kernel -> next kernel) pair, per step."""
    from torch.autograd import DeviceType

    ev = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start
    )
    if not ev:
        return {}
    pairs: dict[str, list[float]] = {}
    busy = 0.0
    end, last = ev[0][1], ev[0][2]
    busy += ev[0][1] - ev[0][0]
    for s, e, name in ev[1:]:
        if s > end:
            key = f"{last[:40]} -> {name[:40]}"
            pairs.setdefault(key, [0.0, 0])
            pairs[key][0] += s - end
            pairs[key][1] += 1
        busy += max(0.0, e - max(s, end))
        if e > end:
            end, last = e, name
    span = end - ev[0][0]
    worst = sorted(pairs.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "span_ms_per_step": span / 1e3 / steps,
        "busy_ms_per_step": busy / 1e3 / steps,
        "idle_ms_per_step": (span - busy) / 1e3 / steps,
        "idle_by_pair_us_per_step": [
            {"pair": k, "us_per_step": v[0] / steps, "count_per_step": v[1] / steps}
            for k, v in worst
        ],
    }


def kernel_profile(
    engine, prompts, steps: int = 16, spec: dict | None = None, trace: Path | None = None,
    batch: int = 1,
) -> dict:
    """GPU kernel time of decode steps of ``batch`` requests (torch.profiler, CUDA activity
    only): total per step against the step's wall time, and the kernels that take it. ``spec``:
    a speculative config (e.g. the oracle) whose steps to profile instead of plain ones."""
    from torch.profiler import ProfilerActivity, profile

    from speculant.bench import _decode_run, _set_strategy
    from speculant.sampling_params import SamplingParams

    _set_strategy(engine, spec)
    _decode_run(engine, prompts[:1], 8)  # warm-up
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"kprof-{time.monotonic_ns()}-{i}", None, prompts[i % len(prompts)],
                           params)
    while engine.scheduler.waiting:
        engine.step()  # prefills: not profiled
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        n = 0
        while engine.has_unfinished_requests():
            engine.step()
            n += 1
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    _set_strategy(engine, None)
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    kernels = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        us = us if us is not None else getattr(e, "self_cuda_time_total", 0.0)
        kernels[e.key] = (us, e.count)
    total_ms = sum(us for us, _ in kernels.values()) / 1e3
    n = max(n, 1)
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:30]
    eff = effective_kernel_time(prof)
    return {
        "strategy": "plain" if spec is None else spec["method"],
        "batch_size": batch,
        "steps": n,
        "wall_ms_per_decode_step_profiled": 1e3 * wall / n,
        "gpu_ms_per_step": total_ms / n,
        "gaps": gpu_gaps(prof, n),
        "top_kernels": [
            {"kernel": k[:100], "ms_per_step": us / 1e3 / n, "calls_per_step": c / n}
            for k, (us, c) in top
        ],
        "effective_ms_per_step": sum(eff.values()) / 1e3 / n,
        "effective_top_kernels": [
            {"kernel": k[:100], "ms_per_step": us / 1e3 / n}
            for k, us in sorted(eff.items(), key=lambda kv: -kv[1])[:30]
        ],
    }


def effective_kernel_time(prof) -> dict[str, float]:
    """Microseconds per kernel name of what each kernel adds to the timeline: its end minus the
    end of the kernel that ended before it (at most its own duration, so idle time before it is
    not counted). With programmatic dependent launch a kernel starts before the previous one
    ends and its own duration includes that wait, so the profiler's kernel times overcount;
    these do not: they add up to the busy span of the GPU."""
    from torch.autograd import DeviceType

    ev = sorted(
        (e.time_range.end, e.time_range.start, e.name)
        for e in prof.events()
        if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start
    )
    out: dict[str, float] = {}
    prev_end = None
    for end, start, name in ev:
        lo = start if prev_end is None else max(start, prev_end)
        out[name] = out.get(name, 0.0) + max(0.0, end - lo)
        prev_end = end
    return out


def proposer_costs(runs: list[dict]) -> list[dict]:
    """Leviathan et al.'s c per strategy and batch size: the cost of ONE draft run relative to
    one plain target decode step = propose time per speculative step / (k * plain step time).
    ``c_per_draft``: steady-state proposes (without a request's first, which prefills a draft
    model); ``c_per_draft_all``: every propose of the cost pass, the first ones included."""
    plain = {r["batch_size"]: r["step_s"] for r in runs if r["method"] == "plain"}
    rows = []
    for r in runs:
        if r["method"] == "plain" or not r.get("propose_s_per_step") or not r.get("k"):
            continue
        step = plain[r["batch_size"]]
        rows.append(
            {
                "name": r["name"],
                "method": r["method"],
                "batch_size": r["batch_size"],
                "k": r["k"],
                "propose_ms": 1e3 * r["propose_s_per_step"],
                "propose_ms_per_draft": 1e3 * r["propose_s_per_step"] / r["k"],
                "plain_step_ms": 1e3 * step,
                "c_per_draft": r["propose_s_per_step"] / (r["k"] * step),
                "c_per_draft_all": (r.get("propose_s_per_step_all") or r["propose_s_per_step"])
                / (r["k"] * step),
                "first_propose_ms": 1e3 * (r.get("first_propose_s") or 0.0),
                "same_tokens_as_plain": r["same_tokens_as_plain"],
            }
        )
    return rows


def _first_tokens(engine, prompt, n) -> list[int]:
    from speculant.bench import _decode_run, _set_strategy

    _set_strategy(engine, None)
    return _decode_run(engine, [prompt], n)["tokens"][0]


if __name__ == "__main__":
    raise SystemExit(main())
