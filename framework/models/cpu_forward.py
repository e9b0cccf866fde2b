"""The CPU fp32 forward of the Llama family as one flat loop.

A one-token decode step of a small model on the CPU is bound by the weights' read (the GEMVs) plus
a few microseconds of dispatch per torch op, which at ~60 ops x 30 layers used to cost as much as
the reads themselves. This loop runs the same arithmetic as the module path (``LlamaDecoderLayer``)
with no module calls, plain references to every layer's tensors, one gather of the RoPE rows and
one set of KV-cache views per forward (``attention.cpu_kv_views``), CPU-specific fused steps
(``rms_norm_cpu``, ``rope_cpu``) and products straight into our C kernel or numpy's BLAS
(``CpuLinear.rows``).
With the C kernels built (the default), every forward with a KV cache goes further:
``_forward_flat`` runs the whole stack in numpy on views of the same weights and cache, because on
a [1, hidden] row a numpy ufunc dispatches in ~1.5 us where a torch op takes ~3 us (products:
``CpuLinear.np_matvec``), and every step in it is batch-invariant: a sequence's rows get bit for
bit the same logits alone or within any batch, for a decode step, a k+1 verification pass or a
prefill (tests/test_batch_invariance.py). Without the C kernels it runs one sequence's forwards of
up to ``CPU_FEW_ROWS`` new tokens (numpy's BLAS); other forwards run the flat torch loop
(``forward``), the same arithmetic up to summation order (as between BLAS libraries), which the
HF greedy-equality tests cover.

Models it does not cover (nn.Linear not prepared for the CPU, partial rotary, other activations,
replaced submodules) return None from ``cpu_plan`` and keep the module path.

A tensor-parallel shard (``model.tp`` of size > 1) runs the same loops on its heads and MLP
share, summing o_proj's and down_proj's outputs over the ranks (gloo, ``all_reduce``) before
each residual add; the sum is per element, so the forward stays batch-invariant.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from speculant.distributed import NO_TENSOR_PARALLEL, TensorParallel, all_reduce
from speculant.models import cpu_kernels
from speculant.models.attention import (
    CPU_FEW_ROWS,
    ForwardContext,
    attention_cpu,
    cpu_kv_views,
)
from speculant.models.layers import CpuLinear, RMSNorm, numpy_blas, rms_norm_cpu, rope_cpu


class CpuPlan:
    """Per-layer references for ``forward``, built once from a loaded model."""

    def __init__(self, model) -> None:
        a = model.layers[0].self_attn
        self.nh, self.nkv, self.d = a.num_heads, a.num_kv_heads, a.head_dim  # this rank's heads
        self.tp: TensorParallel = getattr(model, "tp", NO_TENSOR_PARALLEL)
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
        self.numpy = any(lin.np_wt is not None for lin in lins)  # numpy's BLAS in use
        self.np_layers = None  # numpy views / products of every layer, for _forward_flat
        self._rope_np = None  # numpy views of the RoPE cos / signed sin tables
        mvs = [lin.np_matvec() for lin in lins]
        # our C kernels for attention and RMSNorm too when the products run on them
        self.kernels = cpu_kernels if all(lin.wb is not None for lin in lins) else None
        if all(mv is not None for mv in mvs):
            f32 = np.float32

            def arr(t):
                return None if t is None else t.detach().numpy()

            mv = iter(mvs)
            self.np_layers = [
                (arr(w1), f32(e1), next(mv), next(mv), arr(w2), f32(e2), next(mv), next(mv), inter)
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

    def np_rope_rows(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos and signed sin of each position in ``pos`` [T] tiled over the q and k heads
        [T, qk_size] each, the q part times the attention scale when that is exact: each row the
        same values whatever the other positions."""
        rope = self.rope
        if self._rope_np is None or self._rope_np[0] is not rope.cos_cache:  # (re)set tables
            self._rope_np = (rope.cos_cache, rope.cos_cache.numpy(), rope.cpu_sin_signed().numpy())
        nqk, q_size = self.nh + self.nkv, self.nh * self.d
        cs = np.tile(np.stack((self._rope_np[1][pos], self._rope_np[2][pos])), (1, 1, nqk))
        cs[:, :, :q_size] *= self._q_scale  # [2, T, qk_size]
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
    starts = meta.seq_starts
    if (
        plan.np_layers is not None
        and ctx.kv_cache is not None
        and starts is not None
        and meta.tree_bits is None  # the C kernel's attention is causal: trees take the loop
        and (
            plan.kernels is not None  # any batch: every row's arithmetic is the same (batch-invariant)
            or (T <= CPU_FEW_ROWS and len(meta.query_lens) == 1 and starts[0] >= 0)
        )
    ):
        if plan.numpy:
            numpy_blas().sync_threads()
        return _forward_flat(plan, x, positions, ctx)
    nh, nkv, d, scale = plan.nh, plan.nkv, plan.d, plan.scale
    nqk, qk_size, q_size = nh + nkv, (nh + nkv) * d, nh * d
    cos, sin = plan.rope.cpu_tables(positions)  # [T, 1, d] each
    views = cpu_kv_views(ctx.kv_cache, ctx.meta) if ctx.kv_cache is not None else None
    if plan.numpy:
        numpy_blas().sync_threads()
    aux = ctx.aux_layers
    tp = plan.tp
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
        x = x + all_reduce(o_proj.rows(o), tp)
        gu = gate_up.rows(rms_norm_cpu(x, w2, eps2)).view(T, 2, inter)  # [T, 2, inter]
        gate, up = gu.unbind(1)  # [T, inter] each
        x = x + all_reduce(down.rows(F.silu(gate).mul_(up)), tp)
    return rms_norm_cpu(x, *plan.norm)


