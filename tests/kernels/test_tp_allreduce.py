"""kernels/tp_allreduce.py: the fused one-shot all-reduce + residual + RMSNorm against its torch
reference: the single-rank form everywhere (the Triton interpreter on the CPU), the multi-GPU
form on two GPUs (``gpu``), eagerly and inside a CUDA graph of 64 back-to-back calls."""

from __future__ import annotations

import os
import socket

import pytest
import torch

from speculant.kernels._triton_utils import next_pow2
from speculant.kernels.tp_allreduce import (
    EPOCH_MASK,
    LAMPORT_COUNTERS,
    _allreduce_norm_kernel,
    allreduce_rms_norm_ref,
)


def _tol(dtype):
    return {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]


# the interpreter has no bfloat16 arithmetic (numpy); bf16 runs on CUDA
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("res,norm", [(True, True), (False, True), (True, False), (False, False)])
def test_single_rank_kernel_matches_reference(dtype, res, norm):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    rows, n = 3, 200  # n not a power of two: the masked tail
    x = torch.randn(rows, n, generator=g).to(dev, dtype)
    r = torch.randn(rows, n, generator=g).to(dev, dtype) if res else None
    w = (torch.rand(n, generator=g) + 0.5).to(dev, dtype) if norm else None
    out = torch.empty_like(x)
    res_out = torch.empty_like(x)
    dummy = torch.zeros(1, dtype=torch.int64, device=dev)
    _allreduce_norm_kernel[(2,)](  # 2 programs over 3 rows
        x, dummy, dummy, x, r if res else x, w if norm else x, out, res_out,
        x.stride(0), x.stride(0), out.stride(0), res_out.stride(0), rows, n, 0, rows, 1e-5,
        RANK=0, WORLD=1, HAS_RES=res, NORM=norm, BLOCK=256, WP2=1)
    want, want_res = allreduce_rms_norm_ref([x], r, w, 1e-5)
    torch.testing.assert_close(out, want, atol=_tol(dtype), rtol=_tol(dtype))
    if res and norm:
        torch.testing.assert_close(res_out, want_res, atol=_tol(dtype), rtol=_tol(dtype))


