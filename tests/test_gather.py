"""models/gather.py: the row gather equals index_select for every row count and index dtype."""

from __future__ import annotations

import pytest
import torch

from speculant.models.gather import gather_rows


@pytest.mark.parametrize("n", [0, 1, 2, 6, 31, 32, 40])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_gather_rows_equals_index_select(n, dtype):
    g = torch.Generator().manual_seed(n)
    for table in (torch.randn(50, 7, generator=g), torch.randint(0, 1000, (50,), generator=g)):
        idx = torch.randint(0, 50, (n,), generator=g).to(dtype)
        got = gather_rows(table, idx)
        assert got.shape == (n, *table.shape[1:])
        assert torch.equal(got, table.index_select(0, idx))


def test_gather_rows_equals_embedding():
    """What the models' ``embed`` now returns equals the nn.Embedding module's lookup."""
    emb = torch.nn.Embedding(100, 8)
    for ids in (torch.tensor([7]), torch.tensor([3, 99, 0, 3, 57]), torch.arange(40)):
        assert torch.equal(gather_rows(emb.weight, ids), emb(ids))
