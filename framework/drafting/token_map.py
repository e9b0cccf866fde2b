"""Token maps: a frequency-ranked draft vocabulary (FR-Spec, Zhao et al. 2025, arXiv 2502.14856;
SGLang's ``--speculative-token-map``).

A token map is the set of the N most frequent token ids of a corpus ("hot" tokens). A proposer
with the option ``token_map`` (EAGLE-1, MLPSpeculator, draft model) computes its LM head over
those N rows only, a contiguous copy ``[N, H]`` of the head's hot rows made once at load time.
Greedy drafting takes the argmax over the N hot logits and maps it through the hot ids
(``hot_argmax``: the token the full-row argmax would give, ties included); where draft
probabilities are needed (sampled requests) the N logits are scattered into a full-vocabulary
row of -inf (``scatter_hot``). At Llama-3 scale (vocab 128256, N = 32768) that reads a quarter of
the head per draft token. Speculation stays lossless: the
target verifies every draft; greedy output is unchanged token for token, and sampled output
follows the target distribution (the draft distribution q is simply 0 outside the hot set,
which rejection sampling handles). Only acceptance can drop, for tokens outside the hot set.

Files (``load_token_map``): ``.pt`` / ``.pth`` (``torch.save`` of a 1-D integer tensor or a list
of ints: SGLang's format), ``.json`` (a list of ints), ``.npy`` (a 1-D integer array), ``.txt``
(ints separated by whitespace or newlines). Build one from a text corpus with
``speculant token-map --tokenizer PATH --corpus FILE [FILE ...] --size N --out FILE.pt``
(``build_token_map_from_corpus``), or from token ids / counts with ``build_token_map``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from os import PathLike
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from speculant.kernels.gemv import gemv
from speculant.kernels.logprobs import row_argmax
from speculant.models import fused
from speculant.models.gather import gather_rows
from speculant.models.layers import CpuLinear
from speculant.spec_types import StrategyError

FORMATS = (".pt", ".pth", ".json", ".npy", ".txt")
_BUILD_HINT = (
    "build one with `speculant token-map --tokenizer TARGET_MODEL --corpus FILE --size N "
    "--out FILE.pt`"
)


class TokenMapError(StrategyError):
    """A token map file or a token-map build request that cannot be used (the message names the
    file or argument, the problem and the fix). A StrategyError (so a ValueError): a strategy
    may let it propagate as its own error."""


# --------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------
def load_token_map(path: str | PathLike, vocab_size: int) -> torch.Tensor:
    """The hot token ids of the file ``path``: int64 [N], unique, sorted ascending, each in
    ``[0, vocab_size)``. Raises ``TokenMapError`` for a missing file, an unknown suffix, or
    contents that are not a non-empty 1-D list of distinct integer ids inside the vocabulary."""
    p = Path(path).expanduser()
    where = f"token map {p}"
    if not p.is_file():
        what = "is a directory, not a file" if p.is_dir() else "no such file"
        raise TokenMapError(f"{where}: {what}; fix the token_map path or {_BUILD_HINT}")
    suffix = p.suffix.lower()
    if suffix in (".pt", ".pth"):
        try:
            obj = torch.load(str(p), map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unreadable file gets the same advice
            raise TokenMapError(
                f"{where}: cannot be read with torch.load(weights_only=True) "
                f"({type(e).__name__}: {e}); save a 1-D integer tensor or a list of ints with "
                "torch.save"
            ) from None
        arr = _as_array(obj, where)
    elif suffix == ".json":
        try:
            obj = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise TokenMapError(
                f"{where}: invalid JSON ({e}); a .json token map is a list of ints"
            ) from None
        if not isinstance(obj, list):
            raise TokenMapError(
                f"{where}: expected a JSON list of token ids, got a {type(obj).__name__}; write "
                "the ids as a flat list, e.g. [0, 1, 2, 13]"
            )
        arr = _as_array(obj, where)
    elif suffix == ".npy":
        try:
            arr = np.load(str(p), allow_pickle=False)
        except (ValueError, OSError) as e:
            raise TokenMapError(
                f"{where}: cannot be read with numpy.load ({e}); save a 1-D integer array "
                "with numpy.save"
            ) from None
    elif suffix == ".txt":
        arr = _parse_txt(p.read_text(errors="replace"), where)
    else:
        raise TokenMapError(
            f"{where}: unknown file type {p.suffix!r}; use one of {', '.join(FORMATS)} "
            "(.pt: torch.save of a 1-D integer tensor or list, .json: a list of ints, .npy: a "
            "1-D integer array, .txt: ints separated by whitespace)"
        )
    return _validate(arr, vocab_size, where)


def _parse_txt(text: str, where: str) -> np.ndarray:
    words = text.split()
    out = []
    for n, w in enumerate(words):
        try:
            out.append(int(w))
        except ValueError:
            raise TokenMapError(
                f"{where}: entry {n} is {w!r}, not an integer token id; a .txt token map holds "
                "integer ids separated by whitespace or newlines"
            ) from None
    return np.asarray(out, dtype=np.int64)


def _as_array(obj, where: str) -> np.ndarray:
    """A tensor, list or tuple of ids as a numpy array (dtype and shape checked later)."""
    if isinstance(obj, torch.Tensor):
        if obj.is_complex() or obj.dtype == torch.bool or obj.is_floating_point():
            raise TokenMapError(
                f"{where}: holds {obj.dtype} values, expected integer token ids; save "
                "torch.tensor(ids, dtype=torch.int64)"
            )
        return obj.detach().cpu().numpy()
    if isinstance(obj, (list, tuple)):
        if not obj:
            return np.zeros(0, dtype=np.int64)
        nested = next((n for n, v in enumerate(obj) if isinstance(v, (list, tuple))), None)
        if nested is not None:
            raise TokenMapError(
                f"{where}: element {nested} is a list, expected a 1-D list of token ids; flatten "
                "it (one id per hot token)"
            )
        bad = next((v for v in obj if isinstance(v, bool) or not isinstance(v, int)), None)
        if bad is not None:
            raise TokenMapError(
                f"{where}: holds {bad!r} ({type(bad).__name__}), expected integer token ids only; "
                "write a flat list of ints"
            )
        return np.asarray(obj, dtype=np.int64)
    raise TokenMapError(
        f"{where}: holds a {type(obj).__name__}, expected a 1-D integer tensor or a list of ints "
        "(SGLang's --speculative-token-map format)"
    )


def _validate(arr: np.ndarray, vocab_size: int, where: str) -> torch.Tensor:
    arr = np.asarray(arr)
    if arr.ndim != 1:
        raise TokenMapError(
            f"{where}: has shape {tuple(arr.shape)}, expected a 1-D list of token ids; flatten "
            "it (one id per hot token)"
        )
    if arr.size == 0:
        raise TokenMapError(f"{where}: is empty; a token map needs at least one id ({_BUILD_HINT})")
    if arr.dtype.kind not in "iu":
        raise TokenMapError(
            f"{where}: holds {arr.dtype} values, expected integer token ids; save them as int64"
        )
    ids = arr.astype(np.int64)
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise TokenMapError(
            f"{where}: {bad.size} id(s) outside the model's vocabulary [0, {vocab_size}) (e.g. "
            f"{int(bad[0])}); the map was built for another tokenizer, rebuild it with the "
            "target model's tokenizer"
        )
    uniq, counts = np.unique(ids, return_counts=True)
    if uniq.size != ids.size:
        dup = uniq[counts > 1]
        raise TokenMapError(
            f"{where}: {dup.size} duplicate id(s) (e.g. {int(dup[0])} appears "
            f"{int(counts[counts > 1][0])} times); each hot id must appear once, deduplicate the "
            "list"
        )
    return torch.from_numpy(uniq)


def save_token_map(ids: torch.Tensor | Sequence[int], path: str | PathLike) -> Path:
    """Write ``ids`` to ``path`` in the format its suffix names (see ``FORMATS``)."""
    p = Path(path).expanduser()
    t = torch.as_tensor(ids, dtype=torch.int64).reshape(-1).cpu()  # [N]
    suffix = p.suffix.lower()
    if suffix not in FORMATS:
        raise TokenMapError(
            f"--out {p}: unknown file type {p.suffix!r}; use one of {', '.join(FORMATS)} (.pt "
            "is SGLang's format)"
        )
    p.parent.mkdir(parents=True, exist_ok=True)
    if suffix in (".pt", ".pth"):
        torch.save(t, str(p))
    elif suffix == ".json":
        p.write_text(json.dumps(t.tolist()))
    elif suffix == ".npy":
        np.save(str(p), t.numpy())
    else:
        p.write_text("\n".join(str(i) for i in t.tolist()) + "\n")
    return p


# --------------------------------------------------------------------------------------------
# building
# --------------------------------------------------------------------------------------------
def count_tokens(token_ids: Iterable[int], vocab_size: int | None = None) -> np.ndarray:
    """Occurrences of each id in ``token_ids``: int64 [max(vocab_size, max id + 1)]."""
    arr = np.fromiter((int(t) for t in token_ids), dtype=np.int64)
    if arr.size and int(arr.min()) < 0:
        raise TokenMapError(f"negative token id {int(arr.min())} among the ids to count")
    return np.bincount(arr, minlength=vocab_size or 0)


def build_token_map(
    tokens: Iterable[int] | Mapping[int, float] | np.ndarray | torch.Tensor,
    size: int,
    *,
    vocab_size: int | None = None,
    always: Iterable[int] = (),
) -> torch.Tensor:
    """The ``size`` most frequent token ids, int64 [size], sorted ascending.

    ``tokens``: counts indexed by id (a 1-D tensor or numpy array, or a mapping id -> count), or
    any other iterable of token ids to count. Ids rank by count, ties by the lower id; ids that
    never occur rank after every one that does (by id), up to ``vocab_size`` (default: the
    length of the counts). The ids of ``always`` (e.g. the tokenizer's special tokens) are
    included first, whatever their count."""
    if isinstance(tokens, torch.Tensor):
        counts = tokens.detach().cpu().double().numpy()
    elif isinstance(tokens, np.ndarray):
        counts = tokens.astype(np.float64)
    elif isinstance(tokens, Mapping):
        keys = [int(k) for k in tokens]
        if keys and min(keys) < 0:
            raise TokenMapError(f"negative token id {min(keys)} in the counts")
        counts = np.zeros(max(keys, default=-1) + 1, dtype=np.float64)
        for k, v in tokens.items():
            counts[int(k)] = float(v)
    else:
        counts = count_tokens(tokens).astype(np.float64)
    if counts.ndim != 1:
        raise TokenMapError(f"counts must be 1-D (one per token id), got shape {counts.shape}")
    if counts.size and (np.isnan(counts).any() or counts.min() < 0):
        raise TokenMapError("counts must be non-negative numbers")
    V = counts.size if vocab_size is None else int(vocab_size)
    if counts.size > V:
        if counts[V:].any():
            raise TokenMapError(
                f"token id {V + int(np.flatnonzero(counts[V:])[0])} was counted but the "
                f"vocabulary has {V} ids; pass the tokenizer's vocab_size"
            )
        counts = counts[:V]
    counts = np.pad(counts, (0, V - counts.size))
    if not 1 <= size <= V:
        raise TokenMapError(
            f"size={size}: a token map holds between 1 and the vocabulary's {V} ids; pick a "
            "smaller size (e.g. 32768 for a 128k vocabulary)"
        )
    keep = sorted({int(i) for i in always})
    if keep and (keep[0] < 0 or keep[-1] >= V):
        raise TokenMapError(f"ids to always include {keep} must lie in [0, {V})")
    if len(keep) > size:
        raise TokenMapError(
            f"size={size} is smaller than the {len(keep)} ids that must be included (the "
            "tokenizer's special tokens); raise --size"
        )
    order = np.lexsort((np.arange(V), -counts))  # count descending, then id ascending
    chosen = np.zeros(V, dtype=bool)
    chosen[keep] = True
    rest = order[~chosen[order]][: size - len(keep)]
    chosen[rest] = True
    return torch.from_numpy(np.flatnonzero(chosen).astype(np.int64))


def special_token_ids(tokenizer) -> list[int]:
    """The ids of the tokens a Hugging Face tokenizer marks special (bos, eos, pad, unk, chat
    markers and every other added token flagged special), sorted."""
    ids: set[int] = {int(i) for i in getattr(tokenizer, "all_special_ids", None) or []}
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        v = getattr(tokenizer, name, None)
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(i) for i in v)
    for i, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", False):
            ids.add(int(i))
    return sorted(i for i in ids if i >= 0)


def iter_corpus(
    files: Sequence[str | PathLike], text_field: str = "text"
) -> Iterator[tuple[str, int]]:
    """(text, bytes read for it) of every line of ``files``: plain text line by line (the newline
    kept), ``.jsonl`` one JSON object per line whose ``text_field`` is a string."""
    for f in files:
        p = Path(f).expanduser()
        jsonl = p.suffix.lower() == ".jsonl"
        with open(p, "rb") as fh:
            for n, raw in enumerate(fh, 1):
                if not jsonl:
                    yield raw.decode("utf-8", errors="replace"), len(raw)
                    continue
                if not raw.strip():
                    yield "", len(raw)
                    continue
                try:
                    obj = json.loads(raw)
                except json.JSONDecodeError as e:
                    raise TokenMapError(
                        f"{p}:{n}: invalid JSON ({e}); a .jsonl corpus holds one JSON object per "
                        "line (use a .txt name for plain text)"
                    ) from None
                text = obj.get(text_field) if isinstance(obj, dict) else None
                if not isinstance(text, str):
                    raise TokenMapError(
                        f"{p}:{n}: no string field {text_field!r}; each line of a .jsonl corpus "
                        f'must be an object like {{"{text_field}": "..."}} (--text-field '
                        "picks another field)"
                    )
                yield text, len(raw)


def count_corpus(
    tokenizer,
    files: Sequence[str | PathLike],
    *,
    text_field: str = "text",
    batch_lines: int = 1024,
    progress: bool = True,
) -> np.ndarray:
    """Token counts int64 [vocab] of ``files`` (see ``iter_corpus``) under ``tokenizer`` (no
    special tokens added), with a tqdm progress bar over the bytes read."""
    from tqdm.auto import tqdm

    paths = [Path(f).expanduser() for f in files]
    if not paths:
        raise TokenMapError("no corpus files given; pass --corpus FILE [FILE ...]")
    for p in paths:
        if not p.is_file():
            raise TokenMapError(f"corpus file {p}: no such file; fix the --corpus path")
    vocab = len(tokenizer)
    counts = np.zeros(vocab, dtype=np.int64)
    total = sum(p.stat().st_size for p in paths)

    def add(batch: list[str]) -> None:
        nonlocal counts
        enc = tokenizer(batch, add_special_tokens=False)["input_ids"]
        ids = np.fromiter((t for row in enc for t in row), dtype=np.int64)
        if ids.size:
            c = np.bincount(ids, minlength=counts.size)
            if c.size > counts.size:  # an id beyond len(tokenizer): grow
                counts = np.pad(counts, (0, c.size - counts.size))
            counts += c

    batch: list[str] = []
    with tqdm(
        total=total, unit="B", unit_scale=True, desc="token-map", disable=not progress
    ) as bar:
        for text, nbytes in iter_corpus(paths, text_field):
            if text:
                batch.append(text)
            bar.update(nbytes)
            if len(batch) >= batch_lines:
                add(batch)
                batch = []
        if batch:
            add(batch)
    return counts


def build_token_map_from_corpus(
    tokenizer: Any,  # a transformers tokenizer (the target's)
    files: Sequence[str | PathLike],
    size: int,
    *,
    text_field: str = "text",
    include: Iterable[int] = (),
    progress: bool = True,
) -> tuple[torch.Tensor, np.ndarray]:
    """(hot ids int64 [size] sorted ascending, token counts [vocab]): the ``size`` most frequent
    tokens of the corpus (ties by the lower id), always with the tokenizer's special tokens and
    ``include``."""
    counts = count_corpus(tokenizer, files, text_field=text_field, progress=progress)
    always = [*special_token_ids(tokenizer), *include]
    ids = build_token_map(counts, size, vocab_size=max(len(tokenizer), counts.size), always=always)
    return ids, counts


# --------------------------------------------------------------------------------------------
# using a token map
# --------------------------------------------------------------------------------------------
def scatter_hot(
    small: torch.Tensor,  # [rows, N] float32: logits of the hot ids
    ids: torch.Tensor,  # [N] int64 on small's device: the hot ids, ascending
    vocab_size: int,
) -> torch.Tensor:  # [rows, vocab] float32, -inf outside the hot ids
    """Hot logits into full-vocabulary rows of -inf (as EAGLE-3 maps its draft vocabulary), so
    the draft sampler works unchanged and gives the other tokens probability 0. Greedy drafting
    needs no full row: ``hot_argmax``."""
    full = small.new_full((small.shape[0], vocab_size), -math.inf)
    return full.scatter_(1, ids.expand(small.shape[0], -1), small)


def ascending_ids(
    ids: torch.Tensor,  # [N] integer token ids, any order, duplicates allowed
    device: torch.device,
) -> torch.Tensor:  # [N'] int64 on ``device``, distinct and ascending
    """The hot ids as ``hot_argmax`` needs them (its tie order relies on ascending ids): sorted
    and de-duplicated once, at load time (``load_token_map`` already returns them so)."""
    return torch.unique(ids.detach().to(device="cpu", dtype=torch.long)).to(device)


def hot_argmax(
    small: torch.Tensor,  # [rows, N] float (any row_argmax dtype): logits of the hot ids
    ids: torch.Tensor,  # [N] int64 on small's device: the hot ids, strictly ascending
) -> torch.Tensor:  # [rows] int64: token ids in [0, vocab)
    """The greedy draft token of each row: ``ids[argmax(small)]``, which is
    ``row_argmax(scatter_hot(small, ids, vocab))`` without the [rows, vocab] fill, scatter and
    vocab-wide argmax. Equal on ties too: the argmax returns the first (lowest) index among the
    maxima, and with ascending ids the lowest hot index is the lowest token id, which is what
    the full row's argmax returns (the -inf outside the hot ids never wins against a hot logit).
    The one difference: a row whose hot logits are all -inf gives ``ids[0]`` instead of token 0.
    Device-side only (no host sync, fixed shapes): safe inside a captured CUDA graph."""
    return gather_rows(ids, row_argmax(small))


def keep_rows(head: nn.Linear, ids: torch.Tensor) -> None:
    """Restrict ``head`` (an LM head, weight ``[vocab, H]``, no bias) in place to the rows
    ``ids`` ``[N]`` (ascending: ``ascending_ids``): its weight becomes a contiguous copy
    ``[N, H]`` and the full one is freed, so ``head(x)`` gives the N hot logits ``[rows, N]``
    (``hot_argmax`` / ``scatter_hot`` turn them into tokens / full rows). For a head a strategy
    owns; ``HotHead`` keeps the target's shared head intact instead."""
    with torch.no_grad():
        w = head.weight.detach().index_select(0, ids.to(head.weight.device)).contiguous()
    head.weight = nn.Parameter(w, requires_grad=False)
    head.out_features = w.shape[0]


class HotHead:
    """An LM head restricted to a token map: a contiguous copy of the hot rows ``[N, H]`` of
    ``weight`` ``[vocab, H]`` (made once, in the weight's dtype and device) and the logits
    scatter. ``__call__(x)`` equals ``F.linear(x, weight)`` on the hot ids and -inf elsewhere (for
    draft probabilities); ``greedy(x)`` is the argmax token of that row, taken over the N hot
    logits only (``hot_argmax``).

    One row on CUDA runs the GEMV kernel (as ``Eagle3Strategy._logits``), else a matmul; on the
    CPU, when ``like`` (the full head) was prepared for the CPU products (a ``CpuLinear``), the
    copy is prepared the same way (loader.prepare_cpu_linears). No per-call host work."""

    def __init__(
        self,
        weight: torch.Tensor,  # [vocab, H]: the full head's weight
        ids: torch.Tensor,  # [N] int64: the hot ids (load_token_map; sorted here if not)
        vocab_size: int,
        like: nn.Module | None = None,
    ) -> None:
        if weight.dim() != 2 or weight.shape[0] < vocab_size:
            raise TokenMapError(
                f"the LM head has shape {tuple(weight.shape)}, expected [{vocab_size}, hidden]"
            )
        self.vocab_size = vocab_size
        self.ids = ascending_ids(ids, weight.device)  # [N]
        with torch.no_grad():
            w = weight.detach().index_select(0, self.ids).contiguous()  # [N, H]
        self.linear: nn.Linear | None = None
        if isinstance(like, CpuLinear) and w.device.type == "cpu":
            from speculant.models.loader import prepare_cpu_linears

            lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
            lin.weight = nn.Parameter(w, requires_grad=False)
            prepare_cpu_linears(lin)  # in place: a CpuLinear with its CPU layout
            self.linear = lin
        self._weight = w if self.linear is None else None  # one copy: the Linear's otherwise

    @property
    def weight(self) -> torch.Tensor:  # [N, H]
        return self.linear.weight if self.linear is not None else self._weight

    def small(self, x: torch.Tensor) -> torch.Tensor:  # [rows, H] -> [rows, N] float32
        """The N hot logits of each row, float32 (``ids[i]``'s logit in column i)."""
        return self._logits(x).float()

    def _logits(self, x: torch.Tensor) -> torch.Tensor:  # [rows, H] -> [rows, N] weight's dtype
        if self.linear is not None:
            return self.linear(x)
        w = self._weight
        if fused.gemv_enabled(x) and x.stride(-1) == 1 and x.dtype == w.dtype:
            return gemv(x, w)  # one row on CUDA
        return F.linear(x, w)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [rows, H] -> [rows, vocab] float32
        return scatter_hot(self.small(x), self.ids, self.vocab_size)

    def greedy(self, x: torch.Tensor) -> torch.Tensor:  # [rows, H] -> [rows] int64 token ids
        """``row_argmax(self(x))`` without the full-vocabulary row (``hot_argmax``), on the
        logits in the weight's dtype: float32 holds every half value exactly, so the argmax
        (ties included) is the float32 row's, one conversion kernel less per draft step."""
        return hot_argmax(self._logits(x), self.ids)  # [rows, N] -> [rows]


__all__ = [
    "HotHead",
    "TokenMapError",
    "ascending_ids",
    "build_token_map",
    "build_token_map_from_corpus",
    "count_tokens",
    "hot_argmax",
    "keep_rows",
    "load_token_map",
    "save_token_map",
    "scatter_hot",
]
