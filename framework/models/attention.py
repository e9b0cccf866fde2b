"""Attention over the paged KV cache: metadata for one forward, the torch path (CPU) and the
seam to the Triton kernels (CUDA)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from speculant.kernels._triton_utils import triton_enabled
from speculant.models import batch_invariant


@dataclass
class AttentionMetadata:
    """Where the tokens of one flat forward batch live in the paged cache."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor  # [num_seqs] int32: cached tokens after this step's writes
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cumulative query lengths
    query_lens: list[int]  # per sequence
    context_lens_list: list[int]  # per sequence
    block_size: int
    # CPU: first cache slot of each sequence whose blocks covering its context are consecutive
    # (its K/V are then one slice of the cache), -1 where they are not; None: not computed
    seq_starts: list[int] | None = None
    # tree verification (docs/kernels.md "Tree attention"): bit j of a row = the row may attend to
    # in-step row j of its own sequence (keys before the step stay visible); None: causal.
    # The forward's positions must then be ctx_start + depth per row (kernels/tree_kv.py)
    tree_bits: torch.Tensor | None = None  # [num_tokens] int64
    # Torch-path helpers, built lazily once per forward and shared by all layers.
    _torch_cache: dict = field(default_factory=dict)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens) if self.query_lens else 0

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device,
        tree_bits: list[int] | None = None,  # [num_tokens]: see the field
    ) -> AttentionMetadata:
        slots: list[int] = []
        starts: list[int] | None = [] if device.type == "cpu" else None
        for ql, cl, bt in zip(query_lens, context_lens, block_tables):
            nb = -(-cl // block_size)
            if nb and bt[:nb] == list(range(bt[0], bt[0] + nb)):  # consecutive blocks
                first = bt[0] * block_size
                slots.extend(range(first + cl - ql, first + cl))
                if starts is not None:
                    starts.append(first)
                continue
            if starts is not None:
                starts.append(-1)
            for pos in range(cl - ql, cl):
                slots.append(bt[pos // block_size] * block_size + pos % block_size)
        max_blocks = max((len(bt) for bt in block_tables), default=1) or 1
        bt_pad = [bt + [0] * (max_blocks - len(bt)) for bt in block_tables]
        qsl = [0]
        for ql in query_lens:
            qsl.append(qsl[-1] + ql)
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=torch.tensor(bt_pad, dtype=torch.int32, device=device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            query_lens=list(query_lens),
            context_lens_list=list(context_lens),
            block_size=block_size,
            seq_starts=starts,
            tree_bits=(torch.tensor(tree_bits, dtype=torch.int64, device=device)
                       if tree_bits is not None else None),
        )

    @classmethod
    def padded(
        cls,
        slot_mapping: torch.Tensor,  # [B * Q] int64 (slot -1: no K/V write)
        block_tables: torch.Tensor,  # [B, W] int32
        context_lens: torch.Tensor,  # [B] int32
        query_start_loc: torch.Tensor,  # [B + 1] int32
        q_len: int,
        block_size: int,
        tree_bits: torch.Tensor | None = None,  # [B * Q] int64: see the field
    ) -> AttentionMetadata:
        """Metadata of a padded batch of B rows of ``q_len`` query tokens over ``W``-block
        tables, all on the device (the shapes CUDA-graph replays are captured with: the host
        lists give bucket sizes only, the device tensors hold the real lengths)."""
        B, W = block_tables.shape
        return cls(
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            context_lens=context_lens,
            query_start_loc=query_start_loc,
            query_lens=[q_len] * B,
            context_lens_list=[W * block_size] * B,
            block_size=block_size,
            tree_bits=tree_bits,
        )

    def causal_mask(self, q_len: int, ctx_len: int) -> torch.Tensor | None:
        """[q_len, ctx_len] bool: query j (absolute position ctx_len - q_len + j) sees keys at
        positions <= its own. None for one query (it sees the whole context); shared by all
        layers of this forward."""
        if q_len == 1:
            return None
        key = ("causal", q_len, ctx_len)
        m = self._torch_cache.get(key)
        if m is None:
            dev = self.slot_mapping.device
            kpos = torch.arange(ctx_len, device=dev)  # [ctx_len]
            qpos = torch.arange(ctx_len - q_len, ctx_len, device=dev)  # [q_len]
            m = self._torch_cache[key] = kpos[None, :] <= qpos[:, None]  # [q_len, ctx_len]
        return m

    def step_mask(self, q_start: int, q_len: int, ctx_len: int) -> torch.Tensor | None:
        """``causal_mask`` of the sequence whose rows start at ``q_start``, narrowed by
        ``tree_bits`` when set (a row sees the keys before the step and the in-step rows of its
        bits). One row (a tree's root alone) sees the whole context: None."""
        if self.tree_bits is None or q_len == 1:
            return self.causal_mask(q_len, ctx_len)
        key = ("tree", q_start, q_len, ctx_len)
        m = self._torch_cache.get(key)
        if m is None:
            dev = self.slot_mapping.device
            prefix = ctx_len - q_len
            kpos = torch.arange(ctx_len, device=dev)  # [ctx_len]
            jj = (kpos - prefix).clamp(0, 63)  # [ctx_len]: in-step row of each key
            rows = self.tree_bits[q_start : q_start + q_len].to(dev)  # [q_len] int64
            bit = (rows[:, None] >> jj[None, :]) & 1  # [q_len, ctx_len]
            tree = (kpos[None, :] < prefix) | (bit != 0)
            m = self._torch_cache[key] = self.causal_mask(q_len, ctx_len) & tree
        return m

    def step_bias(self, q_start: int, q_len: int, ctx_len: int) -> torch.Tensor:
        """[q_len, ctx_len] float32: 0 where ``step_mask`` is True, -inf elsewhere."""
        if self.tree_bits is None:
            return self.causal_bias(q_len, ctx_len)
        key = ("tree_bias", q_start, q_len, ctx_len)
        b = self._torch_cache.get(key)
        if b is None:
            m = self.step_mask(q_start, q_len, ctx_len)
            b = torch.zeros(m.shape, dtype=torch.float32, device=m.device)
            b = self._torch_cache[key] = b.masked_fill_(~m, float("-inf"))
        return b

    def causal_bias(self, q_len: int, ctx_len: int) -> torch.Tensor:
        """[q_len, ctx_len] float32: 0 where ``causal_mask`` is True, -inf elsewhere (added to
        the scores of the CPU's few-row attention); shared by all layers of this forward."""
        key = ("bias", q_len, ctx_len)
        b = self._torch_cache.get(key)
        if b is None:
            m = self.causal_mask(q_len, ctx_len)
            b = torch.zeros(m.shape, dtype=torch.float32, device=m.device)
            b = self._torch_cache[key] = b.masked_fill_(~m, float("-inf"))
        return b

    def torch_indices(self) -> dict:
        """Gather indices and the causal mask for the padded torch attention path."""
        if "gather" in self._torch_cache:
            return self._torch_cache
        dev = self.slot_mapping.device
        S = len(self.query_lens)
        Q = max(self.query_lens)
        C = max(self.context_lens_list)
        pos = torch.arange(C, device=dev)
        block_idx = self.block_tables.long().gather(
            1, (pos // self.block_size).clamp(max=self.block_tables.shape[1] - 1).expand(S, C)
        )
        gather = block_idx * self.block_size + (pos % self.block_size)  # [S, C] slots
        ctx = self.context_lens.long()[:, None]  # [S, 1]
        qlen = torch.tensor(self.query_lens, device=dev)[:, None]  # [S, 1]
        qpos = torch.arange(Q, device=dev)[None, :]  # [1, Q]
        q_valid = qpos < qlen  # [S, Q]
        abs_q = ctx - qlen + qpos  # [S, Q] absolute position of each query row
        mask = pos[None, None, :] <= abs_q[:, :, None]  # [S, Q, C]
        mask &= pos[None, None, :] < ctx[:, :, None]
        mask[~q_valid] = False
        mask[..., 0] |= ~q_valid  # padded rows attend somewhere (discarded), avoids NaN
        starts = self.query_start_loc.long()[:-1, None]  # [S, 1]
        q_index = torch.where(q_valid, starts + qpos, torch.zeros_like(qpos))  # [S, Q]
        self._torch_cache.update(
            {
                "gather": torch.where(pos[None, :] < ctx, gather, torch.zeros_like(gather)),
                "mask": mask.unsqueeze(1),  # [S, 1, Q, C]
                "q_index": q_index,
                "q_valid": q_valid,
            }
        )
        return self._torch_cache


def paged_attention_torch(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each sequence's new queries over its cached context. Sequences whose
    blocks are consecutive (the block manager places them so) attend over a slice of the cache,
    one SDPA per sequence without copies or padding; otherwise every sequence's context is
    gathered into a padded batch with a mask. On the CPU in fp32 with our C kernels, each
    sequence's rows go through ``cpu_kernels.attend`` instead (``_attention_c``): batch-invariant.
    With ``meta.tree_bits`` (a tree step): the kernels' torch reference with the tree mask."""
    if meta.tree_bits is not None:
        from speculant.kernels.paged_attention import paged_attention_ref

        return paged_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                   meta.query_start_loc, scale, tree_bits=meta.tree_bits)
    if _c_attention_ok(q, k_cache):
        return _attention_c(q, k_cache, v_cache, meta, scale)
    starts = meta.seq_starts
    if starts is not None and min(starts, default=-1) >= 0:
        return _attention_slices(q, k_cache, v_cache, meta, scale)
    idx = meta.torch_indices()
    nkv, d = k_cache.shape[2], k_cache.shape[3]
    keys = k_cache.view(-1, nkv, d)[idx["gather"]].transpose(1, 2)  # [S, nkv, C, d]
    vals = v_cache.view(-1, nkv, d)[idx["gather"]].transpose(1, 2)  # [S, nkv, C, d]
    qp = q[idx["q_index"]].transpose(1, 2)  # [S, nh, Q, d]
    out = F.scaled_dot_product_attention(
        qp, keys, vals, attn_mask=idx["mask"], scale=scale, enable_gqa=True
    )  # [S, nh, Q, d]
    return out.transpose(1, 2)[idx["q_valid"]]  # [num_tokens, nh, d]


def _attention_slices(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    nkv, d = k_cache.shape[2], k_cache.shape[3]
    kf = k_cache.view(-1, nkv, d)  # [num_slots, nkv, d]
    vf = v_cache.view(-1, nkv, d)  # [num_slots, nkv, d]
    outs = []
    q0 = 0
    for ql, cl, st in zip(meta.query_lens, meta.context_lens_list, meta.seq_starts):
        # 4-D views: SDPA's CPU flash kernel takes them strided; 3-D inputs fall back to the
        # math path (GQA by repeat_interleave), 2.3x slower
        o = F.scaled_dot_product_attention(
            q[q0 : q0 + ql].transpose(0, 1)[None],  # [1, nh, ql, d]
            kf[st : st + cl].transpose(0, 1)[None],  # [1, nkv, cl, d] (a view of the cache)
            vf[st : st + cl].transpose(0, 1)[None],  # [1, nkv, cl, d]
            attn_mask=meta.causal_mask(ql, cl),  # [ql, cl] or None
            scale=scale,
            enable_gqa=True,
        )  # [1, nh, ql, d]
        outs.append(o[0].transpose(0, 1))  # [ql, nh, d]
        q0 += ql
    return outs[0] if len(outs) == 1 else torch.cat(outs)  # [num_tokens, nh, d]


def attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_dim]; None: already stored
    v: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_dim]; None: already stored
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Write this step's K/V into the cache (unless k and v are None: the caller did), then
    attend causally over the whole context. Inside a batch-invariant forward
    (models/batch_invariant.py) the Triton launch has one configuration and fixed KV splits."""
    invariant = batch_invariant.active()
    if q.is_cuda and triton_enabled():
        from speculant.kernels.kv_cache import store_kv
        from speculant.kernels.paged_attention import paged_attention

        if k is not None:
            store_kv(k, v, k_cache, v_cache, meta.slot_mapping)

        return paged_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.context_lens,
            meta.query_start_loc,
            scale,
            max_query_len=meta.max_query_len,
            num_splits=invariant.num_splits if invariant is not None else None,
            split_tokens=invariant.split_tokens if invariant is not None else None,
            tree_bits=meta.tree_bits,
        )
    if invariant is not None and q.is_cuda:
        raise RuntimeError("a batch-invariant forward needs the Triton attention kernel, but "
                           "SPECULANT_DISABLE_TRITON is set; unset it or use "
                           "batch_invariant=False")
    if k is not None:
        _store_torch(k, v, k_cache, v_cache, meta)
    return paged_attention_torch(q, k_cache, v_cache, meta, scale)


def _c_attention_ok(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    if q.device.type != "cpu" or q.dtype != torch.float32 or k_cache.dtype != torch.float32:
        return False
    nh, d, nkv = q.shape[1], q.shape[2], k_cache.shape[2]
    if d % 8 or d > 512 or nh % nkv or q.requires_grad or not k_cache.is_contiguous():
        return False
    from speculant.models import cpu_kernels

    return cpu_kernels.available()


def _attention_c(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim] float32, CPU
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Each sequence's query rows over its own context (a slice of the cache where its blocks are
    consecutive, else an exact copy gathered through its block table) by our C kernel: a row's
    output depends only on its q row and its causal prefix, never on the other rows or sequences
    of the batch (the module paths' attention on the CPU, e.g. OPT)."""
    import numpy as np

    from speculant.models import cpu_kernels

    T, nh, d = q.shape
    bs, nkv = k_cache.shape[1], k_cache.shape[2]
    kf = k_cache.view(-1, nkv * d).numpy()  # [num_slots, nkv d]
    vf = v_cache.view(-1, nkv * d).numpy()
    qn = q.reshape(T, nh * d).numpy()
    o = np.empty((T, nh * d), np.float32)
    starts = meta.seq_starts
    q0 = 0
    for i, (ql, cl) in enumerate(zip(meta.query_lens, meta.context_lens_list)):
        st = starts[i] if starts is not None else -1
        if st >= 0:
            kc, vc = kf[st : st + cl], vf[st : st + cl]
        else:
            p = np.arange(cl)
            slots = meta.block_tables[i].numpy().astype(np.int64)[p // bs] * bs + p % bs
            kc, vc = kf[slots], vf[slots]
        cpu_kernels.attend(qn[q0 : q0 + ql], kc, vc, nh, nkv, scale, o[q0 : q0 + ql])
        q0 += ql
    return torch.from_numpy(o).view(T, nh, d)


def _store_torch(k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
    nkv, d = k_cache.shape[2], k_cache.shape[3]
    starts = meta.seq_starts
    if starts is not None and len(starts) == 1 and starts[0] >= 0:  # one sequence: a slice
        s0 = starts[0] + meta.context_lens_list[0] - meta.query_lens[0]
        k_cache.view(-1, nkv, d)[s0 : s0 + k.shape[0]] = k  # [q_len, nkv, d]
        v_cache.view(-1, nkv, d)[s0 : s0 + v.shape[0]] = v
    else:
        k_cache.view(-1, nkv, d)[meta.slot_mapping] = k.to(k_cache.dtype)
        v_cache.view(-1, nkv, d)[meta.slot_mapping] = v.to(v_cache.dtype)


# CPU: query lengths up to this attend with two batched matmuls per sequence (``_attend_few``);
# longer ones (prefill) with SDPA's flash kernel. SDPA with a mask costs ~0.4 ms per call for a
# 4-row query over 300 tokens of SmolLM2 (its CPU mask path), the two bmm ~0.03 ms.
CPU_FEW_ROWS = 16


def cpu_kv_views(
    kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
) -> list[list[tuple]] | None:
    """CPU, once per forward: for every layer and sequence, the cache views its attention writes
    and reads, so a layer does no slicing of its own. None unless every sequence's blocks are
    consecutive (``seq_starts``). Per layer, per sequence:
    (q_start, q_end, k_dst [q_len, nkv, d], v_dst, k_ctx, v_ctx, mask),
    with k_ctx [nkv, d, ctx_len] and v_ctx [nkv, ctx_len, d] for up to ``CPU_FEW_ROWS`` query
    rows (``_attend_few``; mask None for one row, else the additive [q_len, ctx_len] causal
    bias, narrowed by ``meta.tree_bits`` in a tree step), k_ctx / v_ctx [1, nkv, ctx_len, d] and the bool mask for more (SDPA)."""
    starts = meta.seq_starts
    if starts is None or min(starts, default=-1) < 0:
        return None
    L, _, nb, bs, nkv, d = kv_cache.shape
    flat = kv_cache.view(L, 2, nb * bs, nkv, d)  # [L, 2, num_slots, nkv, d]
    per_seq = []
    q0 = 0
    for ql, cl, st in zip(meta.query_lens, meta.context_lens_list, starts):
        kc, vc = flat[:, 0, st : st + cl], flat[:, 1, st : st + cl]  # [L, cl, nkv, d]
        if ql <= CPU_FEW_ROWS:
            kc, vc = kc.permute(0, 2, 3, 1), vc.transpose(1, 2)  # [L, nkv, d, cl], [L, nkv, cl, d]
            mask = None if ql == 1 else meta.step_bias(q0, ql, cl)
        else:
            kc, vc = kc.transpose(1, 2).unsqueeze(1), vc.transpose(1, 2).unsqueeze(1)
            mask = meta.step_mask(q0, ql, cl)
        per_seq.append((
            q0, q0 + ql,
            flat[:, 0, st + cl - ql : st + cl].unbind(0),  # L x [ql, nkv, d]
            flat[:, 1, st + cl - ql : st + cl].unbind(0),
            kc.unbind(0), vc.unbind(0), mask,
        ))
        q0 += ql
    return [
        [(a, b, kw[i], vw[i], kc[i], vc[i], m) for a, b, kw, vw, kc, vc, m in per_seq]
        for i in range(L)
    ]


def attention_cpu(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    views: list[tuple],  # this layer's entry of cpu_kv_views: one tuple per sequence
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
    """``attention`` on the CPU over the views of ``cpu_kv_views``: write this step's K/V, then
    attend causally over each sequence's context slice."""
    if len(views) == 1:
        _, _, kw, vw, kc, vc, mask = views[0]
        kw.copy_(k)
        vw.copy_(v)
        return _attend_one(q, kc, vc, mask, scale)
    outs = []
    for a, b, kw, vw, kc, vc, mask in views:
        kw.copy_(k[a:b])
        vw.copy_(v[a:b])
        outs.append(_attend_one(q[a:b], kc, vc, mask, scale))
    return torch.cat(outs)


def _attend_one(
    q: torch.Tensor,  # [q_len, nh, d]
    kc: torch.Tensor,  # [nkv, d, ctx_len] (q_len <= CPU_FEW_ROWS) or [1, nkv, ctx_len, d]
    vc: torch.Tensor,  # [nkv, ctx_len, d] (q_len <= CPU_FEW_ROWS) or [1, nkv, ctx_len, d]
    mask: torch.Tensor | None,  # [q_len, ctx_len]: additive float (few rows) or bool (SDPA)
    scale: float,
) -> torch.Tensor:  # [q_len, nh * d]
    ql, nh, d = q.shape
    if ql == 1:  # one query row: the head group of each KV head as one small batched matmul
        s = torch.bmm(q.reshape(kc.shape[0], -1, d), kc)  # [nkv, nh // nkv, ctx_len]
        p = torch.softmax(s.mul_(cpu_const(scale)), -1)
        return torch.bmm(p, vc).view(1, nh * d)
    if ql <= CPU_FEW_ROWS:  # each KV head's query group x rows as the M of one bmm
        nkv = kc.shape[0]
        g = nh // nkv
        qr = q.view(ql, nkv, g, d).permute(1, 2, 0, 3).reshape(nkv, g * ql, d)
        s = torch.bmm(qr, kc).mul_(cpu_const(scale))  # [nkv, g * ql, ctx_len]
        s.view(nkv, g, ql, -1).add_(mask)
        p = torch.softmax(s, -1)
        o = torch.bmm(p, vc)  # [nkv, g * ql, d]
        return o.view(nkv, g, ql, d).permute(2, 0, 1, 3).reshape(ql, nh * d)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], kc, vc, attn_mask=mask, scale=scale, enable_gqa=True
    )  # [1, nh, ql, d]
    return o[0].transpose(0, 1).reshape(ql, nh * d)


_CONSTS: dict[float, torch.Tensor] = {}


def cpu_const(v: float) -> torch.Tensor:
    """A 0-d float32 CPU tensor of ``v``, made once: an op with a tensor operand dispatches ~2x
    faster than one with a Python scalar (no scalar wrapping / type promotion per call)."""
    t = _CONSTS.get(v)
    if t is None:
        t = _CONSTS[v] = torch.tensor(v, dtype=torch.float32)
    return t


@dataclass
class ForwardContext:
    """Everything a model forward needs besides the token ids and positions."""

    meta: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k_cache, v_cache)
    aux_layers: tuple[int, ...] = ()  # layers whose output (residual stream) to collect
    aux_hidden: list[torch.Tensor] = field(
        default_factory=list
    )  # filled: [num_tokens, hidden] each
    # CPU: the whole cache [num_layers, 2, num_blocks, block_size, nkv, d] (cpu_kv_views)
    kv_cache: torch.Tensor | None = None
    # called with the layer index before each layer runs (CUDA-graph capture splits the
    # forward into several graphs there: engine/cuda_graph.py)
    on_layer: Callable[[int], None] | None = None

    def begin_layer(self, layer: int) -> None:
        if self.on_layer is not None:
            self.on_layer(layer)

    def attend(self, layer: int, q, k, v, scale: float) -> torch.Tensor:
        k_cache, v_cache = self.kv_caches[layer]
        return attention(q, k, v, k_cache, v_cache, self.meta, scale)

    def attend_stored(self, layer: int, q, scale: float) -> torch.Tensor:
        """``attend`` when this step's K/V are already in the cache (models/fused.rope_store_)."""
        k_cache, v_cache = self.kv_caches[layer]
        return attention(q, None, None, k_cache, v_cache, self.meta, scale)
