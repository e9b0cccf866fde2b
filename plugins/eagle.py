"""EAGLE-1 (arXiv 2401.15077) and EAGLE-3 (arXiv 2503.01840): small autoregressive draft heads
that run on the target's hidden states and keep their own paged KV cache.

EAGLE-1 (``yuhuili/EAGLE-*`` checkpoints; ``config.json`` is a Llama config with
``num_hidden_layers`` draft layers and an optional ``bias`` flag for ``fc``)::

    x   = fc(concat[embed(token p+1), h_p])           fc: 2H -> H (bias unless "bias": false)
    x   = decoder layers (Llama; layer 0 has NO input_layernorm)
    out = x                                           no final norm
    logits = target.lm_head(out)                      embedding and LM head are the target's

where ``h_p`` is the target's final-norm hidden state at position p (the one that produced token
p + 1). Later draft steps feed ``out`` back in place of ``h``. With the option ``token_map`` (a file
of hot token ids, plugins/token_map.py) the logits come from a copy of the hot rows of the target's
LM head only: greedy drafts are the argmax over those hot logits mapped through the hot ids,
sampled drafts use full-vocabulary rows with -inf elsewhere (EAGLE-3 refuses the option: it has
its own draft vocabulary, handled the same way).

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

Serving: each sequence owns blocks of the strategy's paged draft KV cache. At every ``propose``
the draft re-runs the positions verified since the last call with the target's features (this
overwrites the K/V its own draft steps wrote, and catches up on accepted tokens), then drafts
``k`` tokens autoregressively. Rejected drafts need no rollback: their K/V slots are simply
overwritten next time. While speculation is switched off (batch-size-disable) the engine keeps
collecting the target's features, so the head catches up on every position it missed when it
comes back; only if it lacks features for a position (e.g. its draft cache ran out) does the
sequence's draft context restart at the first position it has features for.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import nn

from speculant import hookimpl
from speculant.drafting import (
    AttentionMetadata,
    DraftSampler,
    ForwardContext,
    GraphCache,
    HotHead,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaMLP,
    RMSNorm,
    RotaryEmbedding,
    StrategyError,
    TokenMapError,
    WeightLoader,
    WeightLoadError,
    bucket,
    checkpoint_files,
    checkpoint_keys,
    fused,
    gemv,
    hot_argmax,
    iter_checkpoint,
    load_config,
    load_token_map,
    mlp_gemv,
    pinned_copy,
    read_config_json,
    resolve_draft_folder,
    row_argmax,
    scatter_hot,
    split_drafts,
    target_hidden_size,
    to_device_async,
)
from speculant.drafting import (
    cache_slot as _slot,
)
from speculant.drafting import (
    capture_eagle_graphs as capture_all,
)
from speculant.drafting import (
    eagle_fused_greedy as fused_greedy,
)
from speculant.spec_types import Proposal, SpecBatch, StrategyContext

PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
DEFAULT_K = 5


def eagle_version(path: Path, config: dict[str, Any]) -> int | None:
    """1 or 3 if ``path`` holds an EAGLE checkpoint in the published layout, else None."""
    if config.get("model_type") == "mlp_speculator" or not Path(path).is_dir():
        return None
    archs = [str(a).lower() for a in config.get("architectures") or []]
    keys = {k.removeprefix("model.") for k in checkpoint_keys(Path(path))}
    if "fc.weight" not in keys:
        return None
    if (
        any(k.startswith("midlayer.") for k in keys)
        or "d2t" in keys
        or any("eagle3" in a for a in archs)
    ):
        return 3
    if any(k.startswith("layers.") for k in keys):
        return 1
    return None


# --------------------------------------------------------------------------------------------
# the draft models
# --------------------------------------------------------------------------------------------
def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _qkv_bias(cfg) -> bool:
    if getattr(cfg, "qkv_bias", None) is not None:
        return bool(cfg.qkv_bias)
    return cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False))


class Eagle1Draft(nn.Module):
    """fc + Llama decoder layers (the first without input_layernorm); target embedding/head."""

    def __init__(self, cfg, fc_bias: bool, max_positions: int) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.rope = RotaryEmbedding(cfg, _head_dim(cfg), max_positions)
        self.fc = nn.Linear(2 * H, H, bias=fc_bias)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, self.rope, _qkv_bias(cfg))
            for i in range(cfg.num_hidden_layers)
        )
        self.layers[0].input_layernorm = nn.Identity()
        self.num_layers = cfg.num_hidden_layers
        self.kv_shape = (self.layers[0].self_attn.num_kv_heads, self.layers[0].self_attn.head_dim)

    def forward(
        self,
        emb: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        from_target: bool,
    ) -> torch.Tensor:
        # emb, hidden: [tokens, H] -> [tokens, H] (fed back as the next step's hidden)
        x = self.fc(torch.cat([emb, hidden], dim=-1))
        for layer in self.layers:
            x = layer(positions, x, ctx)
        return x


class Eagle3Layer(nn.Module):
    """EAGLE-3's ``midlayer``: attention over concat[norm(embeds), norm(hidden)] (2H wide)."""

    def __init__(self, cfg, rope: RotaryEmbedding) -> None:
        super().__init__()
        H, eps = cfg.hidden_size, getattr(cfg, "rms_norm_eps", 1e-6)
        bias = _qkv_bias(cfg)
        self.input_layernorm = RMSNorm(H, eps)
        self.hidden_norm = RMSNorm(H, eps)
        self.self_attn = LlamaAttention(cfg, 0, rope, bias)
        a = self.self_attn
        self.self_attn.qkv_proj = nn.Linear(2 * H, a.q_size + 2 * a.kv_size, bias=bias)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = LlamaMLP(cfg)
        self.norm_before_residual = bool(getattr(cfg, "norm_before_residual", False))

    def forward(self, positions, emb, hidden, ctx: ForwardContext) -> torch.Tensor:
        h = self.hidden_norm(hidden)
        residual = h if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(emb), h], dim=-1)
        a = self.self_attn(positions, x, ctx)  # [tokens, H]
        mlp, norm = self.mlp, self.post_attention_layernorm
        if mlp.fused_act and fused.gemv_enabled(a):  # a one-row draft step on CUDA
            out, x = mlp_gemv(mlp, norm, a, residual)
            return x + out
        x = residual + a
        return x + mlp(norm(x))


