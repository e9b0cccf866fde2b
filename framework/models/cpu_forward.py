"""The CPU fp32 forward of the Llama family as one flat loop.

A one-token decode step of a small model on the CPU is bound by the weights' read (the GEMVs) plus
a few microseconds of dispatch per torch op, which at ~60 ops x 30 layers used to cost as much as
the reads themselves. This loop runs the same arithmetic as the module path (``LlamaDecoderLayer``)
with no module calls, plain references to every layer's tensors, one gather of the RoPE rows and
one set of KV-cache views per forward (``attention.cpu_kv_views``), CPU-specific fused steps
(``rms_norm_cpu``, ``rope_cpu``) and GEMVs straight into numpy's BLAS (``CpuLinear.rows``).
One new token of one sequence (a plain decode step) goes further: ``_forward_one`` runs the
whole stack in numpy on views of the same weights and cache, because on a [1, hidden] row a numpy
ufunc dispatches in ~1.5 us where a torch op takes ~3 us, and the GEMVs are numpy's anyway. Same
arithmetic, in float32; sums and exp may round differently in the last bit (as between BLAS
libraries), which the HF greedy-equality tests cover.

Models it does not cover (nn.Linear not prepared for the CPU, partial rotary, other activations,
replaced submodules) return None from ``cpu_plan`` and keep the module path.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from speculant.engine.attention import ForwardContext, attention_cpu, cpu_kv_views
from speculant.models.layers import CpuLinear, RMSNorm, numpy_blas, rms_norm_cpu, rope_cpu


class CpuPlan:
    """Per-layer references for ``forward``, built once from a loaded model."""

    def __init__(self, model) -> None:
        a = model.layers[0].self_attn
        self.nh, self.nkv, self.d = a.num_heads, a.num_kv_heads, a.head_dim
        self.scale = a.scale
        self.rope = model.rope
        self.norm = (model.norm.weight, model.norm.eps)
        self.layers = [
            (
                layer.input_layernorm.weight, layer.input_layernorm.eps,
                layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps,
                layer.mlp.gate_up_proj, layer.mlp.down_proj, layer.mlp.inter,
            )
            for layer in model.layers
        ]
        lins = [lin for t in self.layers for lin in t[2:4] + t[6:8]]
        self.numpy = any(lin.np_wt is not None for lin in lins)
        self.np_layers = None  # numpy views of every layer's tensors, for _forward_one
        if all(lin.np_wt is not None for lin in lins):
            f32 = np.float32

            def arr(t):
                return None if t is None else t.detach().numpy()

            self.np_layers = [
                (arr(w1), f32(e1), q.np_wt, arr(q.b), o.np_wt, arr(o.b), arr(w2), f32(e2),
                 gu.np_wt, arr(gu.b), dn.np_wt, arr(dn.b), inter)
                for w1, e1, q, o, w2, e2, gu, dn, inter in self.layers
            ]
            self.np_norm = (arr(model.norm.weight), f32(model.norm.eps))
            nqk, half = self.nh + self.nkv, self.d // 2
            swap = np.r_[half : self.d, 0:half]  # one head's halves swapped
            self.np_perm = (np.arange(nqk)[:, None] * self.d + swap).reshape(-1)  # [qk_size]
            # a power-of-two scale (head_dim 64: 1/8) commutes exactly with rounding, so it is
            # folded into the q part of the RoPE tables instead of scaling the scores
            exact = math.frexp(self.scale)[0] == 0.5
            self.np_scale = None if exact else f32(self.scale)
            self._q_scale = f32(self.scale if exact else 1.0)

    def np_rope(self, pos: int) -> tuple[np.ndarray, np.ndarray]:
        """cos and signed sin of ``pos`` tiled over the q and k heads [qk_size] each, the q part
        times the attention scale when that is exact."""
        nqk, q_size = self.nh + self.nkv, self.nh * self.d
        cs = np.tile(np.stack((self.rope.cos_cache[pos].numpy(),
                               self.rope.cpu_sin_signed()[pos].numpy())), nqk)  # [2, qk_size]
        cs[:, :q_size] *= self._q_scale
        return cs[0], cs[1]


def cpu_plan(model) -> CpuPlan | None:
    """A plan if every layer is the standard pre-norm Llama block on fp32 CPU Linears."""
    rope = model.rope
    if rope.cos_cache.device.type != "cpu" or rope.cos_cache.shape[-1] != rope.head_dim:
        return None
    if type(model.norm) is not RMSNorm:
        return None
    for layer in model.layers:
        a, m = layer.self_attn, layer.mlp
        lins = (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)
        if (
            type(layer.input_layernorm) is not RMSNorm
            or type(layer.post_attention_layernorm) is not RMSNorm
            or not m.fused_act
            or a.rope is not rope
            or not all(type(lin) is CpuLinear and lin.w is not None for lin in lins)
            or any(lin.w.dtype != torch.float32 for lin in lins)
        ):
            return None
    return CpuPlan(model)


def forward(
    plan: CpuPlan,
    x: torch.Tensor,  # [num_tokens, hidden]: the embeddings
    positions: torch.Tensor,  # [num_tokens]
    ctx: ForwardContext,
) -> torch.Tensor:  # [num_tokens, hidden]: final-norm output
    T = x.shape[0]
    meta = ctx.meta
    if (
        T == 1
        and plan.np_layers is not None
        and ctx.kv_cache is not None
        and not ctx.aux_layers
        and meta.seq_starts is not None
        and meta.seq_starts[0] >= 0
    ):
        numpy_blas().sync_threads()
        return _forward_one(plan, x, ctx.kv_cache, meta.seq_starts[0], meta.context_lens_list[0])
    nh, nkv, d, scale = plan.nh, plan.nkv, plan.d, plan.scale
    nqk, qk_size, q_size = nh + nkv, (nh + nkv) * d, nh * d
    cos, sin = plan.rope.cpu_tables(positions)  # [T, 1, d] each
    views = cpu_kv_views(ctx.kv_cache, ctx.meta) if ctx.kv_cache is not None else None
    if plan.numpy:
        numpy_blas().sync_threads()
    aux = ctx.aux_layers
    for i, (w1, eps1, qkv_proj, o_proj, w2, eps2, gate_up, down, inter) in enumerate(plan.layers):
        if aux and i in aux:
            ctx.aux_hidden.append(x)  # input of layer i == output of layer i-1
        qkv = qkv_proj.rows(rms_norm_cpu(x, w1, eps1))  # [T, (nh + 2 nkv) d]
        qk = rope_cpu(qkv[:, :qk_size].view(T, nqk, d), cos, sin)  # [T, nh + nkv, d]
        q, k = qk[:, :nh], qk[:, nh:]  # [T, nh, d], [T, nkv, d]
        v = qkv[:, qk_size:].view(T, nkv, d)  # [T, nkv, d]
        if views is not None:
            o = attention_cpu(q, k, v, views[i], scale)  # [T, nh d]
        else:
            o = ctx.attend(i, q, k, v, scale).reshape(T, q_size)
        x = x + o_proj.rows(o)
        gu = gate_up.rows(rms_norm_cpu(x, w2, eps2)).view(T, 2, inter)  # [T, 2, inter]
        gate, up = gu.unbind(1)  # [T, inter] each
        x = x + down.rows(F.silu(gate).mul_(up))
    return rms_norm_cpu(x, *plan.norm)


def _forward_one(
    plan: CpuPlan,
    x: torch.Tensor,  # [1, hidden]: the embedding of the one new token
    kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, nkv, d]
    start: int,  # the sequence's first cache slot (its blocks are consecutive)
    ctx_len: int,  # cached tokens after this step (the new token at position ctx_len - 1)
) -> torch.Tensor:  # [1, hidden]: final-norm output
    """Every vector is 1-D and every per-layer view is made before the loop: after each GEMV has
    streamed megabytes through the caches, an op costs ~10 us, so the loop keeps ~40 of them."""
    nh, nkv, d = plan.nh, plan.nkv, plan.d
    q_size, qk_size, g = nh * d, (nh + nkv) * d, nh // nkv
    pos = ctx_len - 1
    cos, sin = plan.np_rope(pos)  # [qk_size] each, the q part pre-scaled if exact
    L, _, nb, bs = kv_cache.shape[:4]
    flat = kv_cache.numpy().reshape(L, 2, nb * bs, nkv * d)  # a view
    k_new = list(flat[:, 0, start + pos])  # L x [nkv d]: where this token's K/V go
    v_new = list(flat[:, 1, start + pos])
    k_ctx = list(flat[:, 0, start : start + ctx_len].reshape(L, ctx_len, nkv, d).transpose(0, 2, 3, 1))
    v_ctx = list(flat[:, 1, start : start + ctx_len].reshape(L, ctx_len, nkv, d).transpose(0, 2, 1, 3))
    perm, scale = plan.np_perm, plan.np_scale  # scale None: folded into the q part of cos/sin
    x = x.numpy()[0]  # [hidden]
    for (w1, e1, wqkv, bqkv, wo, bo, w2, e2, wgu, bgu, wd, bd, inter), kn, vn, kc, vc in zip(
        plan.np_layers, k_new, v_new, k_ctx, v_ctx
    ):
        qkv = _rms(x, w1, e1) @ wqkv  # [(nh + 2 nkv) d]
        if bqkv is not None:
            qkv += bqkv
        rot = qkv.take(perm)  # [qk_size]: each q/k head with its halves swapped
        rot *= sin
        rot += qkv[:qk_size] * cos  # RoPE: x * cos + rotate_half(x) * sin
        kn[:] = rot[q_size:]
        vn[:] = qkv[qk_size:]
        s = np.matmul(rot[:q_size].reshape(nkv, g, d), kc)  # [nkv, g, ctx_len]
        if scale is not None:
            s *= scale
        s -= s.max(-1, keepdims=True)
        np.exp(s, out=s)
        s /= s.sum(-1, keepdims=True)
        o = np.matmul(s, vc).reshape(q_size) @ wo  # [hidden]
        if bo is not None:
            o += bo
        x = x + o
        gu = _rms(x, w2, e2) @ wgu  # [2 inter]
        if bgu is not None:
            gu += bgu
        gate = gu[:inter]
        act = np.exp(-gate)
        act += 1.0
        np.divide(gate, act, out=act)  # silu(gate) = gate / (1 + exp(-gate))
        act *= gu[inter:]
        o = act @ wd  # [hidden]
        if bd is not None:
            o += bd
        x = x + o
    return torch.from_numpy(_rms(x, *plan.np_norm)[None])


def _rms(x: np.ndarray, w: np.ndarray, eps: np.float32) -> np.ndarray:  # x: [hidden]
    """weight * (x * rsqrt(mean(x^2) + eps)) of one row, float32 throughout."""
    h = x * (np.float32(1.0) / np.sqrt(np.dot(x, x) / np.float32(x.shape[0]) + eps))
    h *= w
    return h
