"""Our model implementations against HF transformers: greedy output token for token (64+ new
tokens, several prompts, CPU fp32) on the embedded SmolLM2-135M-Instruct and on tiny random Llama,
Qwen2 (qkv bias), Mistral and OPT checkpoints in the real HF layout; sharded safetensors with an
index file; the GGUF path."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from speculant import LLM, SamplingParams

NEW = 64


def hf_greedy(model, prompt_ids: list[int], n: int = NEW) -> list[int]:
    """HF transformers' greedy generate, n new tokens, not stopping at EOS (like ignore_eos)."""
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def ours_greedy(llm: LLM, prompts: list[list[int]], n: int = NEW) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def load_hf(folder):
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


SMOL_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Here is a short poem about the sea:\n",
    "Q: Why is the sky blue?\nA:",
]


# the default run: a plain and a chat prompt batched, 16 tokens; the slow run: all five, 64 tokens
@pytest.mark.parametrize("num_plain,new", [(1, 16), pytest.param(len(SMOL_PROMPTS), NEW,
                                                                  marks=pytest.mark.slow)])
def test_smollm2_matches_hf_greedy(smollm, default_model_path, num_plain, new):
    hf = load_hf(default_model_path)
    tok = smollm.tokenizer
    prompts = [tok(p).input_ids for p in SMOL_PROMPTS[:num_plain]]
    chat = tok.apply_chat_template([{"role": "user", "content": "Name three rivers in Europe."}],
                                   add_generation_prompt=True, tokenize=True)
    prompts.append(list(chat["input_ids"] if hasattr(chat, "keys") else chat))
    ours = ours_greedy(smollm, prompts, new)  # all prompts batched in one call
    for p, o in zip(prompts, ours):
        assert len(o) == new
        assert o == hf_greedy(hf, p, new), tok.decode(p)


def _randomize_biases(folder, out):
    """Re-save a tiny checkpoint with non-zero biases so the bias paths are really exercised."""
    hf = load_hf(folder)
    torch.manual_seed(1)
    with torch.no_grad():
        n = 0
        for name, p in hf.named_parameters():
            if name.endswith(".bias") and "norm" not in name:
                p.normal_(0.0, 0.05)
                n += 1
    assert n > 0
    hf.save_pretrained(out, safe_serialization=True)
    for f in folder.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, out / f.name)
    return out


TINY_PROMPTS = [[1, 17, 300, 4000, 42], [1, 9, 9, 9, 9, 9, 9], [1] + list(range(100, 140)),
                [1, 48000]]


# the default run: llama and opt; qwen2 and mistral (llama's layers with their own options) are
# slow
@pytest.mark.parametrize("arch", ["llama", pytest.param("qwen2", marks=pytest.mark.slow),
                                  pytest.param("mistral", marks=pytest.mark.slow), "opt"])
def test_tiny_models_match_hf_greedy(arch, tiny_factory, tmp_path):
    folder = tiny_factory(arch)
    if arch in ("qwen2", "opt"):
        folder = _randomize_biases(folder, tmp_path / f"{arch}-bias")
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == arch
    if arch == "qwen2":
        from safetensors import safe_open

        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            b = f.get_tensor("model.layers.0.self_attn.q_proj.bias")
        assert b.abs().sum() > 0
    hf = load_hf(folder)
    llm = LLM(model=str(folder), max_num_seqs=8)
    ours = ours_greedy(llm, TINY_PROMPTS, 80)
    for p, o in zip(TINY_PROMPTS, ours):
        assert o == hf_greedy(hf, p, 80), (arch, p)


def test_sharded_safetensors_with_index(tiny_factory, tmp_path):
    folder = tiny_factory("llama")
    hf = load_hf(folder)
    out = tmp_path / "sharded"
    hf.save_pretrained(out, safe_serialization=True, max_shard_size="2MB")
    for f in folder.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 3 and not (out / "model.safetensors").exists()
    llm = LLM(model=str(out))
    assert ours_greedy(llm, TINY_PROMPTS[:2]) == [hf_greedy(hf, p) for p in TINY_PROMPTS[:2]]


@pytest.mark.slow  # ~5 s; the default model itself comes from the GGUF
def test_gguf_path(smollm, default_model_path, tmp_path):
    """A .gguf file (and a folder holding one) resolves to the dequantized HF folder the default
    uses; its embedding equals the GGUF tensor dequantized independently with the gguf package."""
    import gguf
    from safetensors import safe_open

    from speculant.models.loader import default_gguf_path, resolve_model

    path = default_gguf_path()
    assert resolve_model(str(path)) == default_model_path
    assert resolve_model("smollm2-135m-instruct") == default_model_path
    linked = tmp_path / "ggufdir"
    linked.mkdir()
    (linked / path.name).symlink_to(path)
    folder = resolve_model(str(linked))
    assert (folder / "config.json").exists()
    reader = gguf.GGUFReader(str(path))
    t = next(t for t in reader.tensors if t.name == "token_embd.weight")
    ref = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()
    with safe_open(str(default_model_path / "model.safetensors"), "pt") as f:
        emb = f.get_tensor("model.embed_tokens.weight")
    assert tuple(ref.shape) == tuple(emb.shape)
    assert torch.equal(ref, emb)
    assert torch.equal(smollm.engine.model.embed_tokens.weight.detach(), emb)
