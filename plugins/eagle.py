"""EAGLE-1 (arXiv 2401.15077) and EAGLE-3 (arXiv 2503.01840): small autoregressive draft heads
that run on the target's hidden states and keep their own paged KV cache.

EAGLE-1 (``yuhuili/EAGLE-*`` checkpoints; ``config.json`` is a Llama config with
``num_hidden_layers`` draft layers and an optional ``bias`` flag for ``fc``)::

    x   = fc(concat[embed(token p+1), h_p])           fc: 2H -> H (bias unless "bias": false)
    x   = decoder layers (Llama; layer 0 has NO input_layernorm)
    out = x                                           no final norm
    logits = target.lm_head(out)                      embedding and LM head are the target's

where ``h_p`` is the target's final-norm hidden state at position p (the one that produced token
p + 1). Later draft steps feed ``out`` back in place of ``h``. With the option ``token_map`` (a
file of hot token ids, ``speculant.drafting.load_token_map``) the logits come from the hot rows
of the target's LM head only: greedy drafts are the argmax over those hot logits mapped through
the hot ids, sampled drafts use full-vocabulary rows with -inf elsewhere (EAGLE-3 refuses the
option: it has its own draft vocabulary, handled the same way). Without the option, an EAGLE-1
folder's own ``token_map.json`` (what ``speculant train`` writes with ``hot_vocab``) is used.

EAGLE-3 (``architectures: ["LlamaForCausalLMEagle3"]``, ``draft_vocab_size``)::

    g   = fc(concat[a_p, b_p, c_p])                   fc: 3 * target_hidden -> H, no bias
    x   = g + attn(concat[input_layernorm(embed(token p+1)), hidden_norm(g)])   (q/k/v: 2H in)
    x   = x + mlp(post_attention_layernorm(x))         the one decoder layer, "midlayer"
    logits_draft = lm_head(norm(x))                    own head over draft_vocab_size tokens
    target id = draft id + d2t[draft id]

``a, b, c`` are the target's residual stream entering decoder layers ``aux_hidden_layers``
(default ``(2, L // 2, L - 3)`` as in the EAGLE repo and vLLM, which both capture the hidden state
*entering* those layers). Later draft steps feed the pre-norm ``x`` back in place of ``g``.
Greedy drafts are the argmax over the draft vocabulary mapped to a target id (the token the
argmax of the full-vocabulary row gives, ties included, when the target ids ascend with the draft
ids, as the EAGLE-3 scripts write d2t; otherwise through the full row); sampled drafts use
full-vocabulary rows, -inf outside the draft vocabulary.

Checkpoint keys (one folder: ``config.json`` plus ``model.safetensors``, ``pytorch_model.bin``
or their sharded ``*.index.json`` forms; a ``model.`` prefix on any key is ignored, and
``*rotary_emb.inv_freq`` buffers are skipped). ``nkv`` = kv heads x head dim, ``I`` =
``intermediate_size``.

EAGLE-1::

    fc.weight                                   [H, 2H]
    fc.bias                                     [H]       present unless config "bias": false
    layers.{i}.self_attn.q_proj.weight          [H, H]
    layers.{i}.self_attn.{k,v}_proj.weight      [nkv, H]  (q/k/v biases as the Llama config says)
    layers.{i}.self_attn.o_proj.weight          [H, H]
    layers.{i}.mlp.{gate,up}_proj.weight        [I, H]
    layers.{i}.mlp.down_proj.weight             [H, I]
    layers.{i}.post_attention_layernorm.weight  [H]
    layers.{i}.input_layernorm.weight           [H]       for i >= 1 only
    embed_tokens.weight                         [V, H]    optional frozen copy; the target's is used

EAGLE-3 (``layers.0.*`` is accepted for ``midlayer.*``)::

    fc.weight                                   [H, 3 * target_hidden]
    midlayer.input_layernorm.weight             [H]       applied to the token embedding
    midlayer.hidden_norm.weight                 [H]       applied to the fused hidden state
    midlayer.self_attn.q_proj.weight            [H, 2H]
    midlayer.self_attn.{k,v}_proj.weight        [nkv, 2H]
    midlayer.self_attn.o_proj.weight            [H, H]
    midlayer.mlp.{gate,up,down}_proj.weight     as above
    midlayer.post_attention_layernorm.weight    [H]
    norm.weight                                 [H]
    lm_head.weight                              [draft_vocab_size, H]
    d2t                                         [draft_vocab_size] int: target id - draft id
    t2d                                         [vocab_size] bool (optional, shape-checked only)
    embed_tokens.weight                         [V, H]    optional: the draft's own embedding

config.json: ``hidden_size`` (must equal the target's, or ``target_hidden_size`` does for
EAGLE-3), ``vocab_size`` (the target's), ``num_attention_heads``, ``num_key_value_heads``,
``intermediate_size``, ``rms_norm_eps``, RoPE settings; EAGLE-3 also ``draft_vocab_size`` and
optionally ``eagle_config.eagle_aux_hidden_state_layer_ids``. Method inference (a ``model`` path
without ``method``): ``fc.weight`` plus ``midlayer.*`` / ``d2t`` / an ``*Eagle3*`` architecture
is EAGLE-3; ``fc.weight`` plus ``layers.*`` is EAGLE-1.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from pydantic import Field, field_validator
from torch import nn

from speculant import hookimpl
from speculant.drafting import (
    DraftKVCache,
    DraftVocab,
    ForwardContext,
    HeadDrafter,
    HeadOptions,
    HeadStrategy,
    HeadTreeDrafter,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaMLP,
    RMSNorm,
    RotaryEmbedding,
    StrategyError,
    TreeOptions,
    build_head,
    checkpoint_keys,
    hot_argmax,
    llama_head_dim,
    llama_qkv_bias,
    load_head_weights,
    norm_logits,
    read_config_json,
    read_head_config,
    residual_mlp,
    resolve_draft_folder,
    row_argmax,
    scatter_hot,
    target_hidden_size,
    target_hot_head,
    target_num_layers,
)
from speculant.spec_types import SpecBatch, StrategyContext


def eagle_version(path: Path, config: dict[str, Any]) -> int | None:
    """1 or 3 if ``path`` holds an EAGLE checkpoint in the published layout, else None."""
    if config.get("model_type") == "mlp_speculator" or not Path(path).is_dir():
        return None
    archs = [str(a).lower() for a in config.get("architectures") or []]
    keys = {k.removeprefix("model.") for k in checkpoint_keys(Path(path))}
    if "fc.weight" not in keys:
        return None
    v3 = any(k.startswith("midlayer.") for k in keys) or any("eagle3" in a for a in archs)
    if v3 or "d2t" in keys:
        return 3
    if any(k.startswith("layers.") for k in keys):
        return 1
    return None


class Eagle1Draft(nn.Module):
    """fc + Llama decoder layers (the first without input_layernorm); target embedding/head."""

    def __init__(self, cfg, fc_bias: bool, max_positions: int) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.rope = RotaryEmbedding(cfg, llama_head_dim(cfg), max_positions)
        self.fc = nn.Linear(2 * H, H, bias=fc_bias)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, self.rope, llama_qkv_bias(cfg))
            for i in range(cfg.num_hidden_layers)
        )
        self.layers[0].input_layernorm = nn.Identity()

    def forward(self, emb, hidden, positions, ctx: ForwardContext, from_target: bool):
        # emb, hidden: [tokens, H] -> [tokens, H] (fed back as the next step's hidden)
        x = self.fc(torch.cat([emb, hidden], dim=-1))
        for layer in self.layers:
            x = layer(positions, x, ctx)
        return x


class Eagle3Layer(nn.Module):
    """EAGLE-3's ``midlayer``: attention over concat[norm(embeds), norm(hidden)] (2H wide)."""

    def __init__(self, cfg, rope: RotaryEmbedding) -> None:
        super().__init__()
        H, eps, bias = cfg.hidden_size, getattr(cfg, "rms_norm_eps", 1e-6), llama_qkv_bias(cfg)
        self.input_layernorm = RMSNorm(H, eps)
        self.hidden_norm = RMSNorm(H, eps)
        self.self_attn = a = LlamaAttention(cfg, 0, rope, bias)
        a.qkv_proj = nn.Linear(2 * H, a.q_size + 2 * a.kv_size, bias=bias)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = LlamaMLP(cfg)
        self.norm_before_residual = bool(getattr(cfg, "norm_before_residual", False))

    def forward(self, positions, emb, hidden, ctx: ForwardContext) -> torch.Tensor:
        h = self.hidden_norm(hidden)
        residual = h if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(emb), h], dim=-1)
        a = self.self_attn(positions, x, ctx)  # [tokens, H]
        return residual_mlp(self.mlp, self.post_attention_layernorm, a, residual)


