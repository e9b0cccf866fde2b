"""Self-distillation data: the target's own greedy replies to a prompt set, and the hidden states
a head trains on, cached on disk.

For every prompt the target (speculant's engine, greedy) writes a reply of up to
``max_new_tokens`` tokens; then one Hugging Face ``transformers`` forward of the whole sequence
(prompt + reply, fp32 on the CPU) records the target's final-norm hidden state at every position
(the LM head's input: what EAGLE-1, MLPSpeculator and Medusa read) and, when asked, the residual
stream entering given decoder layers (EAGLE-3's features). A head then learns to predict the
reply's tokens, which are exactly what the target emits under greedy decoding."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from speculant.training.prompts import Prompt, prompt_set


@dataclass
class Example:
    tokens: torch.Tensor  # [T] int64: prompt + the target's greedy reply
    start: int  # index of the reply's first token (tokens[start:] are the target's own)
    final: torch.Tensor  # [T, H] float16: final-norm hidden state at each position
    aux: torch.Tensor | None = None  # [T, len(aux_layers) * H] float16: layer inputs
    category: str = ""


@dataclass
class Dataset:
    model: str  # the target's folder
    hidden_size: int
    vocab_size: int
    aux_layers: tuple[int, ...] = ()
    examples: list[Example] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:  # reply tokens: the ones a head learns to predict
        return sum(len(e.tokens) - e.start for e in self.examples)

    def token_counts(self) -> torch.Tensor:  # [vocab] int64: how often each reply token occurs
        counts = torch.zeros(self.vocab_size, dtype=torch.long)
        for e in self.examples:
            counts += torch.bincount(e.tokens[e.start:], minlength=self.vocab_size)
        return counts


def generate_replies(model: str | None, prompts: list[Prompt], max_new_tokens: int,
                     device: str = "auto", workers: int = 1, progress: bool = True,
                     ) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy reply ids) of every prompt, as a chat turn, by speculant's engine.

    ``workers`` > 1 on the CPU: that many engine processes each reply to every
    ``workers``-th prompt, each on one thread (``OMP_NUM_THREADS=1``: no helper thread for the
    C kernels, the processes already fill the cores), so on N idle cores N processes reply ~N
    times as fast as one thread, and the replies are
    the same: a CPU forward is batch-invariant, so a sequence's tokens do not depend on which
    other sequences share its batches (tests/test_training.py checks)."""
    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    workers = max(1, min(workers, len(prompts))) if on_cpu else 1
    if workers > 1:
        return _replies_in_processes(model, prompts, max_new_tokens, workers, progress)
    from speculant import LLM, SamplingParams

    llm = LLM(model=model, device=device, max_num_seqs=32)
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    outs = llm.chat([[{"role": "user", "content": p.text}] for p in prompts], params,
                    use_tqdm=progress)
    replies = [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs]
    llm.close()
    return replies


def _replies_in_processes(model: str | None, prompts: list[Prompt], max_new_tokens: int,
                          workers: int, progress: bool) -> list[tuple[list[int], list[int]]]:
    """``generate_replies`` over ``workers`` CPU engine processes (``python -m
    speculant.training.data``: a fresh interpreter, so a caller's script is not re-imported as
    multiprocessing's spawn would), worker w replying to prompts w, w + workers, ..."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory(prefix="speculant-replies-") as tmp:
        procs = []
        try:
            for w in range(workers):
                job = Path(tmp) / f"job{w}.json"
                job.write_text(json.dumps({"model": model, "max_new_tokens": max_new_tokens,
                                           "progress": progress and w == 0,
                                           "prompts": [[p.category, p.text]
                                                       for p in prompts[w::workers]]}))
                procs.append(subprocess.Popen([sys.executable, "-m", "speculant.training.data",
                                               str(job), str(job.with_suffix(".out"))],
                                              env={**os.environ, "OMP_NUM_THREADS": "1"}))
            codes = [p.wait() for p in procs]
        finally:  # interrupted (Ctrl-C, an error): no worker outlives the call
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(codes):
            raise RuntimeError(f"a reply worker process failed (exit codes {codes}; its error is "
                               "printed above); run with cpu_threads=1 to generate in-process")
        out: list = [None] * len(prompts)
        for w in range(workers):
            out[w::workers] = [tuple(r) for r in json.loads(
                (Path(tmp) / f"job{w}.out").read_text())]
    return out


@torch.inference_mode()
def hidden_states(folder: Path, sequences: list[list[int]], aux_layers: tuple[int, ...] = (),
                  progress: bool = True, cpu_threads: int | None = None,
                  ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(final-norm hidden [T, H], inputs of ``aux_layers`` concatenated [T, 3H] or None) of each
    token sequence, fp16, from one fp32 ``transformers`` forward per sequence on the CPU, on
    ``cpu_threads`` threads (None: every available CPU)."""
    from speculant.engine.cpu_threads import torch_threads

    with torch_threads(cpu_threads):
        return _hidden_states(folder, sequences, aux_layers, progress)


def _hidden_states(folder: Path, sequences: list[list[int]], aux_layers: tuple[int, ...],
                   progress: bool) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    import transformers
    from tqdm import tqdm

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    hf.eval()
    base = hf.model
    seen: dict[str, torch.Tensor] = {}
    hooks = [base.norm.register_forward_hook(lambda m, a, out: seen.__setitem__("final", out))]
    for i in aux_layers:
        def pre(m, args, kwargs, i=i):
            seen[f"aux{i}"] = args[0] if args else kwargs["hidden_states"]
        hooks.append(base.layers[i].register_forward_pre_hook(pre, with_kwargs=True))
    out = []
    try:
        for ids in tqdm(sequences, desc="target hidden states", disable=not progress):
            seen.clear()
            base(input_ids=torch.tensor([ids]))
            final = seen["final"][0].to(torch.float16)  # [T, H]
            aux = (torch.cat([seen[f"aux{i}"][0] for i in aux_layers], -1).to(torch.float16)
                   if aux_layers else None)  # [T, 3H]
            out.append((final, aux))
    finally:
        for h in hooks:
            h.remove()
    return out


