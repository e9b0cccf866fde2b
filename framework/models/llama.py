"""Llama family (Llama 2/3, Mistral, SmolLM, TinyLlama, Vicuna, CodeLlama) and Qwen2 (qkv bias).

Fused QKV and gate/up projections; loads the Hugging Face key names
(``model.layers.{i}.self_attn.q_proj.weight`` ...).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from speculant.engine.attention import ForwardContext
from speculant.models import cpu_forward, fused
from speculant.models.layers import RMSNorm, RotaryEmbedding, activation
from speculant.models.weights import WeightLoader


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx: int, rope: RotaryEmbedding, qkv_bias: bool) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
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
            return self.o_proj(o.reshape(T, self.q_size))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        q, k = self.rope(positions, q, k)
        o = ctx.attend(self.layer_idx, q, k, v, self.scale)  # [num_tokens, num_heads, head_dim]
        return self.o_proj(o.reshape(T, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.inter = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.inter, bias=bias)
        self.down_proj = nn.Linear(self.inter, config.hidden_size, bias=bias)
        self.act = activation(getattr(config, "hidden_act", "silu"))
        self.fused_act = getattr(config, "hidden_act", "silu") in ("silu", "swish")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, hidden]
        if self.fused_act and fused.enabled(x):
            return self.down_proj(fused.silu_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(self.act(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, rope: RotaryEmbedding, qkv_bias: bool) -> None:
        super().__init__()
        eps = getattr(config, "rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.self_attn = LlamaAttention(config, layer_idx, rope, qkv_bias)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = LlamaMLP(config)

    def forward(self, positions, x, ctx: ForwardContext) -> torch.Tensor:  # x: [num_tokens, hidden]
        if fused.enabled(x):  # residual add fused into the second norm
            a = self.self_attn(positions, self.input_layernorm(x), ctx)
            norm = self.post_attention_layernorm
            h, x = fused.rms_norm(a, norm.weight, norm.eps, residual=x)
            return x + self.mlp(h)
        x = x + self.self_attn(positions, self.input_layernorm(x), ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """Also serves Mistral and Qwen2 (``qkv_bias``)."""

    # packed parameter: HF names it is made of, in order
    packed = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }

    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.max_positions = max_positions  # sizes CUDA-graph block tables
        qkv_bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        rope = RotaryEmbedding(config, head_dim, max_positions)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, rope, qkv_bias) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, getattr(config, "rms_norm_eps", 1e-6))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = rope
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
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        ctx: ForwardContext,
        inputs_embeds: torch.Tensor | None = None,  # [num_tokens, hidden]
    ) -> torch.Tensor:  # [num_tokens, hidden]: final-norm output (the LM head's input)
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if x.device.type == "cpu" and x.dtype == torch.float32 and not torch.is_grad_enabled():
            if self._cpu_plan is None:
                self._cpu_plan = cpu_forward.cpu_plan(self) or False
            if self._cpu_plan:
                return cpu_forward.forward(self._cpu_plan, x, positions, ctx)
        for i, layer in enumerate(self.layers):
            if i in ctx.aux_layers:
                ctx.aux_hidden.append(x)  # input of layer i == output of layer i-1
            x = layer(positions, x, ctx)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [num_rows, hidden] -> [num_rows, vocab] float32
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
        loader = WeightLoader(self, source, packed=self.packed)
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            loader.load(name, tensor)
        loader.finish(optional=("lm_head.weight",) if self.tie_word_embeddings else ())
