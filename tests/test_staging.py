"""engine/staging.py: the verifier's polled read-back (``read_back``) returns exactly
``tolist()``, and ``to_device`` builds the same tensor as ``torch.tensor``."""

from __future__ import annotations

import pytest
import torch

from speculant.engine.staging import read_back, to_device


def test_read_back_on_cpu_is_tolist():
    t = torch.tensor([[3.0, -1.5], [2.0**40 + 1, 0.25]], dtype=torch.float64)
    assert read_back(t) == t.tolist()


def test_to_device_on_cpu():
    t = to_device([1, 2, 3], torch.int32, "cpu")
    assert t.dtype == torch.int32 and t.tolist() == [1, 2, 3]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_read_back_of_queued_gpu_work():
    """The polled read waits for work still queued on the stream (a large matmul before the
    value), and reads exactly what the blocking read reads."""
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(4):
        a = a @ a / 64.0  # keep the GPU busy for a while
    flat = torch.cat([a[0, :5].double(), torch.arange(3, device="cuda").double() + 2.0**40])
    got = read_back(flat)
    assert got == flat.cpu().tolist()
    assert got[5:] == [2.0**40, 2.0**40 + 1, 2.0**40 + 2]
