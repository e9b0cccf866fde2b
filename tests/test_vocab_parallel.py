"""The vocab-parallel LM head of a tensor-parallel Llama (``compute_logits_parallel``, the head of
its CUDA graphs): each rank's vocabulary rows, then ``all_gather_columns``, give the logits of the
whole head, bit for bit on the GEMV path (each shard runs with the whole head's launch
configuration)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # the Triton GEMV under the CPU interpreter (spawned ranks too)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.multiprocessing as mp  # noqa: E402
from checkpoints import make_tiny_checkpoint  # noqa: E402

from speculant.distributed import (  # noqa: E402
    NO_TENSOR_PARALLEL,
    TensorParallel,
    all_gather_columns,
    init_tensor_parallel,
    shutdown_tensor_parallel,
)
from speculant.kernels.gemv import gemv as gemv_fn  # noqa: E402
from speculant.models import fused, llama  # noqa: E402
from speculant.models.loader import load_config, load_model  # noqa: E402

CPU = torch.device("cpu")
ROWS = (1, 2, 3, 5)  # 2 rows take cuBLAS (no split); the others the GEMV


def _gemv_path(monkeypatch) -> None:
    """The CUDA head's code on CPU tensors: the Triton GEMV (interpreted) for 1 and 3+ rows."""
    monkeypatch.setattr(fused, "enabled", lambda x: True)
    monkeypatch.setattr(fused, "gemv_enabled", lambda x: x.shape[0] == 1)
    monkeypatch.setattr(llama, "gemv", lambda *a, **kw: gemv_fn(*a, **kw, force_triton=True))


def _hidden(rows: int, width: int) -> torch.Tensor:
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(rows))


def test_shards_side_by_side_are_the_whole_head(tmp_path, monkeypatch):
    """One process: rank 0's and rank 1's shards (the gather replaced by handing the shard
    back) side by side equal the unsharded model's logits, bit for bit."""
    tiny_llama = make_tiny_checkpoint(tmp_path / "m", "llama", vocab_size=256, tokenizer=False)
    _gemv_path(monkeypatch)
    config = load_config(tiny_llama)
    whole = load_model(tiny_llama, config, torch.float32, CPU, 64, tp=NO_TENSOR_PARALLEL)
    assert not whole.vocab_parallel
    monkeypatch.setattr(llama, "all_gather_columns", lambda x, tp: x)
    shards = [load_model(tiny_llama, config, torch.float32, CPU, 64,
                         tp=TensorParallel(r, 2, None, None)) for r in range(2)]
    assert all(m.vocab_parallel for m in shards)
    for rows in ROWS:
        h = _hidden(rows, config.hidden_size)
        want = whole.compute_logits(h)  # [rows, vocab]
        got = [m.compute_logits_parallel(h) for m in shards]
        if rows == 2:  # cuBLAS rows: the whole head on every rank
            assert all(torch.equal(g, want) for g in got)
        else:
            assert all(g.shape == (rows, config.vocab_size // 2) for g in got)
            assert torch.equal(torch.cat(got, dim=1), want), rows
    # a vocabulary the size does not divide: the whole head on every rank
    odd = make_tiny_checkpoint(tmp_path / "odd", "llama", vocab_size=257, tokenizer=False)
    m = load_model(odd, load_config(odd), torch.float32, CPU, 64, tp=TensorParallel(1, 2, None, None))
    h = _hidden(3, config.hidden_size)
    assert not m.vocab_parallel and torch.equal(m.compute_logits_parallel(h), m.compute_logits(h))


def _rank(rank: int, size: int, init: str, folder: str, out: str) -> None:
    torch.set_num_threads(1)
    tp = init_tensor_parallel(rank, size, "cpu", init_method=init)
    try:
        x = torch.arange(6.0).view(2, 3) + 10 * rank  # [2, 3] on rank r
        res = {"gather": all_gather_columns(x), "gather1": all_gather_columns(x[:1])}
        fused.enabled = lambda x: True
        fused.gemv_enabled = lambda x: x.shape[0] == 1
        llama.gemv = lambda *a, **kw: gemv_fn(*a, **kw, force_triton=True)
        config = load_config(Path(folder))
        model = load_model(Path(folder), config, torch.float32, CPU, 64, tp=tp)
        for rows in ROWS:
            h = _hidden(rows, config.hidden_size)
            res[rows] = (model.compute_logits_parallel(h), model.compute_logits(h))
        torch.save(res, f"{out}{rank}.pt")
    finally:
        shutdown_tensor_parallel()


def _two_ranks(fn, tmp_path, vocab_size: int) -> list[dict]:
    """``fn(rank, 2, init, folder, out)`` in 2 spawned processes on a tiny Llama of
    ``vocab_size``; each rank's saved results."""
    folder = make_tiny_checkpoint(tmp_path / "m", "llama", vocab_size=vocab_size, tokenizer=False)
    out = str(tmp_path / "res")
    mp.start_processes(fn, args=(2, f"file://{tmp_path / 'init'}", str(folder), out),
                       nprocs=2, start_method="spawn")
    return [torch.load(f"{out}{r}.pt") for r in range(2)]


@pytest.mark.slow  # two spawned gloo ranks
def test_two_ranks_gather_the_whole_head(tmp_path):
    for r, res in enumerate(_two_ranks(_rank, tmp_path, 256)):
        x0, x1 = torch.arange(6.0).view(2, 3), torch.arange(6.0).view(2, 3) + 10
        assert torch.equal(res["gather"], torch.cat([x0, x1], dim=1))
        assert torch.equal(res["gather1"], torch.cat([x0[:1], x1[:1]], dim=1))
        for rows in ROWS:
            got, want = res[rows]
            assert torch.equal(got, want), (r, rows)


def _gpu_rank(rank: int, size: int, init: str, folder: str, out: str) -> None:
    dev = torch.device("cuda", rank)
    tp = init_tensor_parallel(rank, size, dev, init_method=init)
    try:
        config = load_config(Path(folder))
        model = load_model(Path(folder), config, torch.bfloat16, dev, 64, tp=tp)
        res = {}
        for rows in ROWS:
            h = _hidden(rows, config.hidden_size).to(dev, torch.bfloat16)
            want = model.compute_logits(h)
            eager = model.compute_logits_parallel(h)
            stream = torch.cuda.Stream(dev)
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):  # warm-up outside the capture
                model.compute_logits_parallel(h)
            torch.cuda.current_stream(dev).wait_stream(stream)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                graphed = model.compute_logits_parallel(h)
            graphed.zero_()
            g.replay()
            torch.cuda.synchronize(dev)
            res[rows] = [torch.equal(eager, want), torch.equal(graphed, want)]
            del g
        torch.save(res, f"{out}{rank}.pt")
    finally:
        shutdown_tensor_parallel()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_gpu_split_head_in_a_cuda_graph_has_the_whole_heads_bits(tmp_path):
    """2 GPUs, bf16, a 128256-row vocabulary (the Llama-3 one: 64128 rows a rank, whose one-row
    GEMV would pick another configuration of its own): eager and replayed from a CUDA graph
    (the NCCL all-gather inside), every logit equals the whole head's on every rank."""
    for r, res in enumerate(_two_ranks(_gpu_rank, tmp_path, 128256)):
        assert all(all(v) for v in res.values()), (r, res)
