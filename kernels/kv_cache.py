"""Write new K/V vectors into the paged KV cache.

Cache layout (per layer): ``k_cache``, ``v_cache``: ``[num_blocks, block_size, num_kv_heads,
head_dim]``. Token ``t`` goes to slot ``slot_mapping[t] = block_id * block_size + offset``; a
slot of ``-1`` means "do not store" (padding tokens).
"""

from __future__ import annotations

import torch

from ._triton_utils import check_tensor, lazy_jit, next_pow2, tl, use_triton

__all__ = ["store_kv", "store_kv_ref"]

_INDEX_DTYPES = (torch.int64, torch.int32)
_CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def store_kv_ref(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """Plain torch reference (also the CPU path). In place."""
    block_size = k_cache.shape[1]
    slots = slot_mapping.to(torch.int64)
    valid = slots >= 0
    slots = slots[valid]
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots - blocks * block_size
    k_cache[blocks, offsets] = k[valid].to(k_cache.dtype)
    v_cache[blocks, offsets] = v[valid].to(v_cache.dtype)


if tl is not None:

    @lazy_jit
    def _store_kv_kernel(
        k_ptr,  # [num_tokens, num_kv_heads, head_dim]
        v_ptr,  # [num_tokens, num_kv_heads, head_dim]
        k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
        slot_ptr,  # [num_tokens] int64 (or int32), -1 = skip
        num_kv_heads,
        head_dim,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_kcb,
        stride_kcs,
        stride_kch,
        stride_vcb,
        stride_vcs,
        stride_vch,
        BLOCK_SIZE: tl.constexpr,  # tokens per cache block
        BLOCK_H: tl.constexpr,  # kv heads per program (power of two)
        BLOCK_D: tl.constexpr,  # next_pow2(head_dim)
    ):
        tok = tl.program_id(0).to(tl.int64)
        hblk = tl.program_id(1)
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        if slot >= 0:
            blk = slot // BLOCK_SIZE
            off = slot % BLOCK_SIZE
            h = hblk * BLOCK_H + tl.arange(0, BLOCK_H)
            d = tl.arange(0, BLOCK_D)
            mask = (h[:, None] < num_kv_heads) & (d[None, :] < head_dim)
            k = tl.load(k_ptr + tok * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
            v = tl.load(v_ptr + tok * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
            kc = k_cache_ptr + blk * stride_kcb + off * stride_kcs
            vc = v_cache_ptr + blk * stride_vcb + off * stride_vcs
            tl.store(
                kc + h[:, None] * stride_kch + d[None, :],
                k.to(k_cache_ptr.dtype.element_ty),
                mask=mask,
            )
            tl.store(
                vc + h[:, None] * stride_vch + d[None, :],
                v.to(v_cache_ptr.dtype.element_ty),
                mask=mask,
            )


def _check_store_kv_args(k, v, k_cache, v_cache, slot_mapping) -> None:
    check_tensor("k_cache", k_cache, ndim=4, dtypes=_CACHE_DTYPES, last_contiguous=True)
    dev = k_cache.device
    nb, bs, hkv, d = k_cache.shape
    check_tensor(
        "v_cache",
        v_cache,
        shape=(nb, bs, hkv, d),
        dtypes=(k_cache.dtype,),
        device=dev,
        last_contiguous=True,
    )
    check_tensor(
        "k", k, ndim=3, dtypes=_CACHE_DTYPES, device=dev, shape=(None, hkv, d), last_contiguous=True
    )
    n = k.shape[0]
    check_tensor(
        "v", v, shape=(n, hkv, d), dtypes=(k.dtype,), device=dev, last_contiguous=True
    )
    check_tensor("slot_mapping", slot_mapping, shape=(n,), dtypes=_INDEX_DTYPES, device=dev)


def _store_kv_triton(k, v, k_cache, v_cache, slot_mapping) -> None:
    n = k.shape[0]
    if n == 0:
        return
    _, bs, hkv, d = k_cache.shape
    block_d = next_pow2(d)
    block_h = max(1, min(next_pow2(hkv), max(1, 4096 // block_d)))
    grid = (n, -(-hkv // block_h))
    _store_kv_kernel[grid](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping.contiguous(),
        hkv,
        d,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        BLOCK_SIZE=bs,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4 if block_h * block_d >= 2048 else 2,
    )


def store_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
    *,
    force_triton: bool = False,
) -> None:
    """Store ``k``/``v`` at ``slot_mapping`` in the paged caches, in place.

    Values are cast to the cache dtype. Slots must be ``-1`` or in ``[0, num_blocks *
    block_size)``; out-of-range slots are undefined behaviour on the Triton path.
    """
    _check_store_kv_args(k, v, k_cache, v_cache, slot_mapping)
    if use_triton([k, v, k_cache, v_cache, slot_mapping], force_triton):
        _store_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    else:
        store_kv_ref(k, v, k_cache, v_cache, slot_mapping)
