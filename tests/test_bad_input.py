"""Bad input gets a clear error that names the problem and the fix, raised from our code (no
deep torch / transformers stack trace)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from speculant import LLM, SamplingParams


def shallow(excinfo) -> None:
    """The error comes from speculant itself: no frame of the traceback is inside torch or
    transformers, and no chained library exception is shown."""
    tb = excinfo.tb
    files = []
    while tb is not None:
        files.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    assert not [f for f in files if "/torch/" in f or "/transformers/" in f], files
    e = excinfo.value
    assert e.__cause__ is None and (e.__context__ is None or e.__suppress_context__)


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return LLM(model=str(tiny_llama), max_model_len=64)


def test_unknown_model_path(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        LLM(model=str(tmp_path / "no-such-model"))
    msg = str(e.value)
    assert "no-such-model" in msg and "not found" in msg and ".gguf" in msg
    shallow(e)


def test_folder_without_config(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="no config.json") as e:
        LLM(model=str(tmp_path))
    shallow(e)


def test_hub_id_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE") as e:
        LLM(model="someorg/somemodel-does-not-exist")
    assert "pass a local path" in str(e.value)


def test_prompt_longer_than_max_model_len(tiny):
    with pytest.raises(ValueError, match="max_model_len is 64") as e:
        tiny.generate({"prompt_token_ids": [1] * 80}, use_tqdm=False)
    assert "80 tokens" in str(e.value) and "shorten the prompt or raise max_model_len" in str(e.value)
    shallow(e)
    # a bad prompt after good ones: none of the call's requests is left queued (they used to
    # stay in the engine, run during the next call and be mistaken for its outputs)
    with pytest.raises(ValueError, match="max_model_len is 64"):
        tiny.generate([{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [1] * 80}],
                      SamplingParams(max_tokens=40, ignore_eos=True), use_tqdm=False)
    assert not tiny.engine.has_unfinished_requests() and not tiny.engine.requests
    assert tiny.engine.block_manager.num_free_blocks == tiny.engine.block_manager.num_blocks
    out = tiny.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_generation_stops_at_max_model_len(tiny):
    out = tiny.generate({"prompt_token_ids": [1] * 60},
                        SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_max_model_len_beyond_model_limit(tiny_llama):
    with pytest.raises(ValueError, match="exceeds what the model supports") as e:
        LLM(model=str(tiny_llama), max_model_len=100000)
    assert "512" in str(e.value)


def test_bad_prompts(tiny):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny.generate({"prompt_token_ids": [1, 10**6]}, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt is empty"):
        tiny.generate({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(TypeError, match="unsupported prompt type"):
        tiny.generate([3.5], use_tqdm=False)
    with pytest.raises(ValueError, match="got 2 SamplingParams for 1 prompts"):
        tiny.generate("hi", [SamplingParams(), SamplingParams()], use_tqdm=False)
    with pytest.raises(TypeError, match="speculant.SamplingParams"):
        tiny.generate("hi", {"temperature": 0.0}, use_tqdm=False)
    assert not tiny.engine.has_unfinished_requests()


def test_invalid_sampling_values_and_llm_arguments(tiny_llama):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="top_p") as e:
        SamplingParams(top_p=2.0)
    assert "less than or equal to 1" in str(e.value)
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM(model=str(tiny_llama), max_num_seqs=0)


@pytest.mark.parametrize("arch", ["mamba", "no-such-arch"])
def test_gguf_of_unsupported_architecture(tmp_path, monkeypatch, arch):
    import gguf
    import numpy as np

    monkeypatch.setenv("SPECULANT_CACHE", str(tmp_path / "cache"))
    path = tmp_path / f"{arch}.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(8)
    w.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError) as e:
        LLM(model=str(path))
    msg = str(e.value)
    assert path.name in msg and "supported" in msg and "llama" in msg and "qwen2" in msg
    if arch == "mamba":
        assert "'mamba' is not supported" in msg
    shallow(e)


def _copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_weight(tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _copy_checkpoint(tiny_llama, tmp_path / "broken")
    state = load_file(str(folder / "model.safetensors"))
    del state["model.layers.1.mlp.down_proj.weight"]
    del state["model.layers.0.self_attn.k_proj.weight"]  # one part of a packed qkv
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError) as e:
        LLM(model=str(folder))
    msg = str(e.value)
    assert "2 weight(s) missing" in msg and "down_proj" in msg and "qkv_proj" in msg
    assert str(folder) in msg and "incomplete" in msg
    shallow(e)


def test_wrong_shape_and_unexpected_weight(tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _copy_checkpoint(tiny_llama, tmp_path / "shape")
    state = load_file(str(folder / "model.safetensors"))
    state["model.norm.weight"] = torch.ones(65)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"norm.weight.*\(65,\).*\(64,\)") as e:
        LLM(model=str(folder))
    assert "config.json do not match" in str(e.value)
    shallow(e)
    folder = _copy_checkpoint(tiny_llama, tmp_path / "extra")
    state = load_file(str(folder / "model.safetensors"))
    state["model.layers.0.extra.weight"] = torch.ones(3)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unexpected tensor.*layers.0.extra.weight"):
        LLM(model=str(folder))


def test_missing_shard_and_bad_config(tiny_llama, tmp_path):
    folder = _copy_checkpoint(tiny_llama, tmp_path / "idx")
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="shard.*missing.*model-00002-of-00002"):
        LLM(model=str(folder))
    folder = _copy_checkpoint(tiny_llama, tmp_path / "cfg")
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot be read as a model config") as e:
        LLM(model=str(folder))
    shallow(e)


def test_cli_reports_without_traceback(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf at all")
    r = subprocess.run([sys.executable, "-m", "speculant.cli", "generate", "--model", str(bad),
                        "--prompt", "hi"], capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "SPECULANT_CACHE": str(tmp_path / "c")})
    assert r.returncode == 2, r.stderr
    assert "speculant: error:" in r.stderr and "x.gguf" in r.stderr
    assert "Traceback" not in r.stderr


def test_speculant_device_env(monkeypatch):
    """device="auto" follows SPECULANT_DEVICE (the test suite sets cpu); a bad value is named."""
    from speculant.config import EngineConfig

    monkeypatch.setenv("SPECULANT_DEVICE", "cpu")
    assert EngineConfig(device="auto").torch_device() == torch.device("cpu")
    monkeypatch.setenv("SPECULANT_DEVICE", "bogus")
    with pytest.raises(ValueError, match="SPECULANT_DEVICE='bogus' is not a device"):
        EngineConfig(device="auto").torch_device()
    assert EngineConfig(device="cpu").torch_device() == torch.device("cpu")  # explicit wins
    monkeypatch.delenv("SPECULANT_DEVICE")
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert EngineConfig(device="auto").torch_device().type == want