class Eagle3Draft(nn.Module):
    def __init__(self, cfg, target_hidden: int, draft_vocab: int, vocab: int, own_embed: bool,
                 max_positions: int) -> None:  # fmt: skip
        super().__init__()
        H = cfg.hidden_size
        self.rope = RotaryEmbedding(cfg, llama_head_dim(cfg), max_positions)
        self.fc = nn.Linear(3 * target_hidden, H, bias=False)
        self.midlayer = Eagle3Layer(cfg, self.rope)
        self.norm = RMSNorm(H, getattr(cfg, "rms_norm_eps", 1e-6))
        self.lm_head = nn.Linear(H, draft_vocab, bias=False)
        self.embed_tokens = nn.Embedding(vocab, H) if own_embed else None

    def forward(self, emb, hidden, positions, ctx: ForwardContext, from_target: bool):
        if from_target:  # [tokens, 3 * target_hidden] -> [tokens, H]
            hidden = self.fc(hidden)
        return self.midlayer(positions, emb, hidden, ctx)


class EagleOptions(HeadOptions, TreeOptions):
    """EAGLE-1's options: the head's (``model``, ``num_speculative_tokens``, ``token_map``) and
    the tree options (``eagle_topk``, ``num_draft_tokens``, ``speculative_token_tree``)."""


