"""The generic training loop: any :class:`~speculant.training.heads.Trainable` head, the target
frozen (its features come precomputed in the dataset). AdamW, linear warmup then cosine decay,
gradient clipping, bf16 autocast on CUDA, a tqdm bar (tokens, loss, top-1 accuracy per draft
position), a resumable trainer state every ``checkpoint_every`` steps, and at the end the head in
its published layout, ``history.json`` and the loss curve ``loss.png``."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

from speculant.training.data import Dataset, collate
from speculant.training.heads import Trainable

STATE_FILE = "trainer_state.pt"
ESTIMATE_AFTER = 5  # steps after which the wall-time estimate is printed
_FREE = {"steps", "checkpoint_every", "eval_every"}  # settings a resumed run may change


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    steps: int = Field(200, ge=1, description="optimizer steps")
    batch_size: int = Field(8, ge=1, description="sequences per step")
    lr: float = Field(1e-3, gt=0, description="peak learning rate")
    warmup: int = Field(20, ge=0, description="linear warmup steps, then cosine decay to 10%")
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0, description="max global gradient norm")
    checkpoint_every: int = Field(100, ge=1, description="trainer state saved every N steps")
    eval_every: int = Field(50, ge=1, description="held-out loss and accuracy every N steps "
                            "(with validation data)")
    seed: int = 0
    save_dtype: str = Field("float16", pattern="^(float16|bfloat16|float32)$")


@dataclass
class TrainResult:
    out: Path
    steps: int
    wall_s: float
    history: list[dict] = field(default_factory=list)  # per step: loss, acc per position, tokens


def lr_factor(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


def batch_indices(step: int, n: int, cfg: TrainConfig) -> list[int]:
    """The examples of ``step``: epoch-wise shuffles seeded by (seed, epoch), so a resumed run
    sees the batches the uninterrupted one would have."""
    first = step * cfg.batch_size
    out = []
    for i in range(first, first + cfg.batch_size):
        epoch, j = divmod(i, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed * 1000003 + epoch))
        out.append(int(perm[j]))
    return out


@torch.no_grad()
def evaluate(head: Trainable, data: Dataset, batch_size: int, dev: torch.device) -> dict:
    """Mean loss (weighted by labels) and top-1 accuracy per position of ``head`` on ``data``."""
    was = head.training
    head.eval()
    loss = weight = 0.0
    correct = total = None
    for i in range(0, len(data.examples), batch_size):
        res = head.loss(collate(data.examples[i:i + batch_size], dev))
        n = float(res.total.sum())
        loss, weight = loss + float(res.loss) * n, weight + n
        correct = res.correct if correct is None else correct + res.correct
        total = res.total if total is None else total + res.total
    head.train(was)
    acc = (correct.float() / total.clamp(min=1).float()).tolist() if total is not None else []
    return {"val_loss": loss / max(weight, 1.0), "val_acc": [round(a, 4) for a in acc]}


def plot_history(history: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    steps = [h["step"] for h in history]
    a.plot(steps, [h["loss"] for h in history], label="train")
    val = [h for h in history if "val_loss" in h]
    if val:
        a.plot([h["step"] for h in val], [h["val_loss"] for h in val], "o-", label="held-out")
        a.legend()
    a.set_xlabel("step"), a.set_ylabel("loss"), a.set_title(title)
    for j in range(len(history[0]["acc"]) if history else 0):
        b.plot(steps, [h["acc"][j] for h in history], label=f"position {j + 1}")
    b.set_xlabel("step"), b.set_ylabel("top-1 accuracy (teacher forced)"), b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def estimate_line(seconds: float, done: int, to_end: int, to_finish: int) -> str:
    """The wall-time estimate printed after this session's first steps: ``done`` steps took
    ``seconds``; ``to_end`` remain before this session stops (``stop_at``), ``to_finish`` before
    the run's last step."""
    per = seconds / max(done, 1)
    line = (f"estimated training wall time: {per:.2f} s/step, {per * to_end / 60:.1f} min for the "
            f"{to_end} steps left in this session")
    if to_finish != to_end:
        line += f" ({per * to_finish / 60:.1f} min for the {to_finish} left in the run)"
    return line + " (held-out evaluations not included)"


