"""speculant.drafting as a public API: every exported name documented (a docstring and a mention
in docs/drafting.md or docs/drafting_reference.md), and the checkpoint reader's contract (shapes,
key mapping, errors naming file, key and expected shape) on tiny checkpoints in every stored
layout."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import speculant.drafting as drafting
from speculant.drafting import (
    CheckpointConfig,
    StrategyError,
    checkpoint_index,
    checkpoint_keys,
    load_into,
    read_config_json,
    read_tensors,
)

DOCS = [Path(__file__).resolve().parents[1] / "docs" / name
        for name in ("drafting.md", "drafting_reference.md")]


# --------------------------------------------------------------------------------------------
# the public names
# --------------------------------------------------------------------------------------------
def test_every_public_name_has_a_docstring():
    undocumented = [
        name
        for name in drafting.__all__
        if (inspect.isclass(obj := getattr(drafting, name)) or inspect.isroutine(obj))
        and not (obj.__doc__ or "").strip()
    ]
    assert not undocumented, f"public names without a docstring: {undocumented}"


def test_every_public_name_is_in_docs_drafting_md():
    text = "\n".join(doc.read_text() for doc in DOCS)
    missing = [n for n in drafting.__all__ if not re.search(rf"\b{re.escape(n)}\b", text)]
    assert not missing, ("speculant.drafting names not mentioned in docs/drafting.md or "
                         f"docs/drafting_reference.md: {missing}")


# --------------------------------------------------------------------------------------------
# the checkpoint reader
# --------------------------------------------------------------------------------------------
class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 3, bias=False)  # proj.weight [3, 4]
        self.norm = nn.LayerNorm(3)  # norm.weight, norm.bias [3]


def head_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "proj.weight": torch.randn(3, 4, generator=g),
        "norm.weight": torch.randn(3, generator=g),
        "norm.bias": torch.randn(3, generator=g),
    }


def write(folder: Path, tensors: dict[str, torch.Tensor], fmt: str = "safetensors") -> Path:
    """``fmt``: safetensors (one file), sharded (two safetensors + index), bin, bin-sharded."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"hidden_size": 4}))
    keys = sorted(tensors)
    if fmt == "safetensors":
        save_file(tensors, str(folder / "model.safetensors"))
    elif fmt == "bin":
        torch.save(tensors, str(folder / "pytorch_model.bin"))
    else:
        ext, index = ("safetensors", "model.safetensors") if fmt == "sharded" else ("bin", "pytorch_model.bin")
        shards = [keys[: len(keys) // 2], keys[len(keys) // 2 :]]
        weight_map = {}
        for i, part in enumerate(shards):
            name = f"model-0000{i + 1}-of-00002.{ext}"
            sub = {k: tensors[k].contiguous() for k in part}
            save_file(sub, str(folder / name)) if ext == "safetensors" else torch.save(sub, str(folder / name))
            weight_map.update(dict.fromkeys(part, name))
        (folder / f"{index}.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


@pytest.mark.parametrize("fmt", ["safetensors", "sharded", "bin", "bin-sharded"])
def test_every_layout_loads_into_a_module(tmp_path, fmt):
    t = head_tensors()
    ckpt = write(tmp_path / fmt, {f"medusa.{k}": v for k, v in t.items()}, fmt)
    assert set(checkpoint_index(ckpt)) == {f"medusa.{k}" for k in t}
    head = load_into(Head(), ckpt, strip_prefixes=("medusa.",))
    for k, v in head.state_dict().items():
        assert torch.equal(v, t[k])


def test_read_tensors_checks_renames_and_casts(tmp_path):
    t = head_tensors()
    ckpt = write(tmp_path / "c", {"model.w": t["proj.weight"], "model.skip": torch.zeros(2)})
    got = read_tensors(
        ckpt,
        {"w": (None, 4)},
        strip_prefixes=("model.",),
        rename=lambda k: None if k == "skip" else k,
        dtype=torch.float16,
    )
    assert list(got) == ["w"] and got["w"].dtype == torch.float16
    assert torch.equal(got["w"], t["proj.weight"].half())
    assert read_tensors(ckpt, {"w": (3, 4), "b": (3,)}, strip_prefixes=("model.",),
                        optional={"b"}, strict=False).keys() == {"w"}


def test_errors_name_file_key_and_expected_shape(tmp_path):
    t = head_tensors()
    bad = write(tmp_path / "shape", dict(t, **{"proj.weight": torch.zeros(3, 5)}))
    with pytest.raises(StrategyError, match=r"shape/model\.safetensors: tensor 'proj\.weight' "
                       r"has shape \(3, 5\), expected \(3, 4\) \(hidden 4\)"):
        load_into(Head(), bad, hint="hidden 4")
    missing = write(tmp_path / "missing", {k: v for k, v in t.items() if k != "norm.bias"}, "bin")
    with pytest.raises(StrategyError, match=r"missing: 1 tensor\(s\) missing from the Medusa "
                       r"head: norm\.bias"):
        load_into(Head(), missing, what="Medusa head")
    extra = write(tmp_path / "extra", dict(t, **{"lm_head.weight": torch.zeros(2)}), "sharded")
    with pytest.raises(StrategyError, match=r"1 unexpected .*lm_head\.weight \(model-00001-of"):
        load_into(Head(), extra)
    load_into(Head(), extra, strict=False)  # skipped


def test_tied_copies_must_be_equal(tmp_path):
    t = head_tensors()
    both = dict(t, **{"copy.proj.weight": t["proj.weight"].clone()})
    ok = write(tmp_path / "ok", both)
    load_into(Head(), ok, rename=lambda k: k.removeprefix("copy."))
    both["copy.proj.weight"] = both["copy.proj.weight"] + 1
    bad = write(tmp_path / "bad", both)
    with pytest.raises(StrategyError, match=r"tensor 'proj\.weight' differs from 'copy\.proj\."
                       r"weight' \(model\.safetensors\), which it must equal"):
        load_into(Head(), bad, rename=lambda k: k.removeprefix("copy."))


def test_unreadable_folders(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(StrategyError, match="no weights found"):
        checkpoint_index(tmp_path / "empty")
    assert checkpoint_keys(tmp_path / "empty") == set()
    with pytest.raises(StrategyError, match=r"empty/config\.json: missing"):
        read_config_json(tmp_path / "empty")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(StrategyError, match=r"broken/model\.safetensors: cannot be read"):
        read_tensors(tmp_path / "broken", {})


def test_config_fields(tmp_path):
    f = tmp_path / "config.json"
    cfg = CheckpointConfig({"n": 3, "flag": True, "x": 2, "s": "a", "none": None}, f)
    assert cfg.field("n", int, minimum=1) == 3 and cfg["n"] == 3
    assert cfg.field("flag", bool) is True
    assert cfg.field("x", float) == 2.0 and isinstance(cfg.field("x", float), float)
    assert cfg.field("none", int, 7) == 7 and cfg.field("absent", str, "d") == "d"
    assert cfg.check_target("n", 3, "depth") == 3
    with pytest.raises(StrategyError, match=r"config\.json: missing required field 'absent'"):
        cfg.field("absent", int)
    with pytest.raises(StrategyError, match=r"config\.json: field 'flag' must be int, got True"):
        cfg.field("flag", int)
    with pytest.raises(StrategyError, match=r"config\.json: field 's' must be int, got 'a'"):
        cfg.field("s", int)
    with pytest.raises(StrategyError, match=r"field 'n' must be >= 4, got 3"):
        cfg.field("n", int, minimum=4)
    with pytest.raises(StrategyError, match=r"config\.json: n=3 but the target model's hidden "
                       r"size is 64; this checkpoint was trained for a different target"):
        cfg.check_target("n", 64, "hidden size")


# --------------------------------------------------------------------------------------------
# the chain graphs
# --------------------------------------------------------------------------------------------
def test_chain_graphs_stage_pad_and_slice(monkeypatch):
    """ChainGraphs.run on the CPU with the graph replay simulated (the captured function run on
    the static inputs): rows padded to their bucket, tokens staged through the host vector, the
    result sliced back; off (None) when disabled or past the largest bucket."""
    from speculant.drafting import BUCKETS, ChainGraphs

    def chain(state, tokens, K):  # [Bp, 2], [Bp] -> [Bp, K]
        return torch.stack([tokens * 10 + state[:, 0].long() + j for j in range(K)], 1)

    g = ChainGraphs(torch.device("cpu"), "test", False, 2, torch.float32, chain)
    assert not g.enabled and g.run(torch.zeros(3, 2), [1, 2, 3], 2) is None
    g.enabled = True
    seen = []

    def replay(key, fn):
        seen.append(key)
        return fn(*g.inputs[key])

    monkeypatch.setattr(g, "replay", replay)
    state = torch.tensor([[1.0, 0], [2, 0], [3, 0]])
    out = g.run(state, [4, 5, 6], 2)
    assert out.tolist() == [[41, 42], [52, 53], [63, 64]] and seen == [(4, 2)]
    assert g.run(torch.zeros(BUCKETS[-1] + 1, 2), [0] * (BUCKETS[-1] + 1), 2) is None
    assert g.capture(2, 8, progress=False) == 4 and seen[1:] == [(1, 2), (2, 2), (4, 2), (8, 2)]


def test_one_weight_file_and_into(tmp_path):
    """A head stored as one file beside other weights (Medusa's medusa_lm_head.pt) reads by its
    path; ``into`` receives each checked tensor as read (stacking heads) and nothing is kept."""
    t = {f"{i}.weight": torch.randn(3, 4) for i in range(2)}
    (tmp_path / "model.safetensors").write_bytes(b"a base model the head does not use")
    torch.save(t, str(tmp_path / "medusa_lm_head.pt"))
    f = tmp_path / "medusa_lm_head.pt"
    stacked = torch.zeros(2, 4, 3)

    def into(name: str, tensor: torch.Tensor) -> None:
        stacked[int(name.split(".")[0])].copy_(tensor.t())

    expected = {f"{i}.weight": (3, 4) for i in range(2)}
    assert read_tensors(f, expected, into=into) == {}
    assert torch.equal(stacked[1], t["1.weight"].t())
    with pytest.raises(StrategyError, match=r"medusa_lm_head\.pt: tensor '0\.weight' has shape "
                       r"\(3, 4\), expected \(3, 5\)"):
        read_tensors(f, {"0.weight": (3, 5)}, strict=False)


# --------------------------------------------------------------------------------------------
# the rows a head on the target's last hidden state drafts from
# --------------------------------------------------------------------------------------------
def test_last_hidden_rows():
    """The last of each drafting sequence's rows of ``hidden_states``; sequences without rows or
    without drafts this step are left out; one state per sequence, all drafting: no gather."""
    from speculant import SamplingParams
    from speculant.drafting import last_hidden_rows
    from speculant.spec_types import SpecBatch, SpecSequence

    seqs = [SpecSequence(i, [1, 2], 1, 2, SamplingParams(temperature=0)) for i in range(4)]
    seqs[2].max_draft = 0
    hs = torch.arange(7.0)[:, None].expand(7, 3)  # [rows, hidden]: row r holds r
    batch = SpecBatch(seqs, hidden_states=hs, hidden_counts=[3, 0, 2, 2])
    rows, state = last_hidden_rows(batch)
    assert rows == [0, 3] and state[:, 0].tolist() == [2.0, 6.0]
    decode = SpecBatch(seqs[:2], hidden_states=hs[:2], hidden_counts=[1, 1])
    rows, state = last_hidden_rows(decode)
    assert rows == [0, 1] and state is decode.hidden_states
    assert last_hidden_rows(SpecBatch(seqs[2:3], hidden_states=hs[:1], hidden_counts=[1])) == (
        [], None)
    assert last_hidden_rows(SpecBatch(seqs[:1], hidden_counts=[1])) == ([], None)
