"""Trainable heads: each is an ``nn.Module`` whose parameter names are the tensor names of its
strategy's published checkpoint layout, with a ``loss`` (its training objective on a batch of
self-distillation data) and a ``save_pretrained`` (that layout: config.json + safetensors).

* :class:`Eagle1Head` (``method="eagle"``, EAGLE-1, arXiv 2401.15077): fc over
  concat[embed(token p+1), h_p] + Llama decoder layers; the target's embedding and LM head,
  frozen. Objective: smooth-L1 regression of the next feature h_{p+1} plus cross-entropy of the
  target's LM head on the head's output against the target's greedy token, unrolled over
  ``steps`` draft steps as at inference ("training-time test", EAGLE-3): step s feeds the state
  of step s-1 back and attends to the step-1 keys of the positions before it plus its own.
* :class:`Eagle3Head` (``method="eagle3"``, EAGLE-3, arXiv 2503.01840): fc fuses the inputs of
  three target layers; one midlayer over concat[embed(token p+s), that state]; its own
  draft-vocabulary LM head (``d2t``). Objective: cross-entropy only, unrolled the same way.
* :class:`MLPSpeculatorHead` (``method="mlp_speculator"``, arXiv 2404.19124): stage j reads the
  previous state and the true token t_{p+1+j}; per-stage cross-entropy against t_{p+2+j}.
* :class:`MedusaHead` (``method="medusa"``, arXiv 2401.10774, the ``speculant-medusa`` example
  package): head i reads h_p alone; per-head cross-entropy against t_{p+2+i}. Residual blocks
  start at zero and the output layers as copies of the target's LM head (Medusa's recipe).

Labels are only the target's own tokens (the reply part of each sequence), so a head learns
exactly what greedy decoding emits."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from speculant.training.data import Batch


@dataclass
class HeadLoss:
    loss: torch.Tensor  # [] the objective to minimise
    correct: torch.Tensor  # [positions] int64: top-1 hits per draft position
    total: torch.Tensor  # [positions] int64: labels per draft position


@runtime_checkable
class Trainable(Protocol):
    """What :func:`speculant.training.train_head` needs of a head (an ``nn.Module``)."""

    method: str  # the speculative_config method that loads save_pretrained's folder
    num_positions: int  # draft positions whose accuracy loss() reports
    aux_layers: tuple[int, ...]  # target layers whose inputs the data must hold (EAGLE-3)

    def loss(self, batch: Batch) -> HeadLoss: ...

    def save_pretrained(self, out: Path, dtype: torch.dtype = torch.float16) -> None: ...


@dataclass
class TargetInfo:
    """The frozen pieces of the target a head needs: its config.json and its embedding and LM
    head weights (the same tensor when the target ties them)."""

    config: dict[str, Any]
    embed: torch.Tensor  # [V, H]
    lm_head: torch.Tensor  # [V, H]

    @property
    def hidden_size(self) -> int:
        return int(self.config["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    @classmethod
    def load(cls, folder: str | Path) -> TargetInfo:
        from safetensors import safe_open

        folder = Path(folder)
        cfg = json.loads((folder / "config.json").read_text())
        tensors: dict[str, torch.Tensor] = {}
        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(str(file), "pt") as f:
                for name in f.keys():
                    if name.removeprefix("model.") in ("embed_tokens.weight", "lm_head.weight"):
                        tensors[name.removeprefix("model.")] = f.get_tensor(name).float()
        if "embed_tokens.weight" not in tensors:
            raise ValueError(f"{folder}: no embed_tokens.weight in its *.safetensors files; "
                             "training needs a Hugging Face safetensors checkpoint")
        embed = tensors["embed_tokens.weight"]
        return cls(cfg, embed, tensors.get("lm_head.weight", embed))


def token_loss(states: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
               valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean cross-entropy, top-1 hits, labels) of ``states @ weight.T`` over the valid rows
    only (the LM head product is the costly part: prompt rows and padding skip it). states
    [B, T, D], weight [V, D], labels / valid [B, T]; a label < 0 (outside a hot vocabulary)
    counts as a miss and adds no cross-entropy."""
    rows = valid.flatten().nonzero().squeeze(1)  # [N]
    logits = states.flatten(0, 1)[rows] @ weight.T  # [N, V]
    lab = labels.flatten()[rows]  # [N]
    known = lab >= 0
    ce = F.cross_entropy(logits.float(), lab.clamp(min=0), reduction="none")  # [N]
    ce = (ce * known).sum() / known.sum().clamp(min=1)
    hits = ((logits.argmax(-1) == lab) & known).sum()
    return ce, hits, rows.new_tensor(len(rows))


