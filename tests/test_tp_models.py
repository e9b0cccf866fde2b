"""Tensor-parallel models (speculant.distributed, models/llama.py, models/opt.py): a forward of
2 gloo ranks (spawned processes) gives the hidden states and logits of the unsharded model.

Tiny random Hugging Face checkpoints: Llama with fewer KV heads than query heads (2 KV heads over
2 ranks: one each), Llama with one KV head (fewer than the ranks: each keeps a copy) and o_proj /
down_proj biases (added by rank 0 only), Qwen2 (qkv bias) and OPT. Each runs a batch of two
prefills (one sequence's blocks not consecutive) and then a step of decode and verification rows
over the paged KV cache, then a one-row step, on every CPU path: the flat numpy / C loop, the flat
torch loop and the module path; the Llama cases also on the CUDA layer paths (``forward_fused``,
``forward_gemv``: the Triton kernels under the CPU interpreter, as tests/test_fused_models.py);
plus ``load_format="dummy"`` weights (the same model at either size)."""

from __future__ import annotations

import os
import types
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported (as tests/test_fused_models.py):
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the CUDA layer paths, interpreted; the
    # spawned ranks inherit it

import torch.multiprocessing as mp  # noqa: E402
from checkpoints import make_tiny_checkpoint  # noqa: E402

from speculant.distributed import (  # noqa: E402
    NO_TENSOR_PARALLEL,
    TensorParallel,
    init_tensor_parallel,
    shard_range,
    shutdown_tensor_parallel,
    tensor_parallel,
)
from speculant.engine.model_runner import ModelRunner  # noqa: E402
from speculant.models.llama import LlamaForCausalLM  # noqa: E402
from speculant.models.loader import check_tensor_parallel, load_config, load_model  # noqa: E402
from speculant.models.opt import OPTForCausalLM  # noqa: E402

CASES = {  # name: (arch, checkpoint overrides)
    "llama_gqa": ("llama", {}),  # 4 heads, 2 KV heads
    "llama_kv1_bias": ("llama", {"num_key_value_heads": 1, "attention_bias": True,
                                 "mlp_bias": True}),
    "qwen2": ("qwen2", {}),  # qkv bias
    "opt": ("opt", {}),
}
MODES = ("flat", "torch", "module")  # the CPU paths of a Llama forward (OPT: module only)
CUDA_PATHS = ("fused", "gemv")  # the CUDA layer paths, under the Triton interpreter
CUDA_CASES = ("llama_gqa", "llama_kv1_bias")
# two sequences: (prompt length, block table); the second's blocks are not consecutive; the
# 20-row prefill takes forward_fused's cuBLAS o_proj / down_proj (> fused.GEMV_FEW_ROWS rows)
SEQS = ((11, [0, 1, 2, 3]), (9, [9, 5, 6, 11]))
CPU = torch.device("cpu")
STEP2 = (1, 3)  # then one decode row and a 3-row verification pass, then one row of the first


def _plan_ready(model) -> None:
    """Build the Llama CPU plan the way a first forward does (``_forward_all`` then picks a path)."""
    from speculant.models import cpu_forward

    if hasattr(model, "_cpu_plan") and model._cpu_plan is None:
        model._cpu_plan = cpu_forward.cpu_plan(model) or False


def _run_case(folder: Path, arch: str, load_format: str, tp, config=None
              ) -> dict[str, list[torch.Tensor]]:
    config = load_config(folder) if config is None else config
    results = {}
    for mode in MODES if arch != "opt" else ("module",):
        model = load_model(folder, config, torch.float32, torch.device("cpu"), 64,
                           load_format=load_format, seed=3, tp=tp)
        _plan_ready(model)
        if mode != "module":
            assert model._cpu_plan, "the Llama CPU plan should cover this model"
        if mode == "torch":
            model._cpu_plan.np_layers = None
        elif mode == "module":
            model._cpu_plan = False
        results[mode] = _forward(model)
    return results


def _forward(model, device: torch.device = CPU) -> list[torch.Tensor]:
    """Hidden states and logits of a prefill step of both sequences, of STEP2, then of one row
    of the first sequence, on a fresh paged cache with block size 4: [hidden, logits] x 3
    (on CUDA: eager, the CUDA layer paths)."""
    runner = ModelRunner(model, num_blocks=12, block_size=4, device=device,
                         dtype=torch.float32, enforce_eager=True)
    seqs = [types.SimpleNamespace(block_table=bt, num_cached_tokens=0) for _, bt in SEQS]
    g = torch.Generator().manual_seed(5)
    out = []
    for lens in ([n for n, _ in SEQS], STEP2, (1,)):
        toks = [torch.randint(3, 250, (n,), generator=g).tolist() for n in lens]
        hidden, _ = runner.forward(seqs[: len(lens)], toks)
        out += [hidden.clone().cpu(), model.compute_logits(hidden).cpu()]
    return out