class Eagle3Options(EagleOptions):
    aux_hidden_layers: tuple[int, ...] | None = Field(
        None, description="target decoder layers whose INPUT hidden states feed fc (3 of them)"
    )

    @field_validator("token_map")
    @classmethod
    def _no_token_map(cls, v):
        if v is not None:
            raise ValueError(
                "token_map is not supported for EAGLE-3: its head already drafts over its own "
                "reduced vocabulary (draft_vocab_size tokens mapped through d2t); remove "
                "token_map (it applies to eagle, mlp_speculator and draft_model)"
            )
        return v

    @field_validator("aux_hidden_layers")
    @classmethod
    def _three(cls, v):
        if v is not None and len(set(v)) != 3:
            raise ValueError(f"aux_hidden_layers needs 3 distinct layer indices, got {v}")
        return v


class _EagleBase(HeadStrategy):
    """What both versions share: checking the checkpoint, and the ``DraftHead`` methods the
    ``HeadDrafter`` calls (``catch_up``, ``step``, ``logits``, ``greedy``) over the head network
    ``self.draft``; the hooks are ``HeadStrategy``'s."""

    version = 0

    @classmethod
    def matches_model(cls, path: Path, config: dict[str, Any]) -> bool:
        try:
            return eagle_version(path, config) == cls.version
        except Exception:
            return False

    def __init__(self, config: EagleOptions, ctx: StrategyContext) -> None:
        self.config, self.ctx = config, ctx
        k = self.num_speculative_tokens = config.num_speculative_tokens
        self.folder = folder = resolve_draft_folder(config.model)
        self.cfg_file = folder / "config.json"
        self.raw_cfg = read_config_json(folder)
        self.keys = {n.removeprefix("model.") for n in checkpoint_keys(folder)}
        found = eagle_version(folder, self.raw_cfg)
        if found != self.version:
            what = f"an EAGLE-{found}" if found else "not an EAGLE"
            raise StrategyError(
                f"{folder}: this is {what} checkpoint (config.json architectures="
                f"{self.raw_cfg.get('architectures')}, tensors {sorted(self.keys)[:4]}...), but "
                f"method {self.name!r} needs an EAGLE-{self.version} one"
                + (f"; use method 'eagle{found if found == 3 else ''}'" if found else "")
            )
        self.hf = read_head_config(folder, self.raw_cfg, ctx.vocab_size, "EAGLE")
        self.target = ctx.target_model
        self.H_target = target_hidden_size(ctx)
        shape = config.tree_shape()  # None: chains; else EAGLE-2's or a static tree
        depth = max(k, getattr(shape, "depth", 0))  # the most draft positions past a context
        self.max_positions = max_pos = ctx.max_model_len + depth + 8
        self.draft = build_head(self._head(), self.hf, ctx.device, ctx.dtype, max_pos)
        self._load()
        self.draft.eval()
        # the hot rows of the LM head (token_map, EAGLE-1 only): made once here; without the
        # option, a token_map.json beside the checkpoint (what `speculant train` writes) is used
        token_map = config.token_map
        if token_map is None and self.version == 1 and (folder / "token_map.json").is_file():
            token_map = str(folder / "token_map.json")
        self.hot = target_hot_head(ctx, token_map) if token_map else None
        # the target's features: its final hidden state, or the aux layers' inputs concatenated
        width = max(1, len(self.aux_hidden_layers)) * self.H_target
        ahead = max(k, shape.max_rows() if shape is not None else 0)  # K/V rows past a context
        self.drafter = HeadDrafter(
            self, DraftKVCache.for_head(ctx, self.draft, ahead + 1), ctx,
            num_speculative_tokens=k, hidden_size=self.hf.hidden_size, feature_width=width,
            max_positions=max_pos, name=self.name, label=f"{self.name} {folder}",
        )
        if shape is not None:  # trees (speculant.drafting.trees); the engine's k: their nodes
            self.drafter.tree = HeadTreeDrafter(self.drafter, shape)
            self.num_speculative_tokens = self.drafter.tree.budget

    def _load_weights(self, **kw: Any) -> dict[str, tuple[Path, torch.Tensor]]:
        hint = f" (the EAGLE-{self.version} key names are listed in the docstring of {__name__})"
        return load_head_weights(self.draft, self.folder, hint=hint, **kw)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.target.embed(ids)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:  # [rows, H] -> [rows, vocab] fp32
        # EAGLE-1's draft output goes into the target's LM head as is (no final norm: the
        # target's compute_logits is a bare product with lm_head.weight)
        if self.hot is not None:  # the hot rows only, -inf elsewhere
            return self.hot(x)
        return self.target.compute_logits(x)

    def _greedy(self, x: torch.Tensor) -> torch.Tensor:  # [rows, H] -> [rows] int64 token ids
        """``row_argmax(self._logits(x))``; with a token map the argmax over the hot logits
        mapped through the hot ids (``HotHead.greedy``: no [rows, vocab] row)."""
        if self.hot is not None:
            return self.hot.greedy(x)  # [rows, N] -> [rows]
        return row_argmax(self.target.compute_logits(x))  # [rows, vocab] -> [rows]

    def _draft_space(self, x: torch.Tensor) -> torch.Tensor:  # [rows, H] -> [rows, N] fp32
        """The logits the drafts come from: the hot ones with a token map, else the full row."""
        return (self.hot.small(x) if self.hot is not None else self.target.compute_logits(x)).float()

    def _pick(self, small: torch.Tensor) -> torch.Tensor:  # [rows, N] -> [rows] int64 token ids
        return hot_argmax(small, self.hot.ids) if self.hot is not None else row_argmax(small)

    def greedy_confidence(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(``greedy(x)`` [rows], the head's probability of that token [rows] float32: the
        softmax of the logits it comes from, ``_draft_space``), for ``confidence_stop``."""
        small = self._draft_space(x)  # [rows, N]
        return self._pick(small), torch.softmax(small, dim=-1).amax(dim=-1)

    # ----------------------------------------------------------------- DraftHead
    def catch_up(self, ids, feats, positions, fctx: ForwardContext) -> torch.Tensor:
        return self.draft(self._embed(ids), feats, positions, fctx, True)  # [rows, H]

    def step(self, tokens, x, positions, fctx: ForwardContext) -> torch.Tensor:
        return self.draft(self._embed(tokens), x, positions, fctx, False)  # [rows, H]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self._logits(x)

    def greedy(self, x: torch.Tensor) -> torch.Tensor:
        return self._greedy(x)


class EagleStrategy(_EagleBase):
    """EAGLE-1: draft layers over concat[token embedding, target hidden state]."""

    name = "eagle"
    aliases = ("eagle1", "eagle-1")
    Config = EagleOptions
    version = 1

    def _head(self) -> Callable[[], nn.Module]:
        """Checks the head's config against the target; returns the head's constructor."""
        cfg = self.hf
        if cfg.hidden_size != self.H_target:
            raise StrategyError(
                f"{self.cfg_file}: hidden_size={cfg.hidden_size} but the target model's hidden "
                f"size is {self.H_target}; this EAGLE head was trained for a different target "
                f"model. Use the EAGLE checkpoint trained for this target (its config.json has "
                f"hidden_size={self.H_target})"
            )
        fc_bias = bool(self.raw_cfg.get("bias", "fc.bias" in self.keys))
        return lambda: Eagle1Draft(cfg, fc_bias, self.max_positions)

    def _load(self) -> None:  # embed_tokens: a frozen copy of the target's, which is used
        self._load_weights(shapes={"embed_tokens.weight": (self.ctx.vocab_size, self.H_target)})


class Eagle3Strategy(_EagleBase):
    """EAGLE-3: fused low/mid/high target features, one midlayer, own draft-vocabulary head."""

    name = "eagle3"
    aliases = ("eagle-3",)
    Config = Eagle3Options
    version = 3

    def _head(self) -> Callable[[], nn.Module]:
        """Checks the head's config against the target, settles the draft vocabulary and the
        feature layers; returns the head's constructor."""
        cfg, raw, H = self.hf, self.raw_cfg, self.H_target
        t_hidden = int(raw.get("target_hidden_size") or cfg.hidden_size)
        if t_hidden != H:
            key = "target_hidden_size" if raw.get("target_hidden_size") else "hidden_size"
            raise StrategyError(
                f"{self.cfg_file}: {key}={t_hidden} but the target model's hidden size is {H}; "
                f"this EAGLE-3 head was trained for a different target model. Use the EAGLE-3 "
                f"checkpoint trained for this target (its config.json has {key}={H})"
            )
        own_embed = "embed_tokens.weight" in self.keys
        if cfg.hidden_size != H and not own_embed:
            raise StrategyError(
                f"{self.folder}: the draft's hidden_size ({cfg.hidden_size}) differs from the "
                f"target's ({H}) so the checkpoint must hold its own embed_tokens.weight"
            )
        Vd = self.draft_vocab = int(raw.get("draft_vocab_size") or cfg.vocab_size)
        if not 0 < Vd <= self.ctx.vocab_size:
            raise StrategyError(
                f"{self.cfg_file}: draft_vocab_size={Vd} must be in [1, {self.ctx.vocab_size}]"
            )
        L = target_num_layers(self.ctx)
        layers = self.config.aux_hidden_layers
        eagle_cfg = raw.get("eagle_config") or {}
        if layers is None and isinstance(eagle_cfg, dict):
            layers = eagle_cfg.get("eagle_aux_hidden_state_layer_ids")
        if layers is None:
            layers = (2, L // 2, L - 3)
        layers = tuple(sorted({int(i) for i in layers}))
        if len(layers) != 3 or not all(0 <= i < L for i in layers):
            raise StrategyError(
                f"EAGLE-3 needs 3 distinct target layers in [0, {L}) whose input hidden states "
                f"feed fc; got {layers} (default (2, L//2, L-3) for L={L}); set aux_hidden_layers"
            )
        self.aux_hidden_layers = layers
        V = self.ctx.vocab_size
        return lambda: Eagle3Draft(cfg, t_hidden, Vd, V, own_embed, self.max_positions)

    def _load(self) -> None:
        extra = self._load_weights(prefixes={"layers.0.": "midlayer."}, extra=("d2t", "t2d"))
        V = self.ctx.vocab_size
        file, d2t = extra.get("d2t", (self.folder, None))
        vocab = DraftVocab(d2t, self.draft_vocab, V, self.ctx.device, file)
        if "t2d" in extra and tuple(extra["t2d"][1].shape) != (V,):
            file, t = extra["t2d"]
            raise StrategyError(f"{file}: t2d has shape {tuple(t.shape)}, expected ({V},)")
        self.targets, self.identity_vocab = vocab.targets, vocab.identity
        self.ascending_targets = vocab.ascending  # as the EAGLE-3 scripts write d2t: hot_argmax

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.draft.embed_tokens is not None:
            return self.draft.embed_tokens(ids)
        return self.target.embed(ids)

    def features(self, batch: SpecBatch) -> torch.Tensor | None:
        return batch.aux_hidden_states

    def _draft_logits(self, x: torch.Tensor) -> torch.Tensor:  # [rows, H] -> [rows, Vd] fp32
        return norm_logits(x, self.draft.norm, self.draft.lm_head)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:  # [rows, H] -> [rows, vocab] fp32
        small = self._draft_logits(x)  # [rows, draft_vocab]
        if self.identity_vocab:
            return small
        return scatter_hot(small, self.targets, self.ctx.vocab_size)  # [rows, vocab]

    def _greedy(self, x: torch.Tensor) -> torch.Tensor:  # [rows, H] -> [rows] int64 token ids
        """``row_argmax(self._logits(x))`` over the draft vocabulary only, mapped to target ids
        (``hot_argmax``), when the target ids ascend; else through the full row."""
        return self._pick(self._draft_logits(x))  # [rows, draft_vocab] -> [rows]

    def _draft_space(self, x: torch.Tensor) -> torch.Tensor:  # [rows, H] -> [rows, Vd] fp32
        return self._draft_logits(x)

    def _pick(self, small: torch.Tensor) -> torch.Tensor:  # [rows, Vd] -> [rows] int64 token ids
        if self.identity_vocab:
            return row_argmax(small)
        if self.ascending_targets:
            return hot_argmax(small, self.targets)
        return row_argmax(scatter_hot(small, self.targets, self.ctx.vocab_size))


@hookimpl
def register_strategies(register) -> None:
    register(EagleStrategy)
    register(Eagle3Strategy)