def shifted(x: torch.Tensor, s: int, fill: float | int = 0) -> torch.Tensor:
    """x[:, t + s] at index t (``fill`` past the end); x [B, T, ...]."""
    if s == 0:
        return x
    pad = torch.full_like(x[:, :s], fill)
    return torch.cat([x[:, s:], pad], dim=1)


def _save(out: Path, config: dict, tensors: dict[str, torch.Tensor], file: str,
          dtype: torch.dtype) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype).contiguous()
               for k, v in tensors.items()}, str(out / file), metadata={"format": "pt"})


# --------------------------------------------------------------------------------------------
# EAGLE-1
# --------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope_tables(config: dict, head_dim: int, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_positions, head_dim] of the target's RoPE (rotate-half), as the engine's."""
    import transformers

    from speculant.models.layers import rope_inv_freq

    cfg = transformers.LlamaConfig(**{k: v for k, v in config.items() if k != "model_type"})
    inv_freq, scaling = rope_inv_freq(cfg, head_dim)
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], -1)  # [P, head_dim]
    return emb.cos() * scaling, emb.sin() * scaling


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, d]; cos / sin [T, d]."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


class EagleLayer(nn.Module):
    """A Llama decoder layer (HF tensor names) whose attention reads an explicit key cache;
    ``in_dim``: the width q/k/v read (EAGLE-3's midlayer: 2H)."""

    def __init__(self, cfg: dict, first: bool, in_dim: int | None = None) -> None:
        super().__init__()
        H, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        self.nh, self.nkv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
        self.hd = cfg.get("head_dim") or H // self.nh
        bias, D = bool(cfg.get("attention_bias", False)), in_dim or H
        self.input_layernorm = None if first else RMSNorm(H, eps)
        self.self_attn = nn.Module()
        a = self.self_attn
        a.q_proj = nn.Linear(D, self.nh * self.hd, bias=bias)
        a.k_proj = nn.Linear(D, self.nkv * self.hd, bias=bias)
        a.v_proj = nn.Linear(D, self.nkv * self.hd, bias=bias)
        a.o_proj = nn.Linear(self.nh * self.hd, H, bias=False)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = nn.Module()
        inter = cfg["intermediate_size"]
        self.mlp.gate_proj = nn.Linear(H, inter, bias=False)
        self.mlp.up_proj = nn.Linear(H, inter, bias=False)
        self.mlp.down_proj = nn.Linear(inter, H, bias=False)

    def attention(self, h, cos, sin, cache: list, mask) -> torch.Tensor:
        # h: [B, T, D] normed input -> [B, T, H]; cos/sin: [T, hd] of this step's positions;
        # cache: this layer's earlier steps' (k, v) [B, nkv, T, hd], extended here; mask:
        # [T, steps * T] bool (True: attend)
        B, T, _ = h.shape
        a = self.self_attn
        q = apply_rope(a.q_proj(h).view(B, T, self.nh, self.hd).transpose(1, 2), cos, sin)
        k = apply_rope(a.k_proj(h).view(B, T, self.nkv, self.hd).transpose(1, 2), cos, sin)
        v = a.v_proj(h).view(B, T, self.nkv, self.hd).transpose(1, 2)
        cache.append((k, v))
        rep = self.nh // self.nkv
        K = torch.cat([c[0] for c in cache], 2).repeat_interleave(rep, 1)  # [B, nh, sT, hd]
        V = torch.cat([c[1] for c in cache], 2).repeat_interleave(rep, 1)
        o = F.scaled_dot_product_attention(q, K, V, attn_mask=mask)  # [B, nh, T, hd]
        return a.o_proj(o.transpose(1, 2).reshape(B, T, -1))

    def mlp_block(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, H]: x + mlp(norm(x))
        m, y = self.mlp, self.post_attention_layernorm(x)
        return x + m.down_proj(F.silu(m.gate_proj(y)) * m.up_proj(y))

    def forward(self, x, cos, sin, cache: list, mask):  # x: [B, T, H] -> [B, T, H]
        h = x if self.input_layernorm is None else self.input_layernorm(x)
        return self.mlp_block(x + self.attention(h, cos, sin, cache, mask))


