"""The CUDA-graph runner's input staging, on CPU: the list path used for small steps
(``_fill_small``) writes exactly what the numpy path (``_fill``) writes, and the layer
segmentation of captured graphs covers every layer once."""

from __future__ import annotations

import random
import types

import pytest
import torch
from staging_switch import STAGING as _STAGING
from staging_switch import use_staging

from speculant.engine import cuda_graph
from speculant.engine import staging as staging_mod
from speculant.engine.cuda_graph import CudaGraphRunner, segment_starts
from speculant.kernels.stage_copy import stage_copy_reference


class _NoEvent:
    def synchronize(self) -> None:
        pass

    def record(self) -> None:
        pass


def _runner(monkeypatch) -> CudaGraphRunner:
    monkeypatch.setattr(torch.cuda, "Event", _NoEvent)
    return CudaGraphRunner(None, None, 16, torch.device("cpu"), 12, max_batch=8, max_query=8)


def _seqs(rng: random.Random, n: int, query_lens: list[int]):
    seqs = []
    for ql in query_lens:
        cached = rng.randrange(0, 150)
        blocks = rng.sample(range(1000), (cached + ql + 15) // 16)
        seqs.append(types.SimpleNamespace(num_cached_tokens=cached, block_table=blocks))
    return seqs


@pytest.mark.parametrize("staging", ["c", "python"])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("on_device", [False, True])
def test_small_step_staging_matches_numpy_staging(monkeypatch, seed, on_device, staging):
    use_staging(monkeypatch, staging)
    rng = random.Random(seed)
    n = rng.randrange(1, 8)
    query_lens = [rng.randrange(1, 7) for _ in range(n)]
    new_tokens = [[rng.randrange(5, 30000) for _ in range(q)] for q in query_lens]
    B = cuda_graph._bucket(n, (1, 2, 4, 8))
    Q = cuda_graph._bucket(max(query_lens), (1, 2, 4, 8))
    a, b = _runner(monkeypatch), _runner(monkeypatch)
    for r in (a, b):  # stale contents from an earlier, larger step
        r.host.copy_(torch.randint(0, 255, r.host.shape, dtype=torch.uint8))
    b.host.copy_(a.host)
    seqs = _seqs(rng, n, query_lens)
    M, N = B * Q, a.max_tokens
    a._fill(seqs, new_tokens, query_lens, B, M, on_device)
    b._fill_small(seqs, new_tokens, query_lens, B, M, on_device)
    for lo in (0, N, 2 * N):  # ids, positions, slots: the rows the graph reads
        assert a.np64[lo : lo + M].tolist() == b.np64[lo : lo + M].tolist()
    c, q, t = a.o32
    assert a.np32[c : c + B].tolist() == b.np32[c : c + B].tolist()  # context lengths
    assert a.np32[q : q + B + 1].tolist() == b.np32[q : q + B + 1].tolist()  # query starts
    for i, s in enumerate(seqs):  # block tables
        row = slice(t + i * a.W, t + i * a.W + len(s.block_table))
        assert a.np32[row].tolist() == b.np32[row].tolist() == s.block_table
    # and the values are the right ones: positions and slots of the last sequence's tokens
    s, ql, T = seqs[-1], query_lens[-1], sum(query_lens)
    pos = list(range(s.num_cached_tokens, s.num_cached_tokens + ql))
    assert b.np64[N + T - ql : N + T].tolist() == pos
    assert b.np64[2 * N + T - ql : 2 * N + T].tolist() == [
        s.block_table[p // 16] * 16 + p % 16 for p in pos
    ]
    assert b.np64[2 * N + T : 2 * N + M].tolist() == [-1] * (M - T)  # padding is not stored


def test_the_int64_and_int32_regions_share_one_staging_buffer(monkeypatch):
    r = _runner(monkeypatch)
    r.np64[0] = 123456789012
    r.np32[-1] = -7
    r.dev.copy_(r.host)  # what a step does, once
    assert r.dev64[0].item() == 123456789012 and r.dev32[-1].item() == -7


@pytest.mark.parametrize("layers", [1, 2, 9, 16, 32])
def test_segments_start_at_layer_boundaries(layers):
    starts = sorted(segment_starts(layers))
    assert all(0 < s < layers for s in starts)
    bounds = [0, *starts, layers]
    sizes = [hi - lo for lo, hi in zip(bounds, bounds[1:])]
    assert sum(sizes) == layers and all(sz > 0 for sz in sizes)
    assert sizes[0] == min(layers, cuda_graph.FIRST_SEGMENT_LAYERS)


def _ring_copy(r: CudaGraphRunner, B: int, M: int) -> None:
    """What the graph's first kernel does (its torch reference, kernels/stage_copy.py)."""
    stage_copy_reference(r.ring64, r.ring32, r.dev64, r.dev32, r.count, r.ack, r.err,
                         r._layout(B, M))


@pytest.mark.parametrize("staging", ["c", "python"])
@pytest.mark.parametrize("on_device", [False, True])
def test_ring_staging_gives_the_graph_what_the_copy_path_gives(monkeypatch, on_device, staging):
    """Small steps stage into a pinned ring slot that the graph copies itself: over more launches
    than the ring has slots, the device buffers the graph reads hold what the one-copy path
    puts there (the ids a caller wrote on the device are left alone)."""
    use_staging(monkeypatch, staging)
    rng = random.Random(1)
    ring, ref = _runner(monkeypatch), _runner(monkeypatch)
    for launch in range(1, 2 * cuda_graph.STAGE_RING + 2):
        n = rng.randrange(1, 8)
        query_lens = [rng.randrange(1, 7) for _ in range(n)]
        new_tokens = [[rng.randrange(5, 30000) for _ in range(q)] for q in query_lens]
        B = cuda_graph._bucket(n, (1, 2, 4, 8))
        Q = cuda_graph._bucket(max(query_lens), (1, 2, 4, 8))
        T, M = sum(query_lens), B * Q
        seqs = _seqs(rng, n, query_lens)
        twins = [types.SimpleNamespace(**vars(s)) for s in seqs]
        on_dev_ids = torch.tensor([rng.randrange(5, 30000) for _ in range(T)])
        slot = ring._stage_ring(seqs, new_tokens, query_lens, B, M, T if on_device else 0)
        assert slot == (launch - 1) % cuda_graph.STAGE_RING
        if on_device:
            ring.dev64[:T].copy_(on_dev_ids)  # the caller's device-side ids, before the launch
        ring.launches += 1
        _ring_copy(ring, B, M)
        ref._stage(twins, new_tokens, query_lens, B, M, on_device)
        if on_device:
            ref.dev64[:T].copy_(on_dev_ids)
        assert [s.num_cached_tokens for s in seqs] == [s.num_cached_tokens for s in twins]
        assert int(ring.count[0]) == launch and int(ring.ack[slot]) == launch
        assert int(ring.err[0]) == 0
        N = ring.max_tokens
        for lo in (0, N, 2 * N):
            assert ring.dev64[lo : lo + M].tolist() == ref.dev64[lo : lo + M].tolist()
        c, q, t = ring.o32
        for lo, k in ((c, B), (q, B + 1)):
            assert ring.dev32[lo : lo + k].tolist() == ref.dev32[lo : lo + k].tolist()
        for i, s in enumerate(twins):
            row = slice(t + i * ring.W, t + i * ring.W + len(s.block_table))
            assert ring.dev32[row].tolist() == s.block_table


def test_ring_staging_waits_for_an_unconsumed_slot_then_reports_it(monkeypatch):
    r = _runner(monkeypatch)
    synced = []
    monkeypatch.setattr(
        torch.cuda, "current_stream",
        lambda device=None: types.SimpleNamespace(synchronize=lambda: synced.append(1)),
    )
    seqs = _seqs(random.Random(0), 1, [1])
    for _ in range(cuda_graph.STAGE_RING):  # launches whose copies never run
        r._stage_ring(seqs, [[7]], [1], 1, 1, 0)
        r.launches += 1
    assert not synced
    with pytest.raises(RuntimeError, match="never copied its ring slot"):
        r._stage_ring(seqs, [[7]], [1], 1, 1, 0)
    assert synced == [1]  # it waited for the stream before giving up
    r.err[0] = 5
    with pytest.raises(RuntimeError, match="out of step: launch 5"):
        r._stage_ring(seqs, [[7]], [1], 1, 1, 0)


def _prefill_runner(monkeypatch, max_prefill: int = 200) -> CudaGraphRunner:
    monkeypatch.setattr(torch.cuda, "Event", _NoEvent)
    return CudaGraphRunner(None, None, 16, torch.device("cpu"), 40, max_batch=8, max_query=8,
                           max_prefill=max_prefill)


def test_prefill_steps_get_token_bucket_graphs(monkeypatch):
    """A step whose sequences all feed <= max_query tokens runs a (B, B * Q) decode /
    verification graph; one with a longer feed (a prompt) a graph of its total token count
    rounded up to a prefill bucket, up to max_prefill; beyond that it is not supported (eager)."""
    r = _prefill_runner(monkeypatch)
    assert r.max_tokens == 200 and r.p_buckets[-1] == 200
    assert all(b < 200 for b in r.p_buckets[:-1])
    rng = random.Random(0)
    assert r.plan(_seqs(rng, 3, [3, 1, 8]), [3, 1, 8]) == (4, 32, 8)  # decode-style: B * Q rows
    # prefill: one graph per token bucket, for up to max_batch sequences
    assert r.plan(_seqs(rng, 1, [9]), [9]) == (8, 32, 32)  # the smallest prefill bucket
    assert r.plan(_seqs(rng, 2, [100, 3]), [100, 3]) == (8, 128, 128)  # ragged: one flat bucket
    assert r.plan(_seqs(rng, 2, [150, 50]), [150, 50]) == (8, 200, 200)  # the cap is a bucket
    assert r.plan(_seqs(rng, 2, [150, 51]), [150, 51]) is None  # 201 tokens: eager
    assert _prefill_runner(monkeypatch, 0).plan(_seqs(rng, 1, [9]), [9]) is None  # graphs off
    assert r.plan(_seqs(rng, 9, [1] * 9), [1] * 9) is None  # more sequences than max_batch
    wide = _seqs(rng, 1, [1])
    wide[0].block_table = list(range(r.W + 1))
    assert r.plan(wide, [1]) is None  # a table wider than the graphs'
    # buckets grow by at most 1.5x (1.25x from 128): padding is at most half the step's tokens
    b = cuda_graph.PREFILL_BUCKETS
    assert all(hi <= (1.5 if lo < 128 else 1.25) * lo for lo, hi in zip(b, b[1:]))


@pytest.mark.parametrize("staging", ["c", "python"])
@pytest.mark.parametrize("seed", range(4))
def test_prefill_staging_pads_a_flat_token_bucket(monkeypatch, seed, staging):
    """Ragged prompts (and a decode row) staged into a prefill bucket: every real token's id,
    position and slot, padding rows after them (slot -1: no K/V write), and padding sequences
    with empty query ranges and context 0, whichever staging path runs."""
    use_staging(monkeypatch, staging)
    rng = random.Random(seed)
    r = _prefill_runner(monkeypatch)
    n = rng.randrange(2, 5)
    query_lens = [rng.randrange(9, 40) for _ in range(n - 1)] + [1]
    new_tokens = [[rng.randrange(5, 30000) for _ in range(q)] for q in query_lens]
    seqs = _seqs(rng, n, query_lens)
    B, M, Q = r.plan(seqs, query_lens)
    T, N = sum(query_lens), r.max_tokens
    assert M >= T and Q == M and B == r.max_batch
    r.host.copy_(torch.randint(0, 255, r.host.shape, dtype=torch.uint8))  # stale contents
    starts = [s.num_cached_tokens for s in seqs]
    r._stage(seqs, new_tokens, query_lens, B, M)
    ids, pos, slots, ctx, qsl, tables = r._views(B, M)
    assert ids.tolist() == [t for f in new_tokens for t in f] + [0] * (M - T)
    want_pos = [p for st, q in zip(starts, query_lens) for p in range(st, st + q)]
    assert pos.tolist() == want_pos + [0] * (M - T)
    want_slots = [s.block_table[p // 16] * 16 + p % 16
                  for s, st, q in zip(seqs, starts, query_lens) for p in range(st, st + q)]
    assert slots.tolist() == want_slots + [-1] * (M - T)
    assert ctx.tolist() == [st + q for st, q in zip(starts, query_lens)] + [0] * (B - n)
    cum = [0]
    for q in query_lens:
        cum.append(cum[-1] + q)
    assert qsl.tolist() == cum + [T] * (B - n)
    for i, s in enumerate(seqs):
        assert tables[i, : len(s.block_table)].tolist() == s.block_table
    assert [s.num_cached_tokens for s in seqs] == [st + q for st, q in zip(starts, query_lens)]
    assert r.dev64.shape[0] == cuda_graph.REGIONS * N


def test_prefill_graph_limit_from_argument_or_default():
    assert cuda_graph.max_prefill_tokens() == cuda_graph.MAX_PREFILL_TOKENS
    assert cuda_graph.max_prefill_tokens(256) == 256
    assert cuda_graph.max_prefill_tokens(0) == 0
    with pytest.raises(ValueError, match=">= 0 tokens"):
        cuda_graph.max_prefill_tokens(-1)


def test_prefill_graph_limit_config_is_validated():
    from pydantic import ValidationError

    from speculant.config import EngineConfig

    assert EngineConfig(max_prefill_graph_tokens=0).max_prefill_graph_tokens == 0
    with pytest.raises(ValidationError, match="max_prefill_graph_tokens"):
        EngineConfig(max_prefill_graph_tokens=-5)


@pytest.mark.parametrize("on_device", [False, True])
def test_c_ring_staging_equals_python_on_random_steps(monkeypatch, on_device):
    """``ring_ints`` (C) writes what ``_fill_small`` in Python writes, over the whole buffers
    (stale contents outside the written ranges stay as they were), on 300 random steps of 1-8
    sequences: decode, verification and prefill shapes."""
    if _STAGING is None:
        pytest.skip("speculant._staging not built")
    rng = random.Random(7)
    a, b = _prefill_runner(monkeypatch), _prefill_runner(monkeypatch)
    for _ in range(300):
        n = rng.randrange(1, 9)
        query_lens = [rng.choice([1, 2, 6, rng.randrange(1, 30)]) for _ in range(n)]
        if sum(query_lens) > a.max_prefill:
            continue
        new_tokens = [[rng.randrange(0, 130000) for _ in range(q)] for q in query_lens]
        seqs = _seqs(rng, n, query_lens)
        B, M, _ = a.plan(seqs, query_lens)
        stale = torch.randint(-(2**40), 2**40, a.np64.shape, dtype=torch.int64)
        for r in (a, b):
            r.host.copy_(torch.randint(0, 255, r.host.shape, dtype=torch.uint8))
        b.host.copy_(a.host)
        a.np64[:] = stale.numpy()
        b.np64[:] = stale.numpy()
        monkeypatch.setattr(staging_mod, "_ext", _STAGING)
        a._fill_small(seqs, new_tokens, query_lens, B, M, on_device)
        monkeypatch.setattr(staging_mod, "_ext", False)
        b._fill_small(seqs, new_tokens, query_lens, B, M, on_device)
        assert a.np64.tolist() == b.np64.tolist()
        assert a.np32.tolist() == b.np32.tolist()


def test_c_ring_staging_names_bad_inputs(monkeypatch):
    if _STAGING is None:
        pytest.skip("speculant._staging not built")
    r = _prefill_runner(monkeypatch)
    c, q, t = r.o32
    args = dict(N=r.max_tokens, M=8, B=2, W=r.W, bs=16, c=c, q=q, t=t)

    def call(tables, starts, feeds, h64=r.np64, h32=r.np32, **kw):
        d = dict(args, **kw)
        _STAGING.ring_ints(h64, h32, tables, starts, feeds, False, d["N"], d["M"], d["B"],
                           d["W"], d["bs"], d["c"], d["q"], d["t"])

    call([[3, 4]], [20], [[5, 6]])  # fine: positions 20, 21 in block 4
    assert r.np64[2 * r.max_tokens : 2 * r.max_tokens + 3].tolist() == [4 * 16 + 4, 4 * 16 + 5, -1]
    with pytest.raises(ValueError, match="positions 30 .. 32"):
        call([[3, 4]], [30], [[5, 6, 7]])  # position 32 is past the 2-block table
    with pytest.raises(ValueError, match="10 rows over 8"):
        call([[3, 4]], [0], [list(range(10))])
    with pytest.raises(ValueError, match="3 tables, 3 starts, 3 feeds for a batch bucket of 2"):
        call([[1]] * 3, [0] * 3, [[1]] * 3)
    with pytest.raises(ValueError, match="h64 must be int64"):
        call([[1]], [0], [[1]], h64=r.np32)
    with pytest.raises(ValueError, match="h32 must be int32"):
        call([[1]], [0], [[1]], h32=r.np32[:4])
    with pytest.raises(ValueError, match="block id 4294967296 is not an int32"):
        call([[1, 2**32]], [0], [[1]])
    with pytest.raises(ValueError, match="table of 50 blocks"):
        call([list(range(50))], [0], [[1]])


def test_startup_keys_are_the_plans_of_every_step(monkeypatch):
    """Every step of up to ``max_seqs`` sequences and ``max_query`` tokens each (decode,
    verification) or of a prefill of up to the token limit (some prompt longer than the
    runner's max_query) plans a graph among ``startup_keys``, and every key is some step's."""
    r = _prefill_runner(monkeypatch, 256)
    keys = r.startup_keys(max_seqs=3, max_query=4, aux_layers=(0, 2), max_prefill_tokens=100)
    assert keys == [(B, B * Q, Q, (0, 2), False) for Q in (1, 2, 3, 4) for B in (1, 2, 4)] + [
        (8, M, M, (0, 2), False) for M in (32, 48, 64, 96, 128)
    ]
    rng = random.Random(0)
    planned = set()
    for _ in range(2000):
        n = rng.randrange(1, 4)
        if rng.random() < 0.5:  # decode / verification
            lens = [rng.randrange(1, 5) for _ in range(n)]
        else:  # prefill: one prompt over max_query, at most 100 tokens in all
            lens = [rng.randrange(9, 101)] + [rng.randrange(1, 20) for _ in range(n - 1)]
            if sum(lens) > 100:
                continue
        seqs = [types.SimpleNamespace(block_table=[0]) for _ in lens]
        planned.add((*r.plan(seqs, lens), (0, 2), False))
    assert planned <= set(keys)
    assert planned == set(keys)  # 2000 random steps reach every bucket
    # a speculative engine's scored steps: the head graph of every verification bucket (Q >= 2)
    # of at most HEAD_MAX_ROWS rows, besides the plain ones
    head = r.startup_keys(max_seqs=3, max_query=4, aux_layers=(0, 2), max_prefill_tokens=100,
                          head=True)
    assert set(head) - set(keys) == {(B, B * Q, Q, (0, 2), True) for Q in (2, 3, 4)
                                     for B in (1, 2, 4)}
    big = r.startup_keys(max_seqs=50, max_query=8, head=True)
    heads = [k for k in big if k[4]]
    assert heads and all(k[2] >= 2 and k[1] <= cuda_graph.HEAD_MAX_ROWS for k in heads)
    assert {(B, Q) for B, M, Q, _, h in big if h} == {
        (B, Q) for B, M, Q, _, h in big
        if not h and 2 <= Q <= 8 and M <= cuda_graph.HEAD_MAX_ROWS}
    # a vocab-parallel target (``decode_head``): decode steps take head graphs too
    r.decode_head = True
    both = r.startup_keys(max_seqs=3, max_query=4, aux_layers=(0, 2), max_prefill_tokens=100,
                          head=True)
    assert set(both) - set(head) == {(B, B, 1, (0, 2), True) for B in (1, 2, 4)}
    plain = r.startup_keys(max_seqs=3, max_query=4, aux_layers=(0, 2), max_prefill_tokens=100)
    assert set(plain) - set(keys) == {(B, B, 1, (0, 2), True) for B in (1, 2, 4)}
    r.decode_head = False
    # limits: more sequences than the graphs hold, queries past max_query, no prefill graphs
    assert r.startup_keys(50, 40)[-1] == (8, 256, 256, (), False)
    assert {k[0] for k in r.startup_keys(50, 40) if k[2] <= 8} == {1, 2, 4, 8}
    assert all(k[2] <= 8 for k in _prefill_runner(monkeypatch, 0).startup_keys(3, 4))


def test_capture_all_captures_missing_keys_on_an_empty_step(monkeypatch):
    """``capture_all`` captures each missing key once, in order, after staging a step with no
    sequence: padding rows (slot -1: no K/V written), zero context lengths, empty queries."""
    r = _prefill_runner(monkeypatch, 256)
    r.dev.copy_(torch.randint(0, 255, r.dev.shape, dtype=torch.uint8))  # stale contents
    seen = []

    def capture(B, M, Q, aux, head):
        ids, pos, slots, ctx, qsl, tables = r._views(B, M)
        assert ids.tolist() == pos.tolist() == [0] * M and slots.tolist() == [-1] * M
        assert ctx.tolist() == [0] * B and qsl.tolist() == [0] * (B + 1)
        assert tables.abs().sum().item() == 0
        r.graphs[(B, M, Q, aux, head)] = "graph"
        seen.append((B, M, Q, aux, head))

    monkeypatch.setattr(r, "_capture", capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    keys = r.startup_keys(2, 2, head=True)
    assert any(k[4] for k in keys)
    r.graphs[keys[1]] = "captured earlier"
    assert r.capture_all(keys + keys[:1], progress=False) == len(keys) - 1
    assert seen == [k for k in keys if k != keys[1]]
    assert r.capture_all(keys, progress=False) == 0


def test_cuda_graph_capture_mode_is_validated_and_cpu_engines_capture_nothing(tiny_factory):
    from pydantic import ValidationError

    from speculant import LLM
    from speculant.config import EngineConfig

    assert EngineConfig().cuda_graph_capture == "startup"
    with pytest.raises(ValidationError, match="cuda_graph_capture"):
        EngineConfig(cuda_graph_capture="eager")
    tiny = tiny_factory("llama", tokenizer=False)
    llm = LLM(model=str(tiny), skip_tokenizer_init=True, device="cpu")
    assert llm.engine.runner.graphs is None and llm.engine.capture_graphs() == 0


def test_startup_capture_out_of_memory_names_the_fix(tiny_factory, monkeypatch):
    """A start-up capture that runs out of GPU memory raises an error that names the settings
    to lower and the lazy mode, not torch's allocator message."""
    from speculant import LLM

    llm = LLM(model=str(tiny_factory("llama", tokenizer=False)), skip_tokenizer_init=True,
              device="cpu")

    def oom(*a, **k):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(llm.engine.runner, "capture_graphs", oom)
    with pytest.raises(RuntimeError, match="cuda_graph_capture='lazy'") as e:
        llm.engine.capture_graphs()
    assert "gpu_memory_utilization" in str(e.value) and e.value.__cause__ is None


def test_gc_paused_during_captures():
    """No cyclic collection may run inside a capture (it could destroy another graph there,
    which invalidates the capture): ``gc_paused`` turns the collector off and restores it, on
    error too, and leaves it off where it was off."""
    import gc

    from speculant.engine.cuda_graph import gc_paused

    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ValueError), gc_paused():
        raise ValueError("capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_scored_steps_replay_head_graphs_up_to_head_max_rows(monkeypatch):
    """``ModelRunner.score``: a verification step (2+ tokens for some sequence, at most
    max_query) whose graph has at most HEAD_MAX_ROWS rows replays the head graph (LM head and
    greedy pack inside, nothing launched after); a decode-shaped step or a larger one runs the
    graph without the head and the LM head eagerly, with the greedy pack only when asked."""
    from speculant.engine.model_runner import ModelRunner
    from speculant.engine.sampler import greedy_pack

    g = _runner(monkeypatch)  # max_batch 8, max_query 8
    calls = []
    H, V = 4, 11

    def run_head(seqs, new_tokens, aux, plan, clone_hidden=True, token_ids=None):
        calls.append(("head", plan, clone_hidden))
        T = sum(map(len, new_tokens))
        return torch.zeros(T, H), None, torch.zeros(T, V), torch.zeros(T, 2, dtype=torch.float64)

    def run(seqs, new_tokens, aux, token_ids=None, plan=None):
        calls.append(("plain", plan))
        return torch.zeros(sum(map(len, new_tokens)), H), None

    monkeypatch.setattr(g, "run_head", run_head)
    monkeypatch.setattr(g, "run", run)
    runner = ModelRunner.__new__(ModelRunner)
    runner.graphs = g
    gen = torch.Generator().manual_seed(0)
    runner.model = types.SimpleNamespace(compute_logits=lambda h: torch.randn(h.shape[0], V,
                                                                              generator=gen))
    rng = random.Random(0)

    def score(lens, greedy=True, keep=True):
        calls.clear()
        out = runner.score(_seqs(rng, len(lens), lens), [[1] * q for q in lens], (), greedy,
                           keep_hidden=keep)
        return calls[0], out

    (kind, plan, clone), out = score([6], keep=False)
    assert (kind, plan, clone) == ("head", (1, 6, 6), False) and out[3].shape == (6, 2)
    (kind, plan, _), _ = score([3, 1, 2, 8, 1, 1, 1, 5])  # 8 x 8 = 64 rows: the limit
    assert (kind, plan) == ("head", (8, 64, 8))
    (kind, plan), out = score([1, 1])  # decode-shaped: no head graph
    assert (kind, plan) == ("plain", (2, 2, 1))
    assert torch.equal(out[3], greedy_pack(out[2]))  # computed eagerly, from the same logits
    g.head_rows = 16  # what a runner built with HEAD_MAX_ROWS = 16 holds
    (kind, plan), out = score([6, 2, 1], greedy=False)  # 4 x 6 = 24 rows > 16
    assert (kind, plan) == ("plain", (4, 24, 6)) and out[3] is None and out[2].shape == (9, V)
    (kind, plan, _), _ = score([8, 2])  # 2 x 8 = 16 rows
    assert (kind, plan) == ("head", (2, 16, 8))


def test_head_graph_rows_limit_the_startup_keys(monkeypatch):
    """A runner's head graphs (``head_rows``, ``HEAD_MAX_ROWS``) are the verification buckets of at
    most that many rows."""
    r = _runner(monkeypatch)
    assert r.head_rows == cuda_graph.HEAD_MAX_ROWS
    r.head_rows = 16
    assert r.head_fits(16) and not r.head_fits(24)
    assert {k[1] for k in r.startup_keys(8, 8, head=True) if k[4]} <= {2, 3, 4, 6, 8, 12, 16}


def test_wide_verification_steps_get_decode_shaped_graphs(monkeypatch):
    """Scored and tree steps (``wide``) of more than max_query and at most 64 tokens per
    sequence plan (B, B * Q, Q) graphs of a WIDE_QUERY_BUCKETS Q (the tree attention's Q <= 64);
    other steps of that length stay prefill-shaped, and a wide step whose rows exceed the static
    buffers falls back to them too. A speculative engine of k + 1 > max_query captures the wide
    graphs of its scored steps at start-up, head graphs where they fit."""
    r = _prefill_runner(monkeypatch, 256)  # max_batch 8, max_query 8: 256 static rows
    seq = [types.SimpleNamespace(block_table=[0])]
    for q, Q in ((9, 24), (17, 24), (24, 24), (25, 32), (33, 48), (49, 64), (64, 64)):
        assert r.plan(seq, [q], wide=True) == (1, Q, Q)
        M = cuda_graph._bucket(q, r.p_buckets)
        assert r.plan(seq, [q]) == (8, M, M)
    assert r.plan(seq, [65], wide=True) == r.plan(seq, [65])  # past the tree limit: prefill
    four = seq * 4
    assert r.plan(four, [40, 1, 1, 1], wide=True) == (4, 192, 48)
    assert r.plan(seq * 5, [64] * 5, wide=True) == r.plan(seq * 5, [64] * 5)  # 8 x 64 > 256
    assert r.plan(seq, [3], wide=True) == r.plan(seq, [3]) == (1, 3, 3)
    keys = r.startup_keys(max_seqs=3, max_query=30, head=True)
    wide = {k for k in keys if k[2] > 8 and k[1] == k[0] * k[2]}  # not the prefill graphs
    assert wide == {(B, B * Q, Q, (), B * Q <= cuda_graph.HEAD_MAX_ROWS)
                    for Q in (24, 32) for B in (1, 2, 4)}
    assert not any(k[2] > 8 and k[1] == k[0] * k[2]
                   for k in r.startup_keys(max_seqs=3, max_query=30))
    planned = {(*r.plan(seq * n, [q] + [1] * (n - 1), wide=True), (), True)
               for n in (1, 2, 3) for q in range(9, 31)}
    assert {(B, M, Q) for B, M, Q, _, _ in planned} == {k[:3] for k in wide}


def test_tree_steps_stage_positions_and_bits_with_the_other_inputs(monkeypatch):
    """A tree step writes its RoPE positions over the consecutive ones and its tree bits (then
    zeros up to M) into the fourth int64 region of the same staging (a ring slot, or the one
    pinned buffer of larger steps), which the graph's own copy brings to ``tree_bits``."""
    r = _runner(monkeypatch)
    N = r.max_tokens
    seqs = [types.SimpleNamespace(num_cached_tokens=20, block_table=[3, 4])]
    tree = ([20, 21, 21, 22], [1, 3, 5, -(2**63)])
    slot = r._stage_ring(seqs, [[7, 8, 9, 10]], [4], 1, 6, 0, tree)
    h64 = r.ring64[slot]
    assert h64[N : N + 4].tolist() == tree[0] and h64[3 * N : 3 * N + 6].tolist() == tree[1] + [0, 0]
    assert h64[cuda_graph.REGIONS * N].item() == 1  # the launch number after the regions
    r.np64[3 * N : 4 * N] = 9  # stale bits of an earlier step
    seqs[0].num_cached_tokens = 20
    r._stage(seqs, [[7, 8, 9, 10]], [4], 1, 6, tree=tree)
    assert r.np64[N : N + 4].tolist() == tree[0]
    assert r.np64[3 * N : 3 * N + 7].tolist() == tree[1] + [0, 0, 9]
    assert r.tree_bits.data_ptr() == r.dev64[3 * N :].data_ptr() and r.tree_bits.shape[0] == N
    assert r.dev64[3 * N : 3 * N + 6].tolist() == tree[1] + [0, 0]  # the copy (on the CPU)
