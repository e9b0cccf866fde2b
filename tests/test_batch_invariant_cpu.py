"""The batch-invariant mode's pieces on the CPU (``EngineConfig.batch_invariant``,
models/batch_invariant.py; the CUDA end-to-end checks are tests/test_batch_invariance_gpu.py):
the fixed-shape chunked linear, the installation into a model (every linear replaced, the mode active inside
its forwards only) and the engine option's checks. The attention launch with fixed splits:
tests/kernels/test_paged_attention_invariant.py."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
import transformers
from pydantic import ValidationError
from torch import nn

from speculant import LLM, SamplingParams
from speculant.config import EngineConfig
from speculant.models import batch_invariant, cpu_kernels
from speculant.models.attention import AttentionMetadata, ForwardContext
from speculant.models.batch_invariant import BatchInvariantLinear, chunked_linear
from speculant.models.layers import RotaryEmbedding
from speculant.models.llama import LlamaForCausalLM


# ------------------------------------------------------------------------------ chunked linear
@pytest.mark.parametrize("rows", [0, 1, 5, 63, 64, 65, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_linear_is_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 48, generator=g)
    w = torch.randn(72, 48, generator=g)
    b = torch.randn(72, generator=g) if bias else None
    y = chunked_linear(x, w, b)
    assert y.shape == (rows, 72) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_chunked_linear_rows_do_not_depend_on_the_others():
    """Each row bit for bit the same alone, in any batch, at any place in it; any leading shape."""
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(40, 96, generator=g), torch.randn(40, generator=g)
    x = torch.randn(150, 96, generator=g)
    alone = torch.cat([chunked_linear(x[i : i + 1], w, b) for i in range(150)])
    assert torch.equal(chunked_linear(x, w, b), alone)
    assert torch.equal(chunked_linear(x[37:101], w, b), alone[37:101])
    assert torch.equal(chunked_linear(x.flip(0), w, b).flip(0), alone)
    assert torch.equal(chunked_linear(x[:120].view(4, 30, 96), w, b), alone[:120].view(4, 30, 40))


def test_chunked_linear_uses_one_gemm_shape():
    """Every GEMM it issues has ``ROWS`` rows, whatever the row count."""
    shapes = []

    class Spy(torch.Tensor):  # a real tensor whose mm operands are recorded
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func in (torch.mm, torch.addmm):
                shapes.append(tuple(args[-2].shape))
            return super().__torch_function__(func, types, args, kwargs or {})

    w = torch.randn(16, 8)
    for rows in (1, 3, 64, 65, 200):
        chunked_linear(torch.randn(rows, 8).as_subclass(Spy), w)
    assert shapes and set(shapes) == {(batch_invariant.ROWS, 8)}
    assert len(shapes) == 1 + 1 + 1 + 2 + 4


# ------------------------------------------------------------------------------ settings
@pytest.mark.parametrize("max_positions", [1, 100, 2048, 4096, 8192, 131072, 10**6])
def test_settings_cover_the_positions(max_positions):
    s = batch_invariant.settings_for(max_positions)
    assert s.num_splits * s.split_tokens >= max_positions
    assert (s.num_splits - 1) * s.split_tokens < max_positions  # no split past the end
    assert s.split_tokens % 256 == 0 and s.split_tokens >= batch_invariant.MIN_SPLIT_TOKENS
    assert 1 <= s.num_splits <= batch_invariant.MAX_SPLITS


def test_settings_reject_no_positions():
    with pytest.raises(ValueError, match="max_positions=0"):
        batch_invariant.settings_for(0)


# ------------------------------------------------------------------------------ installation
def _tiny_llama(dtype=torch.bfloat16) -> LlamaForCausalLM:
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                                   max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg, 256)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1) if p.dim() == 2 else p.fill_(1.0)
    model = model.to(dtype)
    for mod in model.modules():  # the rotary tables stay float32
        if isinstance(mod, RotaryEmbedding):
            mod.reset(cfg, 256, torch.device("cpu"))
    return model


def _logits(model, seqs: list[tuple[list[int], int]], bs: int = 16) -> torch.Tensor:
    """One forward of ``seqs`` [(tokens, q_len)] (each sequence's last q_len tokens are new, the
    others' K/V already in its blocks: the whole sequence is fed first) -> logits [Σ q_len, V]."""
    nkv, d = model.kv_cache_shape()
    dtype = model.lm_head.weight.dtype
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(len(seqs))]
    caches = [(torch.zeros(8 * len(seqs), bs, nkv, d, dtype=dtype),
               torch.zeros(8 * len(seqs), bs, nkv, d, dtype=dtype)) for _ in range(model.num_layers)]

    def run(feed):  # feed: [(tokens, start)] -> hidden of the fed tokens
        meta = AttentionMetadata.build([len(t) for t, _ in feed], [s + len(t) for t, s in feed],
                                       tables, bs, torch.device("cpu"))
        ids = torch.tensor([x for t, _ in feed for x in t])
        pos = torch.tensor([s + j for t, s in feed for j in range(len(t))])
        return model(ids, pos, ForwardContext(meta=meta, kv_caches=caches))

    with torch.inference_mode():
        run([(t[: len(t) - q], 0) for t, q in seqs])  # the cached part
        hidden = run([(t[len(t) - q :], len(t) - q) for t, q in seqs])
        return model.compute_logits(hidden)


