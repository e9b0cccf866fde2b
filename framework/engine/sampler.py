"""Turn target logits into tokens: logits processors, penalties, min_tokens, then the sampling
transforms (temperature, top-k, top-p, min-p) and greedy / seeded random choice."""

from __future__ import annotations

import contextvars
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from speculant.engine.sequence import Sequence
from speculant.engine.staging import to_device
from speculant.kernels import logprobs as logprob_kernels
from speculant.kernels.rejection_sampling import sample_from_probs
from speculant.kernels.sampling import sampling_probs
from speculant.outputs import Logprob


@dataclass
class Row:
    """One logits row: the sequence it belongs to and the tokens generated before it beyond the
    sequence's own (drafts earlier in a verification window)."""

    seq: Sequence
    extra: list[int]
    ahead: int = 0  # tokens decided for the sequence but not appended yet (an overlapped step's)

    @property
    def position(self) -> int:
        """The index of the token this row decides (keys a seeded request's random numbers)."""
        return len(self.seq.token_ids) + len(self.extra) + self.ahead


class LogitsProcessorError(ValueError):
    """A request's logits processor raised, or returned something that cannot be sampled from:
    a wrong shape, or a row with no finite value (all -inf, or NaN). ``request_id`` names the
    request; ``detail`` is the message without the "request ...: " in front."""

    def __init__(self, message: str, request_id: str | None = None,
                 detail: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.detail = detail if detail is not None else message


@dataclass
class ProcessorFault:
    """A logits row whose processors failed, recorded by :func:`process_logits` inside
    :func:`contain_processor_faults`."""

    seq_id: int
    request_id: str | None
    position: int  # the row's place in its verification window: len(Row.extra) (0: plain)
    error: LogitsProcessorError


_FAULTS: contextvars.ContextVar[list[ProcessorFault] | None] = contextvars.ContextVar(
    "speculant_processor_faults", default=None)


@contextmanager
def contain_processor_faults() -> Iterator[list[ProcessorFault]]:
    """Inside it :func:`process_logits` raises no :class:`LogitsProcessorError`: a row whose
    processors fail is recorded in the yielded list and given neutral logits (zeros) instead, so
    the batch's other rows are sampled exactly as without it. The caller discards what the
    recorded rows produce and fails their requests (the engine: ``LLMEngine.step``)."""
    faults: list[ProcessorFault] = []
    token = _FAULTS.set(faults)
    try:
        yield faults
    finally:
        _FAULTS.reset(token)


def _processor_name(fn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def _error(seq, detail: str) -> LogitsProcessorError:
    """The error of ``seq``'s processors, naming its request (or, for a sequence that does not
    carry one, the sequence)."""
    rid = getattr(seq, "request_id", None)
    who = f"request {rid}" if rid is not None else f"sequence {seq.seq_id}"
    return LogitsProcessorError(f"{who}: {detail}", rid, detail)


def _call_processor(fn, prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor,
                    seq):
    try:
        n = len(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        n = 2
    try:
        res = fn(prompt_ids, output_ids, logits) if n >= 3 else fn(output_ids, logits)
    except Exception as e:
        raise _error(seq, f"logits processor {_processor_name(fn)} raised "
                          f"{type(e).__name__}: {e}") from e
    if res is not None and (not isinstance(res, torch.Tensor) or res.shape != logits.shape):
        got = tuple(res.shape) if isinstance(res, torch.Tensor) else type(res).__name__
        raise _error(seq, f"logits processor {_processor_name(fn)} returned {got}, expected a "
                          f"tensor of shape {tuple(logits.shape)} (the row's logits, one per "
                          "vocabulary entry) or None")
    return res


def _unsampleable(logits: torch.Tensor, rows: list, idx: list[int]
                  ) -> list[tuple[int, LogitsProcessorError]]:
    """Rows ``idx`` (those with logits processors) must keep a finite value and no NaN, or
    nothing could be sampled there: (row, error) of those that do not. One device read, on
    this already host-bound path only."""
    sub = logits[idx]  # [len(idx), vocab]
    bad = ((~torch.isfinite(sub)).all(dim=1) | torch.isnan(sub).any(dim=1)).tolist()
    out = []
    for i, b in zip(idx, bad):
        if b:
            seq = rows[i].seq
            names = ", ".join(_processor_name(fn) for fn in seq.params.logits_processors)
            out.append((i, _error(seq, f"after its logits processors ({names}) the logits row "
                                       "has NaN or no finite value (all -inf), so no token can be "
                                       "sampled; a processor must leave at least one token "
                                       "allowed and return no NaN")))
    return out


def params_need_processing(p) -> bool:
    """Whether :func:`process_logits` may change a row of a request with these parameters."""
    return bool(p.logits_processors or p.has_penalties or p.min_tokens)


def needs_processing(rows: list[Row]) -> bool:
    """Whether :func:`process_logits` changes anything for these rows."""
    return any(params_need_processing(r.seq.params) for r in rows)


def greedy_pack(logits: torch.Tensor) -> torch.Tensor:  # logits: [rows, vocab]
    """[rows, 2] float64: each row's argmax (lowest index on ties, the token a greedy request
    takes there) and its log-probability under the raw logits, from one fused pass
    (kernels/logprobs.py on CUDA). float64 holds every token id exactly, so one device-to-host
    read returns both; the speculative step's scorer computes it (inside the verification CUDA
    graph where there is one) for the greedy verifier."""
    tok, lp = logprob_kernels.token_logprobs(logits)  # [rows] int64, [rows] float32
    return torch.stack([tok.double(), lp.double()], dim=1)


def process_logits(
    logits: torch.Tensor,  # [num_rows, vocab] float32
    rows: list[Row],
    eos_token_id: int | None,
) -> torch.Tensor:  # [num_rows, vocab] float32, processed copy
    """Apply per-request logits processors, repetition/presence/frequency penalties (vLLM
    semantics) and the min_tokens EOS/stop-token mask."""
    if not needs_processing(rows):
        return logits
    logits = logits.clone()
    V = logits.shape[1]
    sink = _FAULTS.get()
    processed = []  # rows whose logits processors ran
    failed: dict[int, LogitsProcessorError] = {}  # row -> what went wrong (inside a sink)
    for i, r in enumerate(rows):
        p = r.seq.params
        out_ids = r.seq.output_token_ids + r.extra
        if p.logits_processors:
            prompt_ids = r.seq.token_ids[: r.seq.num_prompt_tokens]
            try:
                for fn in p.logits_processors:
                    res = _call_processor(fn, prompt_ids, list(out_ids), logits[i], r.seq)
                    if res is not None:
                        logits[i] = res
            except LogitsProcessorError as e:
                if sink is None:
                    raise
                failed[i] = e
                continue
            processed.append(i)
        if p.has_penalties:
            dev = logits.device
            out_t = to_device(out_ids, torch.long, dev)
            counts = torch.zeros(V, device=dev).index_add_(
                0, out_t.clamp(0, V - 1), torch.ones(len(out_ids), device=dev)
            ) if out_ids else torch.zeros(V, device=dev)
            if p.repetition_penalty != 1.0:
                seen = counts > 0
                prompt_t = to_device(r.seq.token_ids[: r.seq.num_prompt_tokens], torch.long, dev)
                seen[prompt_t.clamp(0, V - 1)] = True
                row = logits[i]
                pen = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
                logits[i] = torch.where(seen, pen, row)
            logits[i] -= p.frequency_penalty * counts
            logits[i] -= p.presence_penalty * (counts > 0).float()
        if p.min_tokens and len(out_ids) < p.min_tokens:
            banned = list(p.stop_token_ids or [])
            if eos_token_id is not None and not p.ignore_eos:
                banned.append(eos_token_id)
            for t in banned:
                if 0 <= t < V:
                    logits[i, t] = float("-inf")
    for i, e in _unsampleable(logits, rows, processed) if processed else ():
        if sink is None:
            raise e
        failed[i] = e
    for i, e in sorted(failed.items()):  # neutral logits: its tokens are discarded
        logits[i] = 0.0
        sink.append(ProcessorFault(rows[i].seq.seq_id, e.request_id, len(rows[i].extra), e))
    return logits


def sampling_tensors(rows: list[Row], device) -> tuple[torch.Tensor, ...]:
    """Per-row temperature, top-k, top-p, min-p ``[num_rows]`` each, on ``device``."""
    p = [r.seq.params for r in rows]
    floats = to_device([[x.temperature for x in p], [x.top_p for x in p], [x.min_p for x in p]],
                       torch.float32, device)  # [3, num_rows]
    top_k = to_device([x.top_k for x in p], torch.int32, device)  # [num_rows]
    return floats[0], top_k, floats[1], floats[2]


def target_probs(processed: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """[num_rows, vocab] float32 probabilities after temperature/top-k/top-p/min-p."""
    return sampling_probs(processed, *sampling_tensors(rows, processed.device))


# What a seeded request's random number decides: the third part of its counter-based key
# (request seed, position, purpose); see :func:`uniforms`.
PURPOSES = {
    "sample": 0,  # the token at a position, drawn from the target (plain, bonus, point-mass drafts)
    "accept": 1,  # the accept test of the sampled draft at a position
    "draft": 2,  # the draft token sampled at a position (DraftSampler)
    "residual": 3,  # the recovery / bonus token of a sampled-draft step starting at a position
}

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(z: np.ndarray) -> np.ndarray:  # uint64 array -> uint64 array (wraps modulo 2**64)
    """SplitMix64's finaliser (a bijection of 64-bit integers that passes BigCrush)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def counter_uniforms(
    seeds: np.ndarray,  # [n] uint64: each draw's stream seed
    positions: np.ndarray,  # [n] uint64: the index of the token each draw decides
    purpose: int,  # a value of PURPOSES
) -> torch.Tensor:  # [n] float32 in [0, 1), on the CPU
    """Counter-based uniform numbers: ``u = f(seed, position, purpose)``, the SplitMix64 stream
    of the (hashed) seed read at counter ``4 * position + purpose``. No state: the same key gives
    the same number whenever and in whatever batch it is drawn; distinct keys are independent."""
    ctr = positions * np.uint64(4) + np.uint64(purpose) + np.uint64(1)
    z = _mix64(_mix64(seeds) + ctr * _GOLDEN)
    return torch.from_numpy((z >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24))


def stream_seed(seq) -> int | None:
    """The key of a sequence's counter-based numbers (its :class:`SeedStream`'s seed: one per
    output of a seeded request), or None (an unseeded request, or a plain ``torch.Generator``
    handed in by other code, which is then drawn from as a stateful generator)."""
    return getattr(seq.generator, "stream_seed", None)


def uniforms(seqs: list[Sequence], counts: list[int], engine_gen: torch.Generator, device, *,
             purpose: str | None = None, starts: list[int] | None = None) -> torch.Tensor:
    """Uniform [0, 1) numbers, ``counts[i]`` for sequence i, on ``device`` (through pinned
    memory: no synchronisation), sequence after sequence.

    With ``purpose`` (a key of :data:`PURPOSES`), a seeded sequence's j-th number is
    ``counter_uniforms(seed, starts[i] + j, purpose)``: it depends only on the request's seed,
    the position of the token it decides (``starts[i]`` defaults to the sequence's length, the
    position of its next token) and what it decides, never on preemption, the batch or how many
    numbers were drawn before. Without ``purpose`` (the earlier interface), or for a sequence
    whose generator is a plain ``torch.Generator`` rather than a :class:`SeedStream`, they are
    the next ``counts[i]`` numbers of its generator. Unseeded sequences draw from ``engine_gen``
    either way."""
    keys = [stream_seed(s) for s in seqs] if purpose is not None else [None] * len(seqs)
    if all(s.generator is None for s in seqs):  # all unseeded: one draw
        return to_device(torch.rand(sum(counts), generator=engine_gen), torch.float32, device)
    if all(k is None for k in keys):  # stateful generators only
        parts = [torch.rand(n, generator=s.generator or engine_gen, dtype=torch.float32)
                 for s, n in zip(seqs, counts)]
        return to_device(torch.cat(parts), torch.float32, device) if parts else torch.empty(0, device=device)
    code = PURPOSES[purpose]
    if starts is None:
        starts = [len(s.token_ids) for s in seqs]
    cnt = np.asarray(counts, dtype=np.int64)
    total = int(cnt.sum())
    if total == 0:
        return torch.empty(0, device=device)
    # one vectorised hash for every draw (unseeded sequences' draws are replaced below)
    first = np.repeat(np.cumsum(cnt) - cnt, cnt)  # [total] index of each draw's first draw
    pos = np.repeat(np.asarray(starts, dtype=np.int64), cnt) + np.arange(total) - first
    seeds = np.asarray([0 if k is None else k for k in keys], dtype=np.uint64)
    u = counter_uniforms(np.repeat(seeds, cnt), pos.astype(np.uint64), code)
    if any(k is None for k in keys):  # stateful draws, in sequence order
        if all(k is not None or s.generator is None for s, k in zip(seqs, keys)):
            unseeded = np.repeat(np.asarray([k is None for k in keys]), cnt)  # [total]
            u[torch.from_numpy(unseeded)] = torch.rand(int(unseeded.sum()), generator=engine_gen)
        else:
            off = 0
            for s, k, n in zip(seqs, keys, counts):
                if k is None and n:
                    u[off : off + n] = torch.rand(n, generator=s.generator or engine_gen)
                off += n
    return to_device(u, torch.float32, device)


def sample_tokens(logits: torch.Tensor, rows: list[Row], engine_gen: torch.Generator,
                  eos_token_id: int | None) -> torch.Tensor:  # [num_rows] int64, on logits.device
    """Sample one token per row, leaving the result on the device (no synchronisation)."""
    processed = process_logits(logits, rows, eos_token_id)
    greedy = [r.seq.params.is_greedy for r in rows]
    if all(greedy):
        return logprob_kernels.row_argmax(processed)
    probs = target_probs(processed, rows)
    u = uniforms([r.seq for r in rows], [1] * len(rows), engine_gen, logits.device,
                 purpose="sample", starts=[r.position for r in rows])
    sampled = sample_from_probs(probs, u)
    argmax = logprob_kernels.row_argmax(processed)
    g = to_device(greedy, torch.bool, logits.device)
    return torch.where(g, argmax, sampled)


def sample(logits: torch.Tensor, rows: list[Row], engine_gen: torch.Generator,
           eos_token_id: int | None) -> list[int]:
    """Sample one token per row (plain decoding and the first token after prefill)."""
    return sample_tokens(logits, rows, engine_gen, eos_token_id).tolist()


def chosen_logprobs(
    logits: torch.Tensor,  # [num_rows, vocab] raw target logits
    tokens: torch.Tensor,  # [num_rows] int64, same device
) -> torch.Tensor:  # [num_rows] float32
    """log_softmax(logits)[row, token] (the same numbers the list-based :func:`token_logprobs`
    below gives), without materialising the log-softmax on CUDA (kernels/logprobs.py)."""
    return logprob_kernels.token_logprobs(logits, tokens)[1]


def sample_tokens_and_logprobs(
    logits: torch.Tensor,  # [num_rows, vocab] raw target logits, float32
    rows: list[Row],
    engine_gen: torch.Generator,
    eos_token_id: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([num_rows] int64, [num_rows] float32), on device
    """One token per row and its target log-probability (raw logits), both left on the device.
    All-greedy rows without logits processing take one fused argmax + log-probability pass."""
    if all(r.seq.params.is_greedy for r in rows) and not needs_processing(rows):
        return logprob_kernels.token_logprobs(logits)
    tok = sample_tokens(logits, rows, engine_gen, eos_token_id)  # [num_rows]
    return tok, chosen_logprobs(logits, tok)


def sample_with_logprobs(
    logits: torch.Tensor,  # [num_rows, vocab] raw target logits
    rows: list[Row],
    engine_gen: torch.Generator,
    eos_token_id: int | None,
    tokenizer,
) -> tuple[list[int], list[float], list[dict[int, Logprob] | None]]:
    """Sample one token per row and return (tokens, their target logprobs, top-N dicts for rows
    that asked for logprobs) with ONE device-to-host read for the tokens and logprobs."""
    tok, lp = sample_tokens_and_logprobs(logits, rows, engine_gen, eos_token_id)  # [num_rows]
    # float64 holds every token id exactly
    both = torch.stack([tok.to(torch.float64), lp.to(torch.float64)]).tolist()
    tokens = [int(t) for t in both[0]]
    dicts: list[dict[int, Logprob] | None] = [None] * len(rows)
    asked = [i for i, r in enumerate(rows) if r.seq.params.logprobs is not None]
    if asked:
        full = torch.log_softmax(logits[asked].float(), dim=-1)
        for j, i in enumerate(asked):
            dicts[i] = topn_dict(full[j], tokens[i], rows[i].seq.params.logprobs, tokenizer)
    return tokens, both[1], dicts


def token_logprobs(
    logits: torch.Tensor,  # [num_rows, vocab] raw target logits
    tokens: list[int],
    rows: list[Row],
    tokenizer,
) -> tuple[list[float], list[dict[int, Logprob] | None]]:
    """Log-probability of each chosen token under the target model (raw logits, as vLLM
    returns by default), plus top-N dicts for rows whose request asked for logprobs."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, to_device(tokens, torch.long, lp.device)[:, None])[:, 0]
    chosen_list = chosen.tolist()
    dicts: list[dict[int, Logprob] | None] = []
    for i, r in enumerate(rows):
        n = r.seq.params.logprobs
        if n is None:
            dicts.append(None)
            continue
        dicts.append(topn_dict(lp[i], tokens[i], n, tokenizer))
    return chosen_list, dicts


def topn_dict(lp_row: torch.Tensor, token: int, n: int, tokenizer) -> dict[int, Logprob]:
    rank = int((lp_row > lp_row[token]).sum().item()) + 1
    d: dict[int, Logprob] = {}
    if n > 0:
        vals, ids = lp_row.topk(n)
        for j, (v, t) in enumerate(zip(vals.tolist(), ids.tolist())):
            d[t] = Logprob(v, j + 1, _dec(tokenizer, t))
    if token not in d:
        d[token] = Logprob(float(lp_row[token]), rank, _dec(tokenizer, token))
    return d


def _dec(tokenizer, t: int) -> str | None:
    return tokenizer.decode([t]) if tokenizer is not None else None
