"""OPT (facebook/opt-*): learned positions (offset 2), LayerNorm, ReLU MLP, biases everywhere.

Tensor parallelism as in llama.py: at size n each rank holds num_attention_heads / n heads (q, k
and v packed per rank) and ffn_dim / n of fc1 (column-parallel); out_proj and fc2 take the
matching input columns (row-parallel, their biases added by rank 0 only) and their outputs are
summed over the ranks. Embeddings, LayerNorms, projections and the LM head are whole on every
rank."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from speculant.distributed import NO_TENSOR_PARALLEL, TensorParallel, all_reduce, tensor_parallel
from speculant.models.attention import ForwardContext
from speculant.models.gather import gather_rows
from speculant.models.layers import activation, check_tensor_parallel
from speculant.models.weights import WeightLoader, WeightLoadError, WeightShard

_POS_OFFSET = 2  # OPT's learned position table starts at index 2


def check_opt_tensor_parallel(config, size: int) -> None:
    """Raise ValueError when ``size`` ranks cannot split this OPT config."""
    check_tensor_parallel("opt", size, None, {"num_attention_heads": config.num_attention_heads,
                                              "ffn_dim": config.ffn_dim})


class OPTAttention(nn.Module):
    def __init__(self, config, layer_idx: int, tp: TensorParallel = NO_TENSOR_PARALLEL) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.tp = tp
        self.num_heads = config.num_attention_heads // tp.size  # this rank's heads
        self.num_kv_heads = self.num_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.q_size = self.kv_size = self.num_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        bias = bool(getattr(config, "enable_bias", True))
        self.qkv_proj = nn.Linear(config.hidden_size, 3 * self.q_size, bias=bias)
        self.out_proj = nn.Linear(self.q_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:  # [num_tokens, hidden]
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        o = ctx.attend(
            self.layer_idx,
            q.reshape(T, self.num_heads, self.head_dim),
            k.reshape(T, self.num_heads, self.head_dim),
            v.reshape(T, self.num_heads, self.head_dim),
            self.scale,
        )
        return all_reduce(self.out_proj(o.reshape(T, -1)), self.tp)


class OPTDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, tp: TensorParallel = NO_TENSOR_PARALLEL) -> None:
        super().__init__()
        self.tp = tp
        bias = bool(getattr(config, "enable_bias", True))
        affine = bool(getattr(config, "layer_norm_elementwise_affine", True))
        self.pre_norm = bool(getattr(config, "do_layer_norm_before", True))
        self.self_attn = OPTAttention(config, layer_idx, tp)
        self.self_attn_layer_norm = nn.LayerNorm(config.hidden_size, elementwise_affine=affine)
        self.ffn = config.ffn_dim // tp.size  # this rank's share
        self.fc1 = nn.Linear(config.hidden_size, self.ffn, bias=bias)
        self.fc2 = nn.Linear(self.ffn, config.hidden_size, bias=bias)
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, elementwise_affine=affine)
        self.act = activation(getattr(config, "activation_function", "relu"))

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = self.self_attn_layer_norm(x) if self.pre_norm else x
        x = x + self.self_attn(h, ctx)
        if not self.pre_norm:
            x = self.self_attn_layer_norm(x)
        h = self.final_layer_norm(x) if self.pre_norm else x
        x = x + all_reduce(self.fc2(self.act(self.fc1(h))), self.tp)
        if not self.pre_norm:
            x = self.final_layer_norm(x)
        return x


class OPTForCausalLM(nn.Module):
    """``tp``: the tensor-parallel rank this model is the shard of (default: the current
    ``speculant.distributed.tensor_parallel()``)."""

    packed = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}

    def __init__(self, config, max_positions: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.config = config
        self.max_positions = max_positions  # sizes CUDA-graph block tables
        self.tp = tp = tensor_parallel() if tp is None else tp
        check_opt_tensor_parallel(config, tp.size)
        proj = config.word_embed_proj_dim
        self.embed_tokens = nn.Embedding(config.vocab_size, proj)
        self.embed_positions = nn.Embedding(config.max_position_embeddings + _POS_OFFSET, config.hidden_size)
        self.project_in = nn.Linear(proj, config.hidden_size, bias=False) if proj != config.hidden_size else None
        self.project_out = nn.Linear(config.hidden_size, proj, bias=False) if proj != config.hidden_size else None
        affine = bool(getattr(config, "layer_norm_elementwise_affine", True))
        self.final_layer_norm = (
            nn.LayerNorm(config.hidden_size, elementwise_affine=affine)
            if getattr(config, "do_layer_norm_before", True) and not getattr(config, "_remove_final_layer_norm", False)
            else None
        )
        self.layers = nn.ModuleList(
            OPTDecoderLayer(config, i, tp) for i in range(config.num_hidden_layers))
        self.lm_head = nn.Linear(proj, config.vocab_size, bias=False)
        self.lm_head.weight = self.embed_tokens.weight  # OPT ties the LM head
        self.tie_word_embeddings = True

    @property
    def hidden_size(self) -> int:
        return self.config.word_embed_proj_dim

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    def kv_cache_shape(self) -> tuple[int, int]:
        a = self.layers[0].self_attn
        return a.num_kv_heads, a.head_dim

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return gather_rows(self.embed_tokens.weight, input_ids)

    def forward(self, input_ids, positions, ctx: ForwardContext, inputs_embeds=None) -> torch.Tensor:
        # input_ids, positions: [num_tokens] -> [num_tokens, word_embed_proj_dim]
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        if self.project_in is not None:
            x = self.project_in(x)
        x = x + self.embed_positions(positions + _POS_OFFSET)
        for i, layer in enumerate(self.layers):
            ctx.begin_layer(i)
            if i in ctx.aux_layers:
                ctx.aux_hidden.append(x)
            x = layer(x, ctx)
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # [num_rows, vocab]

    def weight_shard(self, name: str, part: str | None) -> WeightShard | None:
        """This rank's part of the checkpoint tensor that loads into parameter ``name`` (its
        ``part`` of the packed qkv): None (whole) at size 1 and outside the decoder layers'
        attention and fc1 / fc2."""
        tp = self.tp
        fields = name.split(".")
        if not tp.enabled or fields[0] != "layers" or len(fields) < 4:
            return None
        layer, kind, r = self.layers[int(fields[1])], fields[-1], tp.rank
        proj = fields[-2]
        q = layer.self_attn.q_size
        if proj == "qkv_proj":
            if part is None:
                raise WeightLoadError(
                    f"{name}: a packed qkv tensor cannot be split over {tp.size} ranks; save "
                    "q_proj, k_proj and v_proj separately (the Hugging Face layout)")
            return WeightShard(0, r * q, (r + 1) * q, q * tp.size)
        if proj == "fc1":
            return WeightShard(0, r * layer.ffn, (r + 1) * layer.ffn, layer.ffn * tp.size)
        if proj in ("out_proj", "fc2"):  # row-parallel: input columns; bias on rank 0
            if kind == "bias":
                return None if r == 0 else WeightShard(zeros=True)
            width = q if proj == "out_proj" else layer.ffn
            return WeightShard(1, r * width, (r + 1) * width, width * tp.size)
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
        loader = WeightLoader(self, source, packed=self.packed, shard=self.weight_shard)
        for name, tensor in weights:
            name = name.removeprefix("model.").removeprefix("decoder.")
            if name == "lm_head.weight":
                continue  # tied to embed_tokens
            loader.load(name, tensor)
        loader.finish(optional=("lm_head.weight",))