def unroll_mask(T: int, s: int, device) -> torch.Tensor:
    """[T, s * T] bool: step s's query at index p sees step 1's keys at indices <= p (the
    positions the target verified, caught up on) and steps 2..s's keys at index p only (its own
    earlier drafts)."""
    first = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    own = torch.eye(T, dtype=torch.bool, device=device)
    return torch.cat([first] + [own] * (s - 1), dim=1)


class Eagle1Head(nn.Module):
    method = "eagle"
    aux_layers: tuple[int, ...] = ()

    def __init__(self, target: TargetInfo, num_layers: int = 1, steps: int = 4,
                 token_weight: float = 0.5, feature_weight: float = 1.0,
                 hot_ids: torch.Tensor | None = None, max_positions: int = 4096) -> None:
        super().__init__()
        cfg = dict(target.config)
        H = target.hidden_size
        self.cfg = cfg
        self.num_positions = steps
        self.token_weight, self.feature_weight = token_weight, feature_weight
        self.fc = nn.Linear(2 * H, H, bias=True)
        self.layers = nn.ModuleList(EagleLayer(cfg, i == 0) for i in range(num_layers))
        for p in self.layers.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
        self.register_buffer("embed", target.embed, persistent=False)  # [V, H] frozen
        self.register_buffer("lm_head", target.lm_head, persistent=False)  # [V, H] frozen
        # hot vocabulary (token map): the CE and accuracy over these rows only
        self.hot_ids = hot_ids
        if hot_ids is not None:
            lookup = torch.full((target.vocab_size,), -1, dtype=torch.long)
            lookup[hot_ids] = torch.arange(len(hot_ids))
            self.register_buffer("hot_lookup", lookup, persistent=False)
            self.register_buffer("hot_head", target.lm_head[hot_ids], persistent=False)
        cos, sin = rope_tables(cfg, self.layers[0].hd, max_positions)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def loss(self, batch: Batch) -> HeadLoss:
        tokens, target, h = batch.tokens, batch.target, batch.final  # [B, T], [B, T], [B, T, H]
        B, T, _ = h.shape
        caches: list[list] = [[] for _ in self.layers]
        x = h
        total_loss = h.new_zeros(())
        correct, total = [], []
        for s in range(1, self.num_positions + 1):
            tok_in = shifted(tokens, s)  # [B, T]: t_{p+s}
            inp = torch.cat([self.embed[tok_in], x], -1)  # [B, T, 2H]
            y = self.fc(inp)  # [B, T, H]
            pos = torch.arange(T, device=h.device) + (s - 1)
            cos, sin = self.cos[pos], self.sin[pos]
            mask = unroll_mask(T, s, h.device)
            for layer, cache in zip(self.layers, caches):
                y = layer(y, cos, sin, cache, mask)
            labels = shifted(tokens, s + 1)  # [B, T]: t_{p+s+1}
            valid = shifted(target, s + 1, False)  # [B, T]
            feat = shifted(h, s)  # [B, T, H]: h_{p+s}
            reg = (F.smooth_l1_loss(y, feat, reduction="none").mean(-1) * valid).sum()
            reg = reg / valid.sum().clamp(min=1)
            if self.hot_ids is None:
                ce, c, n = token_loss(y, self.lm_head, labels, valid)
            else:  # logits over the N hot tokens only
                ce, c, n = token_loss(y, self.hot_head, self.hot_lookup[labels], valid)
            correct.append(c)
            total.append(n)
            total_loss = total_loss + 0.8 ** (s - 1) * (self.feature_weight * reg + self.token_weight * ce)
            x = y  # the next step's feature: this step's output
        return HeadLoss(total_loss, torch.stack(correct), torch.stack(total))

    def save_pretrained(self, out: Path, dtype: torch.dtype = torch.float16) -> None:
        cfg = dict(self.cfg, architectures=["LlamaForCausalLM"], model_type="llama",
                   num_hidden_layers=len(self.layers), bias=True, torch_dtype=str(dtype).removeprefix("torch."))
        cfg.pop("auto_map", None)
        tensors = {n: p for n, p in self.named_parameters()}
        _save(Path(out), cfg, tensors, "model.safetensors", dtype)
        if self.hot_ids is not None:  # the token map the head was trained for
            (Path(out) / "token_map.json").write_text(json.dumps(self.hot_ids.tolist()))


