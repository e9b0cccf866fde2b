"""Log-probabilities of chosen tokens under raw logits, and the greedy token with its own.

``token_logprobs(logits, tokens=None, rows=None) -> (tokens [N] int64, logprobs [N] fp32)``

* ``logits [R, V]`` (fp32, bf16 or fp16; rows may be strided, the last dim contiguous).
* ``rows [N]`` int64: the logits row of each output (``None``: row ``i`` for output ``i``,
  ``N = R``). A row may appear several times.
* ``tokens [N]`` int64 in ``[0, V)``: the token whose log-probability to return; ``None``: the
  row's argmax (lowest index on ties, as ``torch.argmax``), returned as the first output.
* ``logprobs[i] = log_softmax(logits[rows[i]].float())[tokens[i]]``.

Every decode step needs this: the engine reports the target's log-probability of each emitted
token, and a greedy plain step needs the argmax too. The torch way (``log_softmax`` over the
whole ``[rows, vocab]`` matrix, then ``argmax`` and ``gather``) costs two full passes over a
128k-vocab row done by a single thread block each; at batch 1 on an H100 that was 55 us per
step (2.7 us of data). Here:

1. ``_partial_kernel`` grid ``(N, n_chunks)``: per chunk of the row, its max, the argmax (lowest
   index) and ``sum(exp(x - max))``, one pass.
2. ``_combine_kernel`` grid ``(N,)``: ``M = max_c m_c``, ``S = sum_c s_c exp(m_c - M)``,
   ``lse = M + log(S)``, the argmax (first chunk reaching ``M``), and
   ``logprob = logits[row, token] - lse``.

``row_argmax(logits) -> [R] int64`` is the first kernel's max / argmax and the second's choice
of chunk alone (no exponentials): ``torch.argmax`` for the greedy proposers.

The torch reference is the CPU path. They agree to fp32 rounding (the sums run in a different
order); the argmax is the same index.
"""

from __future__ import annotations

import torch

from ._triton_utils import cdiv, check_tensor, lazy_jit, next_pow2, pdl_launch, tl, use_triton

__all__ = ["token_logprobs", "token_logprobs_ref", "row_argmax"]

_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TARGET_CHUNKS = 32  # chunks per row (programs per row) for large vocabularies


def token_logprobs_ref(
    logits: torch.Tensor,  # [R, V]
    tokens: torch.Tensor | None = None,  # [N] int64
    rows: torch.Tensor | None = None,  # [N] int64
) -> tuple[torch.Tensor, torch.Tensor]:  # ([N] int64, [N] fp32)
    x = logits.float() if rows is None else logits[rows].float()  # [N, V]
    if tokens is None:
        tokens = x.argmax(dim=-1)
    lp = torch.log_softmax(x, dim=-1).gather(1, tokens[:, None].long())[:, 0]
    return tokens.long(), lp


if tl is not None:

    @lazy_jit
    def _partial_kernel(
        x_ptr,  # [R, V] logits
        rows_ptr,  # [N] int64 (HAS_ROWS)
        m_ptr,  # [N, NC] fp32 chunk max
        i_ptr,  # [N, NC] int64 chunk argmax
        s_ptr,  # [N, NC] fp32 chunk sum(exp(x - chunk max))
        V,
        stride_x,
        NC,
        HAS_ROWS: tl.constexpr,
        WITH_LSE: tl.constexpr,  # False: max / argmax only (s_ptr unused)
        CHUNK: tl.constexpr,
        BLOCK: tl.constexpr,
        GDC: tl.constexpr,  # launched with PDL (programmatic dependent launch)
    ):
        if GDC:  # launched with PDL: everything here reads what the previous kernel wrote
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        n = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        row = tl.load(rows_ptr + n) if HAS_ROWS else n
        base = x_ptr + row * stride_x
        best_m = tl.full([], float("-inf"), tl.float32)
        best_i = tl.full([], 0, tl.int64) + c * CHUNK
        s = tl.full([], 0.0, tl.float32)
        for b in range(0, CHUNK, BLOCK):
            offs = c * CHUNK + b + tl.arange(0, BLOCK)
            x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            bm, bi = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
            new_m = tl.maximum(best_m, bm)
            if WITH_LSE:
                safe = tl.where(new_m == float("-inf"), 0.0, new_m)  # all -inf so far: no mass
                s = s * tl.exp(best_m - safe) + tl.sum(tl.exp(x - safe), axis=0)
            better = bm > best_m
            best_i = tl.where(better, (c * CHUNK + b + bi).to(tl.int64), best_i)
            best_m = new_m
        tl.store(m_ptr + n * NC + c, best_m)
        tl.store(i_ptr + n * NC + c, best_i)
        if WITH_LSE:
            tl.store(s_ptr + n * NC + c, s)

    @lazy_jit
    def _combine_kernel(
        x_ptr,  # [R, V] logits
        rows_ptr,  # [N] int64 (HAS_ROWS)
        m_ptr,  # [N, NC] fp32
        i_ptr,  # [N, NC] int64
        s_ptr,  # [N, NC] fp32
        tok_ptr,  # [N] int64: read when HAS_TOKENS, else written (the argmax)
        lp_ptr,  # [N] fp32 out
        stride_x,
        NC,
        HAS_ROWS: tl.constexpr,
        HAS_TOKENS: tl.constexpr,
        WITH_LSE: tl.constexpr,  # False: the argmax only (s_ptr, lp_ptr unused)
        NC_P2: tl.constexpr,
        GDC: tl.constexpr,  # launched with PDL (programmatic dependent launch)
    ):
        if GDC:  # launched with PDL: everything here reads what the previous kernel wrote
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        n = tl.program_id(0).to(tl.int64)
        row = tl.load(rows_ptr + n) if HAS_ROWS else n
        c = tl.arange(0, NC_P2)
        cm = c < NC
        m = tl.load(m_ptr + n * NC + c, mask=cm, other=float("-inf"))  # [NC_P2]
        big_m = tl.max(m, axis=0)
        if HAS_TOKENS:
            tok = tl.load(tok_ptr + n).to(tl.int64)
        else:
            first = tl.min(tl.where(m == big_m, c, NC_P2), axis=0)  # lowest chunk with the max
            tok = tl.load(i_ptr + n * NC + first)
            tl.store(tok_ptr + n, tok)
        if WITH_LSE:
            s = tl.load(s_ptr + n * NC + c, mask=cm, other=0.0)
            safe = tl.where(big_m == float("-inf"), 0.0, big_m)
            total = tl.sum(s * tl.exp(m - safe), axis=0)
            lse = safe + tl.log(total)
            x_tok = tl.load(x_ptr + row * stride_x + tok).to(tl.float32)
            tl.store(lp_ptr + n, x_tok - lse)