MASK = getattr(EPOCH_MASK, "value", EPOCH_MASK)  # flags count modulo 2^30


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's host pointers (CPU)")
@pytest.mark.parametrize("own_epoch,peer_flag", [(0, 1), (5, 7), (MASK, 0)])
def test_two_rank_branch_under_the_interpreter(own_epoch, peer_flag):
    """Rank 0 of two, in one process: the peer has already pushed its rows into rank 0's buffer
    and signalled (its flag at this call's epoch or one ahead, across the 2^30 wrap), so the
    wait passes; rank 0 must push its own rows to the peer, signal it with the new epoch, keep
    that epoch as its counter and sum in rank order."""
    g = torch.Generator().manual_seed(1)
    rows, n, max_rows, world, programs, slot = 3, 200, 4, 2, 2, 1
    x, peer_x = torch.randn(rows, n, generator=g), torch.randn(rows, n, generator=g)
    r, w = torch.randn(rows, n, generator=g), torch.rand(n, generator=g) + 0.5
    bufs = [torch.zeros(2 * world * max_rows * n) for _ in range(world)]
    base = slot * world * max_rows * n
    bufs[0][base + max_rows * n:][: rows * n] = peer_x.flatten()  # [slot, rank 1, :rows]
    sigs = [torch.zeros(64, dtype=torch.int32) for _ in range(world)]
    for pid in range(programs):
        sigs[0][(pid + 1) * world + 0] = own_epoch  # rank 0's counter
        sigs[0][(pid + 1) * world + 1] = peer_flag  # rank 1's signal to rank 0
    ptrs = [torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64) for ts in (bufs, sigs)]
    out, res_out = torch.empty_like(x), torch.empty_like(x)
    _allreduce_norm_kernel[(programs,)](
        x, ptrs[0], ptrs[1], x, r, w, out, res_out, x.stride(0), r.stride(0), out.stride(0),
        res_out.stride(0), rows, n, base, max_rows, 1e-5,
        RANK=0, WORLD=world, HAS_RES=True, NORM=True, BLOCK=256, WP2=2)
    want, want_res = allreduce_rms_norm_ref([x, peer_x], r, w, 1e-5)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(res_out, want_res, atol=1e-5, rtol=1e-5)
    pushed = bufs[1][base:][: rows * n].view(rows, n)  # [slot, rank 0, :rows] of the peer
    assert torch.equal(pushed, x)
    epoch = (own_epoch + 1) & MASK
    for pid in range(programs):
        assert sigs[1][(pid + 1) * world + 0].item() == epoch  # the signal rank 1 waits for
        assert sigs[0][(pid + 1) * world + 0].item() == epoch  # rank 0's counter moved on


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's host pointers (CPU)")
@pytest.mark.parametrize("slot,chunks", [(0, 2), (2, 1), (1, 8)])
def test_lamport_two_rank_branch_under_the_interpreter(slot, chunks):
    """Rank 0 of two, in one process, the Lamport form: the peer's rows are already in rank 0's
    buffer at this call's slot, so the poll passes at once. Rank 0 must push its columns to the
    peer (-0.0 as +0.0: -0.0 marks an empty element), sum in rank order, mark its copy of the
    previous slot empty and move every counter of its rows to the next slot."""
    g = torch.Generator().manual_seed(2)
    rows, n, max_rows, world, programs = 3, 200, 4, 2, 2
    x, peer_x = torch.randn(rows, n, generator=g), torch.randn(rows, n, generator=g)
    x[0, 5] = -0.0
    r, w = torch.randn(rows, n, generator=g), torch.rand(n, generator=g) + 0.5
    sent = -(1 << 31)
    bufs = [torch.full((3, world, max_rows, n), sent, dtype=torch.int32) for _ in range(world)]
    bufs[0][slot, 1, :rows] = peer_x.view(torch.int32)  # the peer's push, already landed
    prev = (slot + 2) % 3
    bufs[0][prev, 1, :rows] = 7  # the previous call's rows: to be marked empty
    counters = torch.full((max_rows, LAMPORT_COUNTERS), slot, dtype=torch.int32)
    counters[rows:] = 9  # rows past this call's: untouched
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    out, res_out = torch.empty_like(x), torch.empty_like(x)
    fpp = LAMPORT_COUNTERS // chunks
    _allreduce_norm_kernel[(programs, chunks)](
        x, ptrs, counters, bufs[0], r, w, out, res_out, x.stride(0), r.stride(0),
        out.stride(0), res_out.stride(0), rows, n, 0, max_rows, 1e-5,
        RANK=0, WORLD=world, HAS_RES=True, NORM=True, BLOCK=256, LAMPORT=True,
        FC=LAMPORT_COUNTERS, FPP=fpp,
        CB=next_pow2(fpp * 16 * -(-n // (16 * LAMPORT_COUNTERS))), SENT=sent)
    want, want_res = allreduce_rms_norm_ref([x, peer_x], r, w, 1e-5)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(res_out, want_res, atol=1e-5, rtol=1e-5)
    pushed = bufs[1][slot, 0, :rows].view(torch.float32)  # [slot, rank 0, :rows] of the peer
    assert torch.equal(pushed, x) and pushed.view(torch.int32)[0, 5].item() == 0  # +0.0
    assert (bufs[1][slot, 0, rows:] == sent).all() and (bufs[1][prev] == sent).all()
    assert (bufs[0][prev] == sent).all()  # marked empty
    assert (counters[:rows] == (slot + 1) % 3).all() and (counters[rows:] == 9).all()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's host pointers (CPU)")
@pytest.mark.parametrize("rows,prologue", [(1, "none"), (1, "silu_mul"), (3, "none")])
def test_gemv_push_then_poll_under_the_interpreter(rows, prologue):
    """The pushed form, rank 0 of two in one process: ``gemv(push=...)`` stores y's rows at
    [slot, 0, row] of both ranks' buffers (-0.0 as +0.0) and no tensor; the peer's rows are
    already in rank 0's buffer; the poll kernel (``PUSHED``: x never read) then sums both from
    the buffer in rank order, marks the previous slot empty, own rows included, and moves the
    counters on."""
    from speculant.kernels.gemv import GemvConfig, GemvPush, gemv

    g = torch.Generator().manual_seed(3)
    n, k, max_rows, world, slot = 96, 64, 4, 2, 1
    x = torch.randn(rows, 2 * k if prologue == "silu_mul" else k, generator=g)
    wt, bias = torch.randn(n, k, generator=g) * 0.1, torch.randn(n, generator=g)
    bias[7], wt[7] = -0.0, 0.0  # column 7 of y: exactly -0.0 (0 + -0.0)
    peer_y = torch.randn(rows, n, generator=g)
    r, w = torch.randn(rows, n, generator=g), torch.rand(n, generator=g) + 0.5
    sent = -(1 << 31)
    bufs = [torch.full((3, world, max_rows, n), sent, dtype=torch.int32) for _ in range(world)]
    bufs[0][slot, 1, :rows] = peer_y.view(torch.int32)
    prev = (slot + 2) % 3
    bufs[0][prev] = 5
    counters = torch.full((max_rows, LAMPORT_COUNTERS), slot, dtype=torch.int32)
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    push = GemvPush(ptrs, bufs[0], counters, 0, world, sent)
    cfg = (GemvConfig(block_n=16, block_k=32, use_dot=False) if rows == 1
           else GemvConfig(block_n=16, block_k=32, use_dot=True))
    got = gemv(x, wt, bias, prologue=prologue, push=push, force_triton=True, config=cfg)
    assert got is None
    y = gemv(x, wt, bias, prologue=prologue, force_triton=True, config=cfg)  # the same sums
    for b in bufs:
        assert torch.equal(b[slot, 0, :rows].view(torch.float32), y)
        assert (b[slot, 0, :rows, 7] == 0).all()  # -0.0 went out as +0.0
    out, res_out = torch.empty(rows, n), torch.empty(rows, n)
    fpp = LAMPORT_COUNTERS
    _allreduce_norm_kernel[(rows, 1)](
        out, ptrs, counters, bufs[0], r, w, out, res_out, out.stride(0), r.stride(0),
        out.stride(0), res_out.stride(0), rows, n, 0, max_rows, 1e-5,
        RANK=0, WORLD=world, HAS_RES=True, NORM=True, BLOCK=128, LAMPORT=True,
        FC=LAMPORT_COUNTERS, FPP=fpp,
        CB=next_pow2(fpp * 16 * -(-n // (16 * LAMPORT_COUNTERS))), SENT=sent, PUSHED=True)
    want, want_res = allreduce_rms_norm_ref([y, peer_y], r, w, 1e-5)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(res_out, want_res, atol=1e-5, rtol=1e-5)
    assert (bufs[0][prev, :, :rows] == sent).all()  # own and peer rows marked empty
    assert (counters[:rows] == (slot + 1) % 3).all() and (counters[rows:] == slot).all()


def test_reference_sums_in_rank_order():
    a = torch.tensor([[1e8, 1.0]], dtype=torch.float32)
    b = torch.tensor([[-1e8, 1.0]], dtype=torch.float32)
    s, _ = allreduce_rms_norm_ref([a, b], None, None)
    assert s.tolist() == [[0.0, 2.0]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, rows_list, q) -> None:
    import torch.distributed as dist

    from speculant.kernels.gemv import gemv, gemv_split
    from speculant.kernels.tp_allreduce import SymmetricAllReduce

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=dev)
    try:
        hidden, dtype = 4096, torch.bfloat16
        ar = SymmetricAllReduce(dist.group.WORLD, dev, max(rows_list), hidden, dtype)
        errs = []
        for rows in rows_list:
            g = torch.Generator(device=dev).manual_seed(1000 + rows)
            parts = [torch.randn(rows, hidden, generator=g, device=dev, dtype=dtype)
                     for _ in range(world)]
            res = torch.randn(rows, hidden, generator=g, device=dev, dtype=dtype)
            w = torch.rand(hidden, generator=g, device=dev, dtype=dtype) + 0.5
            want, want_res = allreduce_rms_norm_ref(parts, res, w, 1e-5)
            for slot in range(4):  # eager, both buffers
                out, out_res = ar(parts[rank], slot, res, w, 1e-5)
                errs.append((out.float() - want.float()).abs().max().item())
                errs.append((out_res.float() - want_res.float()).abs().max().item())
            # a CUDA graph of 64 back-to-back calls, each on the previous one's output
            x = parts[rank].clone()
            outs = []
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                ar(x, 0)
            torch.cuda.current_stream().wait_stream(s)
            with torch.cuda.graph(graph):
                y = x
                for i in range(64):
                    y, _ = ar(y * (1.0 / world), i)
                    outs.append(y)
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
            # every rank starts from its own x; after one call all hold the same mean
            gathered = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(gathered, x)
            ref = allreduce_rms_norm_ref([t * (1.0 / world) for t in gathered], None, None)[0]
            errs.append((outs[0].float() - ref.float()).abs().max().item())
            last = [torch.empty_like(outs[-1]) for _ in range(world)]
            dist.all_gather(last, outs[-1])
            errs.append(max((t.float() - outs[-1].float()).abs().max().item() for t in last))
            if gemv_split(parts[rank][:, :1024], torch.empty(hidden, 1024, device=dev,
                                                             dtype=dtype)) == 1:
                # the GEMV's programs push (gemv_all_reduce), eager then in a graph
                k = 1024
                xs = [torch.randn(rows, k, generator=g, device=dev, dtype=dtype)
                      for _ in range(world)]
                ws = [torch.randn(hidden, k, generator=g, device=dev, dtype=dtype) * 0.05
                      for _ in range(world)]
                prods = [gemv(xs[i], ws[i]) for i in range(world)]
                want, want_res = allreduce_rms_norm_ref(prods, res, w, 1e-5)
                for _ in range(4):
                    got = ar.gemv_all_reduce(xs[rank], ws[rank], None, "none", res, w, 1e-5)
                    assert got is not None, "gemv_all_reduce declined an unsplit product"
                    errs.append((got[0].float() - want.float()).abs().max().item())
                    errs.append((got[1].float() - want_res.float()).abs().max().item())
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    outs = [ar.gemv_all_reduce(xs[rank], ws[rank], None, "none", res, w, 1e-5)[0]
                            if i % 3 else ar(prods[rank], i, res, w, 1e-5)[0] for i in range(24)]
                for _ in range(3):
                    graph.replay()
                torch.cuda.synchronize()
                errs.extend((o.float() - want.float()).abs().max().item() for o in outs)
        q.put((rank, max(errs)))
    except Exception as e:  # pragma: no cover - reported to the parent
        q.put((rank, repr(e)))
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_multi_gpu_allreduce_matches_reference(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA devices")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    ctx = torch.multiprocessing.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, [1, 8, 64], q))
             for r in range(world)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(60)
    for rank, err in got.items():
        assert not isinstance(err, str), f"rank {rank}: {err}"
        assert err <= 0.07, f"rank {rank}: max error {err}"