# --------------------------------------------------------------------------------------------
# EAGLE-3
# --------------------------------------------------------------------------------------------
class Eagle3MidLayer(EagleLayer):
    """EAGLE-3's ``midlayer``: attention over concat[input_layernorm(embed), hidden_norm(g)]
    (2H wide), the residual stream starting from g itself."""

    def __init__(self, cfg: dict) -> None:
        super().__init__(cfg, first=False, in_dim=2 * cfg["hidden_size"])
        self.hidden_norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6))

    def forward(self, emb, g, cos, sin, cache: list, mask):  # emb, g: [B, T, H] -> [B, T, H]
        h = torch.cat([self.input_layernorm(emb), self.hidden_norm(g)], -1)  # [B, T, 2H]
        return self.mlp_block(g + self.attention(h, cos, sin, cache, mask))


class Eagle3Head(nn.Module):
    """EAGLE-3 (arXiv 2503.01840): ``fc`` fuses the inputs of three target layers (low, middle,
    high; ``aux_layers``, default ``(2, L // 2, L - 3)`` as the loader's) into g; one
    ``midlayer``; logits ``lm_head(norm(x))`` over its own draft vocabulary (``hot_ids``: the
    target ids of the draft ids, written as ``d2t``; None: the whole vocabulary), the
    ``lm_head`` starting as those rows of the target's and trained. Objective: cross-entropy
    against the target's greedy token only (no feature regression), unrolled over ``steps`` as
    :class:`Eagle1Head`: step s feeds step s-1's pre-norm output back in place of g."""

    method = "eagle3"

    def __init__(self, target: TargetInfo, steps: int = 4, aux_layers: tuple[int, ...] | None = None,
                 hot_ids: torch.Tensor | None = None, max_positions: int = 4096) -> None:
        super().__init__()
        cfg = dict(target.config)
        H, V, L = target.hidden_size, target.vocab_size, int(cfg["num_hidden_layers"])
        layers = tuple(sorted({int(i) for i in (aux_layers or (2, L // 2, L - 3))}))
        if len(layers) != 3 or not all(0 <= i < L for i in layers):
            raise ValueError(f"eagle3 head option aux_layers needs 3 distinct target layers in "
                             f"[0, {L}), got {aux_layers or layers}; set aux_layers")
        self.cfg, self.aux_layers, self.num_positions = cfg, layers, steps
        self.fc = nn.Linear(3 * H, H, bias=False)
        self.midlayer = Eagle3MidLayer(cfg)
        for p in self.midlayer.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
        self.norm = RMSNorm(H, cfg.get("rms_norm_eps", 1e-6))
        ids = hot_ids if hot_ids is not None else torch.arange(V)  # [Vd] target ids, ascending
        self.lm_head = nn.Linear(H, len(ids), bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(target.lm_head[ids])
        self.register_buffer("d2t", ids - torch.arange(len(ids)), persistent=False)  # [Vd]
        lookup = torch.full((V,), -1, dtype=torch.long)  # [V]: draft id of a target id, or -1
        lookup[ids] = torch.arange(len(ids))
        self.register_buffer("lookup", lookup, persistent=False)
        self.register_buffer("embed", target.embed, persistent=False)  # [V, H] frozen
        cos, sin = rope_tables(cfg, self.midlayer.hd, max_positions)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def loss(self, batch: Batch) -> HeadLoss:
        tokens, target = batch.tokens, batch.target  # [B, T], [B, T]
        if batch.aux is None:
            raise ValueError("eagle3 trains on the target's layer inputs: build the data with "
                             f"aux_layers={self.aux_layers} (build_dataset(..., aux_layers=...))")
        B, T, _ = batch.aux.shape
        cache: list = []
        x = self.fc(batch.aux)  # [B, T, 3H] -> g [B, T, H]
        total_loss = x.new_zeros(())
        correct, total = [], []
        for s in range(1, self.num_positions + 1):
            emb = self.embed[shifted(tokens, s)]  # [B, T, H]: embed(t_{p+s})
            pos = torch.arange(T, device=x.device) + (s - 1)
            x = self.midlayer(emb, x, self.cos[pos], self.sin[pos], cache, unroll_mask(T, s, x.device))
            labels = self.lookup[shifted(tokens, s + 1)]  # [B, T]: draft id of t_{p+s+1}, or -1
            valid = shifted(target, s + 1, False)  # [B, T]
            ce, c, n = token_loss(self.norm(x), self.lm_head.weight, labels, valid)
            correct.append(c)
            total.append(n)
            total_loss = total_loss + 0.8 ** (s - 1) * ce
        return HeadLoss(total_loss, torch.stack(correct), torch.stack(total))

    def save_pretrained(self, out: Path, dtype: torch.dtype = torch.float16) -> None:
        H = int(self.cfg["hidden_size"])
        cfg = dict(self.cfg, architectures=["LlamaForCausalLMEagle3"], model_type="llama",
                   num_hidden_layers=1, draft_vocab_size=self.lm_head.out_features,
                   target_hidden_size=H, torch_dtype=str(dtype).removeprefix("torch."),
                   eagle_config={"eagle_aux_hidden_state_layer_ids": list(self.aux_layers)})
        cfg.pop("auto_map", None)
        tensors = dict(self.named_parameters(), d2t=self.d2t)
        _save(Path(out), cfg, tensors, "model.safetensors", dtype)


# --------------------------------------------------------------------------------------------
# MLPSpeculator
# --------------------------------------------------------------------------------------------
class _AffineRMS(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(dim)), nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight + self.bias


class MLPSpeculatorHead(nn.Module):
    method = "mlp_speculator"
    aux_layers: tuple[int, ...] = ()

    def __init__(self, target: TargetInfo, n_predict: int = 3, inner_dim: int | None = None) -> None:
        super().__init__()
        H, V = target.hidden_size, target.vocab_size
        inner = inner_dim or H
        self.n_predict = self.num_positions = n_predict
        self.emb_dim, self.inner_dim, self.vocab_size = H, inner, V
        self.emb = nn.ModuleList(nn.Embedding(V, inner) for _ in range(n_predict))
        self.proj = nn.ModuleList(nn.Linear(H if i == 0 else inner, inner, bias=False)
                                  for i in range(n_predict))
        self.head = nn.ModuleList(nn.Linear(inner, V, bias=False) for _ in range(n_predict))
        self.ln = nn.ModuleList(_AffineRMS(inner) for _ in range(n_predict))
        with torch.no_grad():
            for e, hd in zip(self.emb, self.head):
                e.weight.normal_(0, 1 / math.sqrt(inner))
                if inner == H:  # start from the target's LM head
                    hd.weight.copy_(target.lm_head)
        self.state_weight = 0.5 ** (0.5 / n_predict)
        self.emb_scale = math.sqrt(1.0 - self.state_weight**2) * math.sqrt(inner / 2)

    def loss(self, batch: Batch) -> HeadLoss:
        tokens, target, h = batch.tokens, batch.target, batch.final  # [B, T], [B, T], [B, T, H]
        state = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) / math.sqrt(2.0)
        loss = h.new_zeros(())
        correct, total = [], []
        for j in range(self.n_predict):
            z = self.emb[j](shifted(tokens, j + 1)) * self.emb_scale  # t_{p+1+j}
            state = F.gelu(self.ln[j](self.proj[j](state) * self.state_weight + z))  # [B, T, inner]
            labels = shifted(tokens, j + 2)  # t_{p+2+j}
            ce, c, n = token_loss(state, self.head[j].weight, labels, shifted(target, j + 2, False))
            loss = loss + ce
            correct.append(c)
            total.append(n)
        return HeadLoss(loss, torch.stack(correct), torch.stack(total))

    def save_pretrained(self, out: Path, dtype: torch.dtype = torch.float16) -> None:
        cfg = {"architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator",
               "n_predict": self.n_predict, "emb_dim": self.emb_dim, "inner_dim": self.inner_dim,
               "vocab_size": self.vocab_size, "tie_weights": False, "scale_input": True,
               "torch_dtype": str(dtype).removeprefix("torch.")}
        _save(Path(out), cfg, dict(self.named_parameters()), "model.safetensors", dtype)


# --------------------------------------------------------------------------------------------
# Medusa-1
# --------------------------------------------------------------------------------------------
class MedusaHead(nn.Module):
    method = "medusa"
    aux_layers: tuple[int, ...] = ()

    def __init__(self, target: TargetInfo, num_heads: int = 4, num_layers: int = 1) -> None:
        super().__init__()
        H, V = target.hidden_size, target.vocab_size
        self.num_heads = self.num_positions = num_heads
        self.num_layers, self.hidden_size, self.vocab_size = num_layers, H, V
        self.w1 = nn.Parameter(torch.zeros(num_heads, num_layers, H, H))  # [heads, layers, H, H]
        self.b1 = nn.Parameter(torch.zeros(num_heads, num_layers, H))
        self.w2 = nn.Parameter(target.lm_head.clone().expand(num_heads, V, H).contiguous())

    def loss(self, batch: Batch) -> HeadLoss:
        tokens, target, h = batch.tokens, batch.target, batch.final  # [B, T], [B, T], [B, T, H]
        loss = h.new_zeros(())
        correct, total = [], []
        for i in range(self.num_heads):
            x = h
            for j in range(self.num_layers):
                x = x + F.silu(x @ self.w1[i, j].T + self.b1[i, j])
            labels = shifted(tokens, i + 2)  # t_{p+2+i}
            ce, c, n = token_loss(x, self.w2[i], labels, shifted(target, i + 2, False))
            loss = loss + ce
            correct.append(c)
            total.append(n)
        return HeadLoss(loss, torch.stack(correct), torch.stack(total))

    def save_pretrained(self, out: Path, dtype: torch.dtype = torch.float16) -> None:
        cfg = {"medusa_num_heads": self.num_heads, "medusa_num_layers": self.num_layers,
               "hidden_size": self.hidden_size, "vocab_size": self.vocab_size}
        t: dict[str, torch.Tensor] = {}
        for i in range(self.num_heads):
            for j in range(self.num_layers):
                t[f"{i}.{j}.linear.weight"] = self.w1[i, j]
                t[f"{i}.{j}.linear.bias"] = self.b1[i, j]
            t[f"{i}.{self.num_layers}.weight"] = self.w2[i]
        _save(Path(out), cfg, t, "medusa_lm_head.safetensors", dtype)


HEADS: dict[str, type[nn.Module]] = {
    "eagle": Eagle1Head, "eagle3": Eagle3Head, "mlp_speculator": MLPSpeculatorHead,
    "medusa": MedusaHead,
}