def _forward_flat(
    plan: CpuPlan,
    x: torch.Tensor,  # [T, hidden]: the embeddings of every sequence's new tokens, in order
    positions: torch.Tensor,  # [T]
    ctx: ForwardContext,
) -> torch.Tensor:  # [T, hidden]: final-norm output
    """A forward of any flat batch in numpy on views of the weights and cache: decode steps,
    verification passes and prefills of one or many sequences (with the C kernels; without them,
    only up to ``CPU_FEW_ROWS`` new tokens of one sequence). Every per-layer view of a sequence
    whose blocks are consecutive is made before the loop: after each product has streamed
    megabytes through the caches, an op costs ~10 us, so the loop keeps ~40 of them per layer.

    Batch invariance: row j computes exactly what a one-token step of its sequence at its position
    computes alone. The products are one FMA chain per output whatever the rows of the call
    (``cpu_kernels``); RMSNorm is per row (the C kernel); RoPE, SiLU and the residual adds are per
    element (numpy ufuncs: the same instruction for every lane, tails included); each row attends
    over its own causal prefix of its own sequence's cache (``cpu_kernels.attend``, one call per
    sequence; a sequence whose blocks are not consecutive attends over an exact copy of its
    context). So the logits of a sequence's rows are bit for bit the same alone or within any
    batch, and for a query of 1 row or k+1 (tests/test_batch_invariance.py): greedy output does
    not depend on what else is batched, and greedy speculation cannot flip a near tie."""
    meta = ctx.meta
    kv_cache = ctx.kv_cache
    nh, nkv, d = plan.nh, plan.nkv, plan.d
    q_size, qk_size, g = nh * d, (nh + nkv) * d, nh // nkv
    T = x.shape[0]
    cos, sin = plan.np_rope_rows(positions.numpy())  # [T, qk_size] each, q part pre-scaled if exact
    L, _, nb, bs = kv_cache.shape[:4]
    flat = kv_cache.numpy().reshape(L, 2, nb * bs, nkv * d)  # a view
    perm, scale = plan.np_perm, plan.np_scale  # scale None: folded into the q part of cos/sin
    ck = plan.kernels  # our C kernels, or None: numpy (one sequence, consecutive blocks)
    # per sequence: (first row, end row, cache rows written, cache rows attended over (a slice,
    # or the slots of a sequence whose blocks are not consecutive))
    seqs = []
    q0 = 0
    for i, (ql, cl, st) in enumerate(zip(meta.query_lens, meta.context_lens_list, meta.seq_starts)):
        if st >= 0:
            seqs.append((q0, q0 + ql, slice(st + cl - ql, st + cl), slice(st, st + cl)))
        else:
            p = np.arange(cl)
            slots = meta.block_tables[i].numpy().astype(np.int64)[p // bs] * bs + p % bs
            seqs.append((q0, q0 + ql, slots[cl - ql :], slots))
        q0 += ql
    if ck is not None:
        rms, c_scale = ck.rms_norm, 1.0 if scale is None else float(scale)
        if len(seqs) == 1 and isinstance(seqs[0][3], slice):  # views made once, before the loop
            _, _, dst, src = seqs[0]
            per_layer = [((0, T, kl[dst], vl[dst], kl[src], vl[src]),) for kl, vl in flat]
        else:
            per_layer = [None] * L
    else:
        ctx_len = meta.context_lens_list[0]
        st = meta.seq_starts[0]
        k_new = flat[:, 0, st + ctx_len - T : st + ctx_len]  # [L, T, nkv d]: this step's K/V
        v_new = flat[:, 1, st + ctx_len - T : st + ctx_len]
        k_ctx = flat[:, 0, st : st + ctx_len].reshape(L, ctx_len, nkv, d).transpose(0, 2, 3, 1)
        v_ctx = flat[:, 1, st : st + ctx_len].reshape(L, ctx_len, nkv, d).transpose(0, 2, 1, 3)
        per_layer = [((0, T, kn, vn, kc, vc),) for kn, vn, kc, vc in zip(k_new, v_new, k_ctx, v_ctx)]
        rms = _rms
        rows = [(j, ctx_len - T + j + 1) for j in range(T)]  # (row, its context length)
    aux = ctx.aux_layers
    tp = plan.tp
    xt = x
    x = x.numpy()  # [T, hidden]
    o = np.empty((T, q_size), np.float32)  # attention output rows
    for i, ((w1, e1, qkv_mm, o_mm, w2, e2, gu_mm, down_mm, inter), views) in enumerate(
        zip(plan.np_layers, per_layer)
    ):
        if aux and i in aux:  # input of layer i == output of layer i-1
            ctx.aux_hidden.append(xt if i == 0 else torch.from_numpy(x))
        qkv = qkv_mm(rms(x, w1, e1))  # [T, (nh + 2 nkv) d]
        rot = qkv.take(perm, axis=1)  # [T, qk_size]: each q/k head with its halves swapped
        rot *= sin
        rot += qkv[:, :qk_size] * cos  # RoPE: x * cos + rotate_half(x) * sin
        if views is None:  # several sequences or a gathered context: this layer's views
            kl, vl = flat[i]
            views = []
            for a, b, dst, src in seqs:
                kl[dst] = rot[a:b, q_size:]
                vl[dst] = qkv[a:b, qk_size:]
                views.append((a, b, None, None, kl[src], vl[src]))
        for a, b, kn, vn, kc, vc in views:
            if kn is not None:
                kn[:] = rot[a:b, q_size:]
                vn[:] = qkv[a:b, qk_size:]
            if ck is not None:
                ck.attend(rot[a:b, :q_size], kc, vc, nh, nkv, c_scale, o[a:b])
                continue
            for j, cl in rows:  # kc [nkv, d, ctx_len], vc [nkv, ctx_len, d]
                kj, vj = (kc, vc) if cl == kc.shape[-1] else (kc[:, :, :cl], vc[:, :cl])
                s = np.matmul(rot[j, :q_size].reshape(nkv, g, d), kj)  # [nkv, g, cl]
                if scale is not None:
                    s *= scale
                s -= s.max(-1, keepdims=True)
                np.exp(s, out=s)
                s /= s.sum(-1, keepdims=True)
                o[j] = np.matmul(s, vj).reshape(q_size)
        x = x + _reduce(o_mm(o), tp)  # [T, hidden]
        gu = gu_mm(rms(x, w2, e2))  # [T, 2 inter]
        gate = gu[:, :inter]
        act = np.exp(-gate)
        act += 1.0
        np.divide(gate, act, out=act)  # silu(gate) = gate / (1 + exp(-gate))
        act *= gu[:, inter:]
        x = x + _reduce(down_mm(act), tp)  # [T, hidden]
    return torch.from_numpy(rms(x, *plan.np_norm))


def _reduce(y: np.ndarray, tp: TensorParallel) -> np.ndarray:  # y: [T, hidden]
    """A row-parallel product's output summed over the tensor-parallel ranks (in place)."""
    if not tp.enabled:
        return y
    y = np.ascontiguousarray(y)
    all_reduce(torch.from_numpy(y), tp)  # in place: the tensor shares y's memory
    return y


def _rms(x: np.ndarray, w: np.ndarray, eps: np.float32) -> np.ndarray:  # x: [T, hidden]
    """weight * (x * rsqrt(mean(x^2) + eps)) row by row, float32 throughout (each row's sum of
    squares by its own dot, so a row's result does not depend on the others)."""
    n = np.float32(x.shape[1])
    ss = np.array([np.dot(r, r) for r in x], np.float32)  # [T]
    h = x * (np.float32(1.0) / np.sqrt(ss / n + eps))[:, None]
    h *= w
    return h
