"""Random checkpoints written in the published on-disk layouts, shared by the tests and by
bench/strategies_smollm2.py (which puts this folder on sys.path): tiny Hugging Face Llama / Qwen2 /
Mistral / OPT models (config.json + model.safetensors + the embedded default's tokenizer), IBM
MLPSpeculator folders, EAGLE-1 / EAGLE-3 heads (formats described in test_eagle.py), and random
EAGLE heads sized for the embedded SmolLM2-135M-Instruct. Nothing is downloaded."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

H, NH, NKV, I_DIM = 64, 4, 2, 128  # the tiny Llama's hidden, heads, kv heads, mlp width
HD = H // NH
EPS = 1e-6
THETA = 10000.0
BIG_V = 49152  # SmolLM2's vocabulary


# --------------------------------------------------------------------------------------------
# tiny Hugging Face models
# --------------------------------------------------------------------------------------------
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=512)


def _tokenizer_folder() -> Path:
    """The embedded default's tokenizer (vocab 49152), materialized once; tiny models use it."""
    from speculant.models.loader import resolve_model

    return resolve_model(None)


def make_tiny_checkpoint(path: Path, arch: str = "llama", vocab_size: int = 49152, seed: int = 0,
                         tokenizer: bool = True, **overrides) -> Path:
    """Write a random tiny HF checkpoint of ``arch`` (llama, qwen2, mistral, opt) into ``path``."""
    import transformers

    torch.manual_seed(seed)
    if arch == "opt":
        cfg = transformers.OPTConfig(
            vocab_size=vocab_size, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=512, word_embed_proj_dim=64,
            bos_token_id=1, eos_token_id=2, pad_token_id=2, **overrides)
        model = transformers.OPTForCausalLM(cfg)
    else:
        cls_cfg = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                   "mistral": transformers.MistralConfig}[arch]
        kw = dict(TINY, vocab_size=vocab_size, num_key_value_heads=2, bos_token_id=1,
                  eos_token_id=2, tie_word_embeddings=False, rope_theta=10000.0)
        kw.update(overrides)
        cfg = cls_cfg(**kw)
        model = getattr(transformers, {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                       "mistral": "MistralForCausalLM"}[arch])(cfg)
    with torch.no_grad():  # make logits peaky enough that greedy ties are vanishingly rare
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(_tokenizer_folder())).save_pretrained(path)
    return path


# --------------------------------------------------------------------------------------------
# EAGLE-1 / EAGLE-3 heads (layouts in test_eagle.py's docstring)
# --------------------------------------------------------------------------------------------

def llama_config(vocab: int, layers: int, hidden: int = H, **extra) -> dict:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": I_DIM,
        "max_position_embeddings": 512,
        "num_attention_heads": NH,
        "num_key_value_heads": NKV,
        "num_hidden_layers": layers,
        "rms_norm_eps": EPS,
        "rope_theta": THETA,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "vocab_size": vocab,
    }
    cfg.update(extra)
    return cfg


def _attn_mlp(g: torch.Generator, prefix: str, in_dim: int, hidden: int) -> dict:
    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.15

    return {
        f"{prefix}self_attn.q_proj.weight": w(NH * HD, in_dim),
        f"{prefix}self_attn.k_proj.weight": w(NKV * HD, in_dim),
        f"{prefix}self_attn.v_proj.weight": w(NKV * HD, in_dim),
        f"{prefix}self_attn.o_proj.weight": w(hidden, NH * HD),
        f"{prefix}mlp.gate_proj.weight": w(I_DIM, hidden),
        f"{prefix}mlp.up_proj.weight": w(I_DIM, hidden),
        f"{prefix}mlp.down_proj.weight": w(hidden, I_DIM),
        f"{prefix}post_attention_layernorm.weight": 1 + 0.1 * torch.randn(hidden, generator=g),
    }


def target_embedding(target: Path) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(str(target / "model.safetensors"))["model.embed_tokens.weight"]  # [V, H]