@contextmanager
def _cuda_layer_path(path: str):
    """The CUDA layer code on CPU tensors: ``fused.enabled`` on (fused norms, RoPE + K/V store,
    ``forward_fused``), one-row steps as ``forward_gemv`` for ``path`` "gemv", and the Llama
    layers' GEMVs on the Triton kernel (``TRITON_INTERPRET=1``)."""
    from speculant.kernels.gemv import gemv as gemv_fn
    from speculant.models import fused, llama

    saved = (fused.enabled, fused.gemv_enabled, llama.gemv, os.environ.get("TRITON_INTERPRET"))
    os.environ["TRITON_INTERPRET"] = "1"
    fused.enabled = lambda x: True
    fused.gemv_enabled = lambda x: path == "gemv" and x.shape[0] == 1
    llama.gemv = lambda *a, **kw: gemv_fn(*a, **kw, force_triton=True)
    try:
        yield
    finally:
        fused.enabled, fused.gemv_enabled, llama.gemv, env = saved
        if env is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = env


def _run_cuda_paths(folder: Path, tp, config=None) -> dict[str, list[torch.Tensor]]:
    config = load_config(folder) if config is None else config
    model = load_model(folder, config, torch.float32, torch.device("cpu"), 64, tp=tp)
    model._cpu_plan = False  # the layer loop
    results = {}
    for path in CUDA_PATHS:
        with _cuda_layer_path(path):
            results[path] = _forward(model)
    return results


def _shapes(folder: Path, config, tp) -> dict[str, tuple]:
    """Local shapes of the first layer's sharded parameters and of the KV cache."""
    model = load_model(folder, config, torch.float32, torch.device("cpu"), 64, tp=tp)
    a = model.layers[0].self_attn
    out = {"kv": model.kv_cache_shape(), "qkv": tuple(a.qkv_proj.weight.shape)}
    o = getattr(a, "o_proj", None) or a.out_proj
    out["o"] = tuple(o.weight.shape)
    if o.bias is not None:
        out["o_bias_abs"] = float(o.bias.detach().abs().sum())
    return out


def _rank_main(rank: int, size: int, init: str, folders: dict, out: str) -> None:
    torch.set_num_threads(1)
    tp = init_tensor_parallel(rank, size, "cpu", init_method=init)
    try:
        assert tensor_parallel() is tp and tp.size == size and tp.rank == rank
        res = {}
        for name, (folder, arch, config) in folders.items():
            res[name] = _run_case(Path(folder), arch, "auto", None, config)  # None: current tp
            res[name + "_shapes"] = _shapes(Path(folder), config, None)
        for name, case in (("dummy", "llama_gqa"), ("dummy_opt", "opt")):
            folder, arch, config = folders[case]
            res[name] = _run_case(Path(folder), arch, "dummy", None, config)
        for case in CUDA_CASES:
            folder, _, config = folders[case]
            res[case + "_cuda"] = _run_cuda_paths(Path(folder), None, config)
        if rank == 0:
            torch.save(res, out)
    finally:
        shutdown_tensor_parallel()
    assert tensor_parallel() is NO_TENSOR_PARALLEL


