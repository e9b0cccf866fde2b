"""Llama family (Llama 2/3, Mistral, SmolLM, TinyLlama, Vicuna, CodeLlama) and Qwen2 (qkv bias).

Fused QKV and gate/up projections; loads the Hugging Face key names
(``model.layers.{i}.self_attn.q_proj.weight`` ...).

Tensor parallelism (``speculant.distributed``, Megatron-style): at size n each rank holds
num_heads / n query heads, their KV heads (num_key_value_heads / n, or a copy of the one KV head
its query heads use when there are fewer KV heads than ranks), intermediate_size / n of the MLP;
qkv_proj is packed per rank as [q shard; k shard; v shard] and gate_up_proj as [gate shard; up
shard] (column-parallel), o_proj and down_proj take the matching input columns (row-parallel)
and their outputs are summed over the ranks (``all_reduce``) in every forward path, so each
layer returns the full hidden state, as at size 1. The embedding, the norms and the LM head are
whole on every rank. At size 1 no path changes (no extra kernel).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from speculant.distributed import (
    NO_TENSOR_PARALLEL,
    TensorParallel,
    all_gather_columns,
    all_reduce,
    fused_all_reduce,
    fused_gemv_all_reduce,
    tensor_parallel,
)
from speculant.kernels.gemv import (
    choose_config,
    few_rows_silu_mul_slower,
    gemv,
    gemv_partials,
    gemv_split,
)
from speculant.models import cpu_forward, fused
from speculant.models.attention import ForwardContext
from speculant.models.gather import gather_rows
from speculant.models.layers import RMSNorm, RotaryEmbedding, activation, check_tensor_parallel
from speculant.models.weights import WeightLoader, WeightLoadError, WeightShard


def check_llama_tensor_parallel(config, size: int) -> None:
    """Raise ValueError when ``size`` ranks cannot split this Llama / Mistral / Qwen2 config."""
    nh = config.num_attention_heads
    nkv = getattr(config, "num_key_value_heads", None) or nh
    check_tensor_parallel(config.model_type, size, (nh, nkv),
                          {"num_attention_heads": nh, "intermediate_size": config.intermediate_size})


class LlamaAttention(nn.Module):
    """Self-attention; at ``tp`` size n this rank's query heads and their KV heads (module
    docstring), ``o_proj``'s output summed over the ranks."""

    def __init__(self, config, layer_idx: int, rope: RotaryEmbedding, qkv_bias: bool,
                 tp: TensorParallel = NO_TENSOR_PARALLEL) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.tp = tp
        self.total_heads = config.num_attention_heads
        self.total_kv_heads = getattr(config, "num_key_value_heads", None) or self.total_heads
        self.head_dim = (getattr(config, "head_dim", None)
                         or config.hidden_size // config.num_attention_heads)
        n = tp.size
        if n > 1:
            check_llama_tensor_parallel(config, n)
        self.num_heads = self.total_heads // n  # this rank's query heads
        if self.total_kv_heads >= n:
            self.num_kv_heads = self.total_kv_heads // n
            self.kv_head_start = tp.rank * self.num_kv_heads
        else:  # fewer KV heads than ranks: a copy of the one this rank's query heads use
            self.num_kv_heads = 1
            self.kv_head_start = tp.rank * self.total_kv_heads // n
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        o_bias = bool(getattr(config, "attention_bias", False)) and config.model_type != "qwen2"
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_bias)
        self.rope = rope

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        x: torch.Tensor,  # [num_tokens, hidden]
        ctx: ForwardContext,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        T = x.shape[0]
        qkv = self.qkv_proj(x)  # [num_tokens, q_size + 2 * kv_size]
        if qkv.device.type == "cpu":  # rotate q and k heads in one pass
            nh, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
            qk = qkv[:, : self.q_size + self.kv_size].view(T, nh + nkv, d)  # [T, nh + nkv, d]
            q, k = self.rope.rotate_cpu(positions, qk).split([nh, nkv], dim=1)
            v = qkv[:, self.q_size + self.kv_size :].view(T, nkv, d)  # [T, nkv, d]
            o = ctx.attend(self.layer_idx, q, k, v, self.scale)  # [T, nh, d]
            return all_reduce(self.o_proj(o.reshape(T, self.q_size)), self.tp)
        o = self.attend_qkv(positions, qkv, ctx)  # [num_tokens, q_size]
        if fused.gemv_enabled(o):  # a one-row step (an EAGLE head's draft step)
            return all_reduce(gemv(o, self.o_proj.weight, self.o_proj.bias), self.tp)
        return all_reduce(self.o_proj(o), self.tp)

    def attend_qkv(
        self,
        positions: torch.Tensor,  # [num_tokens]
        qkv: torch.Tensor,  # [num_tokens, q_size + 2 * kv_size]
        ctx: ForwardContext,
    ) -> torch.Tensor:  # [num_tokens, q_size]: attention output, before o_proj
        T = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        rope = self.rope
        if fused.enabled(q) and rope.cos_cache.shape[-1] == self.head_dim:
            k_cache, v_cache = ctx.kv_caches[self.layer_idx]  # rotate q, k and store k, v at once
            fused.rope_store_(positions, q, k, v, rope.cos_cache, rope.sin_cache, k_cache, v_cache,
                              ctx.meta.slot_mapping)
            o = ctx.attend_stored(self.layer_idx, q, self.scale)
        else:
            q, k = rope(positions, q, k)
            o = ctx.attend(self.layer_idx, q, k, v, self.scale)  # [num_tokens, num_heads, head_dim]
        return o.reshape(T, self.q_size)

    def rope_fusable(self, x: torch.Tensor) -> bool:
        """Whether ``forward_fused`` runs qkv as ``gemv_partials`` + ``attend_partials``: on the
        Triton path, with full-width rotary, and where the GEMV splits K anyway (a reduce kernel
        runs either way: RoPE and the K/V store join it, one launch less per layer; the same
        arithmetic bit for bit, 1-2% less GPU time for a Llama-3.2-1B draft's propose graph:
        docs/kernels.md). The 8B target's qkv does not split at 2-32 rows."""
        return (self.rope.cos_cache.shape[-1] == self.head_dim
                and gemv_split(x, self.qkv_proj.weight) > 1)

    def attend_partials(
        self,
        positions: torch.Tensor,  # [num_tokens]
        partials: torch.Tensor,  # [split, num_tokens, q_size + 2 * kv_size] float32 (qkv, no bias)
        ctx: ForwardContext,
    ) -> torch.Tensor:  # [num_tokens, q_size]: attention output, before o_proj
        """``attend_qkv`` on the QKV projection's unreduced split-K partials: the reduce (plus
        bias), RoPE and the K/V cache store in one kernel (``fused.reduce_rope_store_``)."""
        T = partials.shape[1]
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        qkv = fused.reduce_rope_store_(partials, self.qkv_proj.bias, positions,
                                       self.rope.cos_cache, self.rope.sin_cache, k_cache, v_cache,
                                       ctx.meta.slot_mapping, self.num_heads, self.num_kv_heads,
                                       dtype=self.qkv_proj.weight.dtype)
        q = qkv[:, : self.q_size].view(T, self.num_heads, self.head_dim)
        return ctx.attend_stored(self.layer_idx, q, self.scale).reshape(T, self.q_size)