def _chunking(V: int) -> tuple[int, int, int]:
    """(chunk, block, n_chunks) for a row of ``V`` entries: about ``_TARGET_CHUNKS`` chunks of
    whole ``block``s (up to 1024 entries per load)."""
    block = min(1024, max(16, next_pow2(V)))
    per_chunk = max(1, cdiv(cdiv(V, block), _TARGET_CHUNKS))
    chunk = block * per_chunk
    return chunk, block, cdiv(V, chunk)


def _token_logprobs_triton(logits, tokens, rows, with_lse: bool = True):
    R, V = logits.shape
    N = rows.shape[0] if rows is not None else R
    dev = logits.device
    out_tok = tokens if tokens is not None else torch.empty(N, dtype=torch.int64, device=dev)
    lp = torch.empty(N if with_lse else 0, dtype=torch.float32, device=dev)
    if N == 0:
        return out_tok, lp
    chunk, block, nc = _chunking(V)
    m = torch.empty((N, nc), dtype=torch.float32, device=dev)
    idx = torch.empty((N, nc), dtype=torch.int64, device=dev)
    s = torch.empty((N, nc) if with_lse else (1,), dtype=torch.float32, device=dev)
    pdl = pdl_launch(dev)
    rows_arg = rows if rows is not None else m  # never read without HAS_ROWS
    lp_arg = lp if with_lse else m  # never written without WITH_LSE
    _partial_kernel[(N, nc)](
        logits, rows_arg, m, idx, s, V, logits.stride(0), nc,
        HAS_ROWS=rows is not None, WITH_LSE=with_lse, CHUNK=chunk, BLOCK=block,
        num_warps=4 if block >= 512 else 2, **pdl,
    )
    _combine_kernel[(N,)](
        logits, rows_arg, m, idx, s, out_tok, lp_arg, logits.stride(0), nc,
        HAS_ROWS=rows is not None, HAS_TOKENS=tokens is not None, WITH_LSE=with_lse,
        NC_P2=next_pow2(nc), num_warps=1, **pdl,
    )
    return out_tok, lp


def row_argmax(
    logits: torch.Tensor,  # [R, V]
    *,
    force_triton: bool = False,
) -> torch.Tensor:  # [R] int64
    """``logits.argmax(dim=-1)`` (lowest index on ties) in one chunked pass per row on CUDA:
    ``torch.argmax`` reduces a 128k-vocabulary row with one thread block (~25 us on an H100
    for 2.7 us of data), and every greedy proposer takes one per draft step."""
    check_tensor("logits", logits, ndim=2, dtypes=_LOGIT_DTYPES, last_contiguous=True)
    if logits.shape[1] == 0:
        raise ValueError("row_argmax: logits have an empty vocabulary dimension")
    if use_triton([logits], force_triton):
        return _token_logprobs_triton(logits, None, None, with_lse=False)[0]
    return logits.argmax(dim=-1)


def token_logprobs(
    logits: torch.Tensor,  # [R, V]
    tokens: torch.Tensor | None = None,  # [N] int64 in [0, V)
    rows: torch.Tensor | None = None,  # [N] int64 in [0, R)
    *,
    force_triton: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # (tokens [N] int64, logprobs [N] fp32)
    """``log_softmax(logits[rows].float())[i, tokens[i]]``, with ``tokens`` = the argmax of
    each row when not given (module doc). Triton for CUDA tensors (no host synchronisation),
    torch otherwise; ``force_triton`` runs the kernel (under ``TRITON_INTERPRET=1`` on CPU)."""
    check_tensor("logits", logits, ndim=2, dtypes=_LOGIT_DTYPES, last_contiguous=True)
    dev = logits.device
    if rows is not None:
        check_tensor("rows", rows, ndim=1, dtypes=(torch.int64,), device=dev)
    n = rows.shape[0] if rows is not None else logits.shape[0]
    if tokens is not None:
        check_tensor("tokens", tokens, shape=(n,), dtypes=(torch.int64,), device=dev)
    if logits.shape[1] == 0:
        raise ValueError("token_logprobs: logits have an empty vocabulary dimension")
    if use_triton([logits, tokens, rows], force_triton):
        return _token_logprobs_triton(logits, tokens.contiguous() if tokens is not None else None,
                                      rows.contiguous() if rows is not None else None)
    return token_logprobs_ref(logits, tokens, rows)