def _random_biases(folder: Path) -> None:
    """Biases drawn at random (transformers initialises them to 0): a row-parallel bias added
    by every rank, or by none, would then show."""
    from safetensors.torch import load_file, save_file

    f = folder / "model.safetensors"
    tensors = load_file(str(f))
    g = torch.Generator().manual_seed(1)
    for k, v in tensors.items():
        if k.endswith(".bias") and "norm" not in k:
            tensors[k] = torch.randn(v.shape, generator=g).mul_(0.1).to(v.dtype)
    save_file(tensors, str(f), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory):
    """Every case run at 2 ranks in 2 spawned processes (rank 0's results) and unsharded here."""
    root = tmp_path_factory.mktemp("tp")
    folders = {}
    for name, (arch, over) in CASES.items():
        folder = make_tiny_checkpoint(root / name, arch, vocab_size=256, tokenizer=False, **over)
        _random_biases(folder)
        # the config's values as a plain namespace: the ranks then need not import transformers
        # (seconds per process on a busy machine)
        config = types.SimpleNamespace(**load_config(folder).to_dict())
        folders[name] = (str(folder), arch, config)
    out = root / "rank0.pt"
    mp.start_processes(_rank_main, args=(2, f"file://{root / 'init'}", folders, str(out)),
                       nprocs=2, start_method="spawn")
    tp2 = torch.load(out)
    tp1 = {name: _run_case(Path(f), arch, "auto", NO_TENSOR_PARALLEL)  # the real config
           for name, (f, arch, _) in folders.items()}
    for name, case in (("dummy", "llama_gqa"), ("dummy_opt", "opt")):
        folder, arch, _ = folders[case]
        tp1[name] = _run_case(Path(folder), arch, "dummy", NO_TENSOR_PARALLEL)
    for case in CUDA_CASES:
        tp1[case + "_cuda"] = _run_cuda_paths(Path(folders[case][0]), NO_TENSOR_PARALLEL)
    return tp1, tp2


@pytest.mark.slow  # two spawned ranks: 15-35 s on a busy 2-core machine
@pytest.mark.parametrize("case", [*CASES, "dummy", "dummy_opt", *(c + "_cuda" for c in CUDA_CASES)])
def test_tp2_forward_equals_tp1(tp2_run, case):
    tp1, tp2 = tp2_run
    assert set(tp2[case]) == set(tp1[case])
    for mode, ref in tp1[case].items():
        got = tp2[case][mode]
        assert len(got) == len(ref) == 6
        for what, a, b in zip([f"{s} {x}" for s in ("prefill", "step 2", "one-row step")
                               for x in ("hidden", "logits")], got, ref):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5,
                                       msg=lambda m, w=what, mo=mode: f"{case} {mo} {w}: {m}")


@pytest.mark.slow
def test_tp2_shards_are_local(tp2_run):
    """Rank 0 holds its heads' share: qkv rows [q shard; k shard; v shard], o_proj's columns, a
    KV cache of its KV heads (a copy of the one KV head when there are fewer than ranks)."""
    _, tp2 = tp2_run
    d = 16  # 64 hidden / 4 heads
    s = tp2["llama_gqa_shapes"]
    assert s["kv"] == (1, d) and s["qkv"] == ((2 + 2 * 1) * d, 64) and s["o"] == (64, 2 * d)
    s = tp2["llama_kv1_bias_shapes"]  # one KV head, copied on both ranks; o_proj bias on rank 0
    assert s["kv"] == (1, d) and s["qkv"] == ((2 + 2 * 1) * d, 64) and s["o_bias_abs"] > 0
    s = tp2["opt_shapes"]
    assert s["kv"] == (2, d) and s["qkv"] == (3 * 2 * d, 64) and s["o"] == (64, 2 * d)


def test_dummy_weights_deterministic_and_seeded(tiny_llama):
    config = load_config(tiny_llama)
    cpu = torch.device("cpu")

    def weights(seed):
        m = load_model(tiny_llama, config, torch.float32, cpu, 32, load_format="dummy", seed=seed,
                       tp=NO_TENSOR_PARALLEL)
        return {k: v.detach().clone() for k, v in m.state_dict().items()}

    a, b, c = weights(0), weights(0), weights(1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.self_attn.qkv_proj.weight"],
                           c["layers.0.self_attn.qkv_proj.weight"])
    assert torch.equal(a["norm.weight"], torch.ones_like(a["norm.weight"]))
    w = a["layers.0.mlp.gate_up_proj.weight"]
    assert 0.015 < float(w.std()) < 0.025 and abs(float(w.mean())) < 0.005
    with pytest.raises(ValueError, match="load_format 'pt' is not supported"):
        load_model(tiny_llama, config, torch.float32, cpu, 32, load_format="pt")


def _config(**kw):
    import transformers

    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    base.update(kw)
    return transformers.LlamaConfig(**base)