class LlamaMLP(nn.Module):
    """The gated MLP; at ``tp`` size n intermediate_size / n of it, ``down_proj``'s output summed
    over the ranks."""

    def __init__(self, config, tp: TensorParallel = NO_TENSOR_PARALLEL) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.tp = tp
        if config.intermediate_size % tp.size:
            check_llama_tensor_parallel(config, tp.size)
        self.inter = config.intermediate_size // tp.size  # this rank's share
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.inter, bias=bias)
        self.down_proj = nn.Linear(self.inter, config.hidden_size, bias=bias)
        self.act = activation(getattr(config, "hidden_act", "silu"))
        self.fused_act = getattr(config, "hidden_act", "silu") in ("silu", "swish")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, hidden]
        if self.fused_act and fused.enabled(x):
            return all_reduce(self.down_proj(fused.silu_mul(self.gate_up_proj(x))), self.tp)
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return all_reduce(self.down_proj(self.act(gate) * up), self.tp)


def reduce_sum(a: torch.Tensor, tp: TensorParallel, slot: int) -> torch.Tensor:
    """``all_reduce(a)``: as one fused kernel (``slot``: 0 after o_proj, 1 after down_proj) where
    set up (CUDA), else ``all_reduce``. [rows, hidden] -> [rows, hidden]"""
    got = fused_all_reduce(a, slot) if tp.enabled else None
    return got[0] if got is not None else all_reduce(a, tp)