def eagle1_tensors(
    target: Path,
    layers: int = 1,
    bias: bool = True,
    seed: int = 0,
    hidden: int = H,
    copy: bool = False,
) -> dict[str, torch.Tensor]:
    """Random EAGLE-1 weights. ``copy``: fc passes the target's hidden state through and the
    layers add little, so the head mostly drafts the target's last token again (the tiny
    targets repeat tokens a lot: such drafts are often, not always, accepted)."""
    g = torch.Generator().manual_seed(seed)
    t = {"fc.weight": torch.randn(hidden, 2 * hidden, generator=g) * 0.1}
    if copy:
        t["fc.weight"] = 0.2 * t["fc.weight"] + torch.cat(
            [0 * torch.eye(hidden), torch.eye(hidden)], 1
        )
    if bias:
        t["fc.bias"] = 0.1 * torch.randn(hidden, generator=g)
    for i in range(layers):
        t.update(_attn_mlp(g, f"layers.{i}.", hidden, hidden))
        if copy:
            t[f"layers.{i}.self_attn.o_proj.weight"] *= 0.05
            t[f"layers.{i}.mlp.down_proj.weight"] *= 0.05
        if i > 0:  # EAGLE-1 drops the first layer's input norm
            t[f"layers.{i}.input_layernorm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=g)
    emb = target_embedding(target)
    t["embed_tokens.weight"] = emb if hidden == emb.shape[1] else torch.zeros(emb.shape[0], hidden)
    return t


def _head_view(e: torch.Tensor) -> torch.Tensor:
    """[rows, H] -> [rows, H]: what the copy midlayer's attention outputs for input e (heads 0, 1
    read kv head 0 = dims 0:16, heads 2, 3 read kv head 1 = dims 32:48)."""
    return torch.cat([e[:, :HD], e[:, :HD], e[:, 2 * HD : 3 * HD], e[:, 2 * HD : 3 * HD]], -1)


def eagle3_tensors(
    vocab: int,
    draft_vocab: int,
    seed: int = 0,
    hidden: int = H,
    embedding: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Random EAGLE-3 weights. With the target's ``embedding`` [V, H], a "copy" head: the
    midlayer's attention looks at its own position only (q = k = 10 * the normalized token
    embedding), passes that embedding through (v, o), and the LM head's rows are the draft
    tokens' embeddings seen the same way, so it mostly drafts its input token again."""
    g = torch.Generator().manual_seed(seed)
    t = {"fc.weight": torch.randn(hidden, 3 * hidden, generator=g) * 0.1}
    t.update(_attn_mlp(g, "midlayer.", 2 * hidden, hidden))
    for name in ("input_layernorm", "hidden_norm"):
        t[f"midlayer.{name}.weight"] = 1 + 0.1 * torch.randn(hidden, generator=g)
    t["norm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=g)
    t["lm_head.weight"] = torch.randn(draft_vocab, hidden, generator=g) * 0.15
    # the draft vocabulary: a random subset of the target's, sorted as the EAGLE-3 scripts do
    sel = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values  # [draft_vocab]
    t["d2t"] = sel - torch.arange(draft_vocab)  # target id = draft id + d2t[draft id]
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[sel] = True
    t["t2d"] = t2d
    if embedding is not None:
        p, eye = "midlayer.self_attn.", torch.eye(hidden)
        kv_rows = torch.cat([eye[:HD], eye[2 * HD : 3 * HD]])  # [NKV * HD, H]
        zeros = torch.zeros(NKV * HD, hidden)
        t[p + "q_proj.weight"] = torch.cat([10 * eye, torch.zeros(hidden, hidden)], 1)
        t[p + "k_proj.weight"] = torch.cat([kv_rows, zeros], 1)
        t[p + "v_proj.weight"] = torch.cat([kv_rows, zeros], 1)
        t[p + "o_proj.weight"] = 5 * eye
        t["fc.weight"] *= 0.1
        t["midlayer.mlp.down_proj.weight"] *= 0.05
        for name in (
            "midlayer.input_layernorm.weight",
            "midlayer.post_attention_layernorm.weight",
            "norm.weight",
        ):
            t[name] = torch.ones(hidden)
        e = embedding[sel].float()
        t["lm_head.weight"] = _head_view(e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True)))
    return t


def write_checkpoint(
    path: Path, cfg: dict, tensors: dict[str, torch.Tensor], fmt: str = "bin"
) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    state = {k: v.contiguous() for k, v in tensors.items()}
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        torch.save(state, path / "pytorch_model.bin")
    return path


def make_eagle1(
    path: Path,
    target: Path,
    vocab: int,
    fmt: str = "bin",
    layers: int = 1,
    bias: bool = True,
    seed: int = 0,
    copy: bool = False,
) -> Path:
    cfg = llama_config(vocab, layers)
    if not bias:
        cfg["bias"] = False
    return write_checkpoint(path, cfg, eagle1_tensors(target, layers, bias, seed, copy=copy), fmt)