@pytest.mark.parametrize("kw, size, match", [
    ({}, 3, r"num_attention_heads=4 is not a multiple of it.*\(2, 4\)"),
    ({"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 96}, 2,
     r"num_key_value_heads=3 is not a multiple of it"),
    ({"num_attention_heads": 8, "num_key_value_heads": 3, "hidden_size": 64}, 4,
     r"not a multiple of num_key_value_heads=3 \(with fewer KV heads than ranks"),
    ({"intermediate_size": 130}, 4, r"intermediate_size=130 is not a multiple of it"),
    ({}, 0, r"must be at least 1"),
])
def test_split_errors_name_the_dimension_and_the_fix(kw, size, match):
    config = _config(**kw)
    with pytest.raises(ValueError, match=match):
        check_tensor_parallel(config, size)
    if size >= 1:
        with torch.device("meta"), pytest.raises(ValueError, match=match):
            LlamaForCausalLM(config, 32, tp=TensorParallel(0, size, None, None))


def test_opt_split_error_and_fits():
    import transformers

    config = transformers.OPTConfig(hidden_size=64, ffn_dim=90, num_attention_heads=4,
                                    num_hidden_layers=1, vocab_size=256, word_embed_proj_dim=64)
    with torch.device("meta"), pytest.raises(ValueError, match=r"ffn_dim=90.*\(2\)"):
        OPTForCausalLM(config, 32, tp=TensorParallel(0, 4, None, None))
    check_tensor_parallel(config, 2)  # fits
    check_tensor_parallel(_config(num_key_value_heads=1), 4)  # 1 KV head copied on 4 ranks


def test_shard_range():
    assert [shard_range(12, r, 3) for r in range(3)] == [(0, 4), (4, 8), (8, 12)]
    with pytest.raises(ValueError, match="cannot be split equally"):
        shard_range(10, 0, 3)


def test_draft_model_is_whole_under_tensor_parallel(tiny_llama, monkeypatch):
    """A drafter runs on rank 0 only: loaded whole even where the target is sharded."""
    from speculant.distributed import parallel
    from speculant.drafting.runner import load_draft_model

    monkeypatch.setattr(parallel, "_current", TensorParallel(0, 2, None, None))
    config = load_config(tiny_llama)
    draft = load_draft_model(tiny_llama, config, torch.float32, torch.device("cpu"), 32)
    assert draft.tp.size == 1 and draft.kv_cache_shape() == (2, 16)
    with torch.device("meta"):
        target = LlamaForCausalLM(config, 32)  # the current tensor parallelism: a shard
    assert target.tp.size == 2 and target.kv_cache_shape() == (1, 16)


@pytest.mark.slow
def test_llm_load_format_dummy(tiny_llama):
    """``LLM(load_format="dummy")``: random weights from the seed instead of the checkpoint's."""
    from speculant import LLM, SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = [{"prompt_token_ids": [1, 5, 9, 200]}]
    outs = []
    for seed in (0, 0, 1):
        llm = LLM(model=str(tiny_llama), load_format="dummy", seed=seed, max_num_seqs=2)
        w = llm.engine.model.layers[0].mlp.down_proj.weight.detach()
        assert 0.015 < float(w.std()) < 0.025  # normal(0, 0.02), not the checkpoint's 0.08
        outs.append((llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids,
                     w.detach().clone()))
    assert outs[0][0] == outs[1][0] and torch.equal(outs[0][1], outs[1][1])
    assert not torch.equal(outs[0][1], outs[2][1])


def _gpu_all_reduce_rank(rank: int, size: int, init: str, out: str) -> None:
    from speculant.distributed import all_reduce, comm

    dev = torch.device("cuda", rank)
    init_tensor_parallel(rank, size, dev, init_method=init)
    try:
        res = {"one_shot": comm._one_shot is not None, "bad": []}

        def check(name, x, got):  # x: this rank's part; the sum over ranks of x - rank + r
            want = sum(x.float() - rank + r for r in range(size))
            if not torch.equal(got.float(), want):
                res["bad"].append(name)

        for n, dtype in ((4096, torch.bfloat16), (64 * 4096, torch.bfloat16),
                         (1024 * 4096, torch.bfloat16), (4096, torch.float32)):
            x = (torch.arange(n, device=dev) % 7 + rank).to(dtype)  # exact in bf16
            check(f"eager {n} {dtype}", x, all_reduce(x.clone()))
        for rows in (8, 512):  # one-shot and NCCL sizes, captured in a CUDA graph
            static = torch.zeros(rows, 4096, dtype=torch.bfloat16, device=dev)
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                all_reduce(static * 1)  # warm-up outside the capture
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y = all_reduce(static * 1)
            for step in range(3):
                x = (torch.arange(rows * 4096, device=dev).view(rows, 4096) % 5 + rank + step)
                static.copy_(x.to(torch.bfloat16))
                graph.replay()
                torch.cuda.synchronize(dev)
                check(f"graph {rows} rows step {step}", static, y)
            # a graph holding NCCL collectives keeps destroy_process_group waiting until it is
            # destroyed (CudaGraphRunner.release does this for an LLM's graphs)
            graph.reset()
        if rank == 0:
            torch.save(res, out)
    finally:
        shutdown_tensor_parallel()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_gpu_all_reduce_eager_and_in_cuda_graphs(tmp_path):
    """``all_reduce`` on 2 GPUs: the one-shot symmetric-memory path (small tensors) and NCCL
    (4+ MiB), eagerly and replayed from CUDA graphs, give the exact sums."""
    out = tmp_path / "rank0.pt"
    mp.start_processes(_gpu_all_reduce_rank, args=(2, f"file://{tmp_path / 'init'}", str(out)),
                       nprocs=2, start_method="spawn")
    res = torch.load(out)
    assert res["bad"] == []
    print("one-shot symmetric-memory all-reduce:", "on" if res["one_shot"] else "off")


def _gpu_model_rank(rank: int, size: int, init: str, folder: str, out: str) -> None:
    dev = torch.device("cuda", rank)
    init_tensor_parallel(rank, size, dev, init_method=init)
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        model = load_model(Path(folder), load_config(Path(folder)), torch.float32, dev, 64)
        res = _forward(model, dev)
        if rank == 0:
            torch.save(res, out)
    finally:
        shutdown_tensor_parallel()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("case", ["llama_gqa", "llama_kv1_bias"])
def test_gpu_tp2_forward_equals_tp1(tmp_path, case):
    """The CUDA layer paths (fused norms, few-row GEMVs, forward_fused / forward_gemv, Triton
    paged attention) at 2 ranks on 2 GPUs against one GPU, fp32, eager."""
    arch, over = CASES[case]
    folder = make_tiny_checkpoint(tmp_path / case, arch, vocab_size=256, tokenizer=False, **over)
    _random_biases(folder)
    out = tmp_path / "rank0.pt"
    mp.start_processes(_gpu_model_rank,
                       args=(2, f"file://{tmp_path / 'init'}", str(folder), str(out)),
                       nprocs=2, start_method="spawn")
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda", 0)
    ref = _forward(load_model(folder, load_config(folder), torch.float32, dev, 64,
                              tp=NO_TENSOR_PARALLEL), dev)
    for a, b in zip(torch.load(out), ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=5e-5)


def test_shards_are_slices_of_the_whole_model(tmp_path):
    """Each rank's parameters (loaded in-process: a shard's load needs no process group) are the
    slices of the whole model's: qkv packed as [q shard; k shard; v shard] with the one KV head
    copied on both ranks, o_proj / down_proj columns, gate and up rows, row-parallel biases on
    rank 0 only (zeros elsewhere), embedding and norms whole."""
    folder = make_tiny_checkpoint(tmp_path / "m", "llama", vocab_size=256, tokenizer=False,
                                  num_key_value_heads=1, attention_bias=True, mlp_bias=True)
    _random_biases(folder)
    config = load_config(folder)

    def params(tp):
        m = load_model(folder, config, torch.float32, CPU, 32, tp=tp)
        return {k: v.detach() for k, v in m.named_parameters()}

    full, d, q, inter = params(NO_TENSOR_PARALLEL), 16, 64, 128  # head_dim, q rows, MLP width
    for r in range(2):
        got = params(TensorParallel(r, 2, None, None))
        for kind in ("weight", "bias"):
            w = full[f"layers.1.self_attn.qkv_proj.{kind}"]
            k, v = w[q : q + d], w[q + d :]  # the one KV head
            assert torch.equal(got[f"layers.1.self_attn.qkv_proj.{kind}"],
                               torch.cat([w[r * 32 : (r + 1) * 32], k, v]))
            gu = full[f"layers.1.mlp.gate_up_proj.{kind}"]
            assert torch.equal(got[f"layers.1.mlp.gate_up_proj.{kind}"],
                               torch.cat([gu[r * 64 : (r + 1) * 64],
                                          gu[inter + r * 64 : inter + (r + 1) * 64]]))
        assert torch.equal(got["layers.1.self_attn.o_proj.weight"],
                           full["layers.1.self_attn.o_proj.weight"][:, r * 32 : (r + 1) * 32])
        assert torch.equal(got["layers.1.mlp.down_proj.weight"],
                           full["layers.1.mlp.down_proj.weight"][:, r * 64 : (r + 1) * 64])
        for bias in ("layers.1.self_attn.o_proj.bias", "layers.1.mlp.down_proj.bias"):
            want = full[bias] if r == 0 else torch.zeros_like(full[bias])
            assert torch.equal(got[bias], want) and full[bias].abs().sum() > 0
        for name in ("embed_tokens.weight", "lm_head.weight", "layers.1.input_layernorm.weight"):
            assert torch.equal(got[name], full[name])


def test_shard_of_a_mismatched_checkpoint_names_the_tensor(tmp_path):
    import json

    from speculant.models.weights import WeightLoadError

    folder = make_tiny_checkpoint(tmp_path / "m", "llama", vocab_size=256, tokenizer=False)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["intermediate_size"] = 64  # the tensors are 128 wide
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightLoadError, match=r"m: tensor 'layers\.0\.mlp\.\w+_proj\.weight' has "
                       r"shape \((128, 64|64, 128)\) but the config implies 64 along dim [01]"):
        load_model(folder, load_config(folder), torch.float32, CPU, 32,
                   tp=TensorParallel(1, 2, None, None))