class Eagle3Draft(nn.Module):
    def __init__(
        self,
        cfg,
        target_hidden: int,
        draft_vocab: int,
        vocab: int,
        own_embed: bool,
        max_positions: int,
    ) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.rope = RotaryEmbedding(cfg, _head_dim(cfg), max_positions)
        self.fc = nn.Linear(3 * target_hidden, H, bias=False)
        self.midlayer = Eagle3Layer(cfg, self.rope)
        self.norm = RMSNorm(H, getattr(cfg, "rms_norm_eps", 1e-6))
        self.lm_head = nn.Linear(H, draft_vocab, bias=False)
        self.embed_tokens = nn.Embedding(vocab, H) if own_embed else None
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long), persistent=False)
        self.num_layers = 1
        self.kv_shape = (self.midlayer.self_attn.num_kv_heads, self.midlayer.self_attn.head_dim)

    def forward(
        self, emb, hidden, positions, ctx: ForwardContext, from_target: bool
    ) -> torch.Tensor:
        if from_target:  # [tokens, 3 * target_hidden] -> [tokens, H]
            hidden = self.fc(hidden)
        return self.midlayer(positions, emb, hidden, ctx)


# --------------------------------------------------------------------------------------------
# the draft KV cache
# --------------------------------------------------------------------------------------------
@dataclass
class _SeqState:
    table: list[int]  # blocks of the draft cache
    offset: int  # target position held at cache index 0
    valid: int  # positions [offset, valid) hold K/V computed from the target's features