def make_eagle3(
    path: Path,
    vocab: int,
    draft_vocab: int,
    fmt: str = "safetensors",
    seed: int = 0,
    target: Path | None = None,
) -> Path:
    """``target`` given: a "copy" head built from the target's embedding (see eagle3_tensors)."""
    cfg = llama_config(
        vocab, 1, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab
    )
    emb = None if target is None else target_embedding(target)
    return write_checkpoint(path, cfg, eagle3_tensors(vocab, draft_vocab, seed, embedding=emb), fmt)


def smollm_eagle_heads(folder: Path, cfg, vocab: int, seed: int = 0,
                       draft_vocab: int = 4096) -> tuple[Path, Path]:
    """Random EAGLE-1 (pytorch_model.bin) and EAGLE-3 (model.safetensors) heads shaped for the
    embedded SmolLM2-135M (``cfg``: its Hugging Face config; hidden 576, 9 query / 3 KV heads of
    64, rope_theta 1e5; tied embedding / LM head, so EAGLE-1 stores no embed_tokens and uses the
    target's). Weights N(0, 0.02), unit norms; the EAGLE-3 draft vocabulary maps draft id i to
    target id 7i mod vocab. Such heads are (almost) never accepted: plumbing at a real size."""
    hidden, nh, nkv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    hd, inter = hidden // nh, cfg.intermediate_size
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.02

    def layer(p: str, in_dim: int) -> dict:
        return {
            p + "self_attn.q_proj.weight": w(nh * hd, in_dim),
            p + "self_attn.k_proj.weight": w(nkv * hd, in_dim),
            p + "self_attn.v_proj.weight": w(nkv * hd, in_dim),
            p + "self_attn.o_proj.weight": w(hidden, nh * hd),
            p + "mlp.gate_proj.weight": w(inter, hidden),
            p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
        }

    base = {
        "model_type": "llama", "hidden_size": hidden, "intermediate_size": inter,
        "num_attention_heads": nh, "num_key_value_heads": nkv, "num_hidden_layers": 1,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": 100000.0, "vocab_size": vocab,
        "max_position_embeddings": 8192, "hidden_act": "silu",
    }  # fmt: skip
    e1 = write_checkpoint(
        folder / "eagle1", {**base, "architectures": ["LlamaForCausalLM"]},
        {"fc.weight": w(hidden, 2 * hidden), "fc.bias": w(hidden), **layer("layers.0.", hidden)},
    )  # fmt: skip
    t3 = {
        "fc.weight": w(hidden, 3 * hidden), **layer("midlayer.", 2 * hidden),
        "midlayer.input_layernorm.weight": torch.ones(hidden),
        "midlayer.hidden_norm.weight": torch.ones(hidden), "norm.weight": torch.ones(hidden),
        "lm_head.weight": w(draft_vocab, hidden),
        "d2t": torch.arange(draft_vocab) * 7 % vocab - torch.arange(draft_vocab),
    }  # fmt: skip
    e3 = write_checkpoint(
        folder / "eagle3",
        {**base, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": draft_vocab},
        t3, "safetensors",
    )  # fmt: skip
    return e1, e3


# --------------------------------------------------------------------------------------------
# IBM MLPSpeculator folders (config.json + speculator.-prefixed safetensors, or .bin)
# --------------------------------------------------------------------------------------------

def mlp_config(emb_dim: int, vocab: int, n_predict: int, inner_dim: int, tie: bool,
               scale_input: bool) -> dict:
    return {
        "architectures": ["MLPSpeculatorPreTrainedModel"],
        "model_type": "mlp_speculator",
        "emb_dim": emb_dim,
        "inner_dim": inner_dim,
        "n_candidates": n_predict,
        "n_predict": n_predict,
        "scale_input": scale_input,
        "tie_weights": tie,
        "top_k_tokens_per_head": [1] * n_predict,
        "torch_dtype": "float32",
        "transformers_version": "4.40.2",
        "vocab_size": vocab,
    }


def random_mlp_tensors(emb_dim: int, vocab: int, n_predict: int, inner_dim: int, tie: bool,
                       seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    inner = inner_dim or emb_dim
    std = 1 / math.sqrt(inner)
    t: dict[str, torch.Tensor] = {}
    n_stage = 1 if tie else n_predict
    for i in range(n_stage):
        t[f"emb.{i}.weight"] = torch.randn(vocab, inner, generator=g) * std
        t[f"head.{i}.weight"] = torch.randn(vocab, inner, generator=g) * std
        t[f"ln.{i}.weight"] = 1 + 0.1 * torch.randn(inner, generator=g)
        t[f"ln.{i}.bias"] = 0.1 * torch.randn(inner, generator=g)
    for i in range(min(2, n_predict) if tie else n_predict):
        t[f"proj.{i}.weight"] = torch.randn(inner, emb_dim if i == 0 else inner, generator=g) * std
    return t


def write_mlp(path: Path, tensors: dict[str, torch.Tensor], cfg: dict, prefix: str = "speculator.",
              fmt: str = "safetensors") -> Path:
    return write_checkpoint(path, cfg, {prefix + k: v for k, v in tensors.items()}, fmt)


def make_mlp(path: Path, emb_dim: int = H, vocab: int = BIG_V, n_predict: int = 3,
             inner_dim: int = 32, tie: bool = False, scale_input: bool = False, seed: int = 0,
             prefix: str = "speculator.", fmt: str = "safetensors") -> Path:
    cfg = mlp_config(emb_dim, vocab, n_predict, inner_dim, tie, scale_input)
    return write_mlp(path, random_mlp_tensors(emb_dim, vocab, n_predict, inner_dim, tie, seed), cfg,
                     prefix, fmt)


# --------------------------------------------------------------------------------------------
# Medusa-1 heads (FasterDecoding's medusa_lm_head file, or vLLM's converted layout)
# --------------------------------------------------------------------------------------------

def medusa_tensors(hidden: int, vocab: int, heads: int, layers: int, seed: int = 0,
                   std: float = 0.05, out: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Random heads in FasterDecoding's keys (the heads' ModuleList state dict):
    ``{i}.{j}.linear.weight`` [hidden, hidden], ``{i}.{j}.linear.bias`` [hidden] for block j <
    layers, ``{i}.{layers}.weight`` [vocab, hidden]. ``out`` [heads, vocab, hidden]: the output
    layers to use instead of random ones (the blocks are then zero: each head is out[i] @ h)."""
    g = torch.Generator().manual_seed(seed)
    t: dict[str, torch.Tensor] = {}
    for i in range(heads):
        for j in range(layers):
            scale = 0.0 if out is not None else std
            t[f"{i}.{j}.linear.weight"] = torch.randn(hidden, hidden, generator=g) * scale
            t[f"{i}.{j}.linear.bias"] = torch.randn(hidden, generator=g) * scale
        t[f"{i}.{layers}.weight"] = (
            out[i].clone() if out is not None
            else torch.randn(vocab, hidden, generator=g) / math.sqrt(hidden))
    return t


def make_medusa(path: Path, hidden: int = H, vocab: int = BIG_V, heads: int = 3, layers: int = 1,
                layout: str = "faster", fmt: str = "safetensors", seed: int = 0,
                dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> Path:
    """A Medusa-1 head folder (``medusa_tensors``). ``layout="faster"``: FasterDecoding's
    config.json (``medusa_num_heads``, ``medusa_num_layers``, ``base_model_name_or_path``) and
    ``medusa_lm_head.safetensors`` (``fmt="pt"``: ``medusa_lm_head.pt``, a torch.save'd state
    dict); ``layout="vllm"``: vLLM's converted config.json (``model_type: medusa``, ``num_heads``,
    ``num_hidden_layers``, ``hidden_size``, ``vocab_size``, ``medusa_fc_bias``) and
    ``model.safetensors`` (``fmt="bin"``: ``pytorch_model.bin``) with ``blocks.{i}.layers.{j}``
    and ``lm_heads.{i}`` keys."""
    t = {k: v.to(dtype) for k, v in medusa_tensors(hidden, vocab, heads, layers, seed, out=out).items()}
    path.mkdir(parents=True, exist_ok=True)
    if layout == "faster":
        cfg = {"medusa_num_heads": heads, "medusa_num_layers": layers,
               "base_model_name_or_path": "tiny-random-llama"}
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
        if fmt == "pt":
            torch.save(t, path / "medusa_lm_head.pt")
        else:
            from safetensors.torch import save_file

            save_file(t, str(path / "medusa_lm_head.safetensors"))
        return path
    renamed = {}
    for k, v in t.items():
        i, j, *rest = k.split(".")  # {i}.{j}.linear.{weight,bias} or {i}.{layers}.weight
        renamed[f"blocks.{i}.layers.{j}.{rest[-1]}" if len(rest) == 2 else f"lm_heads.{i}.weight"] = v
    cfg = {"architectures": ["MedusaModel"], "model_type": "medusa", "num_heads": heads,
           "num_hidden_layers": layers, "hidden_size": hidden, "vocab_size": vocab,
           "medusa_fc_bias": True, "truncated_vocab_size": vocab}
    return write_checkpoint(path, cfg, renamed, fmt)