def _cpu_all_reduce_rank(rank: int, size: int, init: str, out: str) -> None:
    from speculant.distributed import all_reduce

    init_tensor_parallel(rank, size, "cpu", init_method=init)
    try:
        x = torch.randn(6, 40, generator=torch.Generator().manual_seed(rank))
        got = all_reduce(x.t())  # [40, 6], not contiguous: summed in a contiguous copy
        torch.save(got, f"{out}{rank}.pt")
    finally:
        shutdown_tensor_parallel()


@pytest.mark.slow  # three spawned processes
def test_cpu_all_reduce_of_three_ranks_is_in_rank_order(tmp_path):
    """Over more than two ranks the CPU sum is (x0 + x1) + x2, the same bits on every rank."""
    out = str(tmp_path / "sum")
    mp.start_processes(_cpu_all_reduce_rank, args=(3, f"file://{tmp_path / 'init'}", out),
                       nprocs=3, start_method="spawn")
    xs = [torch.randn(6, 40, generator=torch.Generator().manual_seed(r)).t() for r in range(3)]
    want = (xs[0] + xs[1]) + xs[2]
    for r in range(3):
        assert torch.equal(torch.load(f"{out}{r}.pt"), want)


def _symm_mem_agreement_rank(rank: int, size: int, init: str, out: str) -> None:
    import speculant.distributed.comm as comm

    made = []

    class Rendezvous:  # stands for _OneShot: a rank that gets here would rendezvous
        def __init__(self, group, device) -> None:
            made.append(rank)

    tp = init_tensor_parallel(rank, size, "cpu", init)
    try:
        comm._OneShot = Rendezvous
        comm.torch.cuda.get_device_capability = lambda device: (9, 0)
        # rank 0 made symmetric memory for an earlier LLM of its process; the workers are new
        comm._symm_mem_used = rank == 0
        got = comm._setup_one_shot(tp, torch.device("cpu"))
        Path(f"{out}{rank}").write_text(f"{got} {made}")
    finally:
        shutdown_tensor_parallel()