def train_head(head: Trainable, data: Dataset, out: str | Path, config: TrainConfig | None = None,
               resume: bool = False, progress: bool = True, device: str | None = None,
               stop_at: int | None = None, val_data: Dataset | None = None) -> TrainResult:
    """Train ``head`` on ``data``; write the head's checkpoint into ``out``. With ``resume`` the
    trainer state in ``out`` (if any) is loaded and training continues at its step (the
    settings must be the saved ones, ``steps`` and ``checkpoint_every`` aside). ``stop_at``:
    stop after that step (the state saved, the schedule still that of ``config.steps``), to
    split one run over several sessions. ``val_data``: held-out examples whose loss and
    accuracy join the history every ``config.eval_every`` steps and at the end."""
    from tqdm import tqdm

    cfg = config or TrainConfig()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    head.to(dev)
    torch.manual_seed(cfg.seed)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    step, history, wall = 0, [], 0.0
    state_file = out / STATE_FILE
    if resume and state_file.exists():
        st = torch.load(state_file, weights_only=False, map_location=dev)
        if st["config"] != cfg.model_dump(exclude=_FREE):
            raise ValueError(f"{state_file} was saved with other training settings "
                             f"({st['config']}); resume with those, or train into a new --out")
        head.load_state_dict(st["head"])
        opt.load_state_dict(st["optimizer"])
        sched.load_state_dict(st["scheduler"])
        step, history, wall = st["step"], st["history"], st["wall_s"]

    def save_state() -> None:
        torch.save({"head": head.state_dict(), "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict(), "step": step, "history": history,
                    "wall_s": wall, "config": cfg.model_dump(exclude=_FREE)},
                   state_file)

    n = len(data.examples)
    if n == 0:
        raise ValueError("the dataset has no examples")
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else None
    bar = tqdm(total=cfg.steps, initial=step, desc=f"train {head.method}", disable=not progress)
    head.train()
    tokens_seen = history[-1]["tokens"] if history else 0
    end = cfg.steps if stop_at is None else min(cfg.steps, stop_at)
    start, wall0 = step, wall
    while step < end:
        t0 = time.perf_counter()
        batch = collate([data.examples[i] for i in batch_indices(step, n, cfg)], dev)
        if autocast is not None:
            with autocast:
                res = head.loss(batch)
        else:
            res = head.loss(batch)
        opt.zero_grad(set_to_none=True)
        res.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        sched.step()
        step += 1
        tokens_seen += int(batch.target.sum())
        acc = (res.correct.float() / res.total.clamp(min=1).float()).tolist()
        wall += time.perf_counter() - t0
        history.append({"step": step, "loss": res.loss.item(), "acc": [round(a, 4) for a in acc],
                        "tokens": tokens_seen, "lr": sched.get_last_lr()[0]})
        bar.update(1)
        if step == min(start + ESTIMATE_AFTER, end) and progress:
            bar.write(estimate_line(wall - wall0, step - start, end - step, cfg.steps - step))
        bar.set_postfix_str(f"tok={tokens_seen} loss={res.loss.item():.3f} acc="
                            + "/".join(f"{a:.2f}" for a in acc))
        if val_data is not None and (step % cfg.eval_every == 0 or step == end):
            history[-1].update(evaluate(head, val_data, cfg.batch_size, dev))
            if progress:
                bar.write(f"step {step}: held-out loss {history[-1]['val_loss']:.3f}, top-1 "
                          f"{history[-1]['val_acc']}")
        if step % cfg.checkpoint_every == 0 or step == end:
            save_state()
    bar.close()
    head.eval()
    head.save_pretrained(out, getattr(torch, cfg.save_dtype))
    (out / "history.json").write_text(json.dumps(history) + "\n")
    if history:
        plot_history(history, out / "loss.png", f"{head.method}: loss")
    return TrainResult(out, step, wall, history)


__all__ = ["TrainConfig", "TrainResult", "train_head"]
