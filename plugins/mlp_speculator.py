"""MLPSpeculator (IBM, "Accelerating Production LLMs with Combined Token/Embedding Speculators",
arXiv 2404.19124): a chain of small MLP stages conditioned on the target's last hidden state.

Checkpoint format (``ibm-ai-platform/*-accelerator``, ``ibm-granite/*-accelerator``, fms-extras'
``MLPSpeculatorPreTrainedModel``): ``config.json`` with ``architectures:
["MLPSpeculatorPreTrainedModel"]`` / ``model_type: "mlp_speculator"``, ``n_predict``, ``emb_dim``
(the target's hidden size), ``inner_dim`` (0 means ``emb_dim``), ``vocab_size``, ``tie_weights``,
``scale_input``; weights (safetensors or ``pytorch_model.bin``, with or without the
``speculator.`` prefix)::

    emb.{i}.weight   [vocab, inner]         token embedding of stage i
    proj.{i}.weight  [inner, emb_dim|inner] state projection (stage 0 reads the target state)
    head.{i}.weight  [vocab, inner]         stage i's LM head
    ln.{i}.weight, ln.{i}.bias  [inner]     stage i's norm (RMS scaling, then weight and bias)

With ``tie_weights`` every stage shares ``emb``, ``head`` and ``ln`` and every stage after the
first shares ``proj.1`` (fms-extras' ``tie_wts``); the checkpoint may hold only index 0 (and
``proj.1``) or every index (each copy must then be identical).

Stage i, given the state ``s`` (the target's final-norm hidden state of the position that produced
the last token, first passed through a weightless RMS norm and divided by sqrt(2) when
``scale_input``) and the previous token ``t``::

    z = emb_i(t) * sqrt(1 - w**2) * sqrt(inner / 2)      w = 0.5 ** (0.5 / n_predict)
    s = gelu(ln_i(proj_i(s) * w + z))
    logits_i = head_i(s)

Greedy requests take the argmax of each stage; sampled requests draw from the stage's softmax
after the request's temperature / top-k / top-p / min-p and pass those probabilities as ``q`` to
the rejection sampler, so the output distribution stays exactly the target's.

With the option ``token_map`` (a file of hot token ids, plugins/token_map.py) every head keeps
only the hot rows: greedy drafts are the argmax over the hot logits mapped through the hot ids,
sampled drafts use full-vocabulary rows where the other tokens get logit -inf (q = 0 for them).

``num_speculative_tokens`` defaults to ``n_predict``. Larger values must be multiples of
``n_predict``: with ``tie_weights`` the recurrence simply continues with the shared stage (the
model is recurrent by construction, as in vLLM); without it stage ``j`` reuses head
``j % n_predict`` and feeds the last state back into ``proj.0`` (this needs ``inner_dim ==
emb_dim``; those extra stages were never trained, so expect low acceptance for them).

This module also holds the small helpers the EAGLE strategies share (checkpoint reading and draft
sampling).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from speculant import hookimpl
from speculant.engine.cuda_graph import gc_paused
from speculant.engine.staging import read_back
from speculant.kernels.logprobs import row_argmax
from speculant.kernels.stage_copy import pinned_copy
from speculant.models import fused
from speculant.plugins.token_map import (
    TokenMapError,
    ascending_ids,
    hot_argmax,
    load_token_map,
    scatter_hot,
)
from speculant.spec_registry import StrategyError
from speculant.spec_types import Proposal, SpecBatch, SpecSequence, StrategyContext

logger = logging.getLogger("speculant")
MLP_ARCHITECTURES = ("MLPSpeculatorPreTrainedModel", "MLPSpeculator")


# --------------------------------------------------------------------------------------------
# helpers shared with the EAGLE strategies
# --------------------------------------------------------------------------------------------
def resolve_draft_folder(model: str) -> Path:
    """The local folder (with config.json) of a draft checkpoint given as a path or hub id."""
    from speculant.models.loader import resolve_model

    try:
        return resolve_model(model)
    except (FileNotFoundError, ValueError) as e:
        raise StrategyError(f"speculative model {model!r}: {e}") from None


def read_config_json(folder: Path) -> dict[str, Any]:
    f = folder / "config.json"
    try:
        data = json.loads(f.read_text())
    except FileNotFoundError:
        raise StrategyError(
            f"{f}: missing (a speculator checkpoint needs its config.json)"
        ) from None
    except json.JSONDecodeError as e:
        raise StrategyError(f"{f}: invalid JSON ({e})") from None
    if not isinstance(data, dict):
        raise StrategyError(f"{f}: expected a JSON object")
    return data


def checkpoint_files(folder: Path) -> list[Path]:
    from speculant.models.loader import weight_files

    try:
        return weight_files(folder)
    except FileNotFoundError as e:
        raise StrategyError(str(e)) from None


def iter_checkpoint(folder: Path) -> Iterator[tuple[Path, str, torch.Tensor]]:
    """(file, tensor name, tensor) for every tensor of a safetensors / pytorch_model.bin checkpoint."""
    from safetensors import safe_open

    for f in checkpoint_files(folder):
        if f.suffix == ".safetensors":
            with safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():
                    yield f, k, sf.get_tensor(k)
        else:
            try:
                state = torch.load(str(f), map_location="cpu", weights_only=True)
            except Exception as e:
                raise StrategyError(f"{f}: cannot be read as a PyTorch state dict ({e})") from None
            if not isinstance(state, dict):
                raise StrategyError(f"{f}: expected a state dict, got {type(state).__name__}")
            for k, v in state.items():
                yield f, k, v


def checkpoint_keys(folder: Path) -> set[str]:
    """Tensor names of a checkpoint without reading the tensors (for method inference)."""
    from safetensors import safe_open

    keys: set[str] = set()
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (folder / index).exists():
            try:
                return set(json.loads((folder / index).read_text())["weight_map"])
            except (json.JSONDecodeError, KeyError, TypeError):
                return set()
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("pytorch_model*.bin"))
    for f in files:
        try:
            if f.suffix == ".safetensors":
                with safe_open(str(f), framework="pt") as sf:
                    keys.update(sf.keys())
            else:
                state = torch.load(str(f), map_location="cpu", weights_only=True, mmap=True)
                keys.update(state.keys())
        except Exception:
            continue
    return keys


def to_device_async(
    values,  # python numbers, a numpy array or a CPU tensor
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """A tensor of ``values`` on ``device``. On CUDA it goes through pinned memory with an
    asynchronous copy: ``torch.tensor(values, device="cuda")`` copies from pageable memory,
    which waits for everything queued on the stream (a full synchronisation)."""
    if isinstance(values, torch.Tensor):
        t = values.to(dtype)
    elif isinstance(values, np.ndarray):
        t = torch.from_numpy(values).to(dtype)
    else:
        t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    # the caching host allocator keeps the pinned block alive until the copy has run
    return t.pin_memory().to(device, non_blocking=True)


def graphs_wanted(device: torch.device, enforce_eager: bool = False) -> bool:
    """CUDA graphs for the proposers' draft loops: on CUDA with the Triton kernels (the torch
    attention path builds host tensors per call and cannot be captured), unless the engine runs
    eagerly (``enforce_eager``, the engine's setting) or ``SPECULANT_ENFORCE_EAGER`` is set."""
    eager = enforce_eager or os.environ.get("SPECULANT_ENFORCE_EAGER", "0") not in ("", "0")
    if device.type != "cuda" or eager:
        return False
    from speculant.kernels._triton_utils import triton_enabled

    return triton_enabled()


class GraphCache:
    """CUDA graphs of a function over static input buffers, one per key, captured on first use
    (or ahead, at start-up, by the strategies' ``capture_graphs`` hooks with padding inputs).

    ``buffers(key, make)`` returns the static inputs of ``key`` (made by ``make`` on first use);
    the caller fills them, then ``replay(key, fn)`` captures ``fn(*inputs)`` on first use and
    replays it, returning its (static) outputs: read or copy them before the next replay of the
    same key. The warm-up run before a capture executes ``fn`` once on the inputs as they are
    (so ``fn`` must be idempotent for given inputs, e.g. write the same K/V twice). If a capture
    fails the cache turns itself off (``enabled`` False) and the caller runs ``fn`` eagerly."""

    def __init__(self, device: torch.device, what: str, enforce_eager: bool = False) -> None:
        self.device = device
        self.what = what
        self.enabled = graphs_wanted(device, enforce_eager)
        self.inputs: dict[Any, tuple[torch.Tensor, ...]] = {}
        self.graphs: dict[Any, tuple[torch.cuda.CUDAGraph, Any]] = {}
        self.pool = None
        self.inflight = False  # a replay whose pinned inputs may not have been read yet

    def buffers(
        self, key, make: Callable[[], tuple[torch.Tensor, ...]]
    ) -> tuple[torch.Tensor, ...]:
        if key not in self.inputs:
            self.inputs[key] = make()
        return self.inputs[key]

    def host_vector(self, n: int) -> torch.Tensor:
        """A host int64 vector [n] for graph inputs the graph copies itself: pinned on CUDA (the
        graph's first node reads it with ``kernels/stage_copy.pinned_copy``), plain on CPU."""
        return torch.zeros(n, dtype=torch.long, pin_memory=self.device.type == "cuda")

    def writable(self, host: torch.Tensor) -> np.ndarray:
        """``host`` (a ``host_vector``) as a numpy array to write a call's inputs into, once the
        last replay has run (its pinned inputs may then be rewritten). The proposers read each
        call's drafts back (``split_drafts(..., graphs=)`` then calls ``consumed``) before they
        stage the next call, so this is a flag test; otherwise it waits for the stream."""
        if self.inflight:
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            self.inflight = False
        return host.numpy()

    def consumed(self) -> None:
        """The caller has read back results of work queued after the last replay: that replay
        has run."""
        self.inflight = False

    def replay(self, key, fn: Callable[..., Any]) -> Any | None:
        """The outputs of ``fn`` on the static inputs of ``key``; None if the capture failed."""
        entry = self.graphs.get(key)
        if entry is None:
            try:
                entry = self.graphs[key] = self._capture(fn, self.inputs[key])
            except Exception as e:  # noqa: BLE001 - fall back to eager, say why
                torch.cuda.synchronize(self.device)
                self.enabled = False
                logger.warning(
                    "%s: CUDA graph capture failed, running eagerly (%s: %s)",
                    self.what,
                    type(e).__name__,
                    e,
                )
                return None
        entry[0].replay()
        self.inflight = True
        return entry[1]

    def capture_all(
        self,
        items: list,
        entry: Callable[[Any], tuple[Any, tuple[torch.Tensor, ...], Callable[..., Any]]],
        pad: Callable[[np.ndarray, Any], None],
        desc: str,
        progress: bool = True,
    ) -> int:
        """Capture now the graph of each of ``items`` not captured yet (a strategy's start-up
        capture, its ``capture_graphs`` hook): ``entry(item)`` gives (key, its static inputs, the
        last one the pinned host vector, the function to capture), ``pad(host, item)`` writes
        padding inputs into the host vector (nothing written to a cache, nothing attended). A
        tqdm bar shows progress. Returns how many were captured (fewer if a capture failed: the
        cache is then off)."""
        from tqdm.auto import tqdm

        if not self.enabled:
            return 0
        todo = [(item, *entry(item)) for item in items]
        todo = [t for t in todo if t[1] not in self.graphs]
        done = 0
        for item, key, bufs, fn in tqdm(todo, desc=desc, unit="graph",
                                        disable=not progress or not todo, dynamic_ncols=True):
            pad(self.writable(bufs[-1]), item)
            if self.replay(key, fn) is None:
                break
            done += 1
        if todo and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.consumed()  # the replays ran: the pinned inputs may be rewritten
        return done

    def _capture(self, fn, inputs):
        cur = torch.cuda.current_stream(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(cur)
        with torch.cuda.stream(stream):  # warm-up: compiles kernels for these shapes
            fn(*inputs)
        cur.wait_stream(stream)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with gc_paused(), torch.cuda.graph(graph, pool=self.pool):
            out = fn(*inputs)
        return graph, out


BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)  # padded batch sizes of graphs


def bucket(n: int) -> int:
    """Padded batch size of a captured draft loop (n <= 256; larger n runs eagerly)."""
    for b in BUCKETS:
        if b >= n:
            return b
    return n


class DraftSampler:
    """Draft tokens of one propose call, chosen on the device: argmax for greedy requests, a
    sample of the request's sampling distribution (temperature / top-k / top-p / min-p applied
    to the draft logits) otherwise, with that distribution kept as q for the rejection sampler
    (a one-hot row for greedy rows). Nothing here reads the device.

    ``seqs``: the sequence of each row; ``steps[r]``: how many draft steps row r really uses
    (rows may run more steps than they use; those draw no random number, so a seeded request's
    generator advances exactly once per draft it gets)."""

    def __init__(
        self,
        seqs: list[SpecSequence],
        steps: list[int],
        generator: torch.Generator,
        device: torch.device,
    ) -> None:
        self.seqs = seqs
        self.steps = steps
        self.generator = generator
        self.device = device
        self.greedy = [s.sampling_params.is_greedy for s in seqs]
        self.all_greedy = all(self.greedy)
        self.qs: list[tuple[list[int], torch.Tensor]] = []  # per step: (rows, q [n, vocab])
        self.params = None
        if not self.all_greedy:
            from speculant.engine.sampler import Row, sampling_tensors

            self.params = sampling_tensors([Row(s, []) for s in seqs], device)
            self.g = to_device_async(self.greedy, torch.bool, device)  # [rows]

    def __call__(self, j: int, logits: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
        """Step j: logits [n, vocab] float32 over the TARGET vocabulary of ``rows`` (positions
        in ``seqs``; None: all rows, n = len(seqs)) -> tokens [n] int64 on the device."""
        argmax = row_argmax(logits)  # [n]
        if self.all_greedy:
            return argmax
        from speculant.kernels.rejection_sampling import sample_from_probs
        from speculant.kernels.sampling import sampling_probs

        sub = range(len(self.seqs)) if rows is None else rows
        params, g = self.params, self.g
        if rows is not None:
            idx = to_device_async(rows, torch.long, self.device)
            params, g = tuple(t[idx] for t in params), g[idx]
        probs = sampling_probs(logits.float(), *params).contiguous()  # [n, vocab]
        u = []
        for r in sub:
            if self.greedy[r] or j >= self.steps[r]:
                u.append(torch.full((1,), 0.5))  # not used: draws nothing
            else:
                gen = self.seqs[r].generator or self.generator
                u.append(torch.rand(1, generator=gen, dtype=torch.float32))
        u_dev = to_device_async(torch.cat(u), torch.float32, self.device)  # [n]
        tokens = torch.where(g, argmax, sample_from_probs(probs, u_dev))
        if any(self.greedy[r] for r in sub):
            onehot = F.one_hot(argmax, probs.shape[1]).to(probs.dtype)
            probs = torch.where(g[:, None], onehot, probs)
        self.qs.append((list(sub), probs))
        return tokens

    def probs(self, batch_rows: list[int], batch: int, vocab: int) -> torch.Tensor | None:
        """[batch, steps, vocab] float32 q of every step (None when every row is greedy);
        ``batch_rows[r]``: the batch index of row r."""
        if self.all_greedy or not self.qs:
            return None
        out = torch.zeros(batch, len(self.qs), vocab, dtype=torch.float32, device=self.device)
        for j, (sub, q) in enumerate(self.qs):
            idx = to_device_async([batch_rows[r] for r in sub], torch.long, self.device)
            out[idx, j] = q.float()
        return out


def split_drafts(
    tokens: torch.Tensor,
    rows: list[int],
    steps: list[int],
    batch: int,
    graphs: GraphCache | None = None,
) -> list[list[int]]:
    """tokens [rows, max_steps] on the device -> per batch index the first ``steps[r]`` tokens of
    its row (one device read for the whole call). ``graphs``: the strategy's graph cache, told
    that its last replay has run (its pinned inputs may be rewritten)."""
    drafts: list[list[int]] = [[] for _ in range(batch)]
    # read_back: waits by polling, not in the driver's blocking copy (the host work right after a
    # blocking wait of milliseconds runs slower; engine/staging.py)
    for r, toks in enumerate(read_back(tokens)):
        drafts[rows[r]] = toks[: steps[r]]
    if graphs is not None:
        graphs.consumed()
    return drafts


def target_hidden_size(ctx: StrategyContext) -> int:
    h = getattr(ctx.target_model, "hidden_size", None) or getattr(
        ctx.target_config, "hidden_size", None
    )
    if h is None:
        raise StrategyError("the target model does not expose its hidden size")
    return int(h)


# --------------------------------------------------------------------------------------------
# the model
# --------------------------------------------------------------------------------------------
class MLPSpeculatorNorm(nn.Module):
    """fms' LayerNormParameterized(use_mean=False): x / rms(x), then weight and bias (optional)."""

    def __init__(self, dim: int, affine: bool, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        if affine:
            self.weight = nn.Parameter(torch.ones(dim))
            self.bias = nn.Parameter(torch.zeros(dim))
        else:
            self.weight = self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [rows, dim]
        h = x.float()
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        if self.weight is not None:
            h = h * self.weight + self.bias
        return h


class MLPSpeculatorModel(nn.Module):
    def __init__(
        self,
        n_predict: int,
        emb_dim: int,
        inner_dim: int,
        vocab_size: int,
        tie_weights: bool,
        scale_input: bool,
    ) -> None:
        super().__init__()
        self.n_predict = n_predict
        self.emb_dim = emb_dim
        self.inner_dim = inner_dim
        self.tie_weights = tie_weights
        self.scale_input = scale_input
        n_shared = 1 if tie_weights else n_predict
        n_proj = min(2, n_predict) if tie_weights else n_predict
        self.emb = nn.ModuleList(nn.Embedding(vocab_size, inner_dim) for _ in range(n_shared))
        self.proj = nn.ModuleList(
            nn.Linear(emb_dim if i == 0 else inner_dim, inner_dim, bias=False)
            for i in range(n_proj)
        )
        self.head = nn.ModuleList(
            nn.Linear(inner_dim, vocab_size, bias=False) for _ in range(n_shared)
        )
        self.ln = nn.ModuleList(MLPSpeculatorNorm(inner_dim, affine=True) for _ in range(n_shared))
        self.ln0 = MLPSpeculatorNorm(emb_dim, affine=False) if scale_input else None
        self.state_weight = 0.5 ** (0.5 / n_predict)
        self.emb_scale = math.sqrt(1.0 - self.state_weight**2) * math.sqrt(inner_dim / 2)
        self.vocab_size = vocab_size
        self.hot_ids: torch.Tensor | None = None  # [N] int64: the token map (restrict_heads)

    def restrict_heads(self, ids: torch.Tensor) -> None:
        """Keep only the rows ``ids`` [N] (a token map; sorted here if not) of every stage's
        head, as contiguous copies [N, inner] that replace the full heads (which are freed);
        ``stage_head`` then gives the N hot logits, ``greedy`` maps their argmax through the hot
        ids and ``expand`` (``stage``) scatters them into full-vocabulary rows of -inf."""
        self.hot_ids = ascending_ids(ids, self.head[0].weight.device)  # [N]
        with torch.no_grad():
            for head in self.head:
                w = head.weight.detach().index_select(0, self.hot_ids).contiguous()  # [N, inner]
                head.weight = nn.Parameter(w, requires_grad=False)
                head.out_features = w.shape[0]

    def stage_modules(self, j: int) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
        """(emb, proj, ln, head) of draft position j (0-based)."""
        if self.tie_weights:
            return (
                self.emb[0],
                self.proj[0 if j == 0 else len(self.proj) - 1],
                self.ln[0],
                self.head[0],
            )
        i = j % self.n_predict
        return self.emb[i], self.proj[i], self.ln[i], self.head[i]

    def prepare_state(self, state: torch.Tensor) -> torch.Tensor:
        if self.ln0 is not None:
            state = self.ln0(state) / math.sqrt(2.0)
        return state

    def stage_head(
        self, j: int, state: torch.Tensor, tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """state [rows, emb_dim or inner], tokens [rows] -> (new state [rows, inner], the head's
        logits fp32: [rows, vocab], or with a token map [rows, N] over the hot ids)."""
        emb, proj, ln, head = self.stage_modules(j)
        z = emb(tokens) * self.emb_scale
        state = F.gelu(ln(fused.linear(state, proj.weight, proj.bias) * self.state_weight + z))
        return state, fused.linear(state, head.weight, head.bias).float()  # [rows, vocab or N]

    def expand(self, logits: torch.Tensor) -> torch.Tensor:  # [rows, vocab or N] -> [rows, vocab]
        """The head's logits as full-vocabulary rows (with a token map: -inf outside the hot
        ids), for the draft probabilities of sampled requests."""
        if self.hot_ids is None:
            return logits
        return scatter_hot(logits, self.hot_ids, self.vocab_size)

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:  # [rows, vocab or N] -> [rows] int64
        """``row_argmax(expand(logits))``: with a token map the argmax over the N hot logits
        mapped through the hot ids (``hot_argmax``: no full-vocabulary row). Device-side only."""
        if self.hot_ids is None:
            return row_argmax(logits)
        return hot_argmax(logits, self.hot_ids)

    def stage(
        self, j: int, state: torch.Tensor, tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """state [rows, emb_dim or inner], tokens [rows] -> (new state [rows, inner], logits
        [rows, vocab] fp32; with a token map -inf outside the hot ids)."""
        state, logits = self.stage_head(j, state, tokens)
        return state, self.expand(logits)


_KEY = re.compile(r"^(emb|proj|head|ln)\.(\d+)\.(weight|bias)$")


def load_mlp_speculator(
    folder: Path, cfg: dict[str, Any], device: torch.device, dtype: torch.dtype
) -> MLPSpeculatorModel:
    """Build the model from config.json values and load its weights (strict)."""
    n = int(cfg["n_predict"])
    emb_dim = int(cfg["emb_dim"])
    inner = int(cfg.get("inner_dim") or 0) or emb_dim
    vocab = int(cfg["vocab_size"])
    tie = bool(cfg.get("tie_weights", False))
    model = MLPSpeculatorModel(n, emb_dim, inner, vocab, tie, bool(cfg.get("scale_input", False)))
    model = model.to(device=device, dtype=dtype)
    params = dict(model.named_parameters())
    loaded: dict[str, tuple[Path, torch.Tensor]] = {}
    unexpected: list[str] = []
    for file, name, tensor in iter_checkpoint(folder):
        key = name.removeprefix("speculator.")
        m = _KEY.match(key)
        if m is None or int(m.group(2)) >= n or (m.group(1) != "ln" and m.group(3) == "bias"):
            unexpected.append(f"{name} ({file.name})")
            continue
        kind, idx = m.group(1), int(m.group(2))
        if tie:
            idx = (0 if idx == 0 else len(model.proj) - 1) if kind == "proj" else 0
        pname = f"{kind}.{idx}.{m.group(3)}"
        param = params[pname]
        if tuple(tensor.shape) != tuple(param.shape):
            raise StrategyError(
                f"{file}: tensor {name!r} has shape {tuple(tensor.shape)} but {folder / 'config.json'} "
                f"(n_predict={n}, emb_dim={emb_dim}, inner_dim={inner}, vocab_size={vocab}, "
                f"tie_weights={tie}) implies {tuple(param.shape)}"
            )
        if pname in loaded:  # a tied copy: must be the same tensor
            prev_file, prev = loaded[pname]
            if not torch.equal(prev, tensor):
                raise StrategyError(
                    f"{file}: tensor {name!r} differs from the tied tensor it must equal ({pname} in "
                    f"{prev_file.name}); config.json says tie_weights={tie}"
                )
            continue
        with torch.no_grad():
            param.copy_(tensor.to(dtype))
        loaded[pname] = (file, tensor)
    if unexpected:
        shown = ", ".join(unexpected[:6]) + (" ..." if len(unexpected) > 6 else "")
        raise StrategyError(
            f"{folder}: {len(unexpected)} unexpected tensor(s) in the MLPSpeculator checkpoint: "
            f"{shown}. Expected (optionally prefixed 'speculator.') emb.i.weight, proj.i.weight, "
            f"head.i.weight, ln.i.weight, ln.i.bias for i < n_predict={n}"
        )
    missing = [p for p in params if p not in loaded]
    if missing:
        hint = " (tied: index 0 of emb/head/ln, proj.0 and proj.1)" if tie else ""
        raise StrategyError(
            f"{folder}: {len(missing)} tensor(s) missing from the MLPSpeculator checkpoint{hint}: "
            f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}"
        )
    return model.eval()


# --------------------------------------------------------------------------------------------
# the strategy
# --------------------------------------------------------------------------------------------
class MLPSpeculatorOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = Field(..., description="folder (or hub id) of the MLPSpeculator checkpoint")
    num_speculative_tokens: int | None = Field(None, ge=1, le=64)
    token_map: str | None = Field(
        None,
        description="file of hot token ids (.pt, .json, .npy or .txt; plugins/token_map.py): "
        "every stage's head keeps only those rows (FR-Spec)",
    )


class MLPSpeculatorStrategy:
    """Draft with an IBM MLPSpeculator conditioned on the target's last hidden state."""

    name = "mlp_speculator"
    aliases = ("mlp-speculator",)
    Config = MLPSpeculatorOptions
    needs_hidden_states = True

    @classmethod
    def matches_model(cls, path: Path, config: dict[str, Any]) -> bool:
        archs = config.get("architectures") or []
        return config.get("model_type") == "mlp_speculator" or any(
            a in MLP_ARCHITECTURES for a in archs
        )

    def __init__(self, config: MLPSpeculatorOptions, ctx: StrategyContext) -> None:
        self.ctx = ctx
        folder = resolve_draft_folder(config.model)
        cfg = read_config_json(folder)
        cfg_file = folder / "config.json"
        archs = cfg.get("architectures") or []
        if not self.matches_model(folder, cfg):
            raise StrategyError(
                f"{cfg_file}: not an MLPSpeculator checkpoint (architectures={archs}, model_type="
                f"{cfg.get('model_type')!r}; expected MLPSpeculatorPreTrainedModel / mlp_speculator)"
            )
        missing = [k for k in ("n_predict", "emb_dim", "vocab_size") if cfg.get(k) is None]
        if missing:
            raise StrategyError(f"{cfg_file}: missing required field(s) {missing}")
        n = int(cfg["n_predict"])
        if n < 1:
            raise StrategyError(f"{cfg_file}: n_predict must be >= 1, got {n}")
        hidden = target_hidden_size(ctx)
        if int(cfg["emb_dim"]) != hidden:
            raise StrategyError(
                f"{cfg_file}: emb_dim={cfg['emb_dim']} but the target model's hidden size is {hidden}; "
                "this speculator was trained for a different target"
            )
        if int(cfg["vocab_size"]) != ctx.vocab_size:
            raise StrategyError(
                f"{cfg_file}: vocab_size={cfg['vocab_size']} but the target model's vocabulary has "
                f"{ctx.vocab_size} tokens; this speculator was trained for a different target"
            )
        k = config.num_speculative_tokens or n
        tie = bool(cfg.get("tie_weights", False))
        inner = int(cfg.get("inner_dim") or 0) or int(cfg["emb_dim"])
        if k > n:
            if k % n:
                raise StrategyError(
                    f"num_speculative_tokens={k} is larger than the speculator's n_predict={n} "
                    f"({cfg_file}) and not a multiple of it; use k <= {n} or a multiple of {n}"
                )
            if (not tie or n == 1) and inner != int(cfg["emb_dim"]):
                raise StrategyError(
                    f"num_speculative_tokens={k} > n_predict={n} reuses the heads cyclically, which "
                    f"feeds the last state back into proj.0; {cfg_file} has inner_dim={inner} != "
                    f"emb_dim={cfg['emb_dim']}, so use k <= {n}"
                )
        self.num_speculative_tokens = k
        self.n_predict = n
        self.folder = folder
        self.model = load_mlp_speculator(folder, cfg, ctx.device, ctx.dtype)
        if config.token_map:  # the heads' hot rows, once here (the full heads are freed)
            try:
                self.model.restrict_heads(load_token_map(config.token_map, ctx.vocab_size))
            except TokenMapError as e:
                raise StrategyError(str(e)) from None
        self.generator = torch.Generator().manual_seed(ctx.seed + 104729)
        self.graphs = GraphCache(ctx.device, f"mlp_speculator {folder}", ctx.enforce_eager)

    @hookimpl
    @torch.inference_mode()
    def propose(self, batch: SpecBatch) -> Proposal:
        B = len(batch.seqs)
        hs = batch.hidden_states
        if hs is None or not B:
            return Proposal(token_ids=[[] for _ in range(B)])
        ends = [e - 1 for e in itertools.accumulate(batch.hidden_counts)]
        rows = [
            i
            for i, (s, c) in enumerate(zip(batch.seqs, batch.hidden_counts))
            if c > 0 and s.max_draft > 0
        ]
        if not rows:
            return Proposal(token_ids=[[] for _ in range(B)])
        dev = hs.device
        # every row runs max(want) stages (the stages of a row depend on that row only)
        want = [min(batch.seqs[i].max_draft, self.num_speculative_tokens) for i in rows]
        K = max(want)
        last = [ends[i] for i in rows]
        if last == list(range(hs.shape[0])):  # one state per sequence, all drafted: no gather
            state = hs  # [rows, emb_dim]
        else:
            state = hs[to_device_async(last, torch.long, dev)]  # [rows, emb_dim]
        tokens = [batch.seqs[i].token_ids[-1] for i in rows]
        sampler = DraftSampler([batch.seqs[i] for i in rows], want, self.generator, dev)
        if sampler.all_greedy and self.graphs.enabled and len(rows) <= 256:
            out = self._greedy_graph(state, tokens, K)  # [rows, K]
        else:
            tok_t = to_device_async(tokens, torch.long, dev)  # [rows]
            choose = None if sampler.all_greedy else sampler  # all greedy: no q to keep
            out = self._stages(state, tok_t, K, choose)  # [rows, K]
        # the read-back also tells the graph cache its last replay has run (graph inputs free)
        drafts = split_drafts(out, rows, want, B, self.graphs)
        return Proposal(token_ids=drafts, probs=sampler.probs(rows, B, self.ctx.vocab_size))

    def _stages(
        self,
        state: torch.Tensor,
        tokens: torch.Tensor,
        K: int,
        sampler: DraftSampler | None,
    ) -> torch.Tensor:
        """state [rows, emb_dim] (the target's state that produced ``tokens`` [rows]) -> the
        draft tokens of K stages [rows, K]; ``sampler(j, logits [rows, vocab])`` picks stage j's
        tokens, or with no sampler (every row greedy) the model's ``greedy`` argmax, which with
        a token map needs no full-vocabulary row."""
        model = self.model
        state = model.prepare_state(state.to(self.ctx.dtype))
        out = []
        for j in range(K):
            state, logits = model.stage_head(j, state, tokens)  # [rows, vocab or N] float32
            if sampler is None:
                tokens = model.greedy(logits)  # [rows]
            else:
                tokens = sampler(j, model.expand(logits))  # [rows]
            out.append(tokens)
        return torch.stack(out, dim=1)  # [rows, K]

    def _greedy_graph(self, state: torch.Tensor, tokens: list[int], K: int) -> torch.Tensor:
        """All K greedy stages as one CUDA graph replay (batch padded to a bucket)."""
        n = state.shape[0]
        key, (st_buf, tok_buf, host), fn = self._entry(bucket(n), K)
        st_buf[:n].copy_(state)
        self.graphs.writable(host)[:n] = tokens  # the graph copies it
        out = self.graphs.replay(key, fn)
        if out is None:  # the capture failed: eagerly
            out = fn(st_buf, tok_buf, host)
        return out[:n]  # [rows, K]

    def _entry(self, Bp: int, K: int):
        """(key, its static inputs ([Bp, emb_dim] states, [Bp] tokens, [Bp] pinned host
        tokens), the function the graph captures) of one (Bp, K) greedy stages graph."""
        dev = self.ctx.device

        def make():
            return (
                torch.zeros(Bp, self.model.emb_dim, dtype=self.ctx.dtype, device=dev),
                torch.zeros(Bp, dtype=torch.long, device=dev),
                self.graphs.host_vector(Bp),
            )

        key = (Bp, K)
        bufs = self.graphs.buffers(key, make)  # [Bp, emb_dim], [Bp], [Bp]

        def fn(st, tok, host):
            pinned_copy(host, tok)  # [Bp] pinned -> device: the graph's first node
            return self._stages(st, tok, K, None)  # greedy

        return key, bufs, fn

    @hookimpl
    @torch.inference_mode()
    def capture_graphs(self, max_num_seqs: int, progress: bool) -> int:
        """The greedy stages graph of every batch bucket up to ``max_num_seqs`` sequences (at
        most 256), K = k, captured on zero states and tokens (it writes no cache)."""
        K, top = self.num_speculative_tokens, bucket(min(max_num_seqs, BUCKETS[-1]))

        def zeros(host: np.ndarray, Bp: int) -> None:
            host[:] = 0

        return self.graphs.capture_all([b for b in BUCKETS if b <= top],
                                       lambda Bp: self._entry(Bp, K), zeros,
                                       "Capturing mlp_speculator propose graphs", progress)


@hookimpl
def register_strategies(register) -> None:
    register(MLPSpeculatorStrategy)