class DraftKVCache:
    def __init__(
        self,
        num_layers: int,
        nkv: int,
        head_dim: int,
        block_size: int,
        num_blocks: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        self.kv = torch.zeros(
            num_layers, 2, num_blocks, block_size, nkv, head_dim, dtype=dtype, device=device
        )
        self.kv_caches = [(self.kv[i, 0], self.kv[i, 1]) for i in range(num_layers)]
        self.free: deque[int] = deque(range(num_blocks))

    def grow(self, table: list[int], entries: int) -> bool:
        need = -(-entries // self.block_size) - len(table)
        if need > len(self.free):
            return False
        for _ in range(max(0, need)):
            table.append(self.free.popleft())
        return True

    def release(self, table: list[int]) -> None:
        for b in reversed(table):
            self.free.appendleft(b)
        table.clear()


@dataclass
class _Plan:
    """One sequence of a propose call."""

    i: int  # index in the batch
    st: _SeqState
    row: int  # first row of its target features
    count: int  # rows of features (positions verified since the last call)
    start: int  # first position covered
    n: int  # tokens of the sequence
    k: int  # drafts wanted (0: catch up only)


def _stage_ints(parts: list, device: torch.device) -> list[torch.Tensor]:
    """int64 tensors of ``parts`` (lists or arrays, flattened) on ``device``: one host array, one
    asynchronous copy, views into it."""
    arrs = [np.asarray(p, dtype=np.int64).reshape(-1) for p in parts]
    flat = to_device_async(np.concatenate(arrs), torch.long, device)
    out, o = [], 0
    for a in arrs:
        out.append(flat[o : o + a.size])
        o += a.size
    return out


# --------------------------------------------------------------------------------------------
# the strategies
# --------------------------------------------------------------------------------------------
class EagleOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = Field(..., description="folder (or hub id) of the EAGLE checkpoint")
    num_speculative_tokens: int = Field(DEFAULT_K, ge=1, le=64)
    token_map: str | None = Field(
        None,
        description="file of hot token ids (.pt, .json, .npy or .txt; plugins/token_map.py): "
        "the draft's LM head runs over those rows of the target's head only (FR-Spec)",
    )


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


class _EagleBase:
    needs_hidden_states = True
    version = 0

    @classmethod
    def matches_model(cls, path: Path, config: dict[str, Any]) -> bool:
        try:
            return eagle_version(path, config) == cls.version
        except Exception:
            return False

    def __init__(self, config: EagleOptions, ctx: StrategyContext) -> None:
        self.ctx = ctx
        self.num_speculative_tokens = config.num_speculative_tokens
        folder = resolve_draft_folder(config.model)
        self.folder = folder
        self.cfg_file = folder / "config.json"
        self.raw_cfg = read_config_json(folder)
        self.keys = {k.removeprefix("model.") for k in checkpoint_keys(folder)}
        found = eagle_version(folder, self.raw_cfg)
        if found != self.version:
            what = f"an EAGLE-{found}" if found else "not an EAGLE"
            raise StrategyError(
                f"{folder}: this is {what} checkpoint (config.json architectures="
                f"{self.raw_cfg.get('architectures')}, tensors {sorted(self.keys)[:4]}...), but "
                f"method {self.name!r} needs an EAGLE-{self.version} one"
                + (f"; use method 'eagle{found if found == 3 else ''}'" if found else "")
            )
        self.hf = self._hf_config()
        self.target = ctx.target_model
        self.H_target = target_hidden_size(ctx)
        max_pos = ctx.max_model_len + config.num_speculative_tokens + 8
        self.draft = self._build(max_pos)
        self._load()
        self.draft.eval()
        # the hot rows of the LM head (token_map, EAGLE-1 only): made once here
        self.hot: HotHead | None = None
        if getattr(config, "token_map", None):
            self.hot = self._hot_head(config.token_map)
        nkv, hd = self.draft.kv_shape
        self.cache = DraftKVCache(
            self.draft.num_layers,
            nkv,
            hd,
            ctx.block_size,
            self._num_blocks(nkv, hd),
            ctx.device,
            ctx.dtype,
        )
        self.states: dict[int, _SeqState] = {}
        self.generator = torch.Generator().manual_seed(ctx.seed + 15485863)
        self.graphs = GraphCache(ctx.device, f"{self.name} {folder}", ctx.enforce_eager)
        # block-table width of the captured draft loop: the most blocks a sequence can hold
        self.graph_width = -(-(max_pos + 1) // ctx.block_size) + 1

    # ----------------------------------------------------------------- set-up
    def _hf_config(self):
        import transformers

        try:
            cfg = load_config(self.folder)
        except ValueError:
            d = {k: v for k, v in self.raw_cfg.items() if k != "model_type"}
            try:
                cfg = transformers.LlamaConfig(**d)
            except Exception as e:
                raise StrategyError(
                    f"{self.cfg_file}: cannot be read as a Llama config ({e})"
                ) from None
        for key in ("hidden_size", "num_attention_heads", "intermediate_size"):
            if not getattr(cfg, key, None):
                raise StrategyError(f"{self.cfg_file}: missing {key}")
        if getattr(cfg, "vocab_size", None) != self.ctx.vocab_size:
            raise StrategyError(
                f"{self.cfg_file}: vocab_size={getattr(cfg, 'vocab_size', None)} but the target model's "
                f"vocabulary has {self.ctx.vocab_size} tokens; this EAGLE head was trained for a "
                "different target model. Use the EAGLE checkpoint trained for this target"
            )
        return cfg

    def _num_blocks(self, nkv: int, hd: int) -> int:
        ctx = self.ctx
        bs = ctx.block_size
        per_block = (
            2
            * self.draft.num_layers
            * bs
            * nkv
            * hd
            * torch.empty(0, dtype=ctx.dtype).element_size()
        )
        per_seq = -(-(ctx.max_model_len + self.num_speculative_tokens + 1) // bs)
        want = ctx.max_num_seqs * per_seq
        budget = ctx.kv_cache_memory
        if budget is None:
            if ctx.device.type == "cuda":
                budget = int(torch.cuda.mem_get_info(ctx.device)[0] * 0.1)
            else:
                budget = 1 << 30
        return max(per_seq, min(want, budget // per_block))

    def _source(self) -> str:
        files = checkpoint_files(self.folder)
        return (
            str(files[0])
            if len(files) == 1
            else f"{self.folder} ({', '.join(f.name for f in files)})"
        )

    def _load_into(self, loader: WeightLoader, name: str, tensor: torch.Tensor) -> None:
        try:
            loader.load(name, tensor)
        except WeightLoadError as e:
            raise StrategyError(str(e)) from None

    def _finish(self, loader: WeightLoader) -> None:
        try:
            loader.finish()
        except WeightLoadError as e:
            raise StrategyError(
                f"{e} (the EAGLE-{self.version} key names are listed in the docstring of "
                "speculant.plugins.eagle)"
            ) from None

    def _materialize(self, module: nn.Module, max_pos: int) -> nn.Module:
        module = module.to_empty(device=self.ctx.device).to(self.ctx.dtype)
        module.rope.reset(self.hf, max_pos, self.ctx.device)
        return module

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.target.embed(ids)

    def _features(self, batch: SpecBatch) -> torch.Tensor | None:
        return batch.hidden_states

    def _hot_head(self, path: str) -> HotHead:
        """The target's LM head restricted to the token map at ``path``."""
        head = getattr(self.target, "lm_head", None)
        weight = getattr(head, "weight", None)
        V = self.ctx.vocab_size
        if weight is None or weight.dim() != 2 or tuple(weight.shape) != (V, self.H_target):
            raise StrategyError(
                f"token_map: the target model's LM head (lm_head.weight "
                f"{None if weight is None else tuple(weight.shape)}) is not a [{V}, "
                f"{self.H_target}] matrix; use this target without token_map"
            )
        try:
            ids = load_token_map(path, V)
        except TokenMapError as e:
            raise StrategyError(str(e)) from None
        return HotHead(weight, ids, V, like=head)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:  # [rows, H] -> [rows, vocab] fp32
        # EAGLE-1's draft output goes into the target's LM head as is (no final norm: the
        # target's compute_logits is a bare product with lm_head.weight)
        if self.hot is not None:  # the hot rows only, -inf elsewhere
            return self.hot(x)
        return self.target.compute_logits(x)

    def _greedy(self, x: torch.Tensor) -> torch.Tensor:  # [rows, H] -> [rows] int64 token ids
        """``row_argmax(self._logits(x))``; with a token map the argmax over the hot logits
        mapped through the hot ids (``HotHead.greedy``: no [rows, vocab] row). Device-side only:
        the captured greedy loops run it."""
        if self.hot is not None:
            return self.hot.greedy(x)  # [rows, N] -> [rows]
        return row_argmax(self.target.compute_logits(x))  # [rows, vocab] -> [rows]

    # ----------------------------------------------------------------- hooks
    @hookimpl
    def on_requests_finished(self, seq_ids: list[int]) -> None:
        for i in seq_ids:
            st = self.states.pop(i, None)
            if st is not None:
                self.cache.release(st.table)

    @hookimpl
    @torch.inference_mode()
    def propose(self, batch: SpecBatch) -> Proposal:
        B = len(batch.seqs)
        feats = self._features(batch)
        if feats is None or not B:
            return Proposal(token_ids=[[] for _ in range(B)])
        row0 = [0, *itertools.accumulate(batch.hidden_counts)]
        ks = [min(s.max_draft, self.num_speculative_tokens) for s in batch.seqs]
        # every drafting sequence runs K draft steps (a step of one row depends on that row only);
        # rows that want fewer drafts drop the extra ones
        K = max((k for k, c in zip(ks, batch.hidden_counts) if c > 0), default=0)
        plan: list[_Plan] = []
        for i, s in enumerate(batch.seqs):
            c, start, n = batch.hidden_counts[i], batch.hidden_start[i], s.num_tokens
            if c == 0 or start + c != n - 1:
                continue
            st = self.states.get(s.seq_id)
            if st is None or start < st.offset or start > st.valid:
                if st is not None:
                    self.cache.release(st.table)
                st = self.states[s.seq_id] = _SeqState([], start, start)
            last_pos = max(n - 2, n + K - 3) if ks[i] > 0 else n - 2  # last position written
            if not self.cache.grow(st.table, last_pos - st.offset + 1):
                self.cache.release(st.table)  # out of draft cache: restart this one later
                del self.states[s.seq_id]
                continue
            plan.append(_Plan(i, st, row0[i], c, start, n, ks[i]))
        if not plan:
            return Proposal(token_ids=[[] for _ in range(B)])
        if self.graphs.enabled:  # all greedy and short catch-ups: everything in one CUDA graph
            toks = fused_greedy(self, batch, feats, plan, K)  # [drafting rows, K] or None
            if toks is not None:
                for p in plan:
                    p.st.valid = p.n - 1
                rows = [p for p in plan if p.k > 0]
                return Proposal(
                    token_ids=split_drafts(
                        toks, [p.i for p in rows], [p.k for p in rows], B, self.graphs
                    )
                )

        # 1) the verified positions, with the target's features (one staged copy of the ints)
        bs = self.cache.block_size
        ids, pos, slots, gather = [], [], [], []
        for p in plan:
            ids.extend(batch.seqs[p.i].token_ids[p.start + 1 : p.n])
            for q in range(p.start, p.n - 1):
                pos.append(q)
                idx = q - p.st.offset
                slots.append(p.st.table[idx // bs] * bs + idx % bs)
            gather.extend(range(p.row, p.row + p.count))
        qlens = [p.count for p in plan]
        ctxs = [p.n - 1 - p.st.offset for p in plan]
        W = max(len(p.st.table) for p in plan)
        tables = [p.st.table + [0] * (W - len(p.st.table)) for p in plan]
        active = [a for a, p in enumerate(plan) if p.k > 0]
        ends = list(itertools.accumulate(qlens))
        last_active = [ends[a] - 1 for a in active]
        whole = gather == list(range(feats.shape[0]))
        ids_t, pos_t, slots_t, ctx_t, qsl_t, tab_t, gather_t, last_t = _stage_ints(
            [ids, pos, slots, ctxs, [0, *ends], tables, [] if whole else gather, last_active],
            feats.device,
        )
        meta = AttentionMetadata(
            slot_mapping=slots_t,
            block_tables=tab_t.view(len(plan), W).to(torch.int32),
            context_lens=ctx_t.to(torch.int32),
            query_start_loc=qsl_t.to(torch.int32),
            query_lens=qlens,
            context_lens_list=ctxs,
            block_size=bs,
        )
        hidden = (feats if whole else feats[gather_t]).to(self.ctx.dtype)  # [tokens, H or 3H]
        fctx = ForwardContext(meta=meta, kv_caches=self.cache.kv_caches)
        out = self.draft(self._embed(ids_t), hidden, pos_t, fctx, True)  # [tokens, H]
        for p in plan:
            p.st.valid = p.n - 1
        if not active:
            return Proposal(token_ids=[[] for _ in range(B)])
        x = out[last_t]  # [len(active), H]: the draft state of each sequence's last position

        # 2) K draft steps, feeding the draft's own output back; one device read at the end
        rows = [plan[a] for a in active]
        sampler = DraftSampler(
            [batch.seqs[p.i] for p in rows], [p.k for p in rows], self.generator, feats.device
        )
        if sampler.all_greedy and self.graphs.enabled and len(rows) <= 256:
            toks = self._greedy_graph(x, rows, K)  # [len(active), K]
        else:
            ints = _stage_ints([self._chain_ints(rows, K, len(rows), W)], feats.device)[0]
            ctx_lists = [[p.n - p.st.offset + j for p in rows] for j in range(K - 1)]
            choose = None if sampler.all_greedy else sampler  # all greedy: no q to keep
            toks = self._chain(ints, x, K, W, choose, ctx_lists)  # [len(active), K]
        row_ids = [p.i for p in rows]
        drafts = split_drafts(toks, row_ids, [p.k for p in rows], B, self.graphs)
        return Proposal(token_ids=drafts, probs=sampler.probs(row_ids, B, self.ctx.vocab_size))

    def _chain_ints(self, rows: list[_Plan], K: int, Bp: int, W: int) -> list[int]:
        """The int64 inputs of K - 1 draft steps for ``rows`` padded to ``Bp`` sequences and
        block tables of width ``W``: positions, slots, context lengths ``[K - 1, Bp]`` each,
        query start offsets ``[Bp + 1]``, block tables ``[Bp, W]`` (flat, in that order). Padded
        sequences have context length 0 and an empty query range; their token rows write no
        K/V (slot -1). Built as a Python list: a few hundred numbers, where numpy's per-call
        cost dominated (the GPU waits for this host work before the draft graph runs)."""
        S, A, bs = K - 1, len(rows), self.cache.block_size
        pos, slots, ctx = [0] * (S * Bp), [-1] * (S * Bp), [0] * (S * Bp)
        tables = [0] * (Bp * W)
        for r, p in enumerate(rows):
            tbl = p.st.table
            tables[r * W : r * W + len(tbl)] = tbl
            for j in range(S):
                idx = p.n - 1 + j - p.st.offset  # draft step j writes position n - 1 + j
                pos[j * Bp + r] = p.n - 1 + j
                slots[j * Bp + r] = _slot(tbl, idx, bs)
                ctx[j * Bp + r] = idx + 1
        return pos + slots + ctx + list(range(A + 1)) + [A] * (Bp - A) + tables

    def _chain(
        self,
        ints: torch.Tensor,  # [3 * (K - 1) * Bp + Bp + 1 + Bp * W] int64, see _chain_ints
        x: torch.Tensor,  # [Bp, H] the draft state that predicts each row's first draft
        K: int,
        W: int,
        sampler: DraftSampler | None,  # the draft sampler; None: every row greedy
        ctx_lists: list[list[int]] | None = None,  # context lengths per step (torch path)
    ) -> torch.Tensor:  # [Bp, K] draft tokens
        """K draft steps from the draft states ``x``: each step's tokens are ``sampler``'s choice
        from full-vocabulary logits, or with no sampler (every row greedy) ``_greedy``'s argmax,
        which needs no full-vocabulary row with a token map or a draft vocabulary."""
        Bp, S, bs = x.shape[0], K - 1, self.cache.block_size
        o = 3 * S * Bp
        pos = ints[: S * Bp].view(S, Bp)
        slots = ints[S * Bp : 2 * S * Bp].view(S, Bp)
        ctx = ints[2 * S * Bp : o].view(S, Bp).to(torch.int32)
        qsl = ints[o : o + Bp + 1].to(torch.int32)
        tables = ints[o + Bp + 1 : o + Bp + 1 + Bp * W].view(Bp, W).to(torch.int32)
        out = []
        for j in range(K):
            if sampler is None:
                tok = self._greedy(x)  # [Bp]
            else:
                tok = sampler(j, self._logits(x))  # [Bp]
            out.append(tok)
            if j + 1 == K:
                break
            meta = AttentionMetadata(
                slot_mapping=slots[j],
                block_tables=tables,
                context_lens=ctx[j],
                query_start_loc=qsl,
                query_lens=[1] * Bp,
                context_lens_list=ctx_lists[j] if ctx_lists else [W * bs] * Bp,
                block_size=bs,
            )
            fctx = ForwardContext(meta=meta, kv_caches=self.cache.kv_caches)
            x = self.draft(self._embed(tok), x, pos[j], fctx, False)  # [Bp, H]
        return torch.stack(out, dim=1)  # [Bp, K]

    def _greedy_graph(self, x: torch.Tensor, rows: list[_Plan], K: int) -> torch.Tensor:
        """The K greedy draft steps as one CUDA graph replay (batch padded to a bucket, block
        tables to the widest a sequence can have)."""
        A, Bp, W = len(rows), bucket(len(rows)), self.graph_width
        if any(len(p.st.table) > W for p in rows):  # grow() bounds it by max_model_len + k
            raise AssertionError(f"draft block table wider than the graph's ({W} blocks)")
        key, (ints_buf, x_buf, host), fn = self._chain_entry(Bp, K, W)
        self.graphs.writable(host)[:] = self._chain_ints(rows, K, Bp, W)  # the graph copies it
        x_buf[:A].copy_(x)
        out = self.graphs.replay(key, fn)
        if out is None:  # the capture failed: eagerly
            out = fn(ints_buf, x_buf, host)
        return out[:A]  # [A, K]

    def _chain_entry(self, Bp: int, K: int, W: int):
        """(key, its static inputs ([n_ints] device, [Bp, H] draft states, [n_ints] pinned
        host), the function the graph captures) of one (Bp, K) greedy chain graph."""
        dev = self.ctx.device
        n_ints = 3 * (K - 1) * Bp + Bp + 1 + Bp * W

        def make():
            return (
                torch.zeros(n_ints, dtype=torch.long, device=dev),
                torch.zeros(Bp, self.hf.hidden_size, dtype=self.ctx.dtype, device=dev),
                self.graphs.host_vector(n_ints),
            )

        key = (Bp, K)
        bufs = self.graphs.buffers(key, make)  # [n_ints], [Bp, H], [n_ints]

        def fn(ints, xs, host):
            pinned_copy(host, ints)  # [n_ints] pinned -> device: the graph's first node
            return self._chain(ints, xs, K, W, None)  # greedy

        return key, bufs, fn

    @property
    def feature_width(self) -> int:
        """Width of the target features a catch-up row carries (``_features``)."""
        return self.H_target

    @hookimpl
    @torch.inference_mode()
    def capture_graphs(self, max_num_seqs: int, progress: bool) -> int:
        """The one-graph greedy proposes and draft-step chains (``eagle_graph.capture_all``)."""
        return capture_all(self, max_num_seqs, progress)


class EagleStrategy(_EagleBase):
    """EAGLE-1: draft layers over concat[token embedding, target hidden state]."""

    name = "eagle"
    aliases = ("eagle1", "eagle-1")
    Config = EagleOptions
    version = 1

    def _build(self, max_pos: int) -> nn.Module:
        cfg = self.hf
        if cfg.hidden_size != self.H_target:
            raise StrategyError(
                f"{self.cfg_file}: hidden_size={cfg.hidden_size} but the target model's hidden size is "
                f"{self.H_target}; this EAGLE head was trained for a different target model. Use "
                f"the EAGLE checkpoint trained for this target (its config.json has hidden_size="
                f"{self.H_target})"
            )
        if "bias" in self.raw_cfg:
            fc_bias = bool(self.raw_cfg["bias"])
        else:
            fc_bias = "fc.bias" in self.keys
        with torch.device("meta"):
            draft = Eagle1Draft(cfg, fc_bias, max_pos)
        return self._materialize(draft, max_pos)

    def _load(self) -> None:
        src = self._source()
        loader = WeightLoader(self.draft, src, packed=PACKED)
        V, H = self.ctx.vocab_size, self.H_target
        for file, name, tensor in iter_checkpoint(self.folder):
            key = name.removeprefix("model.")
            if key.endswith("rotary_emb.inv_freq"):
                continue
            if key == "embed_tokens.weight":  # a frozen copy of the target's; the target's is used
                if tuple(tensor.shape) != (V, H):
                    raise StrategyError(
                        f"{file}: embed_tokens.weight has shape {tuple(tensor.shape)}, "
                        f"expected the target's ({V}, {H})"
                    )
                continue
            self._load_into(loader, key, tensor)
        self._finish(loader)


class Eagle3Strategy(_EagleBase):
    """EAGLE-3: fused low/mid/high target features, one midlayer, own draft-vocabulary head."""

    name = "eagle3"
    aliases = ("eagle-3",)
    Config = Eagle3Options
    version = 3

    def __init__(self, config: Eagle3Options, ctx: StrategyContext) -> None:
        self._want_aux = config.aux_hidden_layers
        super().__init__(config, ctx)

    def _build(self, max_pos: int) -> nn.Module:
        cfg, raw = self.hf, self.raw_cfg
        t_hidden = int(raw.get("target_hidden_size") or cfg.hidden_size)
        if t_hidden != self.H_target:
            key = "target_hidden_size" if raw.get("target_hidden_size") else "hidden_size"
            raise StrategyError(
                f"{self.cfg_file}: {key}={t_hidden} but the target model's hidden size is "
                f"{self.H_target}; this EAGLE-3 head was trained for a different target model. Use "
                f"the EAGLE-3 checkpoint trained for this target (its config.json has {key}="
                f"{self.H_target})"
            )
        own_embed = "embed_tokens.weight" in self.keys
        if cfg.hidden_size != self.H_target and not own_embed:
            raise StrategyError(
                f"{self.folder}: the draft's hidden_size ({cfg.hidden_size}) differs from the target's "
                f"({self.H_target}) so the checkpoint must hold its own embed_tokens.weight"
            )
        self.draft_vocab = int(raw.get("draft_vocab_size") or cfg.vocab_size)
        if not 0 < self.draft_vocab <= self.ctx.vocab_size:
            raise StrategyError(
                f"{self.cfg_file}: draft_vocab_size={self.draft_vocab} must be in "
                f"[1, {self.ctx.vocab_size}]"
            )
        L = int(
            getattr(self.ctx.target_model, "num_layers", 0)
            or self.ctx.target_config.num_hidden_layers
        )
        layers = self._want_aux
        if layers is None:
            eagle_cfg = raw.get("eagle_config") or {}
            layers = (
                eagle_cfg.get("eagle_aux_hidden_state_layer_ids")
                if isinstance(eagle_cfg, dict)
                else None
            )
        if layers is None:
            layers = (2, L // 2, L - 3)
        layers = tuple(sorted({int(i) for i in layers}))
        if len(layers) != 3 or not all(0 <= i < L for i in layers):
            raise StrategyError(
                f"EAGLE-3 needs 3 distinct target layers in [0, {L}) whose input hidden states feed fc; "
                f"got {layers} (default (2, L//2, L-3) for L={L}); set aux_hidden_layers"
            )
        self.aux_hidden_layers = layers
        with torch.device("meta"):
            draft = Eagle3Draft(
                cfg, t_hidden, self.draft_vocab, self.ctx.vocab_size, own_embed, max_pos
            )
        return self._materialize(draft, max_pos)

    def _load(self) -> None:
        src = self._source()
        loader = WeightLoader(self.draft, src, packed=PACKED)
        d2t = t2d = None
        for file, name, tensor in iter_checkpoint(self.folder):
            key = name.removeprefix("model.")
            if key.startswith("layers.0."):
                key = "midlayer." + key.removeprefix("layers.0.")
            if key.endswith("rotary_emb.inv_freq"):
                continue
            if key == "d2t":
                d2t = (file, tensor)
            elif key == "t2d":
                t2d = (file, tensor)
            else:
                self._load_into(loader, key, tensor)
        self._finish(loader)
        Vd, V = self.draft_vocab, self.ctx.vocab_size
        if d2t is None:
            if Vd != V:
                raise StrategyError(
                    f"{self.folder}: no d2t tensor, but draft_vocab_size={Vd} differs "
                    f"from vocab_size={V} so the draft->target id map is needed"
                )
            offsets = torch.zeros(Vd, dtype=torch.long)
        else:
            file, t = d2t
            if tuple(t.shape) != (Vd,) or t.dtype.is_floating_point:
                raise StrategyError(
                    f"{file}: d2t has shape {tuple(t.shape)} and dtype {t.dtype}, "
                    f"expected integer offsets of shape ({Vd},)"
                )
            offsets = t.long()
            ids = torch.arange(Vd) + offsets
            if int(ids.min()) < 0 or int(ids.max()) >= V:
                raise StrategyError(
                    f"{file}: d2t maps draft ids outside the target vocabulary [0, {V})"
                )
        if t2d is not None and tuple(t2d[1].shape) != (V,):
            raise StrategyError(f"{t2d[0]}: t2d has shape {tuple(t2d[1].shape)}, expected ({V},)")
        self.draft.d2t = offsets.to(self.ctx.device)
        targets = torch.arange(Vd) + offsets  # [Vd] on the CPU
        self.targets = targets.to(self.ctx.device)
        if len(set(targets.tolist())) != Vd:
            raise StrategyError(f"{self.folder}: d2t maps two draft ids to the same target id")
        # decided once here: a device read per draft step would stall the draft loop
        self.identity_vocab = Vd == V and not bool(offsets.any())
        # greedy drafts map the draft argmax through the targets (hot_argmax) when they ascend,
        # as the EAGLE-3 scripts write d2t: then ties resolve to the lowest target id, as the
        # full row's argmax does
        self.ascending_targets = bool((targets[1:] > targets[:-1]).all())

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.draft.embed_tokens is not None:
            return self.draft.embed_tokens(ids)
        return self.target.embed(ids)

    def _features(self, batch: SpecBatch) -> torch.Tensor | None:
        return batch.aux_hidden_states

    @property
    def feature_width(self) -> int:  # the residual streams of the aux layers, concatenated
        return len(self.aux_hidden_layers) * self.H_target

    def _draft_logits(self, x: torch.Tensor) -> torch.Tensor:  # [rows, H] -> [rows, Vd] fp32
        d = self.draft
        if fused.gemv_enabled(x) and x.stride(-1) == 1:  # one row on CUDA: the norm fused
            return gemv(
                x, d.lm_head.weight, prologue="rmsnorm", norm_weight=d.norm.weight, eps=d.norm.eps
            ).float()  # [1, draft_vocab]
        return d.lm_head(d.norm(x)).float()  # [rows, draft_vocab]

    def _logits(self, x: torch.Tensor) -> torch.Tensor:  # [rows, H] -> [rows, vocab] fp32
        small = self._draft_logits(x)  # [rows, draft_vocab]
        if self.identity_vocab:
            return small
        return scatter_hot(small, self.targets, self.ctx.vocab_size)  # [rows, vocab]

    def _greedy(self, x: torch.Tensor) -> torch.Tensor:  # [rows, H] -> [rows] int64 token ids
        """``row_argmax(self._logits(x))`` over the draft vocabulary only, mapped to target ids
        (``hot_argmax``), when the target ids ascend; else through the full row."""
        small = self._draft_logits(x)  # [rows, draft_vocab]
        if self.identity_vocab:
            return row_argmax(small)
        if self.ascending_targets:
            return hot_argmax(small, self.targets)
        return row_argmax(scatter_hot(small, self.targets, self.ctx.vocab_size))


@hookimpl
def register_strategies(register) -> None:
    register(EagleStrategy)
    register(Eagle3Strategy)
