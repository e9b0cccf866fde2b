"""kernels/stage_copy.py: the CUDA graph's own input copy from a pinned ring buffer, against its
torch reference, over a sequence of launches that wraps around the ring."""

from __future__ import annotations

import pytest
import torch

from speculant.kernels.stage_copy import (
    HEADER,
    REGIONS,
    StageLayout,
    pinned_copy,
    pinned_copy_reference,
    stage_copy,
    stage_copy_reference,
)

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")


def _buffers(R: int, n_max: int, l32: int, g: torch.Generator):
    pin = CUDA
    ring64 = (
        torch.randint(1, 1 << 40, (R, REGIONS * n_max + HEADER), generator=g).pin_memory()
        if pin
        else torch.randint(1, 1 << 40, (R, REGIONS * n_max + HEADER), generator=g)
    )
    ring32 = torch.randint(1, 1 << 30, (R, l32), generator=g, dtype=torch.int32)
    ring32 = ring32.pin_memory() if pin else ring32
    ack = torch.zeros(R, dtype=torch.int64, pin_memory=pin)
    err = torch.zeros(1, dtype=torch.int64, pin_memory=pin)
    dst64 = torch.randint(1, 1 << 40, (REGIONS * n_max,), generator=g).to(DEV)
    dst32 = torch.randint(1, 1 << 30, (l32,), generator=g, dtype=torch.int32).to(DEV)
    count = torch.zeros(1, dtype=torch.int64, device=DEV)
    return ring64, ring32, dst64, dst32, count, ack, err


@pytest.mark.parametrize("R", [1, 3])
@pytest.mark.parametrize(
    "n_max,m,b,w",
    [(8, 1, 1, 5), (64, 48, 8, 6), (600, 300, 12, 100)],  # the last: several blocks of each loop
)
def test_launch_sequence_matches_reference(R, n_max, m, b, w):
    g = torch.Generator().manual_seed(n_max + R)
    c, q, t = 0, b + 2, 2 * b + 5  # gaps between the regions that must stay untouched
    l32 = t + b * w + 7
    layout = StageLayout(n_max=n_max, m=m, c=c, q=q, t=t, b=b, w=w)
    kern = _buffers(R, n_max, l32, g)
    ref = [x.clone().cpu() for x in kern]
    for s in range(1, 2 * R + 3):  # wraps around the ring twice
        slot = (s - 1) % R
        vals64 = torch.randint(1, 1 << 40, (REGIONS * n_max,), generator=g)
        vals32 = torch.randint(1, 1 << 30, (l32,), generator=g, dtype=torch.int32)
        skip = [0, 1, m][s % 3] if m > 1 else 0  # leading ids already on the device
        for ring64, ring32 in ((kern[0], kern[1]), (ref[0], ref[1])):
            ring64[slot, : REGIONS * n_max] = vals64
            ring64[slot, REGIONS * n_max] = s
            ring64[slot, REGIONS * n_max + 1] = skip
            ring32[slot] = vals32
        stage_copy(*kern, layout, force_triton=True)
        stage_copy_reference(*ref, layout)
        if CUDA:
            torch.cuda.synchronize()
        for got, want in zip(kern, ref):
            assert torch.equal(got.cpu(), want), f"launch {s}"
        assert int(kern[4][0]) == s and int(kern[5][slot]) == s and int(kern[6][0]) == 0
        # what a launch must copy, checked by hand on the reference
        d64 = ref[2]
        assert torch.equal(d64[skip:m], vals64[skip:m])
        assert torch.equal(d64[n_max : n_max + m], vals64[n_max : n_max + m])
        assert torch.equal(d64[2 * n_max : 2 * n_max + m], vals64[2 * n_max : 2 * n_max + m])
        assert torch.equal(d64[3 * n_max : 3 * n_max + m], vals64[3 * n_max : 3 * n_max + m])
        assert REGIONS == 4  # ids, positions, slots, tree bits
        assert torch.equal(ref[3][t : t + b * w], vals32[t : t + b * w])
        assert torch.equal(ref[3][q : q + b + 1], vals32[q : q + b + 1])


def test_stale_slot_is_not_copied_and_flags_the_error():
    g = torch.Generator().manual_seed(0)
    layout = StageLayout(n_max=16, m=4, c=0, q=2, t=5, b=2, w=3)
    kern = _buffers(2, 16, 12, g)
    ring64, _, dst64, dst32, count, ack, err = kern
    ring64[0, REGIONS * 16] = 7  # the slot holds launch 7, the device expects launch 1
    before = (dst64.clone(), dst32.clone())
    stage_copy(*kern, layout, force_triton=True)
    if CUDA:
        torch.cuda.synchronize()
    assert int(err[0]) == 1 and int(count[0]) == 0 and int(ack[0]) == 0
    assert torch.equal(dst64, before[0]) and torch.equal(dst32, before[1])


def test_bad_layout_and_buffers_raise():
    g = torch.Generator().manual_seed(0)
    kern = _buffers(2, 16, 12, g)
    with pytest.raises(ValueError, match="tables"):
        stage_copy(*kern, StageLayout(n_max=16, m=4, c=0, q=2, t=5, b=2, w=4))
    with pytest.raises(ValueError, match="m=17"):
        stage_copy(*kern, StageLayout(n_max=16, m=17, c=0, q=2, t=5, b=2, w=3))
    with pytest.raises(ValueError, match="ring64 must have shape"):
        stage_copy(kern[0][:, :-1].contiguous(), *kern[1:], StageLayout(16, 4, 0, 2, 5, 2, 3))
    with pytest.raises(ValueError, match="dtype"):
        stage_copy(*kern[:3], kern[3].long(), *kern[4:], StageLayout(16, 4, 0, 2, 5, 2, 3))


@pytest.mark.parametrize("n", [1, 5, 1024, 3001, 300_000])  # the last: a large index
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_pinned_copy_matches_reference(n, dtype):
    """The proposers' graph input copy (pinned host vector -> device vector) against dst.copy_."""
    g = torch.Generator().manual_seed(n)
    hi = (1 << 40) if dtype == torch.int64 else (1 << 30)
    src = torch.randint(1, hi, (n,), generator=g, dtype=dtype)
    src = src.pin_memory() if CUDA else src
    dst = torch.randint(1, hi, (n,), generator=g, dtype=dtype).to(DEV)
    want = torch.empty(n, dtype=dtype)
    pinned_copy_reference(src, want)
    pinned_copy(src, dst, force_triton=True)
    if CUDA:
        torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), want) and torch.equal(want, src.cpu())


def test_pinned_copy_bad_arguments_raise():
    src = torch.ones(8, dtype=torch.int64)
    with pytest.raises(ValueError, match="same shape and dtype"):
        pinned_copy(src, torch.zeros(7, dtype=torch.int64, device=DEV))
    with pytest.raises(ValueError, match="same shape and dtype"):
        pinned_copy(src, torch.zeros(8, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="contiguous"):
        pinned_copy(torch.ones(16, dtype=torch.int64)[::2], torch.zeros(8, dtype=torch.int64))
    with pytest.raises(ValueError, match="1 dims"):
        pinned_copy(src.view(2, 4), torch.zeros(2, 4, dtype=torch.int64))
    if CUDA:  # the kernel reads src over the bus: pageable memory is refused
        with pytest.raises(ValueError, match="pinned host memory"):
            pinned_copy(src, torch.zeros(8, dtype=torch.int64, device=DEV))