CHUNK = 250  # prompts distilled (and, with a cache, saved) at a time


def _distill(folder: Path, prompts: list[Prompt], max_new_tokens: int,
             aux_layers: tuple[int, ...], device: str, progress: bool,
             cpu_threads: int | None) -> list[Example]:
    from speculant.engine.cpu_threads import available_cpus

    # one engine batch (32 sequences) per process at least: spawning one costs seconds
    workers = min(available_cpus() if cpu_threads is None else cpu_threads, len(prompts) // 32)
    replies = generate_replies(str(folder), prompts, max_new_tokens, device, workers, progress)
    seqs = [p + r for p, r in replies]
    feats = hidden_states(folder, seqs, aux_layers, progress, cpu_threads)
    return [Example(torch.tensor(seq), len(p), final, aux, prompt.category)
            for prompt, (p, _), seq, (final, aux) in zip(prompts, replies, seqs, feats)]


def _cache_file(cache_dir: Path, kind: str, folder: Path, prompts: list[Prompt],
                max_new_tokens: int, aux_layers: tuple[int, ...]) -> Path:
    key = json.dumps([str(folder), [p.text for p in prompts], max_new_tokens, list(aux_layers)])
    return cache_dir / f"distill-{kind}-{hashlib.sha256(key.encode()).hexdigest()[:12]}.pt"


def build_dataset(model: str | None = None, split: str = "train", num_prompts: int | None = None,
                  max_new_tokens: int = 128, aux_layers: tuple[int, ...] = (),
                  cache_dir: str | Path | None = None, device: str = "auto",
                  progress: bool = True, cpu_threads: int | None = None) -> Dataset:
    """The self-distillation data of the first ``num_prompts`` prompts of ``split`` (all when
    None). With ``cache_dir`` the dataset is saved there and reused by later calls of the same
    arguments (the file name is a hash of the target's folder, the prompts' texts, the reply
    length and the aux layers). The prompts are distilled ``CHUNK`` at a time; with a cache each
    finished chunk is saved too (``distill-part-*.pt``, removed once the whole set is), so an
    interrupted build continues where it stopped. ``cpu_threads`` (None: every available CPU):
    on the CPU, the engine processes that write the replies (``generate_replies``' ``workers``)
    and the threads of the hidden-state pass; the data does not depend on it."""
    from speculant.models.loader import resolve_model

    folder = resolve_model(model)
    prompts = prompt_set(split)[:num_prompts]
    aux_layers = tuple(aux_layers)
    cache = None
    if cache_dir is not None:
        cache_dir = Path(cache_dir)
        cache = _cache_file(cache_dir, split, folder, prompts, max_new_tokens, aux_layers)
        if cache.exists():
            return torch.load(cache, weights_only=False)
    cfg = json.loads((folder / "config.json").read_text())
    ds = Dataset(str(folder), int(cfg["hidden_size"]), int(cfg["vocab_size"]), aux_layers)
    parts = []
    for i in range(0, len(prompts), CHUNK):
        chunk = prompts[i:i + CHUNK]
        part = None
        if cache is not None and len(prompts) > CHUNK:
            part = _cache_file(cache_dir, "part", folder, chunk, max_new_tokens, aux_layers)
            parts.append(part)
            if part.exists():
                ds.examples += torch.load(part, weights_only=False)
                continue
        examples = _distill(folder, chunk, max_new_tokens, aux_layers, device, progress,
                            cpu_threads)
        ds.examples += examples
        if part is not None:
            part.parent.mkdir(parents=True, exist_ok=True)
            torch.save(examples, part)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save(ds, cache)
        for part in parts:
            part.unlink(missing_ok=True)
    return ds


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, T] int64 (0 after a sequence's end)
    target: torch.Tensor  # [B, T] bool: tokens[b, t] is the target's own (a reply token)
    final: torch.Tensor  # [B, T, H] float32
    aux: torch.Tensor | None  # [B, T, F] float32


def collate(examples: list[Example], device: torch.device | str = "cpu") -> Batch:
    """Pad ``examples`` to the longest; padding is never a target token."""
    B, T = len(examples), max(len(e.tokens) for e in examples)
    H = examples[0].final.shape[-1]
    tokens = torch.zeros(B, T, dtype=torch.long)
    target = torch.zeros(B, T, dtype=torch.bool)
    final = torch.zeros(B, T, H)
    aux = None if examples[0].aux is None else torch.zeros(B, T, examples[0].aux.shape[-1])
    for b, e in enumerate(examples):
        n = len(e.tokens)
        tokens[b, :n], target[b, e.start:n] = e.tokens, True
        final[b, :n] = e.final.float()
        if aux is not None:
            aux[b, :n] = e.aux.float()
    dev = torch.device(device)
    return Batch(tokens.to(dev), target.to(dev), final.to(dev),
                 None if aux is None else aux.to(dev))


if __name__ == "__main__":  # a reply worker of _replies_in_processes: JOB.json -> OUT.json
    import sys

    job = json.loads(Path(sys.argv[1]).read_text())
    replies = generate_replies(job["model"], [Prompt(c, t) for c, t in job["prompts"]],
                               job["max_new_tokens"], "cpu", 1, job["progress"])
    Path(sys.argv[2]).write_text(json.dumps(replies))
