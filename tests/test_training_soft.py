"""The eagle head's ``soft_labels`` option (docs/training.md, "What train does" item 3): the
token loss against the target's own distribution, softmax of its LM head on the next feature,
learns on a tiny random Llama and writes a checkpoint whose greedy output equals plain
decoding; with the option off the loss is the greedy-label one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from speculant import LLM, SamplingParams
from speculant.training import (
    TargetInfo,
    TrainConfig,
    build_dataset,
    make_head,
    prompt_set,
    train_head,
)
from speculant.training.heads import token_loss


@pytest.fixture(scope="module")
def target(tiny_factory) -> Path:
    return tiny_factory("llama")


@pytest.fixture(scope="module")
def data(target, tmp_path_factory):
    return build_dataset(
        str(target),
        "train",
        num_prompts=8,
        max_new_tokens=24,
        cache_dir=tmp_path_factory.mktemp("distill"),
        progress=False,
    )


def replies(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=24)
    prompts = [[{"role": "user", "content": p.text}] for p in prompt_set("held-out")[:3]]
    return [o.outputs[0].token_ids for o in llm.chat(prompts, params, use_tqdm=False)]


def test_token_loss_soft_is_the_cross_entropy_against_the_teachers_distribution():
    g = torch.Generator().manual_seed(0)
    states, teacher = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g)
    weight = torch.randn(11, 8, generator=g)  # [V, D]
    labels = torch.randint(0, 11, (2, 5), generator=g)
    labels[0, 1] = -1  # outside a hot vocabulary: no hard cross-entropy, still a soft target
    valid = torch.rand(2, 5, generator=g) > 0.3
    hard, hits, n = token_loss(states, weight, labels, valid)
    same = token_loss(states, weight, labels, valid, teacher=teacher, soft=0.0)
    assert torch.equal(hard, same[0]) and torch.equal(hits, same[1])
    rows = valid.flatten()
    logits = states.flatten(0, 1)[rows] @ weight.T  # [N, V]
    probs = (teacher.flatten(0, 1)[rows] @ weight.T).softmax(-1)  # [N, V]
    soft_ce = F.cross_entropy(logits, probs)  # probabilities as targets, mean over rows
    soft, soft_hits, soft_n = token_loss(states, weight, labels, valid, teacher=teacher, soft=1.0)
    torch.testing.assert_close(soft, soft_ce)
    assert torch.equal(soft_hits, hits) and torch.equal(soft_n, n)  # hits: the greedy label
    mix, _, _ = token_loss(states, weight, labels, valid, teacher=teacher, soft=0.25)
    torch.testing.assert_close(mix, 0.75 * hard + 0.25 * soft_ce)
    with pytest.raises(ValueError, match="teacher"):
        token_loss(states, weight, labels, valid, soft=0.5)


def soft_floor(head, batch) -> torch.Tensor:
    """The least value of the eagle head's loss with ``soft_labels=1``: no feature error and
    each step's cross-entropy the entropy of the target's distribution (its LM head over the
    hot rows on the next feature), with the loss's weights."""
    from speculant.training.heads import shifted

    floor = torch.zeros(())
    for s in range(1, head.num_positions + 1):
        feat, valid = shifted(batch.final, s), shifted(batch.target, s + 1, False)
        labels = head.hot_lookup[shifted(batch.tokens, s + 1)]
        entropy, _, _ = token_loss(feat, head.hot_head, labels, valid, teacher=feat, soft=1.0)
        floor = floor + 0.8 ** (s - 1) * head.token_weight * entropy
    return floor


def test_eagle_soft_labels_learns_and_its_checkpoint_runs_losslessly(target, data, tmp_path):
    from speculant.training.api import hot_token_ids
    from speculant.training.data import collate

    info = TargetInfo.load(target)
    torch.manual_seed(0)
    head = make_head(
        "eagle", info, steps=3, soft_labels=1.0, hot_ids=hot_token_ids(data.token_counts(), 64)
    )
    batch = collate(data.examples)  # every example: the loss before and after training
    floor = soft_floor(head, batch)
    with torch.no_grad():
        before = head.loss(batch).loss - floor
    out = tmp_path / "eagle-soft"
    cfg = TrainConfig(steps=20, batch_size=4, lr=3e-3, warmup=3, save_dtype="float32")
    res = train_head(head, data, out, cfg, progress=False, device="cpu")
    with torch.no_grad():
        after = head.loss(batch).loss - floor
    assert 0 <= after < 0.8 * before, (float(before), float(after), float(floor))
    assert len(res.history[-1]["acc"]) == 3
    assert (out / "token_map.json").exists()

    plain = replies(LLM(model=str(target)))
    llm = LLM(model=str(target), speculative_config={"method": "eagle", "model": str(out)})
    assert replies(llm) == plain
    assert llm.get_metrics().num_draft_tokens > 0


def test_soft_labels_off_is_the_greedy_label_loss_and_out_of_range_is_refused(target, data):
    from speculant.training.data import collate

    info = TargetInfo.load(target)
    batch = collate(data.examples[:2])
    torch.manual_seed(0)
    hard = make_head("eagle", info, steps=2)
    torch.manual_seed(0)
    off = make_head("eagle", info, steps=2, soft_labels=0.0)
    torch.manual_seed(0)
    soft = make_head("eagle", info, steps=2, soft_labels=1.0)
    assert torch.equal(hard.loss(batch).loss, off.loss(batch).loss)
    assert not torch.equal(hard.loss(batch).loss, soft.loss(batch).loss)
    with pytest.raises(ValueError, match="soft_labels"):
        make_head("eagle", info, soft_labels=1.5)
