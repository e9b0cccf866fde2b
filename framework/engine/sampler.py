"""Turn target logits into tokens: logits processors, penalties, min_tokens, then the sampling
transforms (temperature, top-k, top-p, min-p) and greedy / seeded random choice."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from speculant.engine.sequence import Sequence
from speculant.kernels.rejection_sampling import sample_from_probs
from speculant.kernels.sampling import sampling_probs
from speculant.outputs import Logprob


@dataclass
class Row:
    """One logits row: the sequence it belongs to and the tokens generated before it beyond the
    sequence's own (drafts earlier in a verification window)."""

    seq: Sequence
    extra: list[int]


def _call_processor(fn, prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor):
    try:
        n = len(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        n = 2
    return fn(prompt_ids, output_ids, logits) if n >= 3 else fn(output_ids, logits)


def process_logits(
    logits: torch.Tensor,  # [num_rows, vocab] float32
    rows: list[Row],
    eos_token_id: int | None,
) -> torch.Tensor:  # [num_rows, vocab] float32, processed copy
    """Apply per-request logits processors, repetition/presence/frequency penalties (vLLM
    semantics) and the min_tokens EOS/stop-token mask."""
    needs = [r for r in rows if r.seq.params.logits_processors or r.seq.params.has_penalties
             or r.seq.params.min_tokens]
    if not needs:
        return logits
    logits = logits.clone()
    V = logits.shape[1]
    for i, r in enumerate(rows):
        p = r.seq.params
        out_ids = r.seq.output_token_ids + r.extra
        if p.logits_processors:
            prompt_ids = r.seq.token_ids[: r.seq.num_prompt_tokens]
            for fn in p.logits_processors:
                res = _call_processor(fn, prompt_ids, list(out_ids), logits[i])
                if res is not None:
                    logits[i] = res
        if p.has_penalties:
            dev = logits.device
            out_t = torch.tensor(out_ids, dtype=torch.long, device=dev)
            counts = torch.zeros(V, device=dev).index_add_(
                0, out_t.clamp(0, V - 1), torch.ones(len(out_ids), device=dev)
            ) if out_ids else torch.zeros(V, device=dev)
            if p.repetition_penalty != 1.0:
                seen = counts > 0
                prompt_t = torch.tensor(r.seq.token_ids[: r.seq.num_prompt_tokens], dtype=torch.long, device=dev)
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
    return logits


def sampling_tensors(rows: list[Row], device) -> tuple[torch.Tensor, ...]:
    temp = torch.tensor([r.seq.params.temperature for r in rows], dtype=torch.float32, device=device)
    top_k = torch.tensor([r.seq.params.top_k for r in rows], dtype=torch.int32, device=device)
    top_p = torch.tensor([r.seq.params.top_p for r in rows], dtype=torch.float32, device=device)
    min_p = torch.tensor([r.seq.params.min_p for r in rows], dtype=torch.float32, device=device)
    return temp, top_k, top_p, min_p


def target_probs(processed: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """[num_rows, vocab] float32 probabilities after temperature/top-k/top-p/min-p."""
    return sampling_probs(processed, *sampling_tensors(rows, processed.device))


def uniforms(seqs: list[Sequence], counts: list[int], engine_gen: torch.Generator, device) -> torch.Tensor:
    """Uniform [0, 1) numbers, ``counts[i]`` for sequence i, from its own seeded generator when it
    has one (so seeded requests are reproducible whatever else is in the batch)."""
    parts = []
    for s, n in zip(seqs, counts):
        gen = s.generator or engine_gen
        parts.append(torch.rand(n, generator=gen, dtype=torch.float32))
    return torch.cat(parts).to(device) if parts else torch.empty(0, device=device)


def sample(logits: torch.Tensor, rows: list[Row], engine_gen: torch.Generator,
           eos_token_id: int | None) -> list[int]:
    """Sample one token per row (plain decoding and the first token after prefill)."""
    processed = process_logits(logits, rows, eos_token_id)
    greedy = [r.seq.params.is_greedy for r in rows]
    if all(greedy):
        return processed.argmax(dim=-1).tolist()
    probs = target_probs(processed, rows)
    u = uniforms([r.seq for r in rows], [1] * len(rows), engine_gen, logits.device)
    sampled = sample_from_probs(probs, u)
    argmax = processed.argmax(dim=-1)
    g = torch.tensor(greedy, device=logits.device)
    return torch.where(g, argmax, sampled).tolist()


def token_logprobs(
    logits: torch.Tensor,  # [num_rows, vocab] raw target logits
    tokens: list[int],
    rows: list[Row],
    tokenizer,
) -> tuple[list[float], list[dict[int, Logprob] | None]]:
    """Log-probability of each chosen token under the target model (raw logits, as vLLM
    returns by default), plus top-N dicts for rows whose request asked for logprobs."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0]
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