def reduce_add_norm(
    a: torch.Tensor,  # [rows, hidden]: this rank's partial of a row-parallel product
    residual: torch.Tensor,  # [rows, hidden]
    norm: RMSNorm,
    tp: TensorParallel,
    slot: int,  # 0 after o_proj, 1 after down_proj
) -> tuple[torch.Tensor, torch.Tensor]:  # (norm(sum + residual), sum + residual)
    """The all-reduce, residual add and RMSNorm after a row-parallel product: one kernel
    (kernels/tp_allreduce.py) where set up, else ``all_reduce`` + ``fused.rms_norm``."""
    got = fused_all_reduce(a, slot, residual, norm.weight, norm.eps) if tp.enabled else None
    if got is not None:
        return got
    return fused.rms_norm(all_reduce(a, tp), norm.weight, norm.eps, residual=residual)


def mlp_gemv(
    mlp: LlamaMLP,  # SiLU-gated
    norm: RMSNorm,
    a: torch.Tensor,  # [rows, hidden]: the attention output
    residual: torch.Tensor,  # [rows, hidden]: the residual stream before it
) -> tuple[torch.Tensor, torch.Tensor]:  # (MLP output, a + residual)
    """``mlp(norm(a + residual))`` as two GEMVs (kernels/gemv.py): the residual add and RMSNorm
    inside the gate/up product, SiLU * up inside the down product."""
    gu, x = gemv(a, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, prologue="rmsnorm",
                 norm_weight=norm.weight, residual=residual, eps=norm.eps)
    return reduce_sum(gemv(gu, mlp.down_proj.weight, mlp.down_proj.bias, prologue="silu_mul"),
                      mlp.tp, 1), x


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, rope: RotaryEmbedding, qkv_bias: bool,
                 tp: TensorParallel = NO_TENSOR_PARALLEL) -> None:
        super().__init__()
        eps = getattr(config, "rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.self_attn = LlamaAttention(config, layer_idx, rope, qkv_bias, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = LlamaMLP(config, tp)

    def forward(self, positions, x, ctx: ForwardContext) -> torch.Tensor:  # x: [num_tokens, hidden]
        """One layer, residual stream in and out (the target model runs ``forward_fused`` /
        ``forward_gemv`` on CUDA; this serves the CPU and the EAGLE heads' layers)."""
        if fused.enabled(x):  # residual add fused into the second norm
            a = self.self_attn(positions, self.input_layernorm(x), ctx)
            norm, mlp = self.post_attention_layernorm, self.mlp
            if mlp.fused_act and fused.gemv_enabled(a):  # one row: norm and SiLU*up in GEMVs
                out, x = mlp_gemv(mlp, norm, a, x)
                return x + out
            h, x = fused.rms_norm(a, norm.weight, norm.eps, residual=x)
            return x + self.mlp(h)
        x = x + self.self_attn(positions, self.input_layernorm(x), ctx)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(
        self,
        positions: torch.Tensor,  # [num_tokens]
        h: torch.Tensor,  # [num_tokens, hidden]: the previous layer's MLP output (or the input)
        ctx: ForwardContext,
        residual: torch.Tensor | None,  # [num_tokens, hidden]: residual stream before ``h``
        normed: bool = False,  # ``h`` is already this layer's normed input (``residual`` its input)
        next_norm: RMSNorm | None = None,  # the norm after this layer: the next layer's, or final
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:  # (out, residual stream before it, out normed)
        """The CUDA path of ``forward`` with the residual stream carried to the next layer: both
        residual adds happen inside the RMSNorm kernels (``fused.rms_norm(residual=)``), so a
        layer has no separate add kernel (same additions, same order and rounding).

        Up to ``fused.GEMV_IN_ROWS`` rows qkv and gate/up are GEMVs (kernels/gemv.py) instead of
        cuBLAS. Up to ``fused.GEMV_FEW_ROWS`` rows, o_proj and down_proj (with SiLU * up) are GEMVs whose
        split-K reduction also does the residual add and the RMSNorm that follows
        (kernels/gemv.py ``out_norm_weight``): o_proj's the post-attention norm, down_proj's
        ``next_norm``. The layer then returns ``next_norm``'s output (``normed`` True) and the
        next layer starts from it. Bit-identical to the separate kernels; two kernels fewer per
        layer. Under tensor parallelism the norm needs the sum over the ranks, so those two
        products stay plain GEMVs; the sum, the residual add and the norm then run as one kernel
        (``fused_all_reduce``, kernels/tp_allreduce.py: slot 0 after o_proj, 1 after down_proj,
        so its two buffers alternate) where it is set up and the step fits it, else
        ``all_reduce`` and the RMSNorm kernel."""
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        attn, mlp = self.self_attn, self.mlp
        if normed:
            x = h
        elif residual is None:
            x, residual = fused.rms_norm(h, ln1.weight, ln1.eps), h
        else:
            x, residual = fused.rms_norm(h, ln1.weight, ln1.eps, residual=residual)
        few = fused.gemv_few_enabled(x)  # o_proj / down_proj as few-row GEMVs
        tp = attn.tp
        few_in = fused.gemv_in_enabled(x)  # qkv and gate/up as GEMVs
        if few_in and attn.rope_fusable(x):  # qkv's split-K reduce does RoPE and the K/V store
            o = attn.attend_partials(positions, gemv_partials(x, attn.qkv_proj.weight), ctx)
        else:
            qkv = gemv(x, attn.qkv_proj.weight, attn.qkv_proj.bias) if few_in else attn.qkv_proj(x)
            o = attn.attend_qkv(positions, qkv, ctx)  # [num_tokens, q_size]
        if few and not tp.enabled:
            x, residual = gemv(o, attn.o_proj.weight, attn.o_proj.bias, out_norm_weight=ln2.weight,
                               out_residual=residual, out_eps=ln2.eps)
        else:
            got = (fused_gemv_all_reduce(o, attn.o_proj.weight, attn.o_proj.bias, "none",
                                         residual, ln2.weight, ln2.eps) if few and tp.enabled
                   else None)
            if got is not None:  # the GEMV's programs start the all-reduce
                x, residual = got
            else:
                a = gemv(o, attn.o_proj.weight, attn.o_proj.bias) if few else attn.o_proj(o)
                x, residual = reduce_add_norm(a, residual, ln2, tp, 0)
        if mlp.fused_act and (few or few_in):
            gu = (gemv(x, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias) if few_in
                  else mlp.gate_up_proj(x))  # [num_tokens, 2 * inter]
            wd, bd = mlp.down_proj.weight, mlp.down_proj.bias
            if not few or few_rows_silu_mul_slower(gu.shape[0], wd.shape[0]):
                d = mlp.down_proj(fused.silu_mul(gu))  # [num_tokens, hidden]
            else:
                if next_norm is not None and not tp.enabled:
                    x, residual = gemv(gu, wd, bd, prologue="silu_mul",
                                       out_norm_weight=next_norm.weight, out_residual=residual,
                                       out_eps=next_norm.eps)
                    return x, residual, True
                if next_norm is not None:  # the GEMV's programs start the all-reduce
                    got = fused_gemv_all_reduce(gu, wd, bd, "silu_mul", residual,
                                                next_norm.weight, next_norm.eps)
                    if got is not None:
                        return got[0], got[1], True
                d = gemv(gu, wd, bd, prologue="silu_mul")
        elif tp.enabled and mlp.fused_act:
            d = mlp.down_proj(fused.silu_mul(mlp.gate_up_proj(x)))  # [num_tokens, hidden]: partial
        else:
            return mlp(x), residual, False
        if not tp.enabled:
            return d, residual, False
        if next_norm is not None:  # the all-reduce, residual add and next norm in one kernel
            got = fused_all_reduce(d, 1, residual, next_norm.weight, next_norm.eps)
            if got is not None:
                return got[0], got[1], True
        return all_reduce(d, tp), residual, False

    def forward_gemv(
        self,
        positions: torch.Tensor,  # [num_tokens]
        h: torch.Tensor,  # [num_tokens, hidden]: the previous layer's MLP output (or the input)
        ctx: ForwardContext,
        residual: torch.Tensor | None,  # [num_tokens, hidden]: residual stream before ``h``
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (MLP output, residual stream before it)
        """The one-row CUDA path (``fused.GEMV_MAX_ROWS``): 4 GEMVs with fused prologues
        (kernels/gemv.py) around attention. The layer input is ``h + residual``, summed inside
        the QKV product's RMSNorm. Same arithmetic as ``forward`` up to the products' summation
        order."""
        attn, mlp = self.self_attn, self.mlp
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        qkv_w, qkv_b = attn.qkv_proj.weight, attn.qkv_proj.bias
        if residual is None:
            qkv, residual = gemv(h, qkv_w, qkv_b, prologue="rmsnorm", norm_weight=ln1.weight,
                                 eps=ln1.eps), h
        else:
            qkv, residual = gemv(h, qkv_w, qkv_b, prologue="rmsnorm", norm_weight=ln1.weight,
                                 residual=residual, eps=ln1.eps)
        o = gemv(attn.attend_qkv(positions, qkv, ctx), attn.o_proj.weight, attn.o_proj.bias)
        return mlp_gemv(mlp, ln2, reduce_sum(o, attn.tp, 0), residual)


class LlamaForCausalLM(nn.Module):
    """Also serves Mistral and Qwen2 (``qkv_bias``). ``tp``: the tensor-parallel rank this
    model is the shard of (default: the current ``speculant.distributed.tensor_parallel()``)."""

    # packed parameter: HF names it is made of, in order
    packed = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }

    def __init__(self, config, max_positions: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.config = config
        self.max_positions = max_positions  # sizes CUDA-graph block tables
        self.tp = tp = tensor_parallel() if tp is None else tp
        check_llama_tensor_parallel(config, tp.size)
        qkv_bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        rope = RotaryEmbedding(config, head_dim, max_positions)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, rope, qkv_bias, tp) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, getattr(config, "rms_norm_eps", 1e-6))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = rope
        # the one-row GEMV path (``forward_gemv``) fuses SiLU * up: SiLU-gated MLPs only. Under
        # tensor parallelism one-row steps take ``forward_fused`` instead, whose o_proj / down
        # products end in the fused all-reduce + residual + RMSNorm kernel: measured on 4 H200s,
        # 70B geometry TP 4 batch 1 70.8 -> 78.3 tok/s, 8B TP 2 310.5 -> 318.5
        # (docs/tensor_parallel.md)
        self.gemv_ok = getattr(config, "hidden_act", "silu") in ("silu", "swish") and not tp.enabled
        self._cpu_plan: cpu_forward.CpuPlan | bool | None = None  # built at the first CPU forward

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    def kv_cache_shape(self) -> tuple[int, int]:
        """(num_kv_heads, head_dim) of every layer."""
        a = self.layers[0].self_attn
        return a.num_kv_heads, a.head_dim

    def embed(
        self, input_ids: torch.Tensor
    ) -> torch.Tensor:  # [num_tokens] -> [num_tokens, hidden]
        return gather_rows(self.embed_tokens.weight, input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        ctx: ForwardContext,
        inputs_embeds: torch.Tensor | None = None,  # [num_tokens, hidden]
    ) -> torch.Tensor:  # [num_tokens, hidden]: final-norm output (the LM head's input)
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        if x.device.type == "cpu" and x.dtype == torch.float32 and not torch.is_grad_enabled():
            if self._cpu_plan is None:
                self._cpu_plan = cpu_forward.cpu_plan(self) or False
            if self._cpu_plan:
                return cpu_forward.forward(self._cpu_plan, x, positions, ctx)
        if self.gemv_ok and fused.gemv_enabled(x):
            return self._forward_residual(positions, x, ctx, gemv=True)
        if fused.enabled(x):
            return self._forward_residual(positions, x, ctx, gemv=False)
        for i, layer in enumerate(self.layers):
            ctx.begin_layer(i)
            if i in ctx.aux_layers:
                ctx.aux_hidden.append(x)  # input of layer i == output of layer i-1
            x = layer(positions, x, ctx)
        return self.norm(x)

    def _forward_residual(self, positions, x, ctx: ForwardContext, gemv: bool) -> torch.Tensor:
        """CUDA layers that carry the residual stream (``forward_gemv`` / ``forward_fused``)."""
        h, residual, normed = x, None, False
        layers = self.layers
        for i, layer in enumerate(layers):
            ctx.begin_layer(i)
            if i in ctx.aux_layers:
                if normed:  # h is layer i's normed input, residual its input
                    ctx.aux_hidden.append(residual)
                else:
                    if residual is not None:
                        h, residual = h + residual, None
                    ctx.aux_hidden.append(h)  # input of layer i
            if gemv:
                h, residual = layer.forward_gemv(positions, h, ctx, residual)
            else:
                nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.norm
                h, residual, normed = layer.forward_fused(positions, h, ctx, residual, normed, nxt)
        if normed:  # the last layer's down_proj did the final norm
            return h
        if residual is None:  # no layers
            return fused.rms_norm(h, self.norm.weight, self.norm.eps)
        return fused.rms_norm(h, self.norm.weight, self.norm.eps, residual=residual)[0]

    def _head_gemv(self, hidden: torch.Tensor) -> bool:
        # one row, or a verification step's rows (H100: 343-355 vs cuBLAS 373-379 us, 6-32 rows)
        return fused.gemv_enabled(hidden) or (hidden.shape[0] >= 3 and fused.gemv_in_enabled(hidden))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [num_rows, hidden] -> [num_rows, vocab] float32
        if self._head_gemv(hidden):
            return gemv(hidden, self.lm_head.weight).float()
        return self.lm_head(hidden).float()

    @property
    def vocab_parallel(self) -> bool:
        """Whether :meth:`compute_logits_parallel` splits the LM head here: tensor parallelism
        with a vocabulary the size divides."""
        return self.tp.enabled and self.config.vocab_size % self.tp.size == 0

    def compute_logits_parallel(self, hidden: torch.Tensor) -> torch.Tensor:
        """``compute_logits`` with the LM head split by vocabulary rows: each rank multiplies
        its ``vocab / size`` rows of the (replicated) head, and the shards are all-gathered.
        Collective: every rank calls it with the same shape (a CUDA graph's head). The GEMV
        runs each shard with the launch configuration of the whole head, so every logit has
        the bits ``compute_logits`` gives; row counts that take cuBLAS instead (2 rows, more
        than ``fused.GEMV_IN_ROWS``) compute the whole head on every rank (no collective).
        hidden: [num_rows, hidden] -> [num_rows, vocab] float32"""
        if not (self.vocab_parallel and self._head_gemv(hidden)):
            return self.compute_logits(hidden)
        w = self.lm_head.weight  # [vocab, hidden]
        n = w.shape[0] // self.tp.size
        cfg = choose_config(hidden.shape[0], w.shape[0], w.shape[1], "none", hidden.device)
        local = gemv(hidden, w[self.tp.rank * n : (self.tp.rank + 1) * n], config=cfg)
        return all_gather_columns(local, self.tp).float()  # [num_rows, vocab]

    def weight_shard(self, name: str, part: str | None) -> WeightShard | None:
        """This rank's part of the checkpoint tensor that loads into parameter ``name`` (its
        ``part`` of a packed one): None (whole) at size 1 and for the embedding, norms, LM head."""
        tp = self.tp
        fields = name.split(".")
        if not tp.enabled or fields[0] != "layers" or len(fields) != 5:
            return None
        layer, proj, kind = self.layers[int(fields[1])], fields[3], fields[4]
        a, r = layer.self_attn, tp.rank
        d = a.head_dim
        if proj == "qkv_proj":
            if part == "q_proj":
                return WeightShard(0, r * a.q_size, (r + 1) * a.q_size, a.total_heads * d)
            if part in ("k_proj", "v_proj"):
                start = a.kv_head_start * d
                return WeightShard(0, start, start + a.kv_size, a.total_kv_heads * d)
            raise WeightLoadError(
                f"{name}: a packed qkv tensor cannot be split over {tp.size} ranks; save "
                "q_proj, k_proj and v_proj separately (the Hugging Face layout)")
        if proj == "gate_up_proj":
            if part is None:
                raise WeightLoadError(
                    f"{name}: a packed gate/up tensor cannot be split over {tp.size} ranks; "
                    "save gate_proj and up_proj separately (the Hugging Face layout)")
            inter = layer.mlp.inter
            return WeightShard(0, r * inter, (r + 1) * inter, inter * tp.size)
        if proj in ("o_proj", "down_proj"):  # row-parallel: input columns; bias on rank 0
            if kind == "bias":
                return None if r == 0 else WeightShard(zeros=True)
            width = a.q_size if proj == "o_proj" else layer.mlp.inter
            return WeightShard(1, r * width, (r + 1) * width, width * tp.size)
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
        loader = WeightLoader(self, source, packed=self.packed, shard=self.weight_shard)
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            loader.load(name, tensor)
        loader.finish(optional=("lm_head.weight",) if self.tie_word_embeddings else ())
