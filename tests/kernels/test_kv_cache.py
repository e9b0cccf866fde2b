from __future__ import annotations

import pytest
import torch

from speculant.kernels.kv_cache import store_kv, store_kv_ref


def _dense_store(k, v, k_cache, v_cache, slots):
    """Dead-simple loop version."""
    bs = k_cache.shape[1]
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        k_cache[s // bs, s % bs] = k[t].to(k_cache.dtype)
        v_cache[s // bs, s % bs] = v[t].to(v_cache.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size,hkv,d", [(16, 2, 64), (8, 3, 128), (32, 1, 16)])
def test_store_kv_matches_reference(device, dtype, block_size, hkv, d):
    nb, n = 12, 23
    slots = torch.randperm(nb * block_size)[:n]
    slots[[2, 7, 19]] = -1
    k = torch.randn(n, hkv, d, dtype=dtype)
    v = torch.randn(n, hkv, d, dtype=dtype)
    poison = torch.full((nb, block_size, hkv, d), float("nan"), dtype=dtype)
    kc, vc = poison.clone(), poison.clone()
    kr, vr = poison.clone(), poison.clone()
    kd, vd = poison.clone(), poison.clone()
    store_kv(
        k.to(device), v.to(device), kc_d := kc.to(device), vc_d := vc.to(device),
        slots.to(device), force_triton=True,
    )
    store_kv_ref(k, v, kr, vr, slots)
    _dense_store(k, v, kd, vd, slots)
    for got, want in ((kc_d.cpu(), kr), (vc_d.cpu(), vr), (kr, kd), (vr, vd)):
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))
    # every valid slot was written, nothing else
    written = ~torch.isnan(kc_d.cpu()).view(-1, hkv, d)[:, 0, 0]
    assert written.sum().item() == int((slots >= 0).sum())


def test_store_kv_strided_inputs_and_cast(device):
    # k, v as views of a fused qkv projection; fp32 inputs into an fp16 cache (the interpreter
    # rounds fp32 -> bf16 by truncation, the GPU to nearest, so the cast is checked with fp16)
    n, hkv, d, bs, nb = 9, 2, 64, 16, 4
    qkv = torch.randn(n, 4 + 2 * hkv, d)
    k, v = qkv[:, 4 : 4 + hkv], qkv[:, 4 + hkv :]
    slots = torch.tensor([0, 5, 17, 63, -1, 33, 34, 48, 1])
    kc = torch.zeros(nb, bs, hkv, d, dtype=torch.float16, device=device)
    vc = torch.zeros_like(kc)
    store_kv(k.to(device), v.to(device), kc, vc, slots.to(device), force_triton=True)
    kr = torch.zeros(nb, bs, hkv, d, dtype=torch.float16)
    vr = torch.zeros_like(kr)
    store_kv_ref(k, v, kr, vr, slots)
    assert torch.equal(kc.cpu(), kr) and torch.equal(vc.cpu(), vr)


def test_store_kv_large_slots(device):
    """Slots near the top of a cache with more than 2**31 elements (int64 addressing)."""
    hkv, d, bs = 1, 16, 16
    nb = (2**31) // (bs * hkv * d) + 64
    try:
        big = torch.empty((2, nb, bs, hkv, d), dtype=torch.float16, device=device)
    except (RuntimeError, MemoryError):
        pytest.skip("cannot reserve a >4 GiB cache here")
    kc, vc = big[0], big[1]
    n = 6
    slots = torch.tensor([nb * bs - 1, nb * bs - 17, (nb - 3) * bs + 5, -1, nb * bs - 2, 7])
    k = torch.randn(n, hkv, d, dtype=torch.float16)
    v = torch.randn(n, hkv, d, dtype=torch.float16)
    store_kv(k.to(device), v.to(device), kc, vc, slots.to(device), force_triton=True)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        assert torch.equal(kc[s // bs, s % bs].cpu(), k[t])
        assert torch.equal(vc[s // bs, s % bs].cpu(), v[t])
    del big


def test_store_kv_validation(device):
    kc = torch.zeros(4, 16, 2, 64, device=device)
    vc = torch.zeros_like(kc)
    k = torch.randn(3, 2, 64, device=device)
    slots = torch.tensor([0, 1, 2], device=device)
    with pytest.raises(ValueError, match="v "):
        store_kv(k, torch.randn(3, 2, 32, device=device), kc, vc, slots)
    with pytest.raises(ValueError, match="k "):
        store_kv(torch.randn(3, 4, 64, device=device), k, kc, vc, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(k, k, kc, vc, slots.float())
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(k, k, kc, vc, slots[:2])
    with pytest.raises(ValueError, match="v_cache"):
        store_kv(k, k, kc, vc[:, :8], slots)
    with pytest.raises(ValueError, match="k_cache"):
        store_kv(k, k, kc[0], vc, slots)
    with pytest.raises(ValueError, match="last dim"):
        store_kv(k, k, kc.transpose(2, 3).contiguous().transpose(2, 3)[..., :2, :], vc, slots)