@pytest.mark.slow  # two spawned ranks (~3.5 s busy)
def test_a_second_llm_of_a_process_skips_symmetric_memory_on_every_rank(tmp_path):
    """torch numbers a process's symmetric-memory rendezvous, so rank 0 of a second tensor-
    parallel LLM and its new workers would wait on different keys forever: every rank agrees
    (before any rendezvous) to all-reduce with NCCL instead."""
    out = str(tmp_path / "got")
    mp.start_processes(_symm_mem_agreement_rank, args=(2, f"file://{tmp_path / 'init'}", out),
                       nprocs=2, start_method="spawn")
    assert [Path(f"{out}{r}").read_text() for r in range(2)] == ["None []", "None []"]


def test_release_graphs_destroys_the_graphs_a_caller_still_holds():
    """Closing a tensor-parallel LLM destroys its CUDA graphs explicitly before the process
    groups go, even while the caller holds the graph runner (``g = llm.engine.runner.graphs``):
    a graph with NCCL collectives in it would keep the group's destruction waiting forever."""
    from speculant.distributed.worker import release_graphs

    class Graphs:
        released = 0

        def release(self) -> None:
            self.released += 1

    runner = types.SimpleNamespace(graphs=Graphs())
    held = runner.graphs
    release_graphs(runner)
    assert runner.graphs is None and held.released == 1
    release_graphs(runner)  # a second close: nothing left to release
    assert held.released == 1