def test_install_replaces_every_linear_and_scopes_the_forwards():
    model = _tiny_llama()
    names = sorted(model.state_dict())
    ref = _logits(model, [([5, 6, 7, 8], 2)])
    settings = batch_invariant.install(model)
    assert settings == batch_invariant.settings_for(256) == model.batch_invariant
    assert type(model).__name__ == "BatchInvariantLlamaForCausalLM"
    assert isinstance(model, LlamaForCausalLM) and sorted(model.state_dict()) == names
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 2 * 4 + 1 and all(type(m) is BatchInvariantLinear for m in linears)
    seen = []
    for m in linears:
        m.register_forward_hook(lambda mod, inp, out: seen.append(batch_invariant.active()))
    assert batch_invariant.active() is None
    out = _logits(model, [([5, 6, 7, 8], 2)])
    # two forwards (the cached part, the new rows) through 8 layer linears, then the LM head
    assert len(seen) == 2 * 8 + 1 and set(seen) == {settings}
    assert batch_invariant.active() is None  # and only inside the forwards
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)  # the same model (bf16 sums)
    assert batch_invariant.install(model) == settings  # a second install changes nothing
    assert type(model).__mro__[1] is LlamaForCausalLM


def test_installed_model_rows_do_not_depend_on_the_batch():
    """The torch CPU path (bf16: not the C kernels) with the mode installed: a sequence's rows
    alone, next to others and as 1 or 3 rows are bit for bit the same (every sequence with a
    cached part: its attention is then one SDPA per sequence)."""
    model = _tiny_llama()
    batch_invariant.install(model)
    seq = [11, 12, 13, 14, 15, 16]
    alone = _logits(model, [(seq, 3)])
    assert torch.equal(_logits(model, [(seq, 1)]), alone[-1:])
    others = [([7] * 9, 1), (list(range(20, 40)), 4), ([3, 4, 5], 2)]
    out = _logits(model, others + [(seq, 3)])
    assert torch.equal(out[-3:], alone)
    out = _logits(model, [(seq, 1)] + others * 10)  # 70 rows: two GEMM chunks
    assert torch.equal(out[:1], alone[-1:])


def test_install_refuses_a_linear_it_cannot_replace():
    class Custom(nn.Linear):
        pass

    model = _tiny_llama()
    model.lm_head.__class__ = Custom
    with pytest.raises(ValueError, match="Custom .* has no batch-invariant form"):
        batch_invariant.install(model)


# ------------------------------------------------------------------------------ engine option
def test_config_field():
    assert EngineConfig().batch_invariant is False
    assert EngineConfig(batch_invariant=True).batch_invariant is True
    assert "batch" in EngineConfig.model_fields["batch_invariant"].description
    with pytest.raises(ValidationError, match="batch_invariant"):
        EngineConfig(batch_invariant="sometimes")


def test_enable_checks_what_the_mode_needs():
    model = _tiny_llama(torch.float32)
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        batch_invariant.enable(model, cpu, torch.float32, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="dtype float32"):
        batch_invariant.enable(model, cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="not on meta"):
        batch_invariant.enable(model, torch.device("meta"), torch.float32)
    if cpu_kernels.available():  # the CPU path is invariant already: nothing installed
        assert batch_invariant.enable(model, cpu, torch.float32) is None
        assert type(model) is LlamaForCausalLM
    else:
        with pytest.raises(ValueError, match="C kernels"):
            batch_invariant.enable(model, cpu, torch.float32)


@pytest.mark.skipif(not cpu_kernels.available() and not os.environ.get("CI"),
                    reason="CPU kernels not built / no AVX2")
def test_cpu_engine_with_the_option_decodes_as_without(tiny_llama):
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8 + i]} for i in range(3)]
    outs = []
    for flag in (False, True):
        llm = LLM(model=str(tiny_llama), max_num_seqs=4, batch_invariant=flag)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)])
    assert outs[0] == outs[1]
