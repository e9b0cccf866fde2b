"""Draft-model speculation: a smaller causal LM with the target's vocabulary proposes ``k`` tokens
per step, and the target verifies them in one forward pass.

The draft runs on speculant's own engine pieces: it is loaded with our loader
(``resolve_model`` / ``load_config`` / ``load_model``), owns its own paged KV cache
(a :class:`~speculant.engine.model_runner.ModelRunner` plus a
:class:`~speculant.engine.block_manager.BlockManager`) and is kept in step with the target by
prefix comparison: at every ``propose`` it compares the tokens whose K/V it holds with the
sequence's tokens, rolls its cache back to the common prefix (rejected drafts are always a
suffix), and feeds what it misses (accepted drafts it never cached, the bonus token, tokens
produced while speculation was off, or a whole sequence that is new or came back after
preemption). That catch-up forward also yields the first draft token; ``k - 1`` more batched
decode steps (one forward for all sequences per step) yield the rest. On CUDA a greedy propose with
short catch-ups is one CUDA graph replay instead (:mod:`speculant.drafting.draft_graph`).

With the option ``token_map`` (a file of hot token ids, plugins/token_map.py) the draft's LM head
runs over a copy of its hot rows only, in the eager path and in the one-graph greedy propose alike:
greedy drafts are the argmax over the hot logits mapped through the hot ids (``draft_greedy``),
sampled drafts come from full-vocabulary rows with -inf outside the hot ids (``draft_logits``).

Greedy requests draft with the argmax. Sampling requests draft from the draft model's
distribution after the request's temperature / top-k / top-p / min-p (drawn with the request's
seeded generator when it has one) and return those probabilities as ``Proposal.probs``, so the
rejection sampler accepts with ``min(1, p/q)`` using the real ``q``.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from speculant import hookimpl
from speculant.drafting import (
    BlockManager,
    DraftSampler,
    GraphCache,
    HotHead,
    ModelRunner,
    StrategyError,
    TokenMapError,
    kv_bytes_per_block,
    load_config,
    load_model,
    load_token_map,
    load_tokenizer,
    max_prefill_tokens,
    resolve_model,
    row_argmax,
    split_drafts,
    to_device_async,
)
from speculant.drafting import (
    capture_draft_graphs as capture_all,
)
from speculant.drafting import (
    draft_fused_greedy as fused_greedy,
)
from speculant.spec_types import Proposal, SpecBatch, SpecSequence, StrategyContext

logger = logging.getLogger("speculant")

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
_CPU_MAX_KV_BYTES = 1 << 30  # default cap of the draft's KV cache on CPU
_CUDA_FREE_FRACTION = 0.5  # default cap on CUDA: this share of the memory free after loading


class DraftModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = Field(..., description="draft checkpoint: HF folder, .gguf file or hub id")
    num_speculative_tokens: int = Field(..., ge=1, le=64)
    dtype: str | None = Field(None, description="draft dtype; default: the target's")
    kv_cache_memory: int | None = Field(
        None,
        ge=1 << 16,
        description="bytes for the draft's own KV cache; default: enough for "
        "max_num_seqs sequences of max_model_len (capped at 1 GiB on CPU, half the free memory "
        "on CUDA)",
    )
    token_map: str | None = Field(
        None,
        description="file of hot token ids (.pt, .json, .npy or .txt; plugins/token_map.py): "
        "the draft's LM head runs over those rows only (FR-Spec)",
    )

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str | None) -> str | None:
        if v is None:
            return None
        v = str(v).replace("torch.", "")
        if v != "auto" and v not in _DTYPES:
            raise ValueError(f"unknown dtype {v!r}; use auto, float32, float16 or bfloat16")
        return v


class _DraftSeq:
    """The draft cache's view of one sequence (what BlockManager / ModelRunner need)."""

    __slots__ = ("block_table", "num_cached_tokens", "tokens", "checked")

    def __init__(self) -> None:
        self.block_table: list[int] = []
        self.num_cached_tokens = 0
        self.tokens: list[int] = []  # token ids whose K/V the draft cache holds, in order
        # leading entries of ``tokens`` known to equal the sequence's tokens (the engine only
        # appends to a sequence): the next comparison starts there
        self.checked = 0


def _common_prefix(a: list[int], b: list[int], start: int = 0) -> int:
    """Length of the longest common prefix of ``a`` and ``b``, given that ``a[:start] ==
    b[:start]`` (only what follows is compared). Called every step with the draft cache's tokens
    and the sequence's, which normally differ only in the last few positions (the rejected
    drafts): one C-speed slice compare up to a few tokens before the end, then a short scan; a
    bisection on slice compares only when they differ earlier."""
    m = min(len(a), len(b))
    lo = min(start, m)
    g = max(lo, m - 8)
    if a[lo:g] == b[lo:g]:
        while g < m and a[g] == b[g]:
            g += 1
        return g
    hi = g  # a[:lo] == b[:lo] and a[:hi] != b[:hi]: bisect on C-speed slice compares
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _source(cfg) -> str:
    name = getattr(cfg, "_name_or_path", None) or getattr(cfg, "name_or_path", None)
    return str(Path(name) / "config.json") if name else "the target model"


def _has_tokenizer(folder: Path) -> bool:
    return any(
        (folder / f).exists()
        for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    )


class DraftModelStrategy:
    name = "draft_model"
    default_for_model = True  # a bare ``model`` in speculative_config means a draft model

    Config = DraftModelConfig

    def __init__(self, config: DraftModelConfig, ctx: StrategyContext) -> None:

        self.config = config
        self.ctx = ctx
        self.num_speculative_tokens = config.num_speculative_tokens
        self.device = ctx.device
        self.dtype = ctx.dtype if config.dtype in (None, "auto") else _DTYPES[config.dtype]
        folder = resolve_model(config.model)
        self.folder = folder
        hf = load_config(folder)
        self.hf_config = hf
        target_src = _source(ctx.target_config)
        draft_src = str(folder / "config.json")
        dv = getattr(hf, "vocab_size", None)
        if dv is not None and int(dv) != ctx.vocab_size:
            raise ValueError(self._vocab_msg(draft_src, int(dv), target_src, ctx.vocab_size))
        if ctx.tokenizer is not None and _has_tokenizer(folder):
            self._check_tokenizers(load_tokenizer(folder), ctx.tokenizer, folder, target_src)

        hot_ids = None
        if config.token_map:  # read before the (large) draft weights: a bad file fails fast
            try:
                hot_ids = load_token_map(config.token_map, ctx.vocab_size)
            except TokenMapError as e:
                raise StrategyError(str(e)) from None

        self.max_len = self._draft_max_len(hf)
        self.model = load_model(folder, hf, self.dtype, self.device, self.max_len)
        rows = self.model.lm_head.weight.shape[0]
        if rows != ctx.vocab_size:
            raise ValueError(
                self._vocab_msg(draft_src + " (LM head)", rows, target_src, ctx.vocab_size)
            )
        # the hot rows of the draft's LM head (a copy [N, H], also when tied to the embedding)
        self.hot: HotHead | None = None
        if hot_ids is not None:
            self.hot = HotHead(
                self.model.lm_head.weight, hot_ids, ctx.vocab_size, like=self.model.lm_head
            )
        self.block_size = ctx.block_size
        num_blocks = self._num_blocks()
        self.block_manager = BlockManager(num_blocks, self.block_size)
        # the draft's first feed of a sequence is its prompt plus the target's first token: a
        # prefill graph one token per sequence larger than the target's
        limit = max_prefill_tokens(ctx.max_prefill_graph_tokens)
        self.runner = ModelRunner(
            self.model,
            num_blocks,
            self.block_size,
            self.device,
            self.dtype,
            enforce_eager=ctx.enforce_eager,
            max_graph_prefill=limit and limit + ctx.max_num_seqs,
        )
        self.states: dict[int, _DraftSeq] = {}
        # greedy proposes as one CUDA graph replay each (draft_graph.py); off on the CPU
        self.graphs = GraphCache(self.device, "draft model propose", ctx.enforce_eager)
        self.generator = torch.Generator().manual_seed(ctx.seed + 104729)
        logger.info(
            "draft model %s (%s, %d layers) on %s: %d KV blocks of %d",
            folder,
            getattr(hf, "model_type", "?"),
            self.model.num_layers,
            self.device,
            num_blocks,
            self.block_size,
        )

    # ----------------------------------------------------------------- set-up
    @staticmethod
    def _vocab_msg(draft_src: str, dv: int, target_src: str, tv: int) -> str:
        return (
            f"draft model {draft_src} has vocab_size={dv} but the target model {target_src} has "
            f"vocab_size={tv}; a draft model must share the target's vocabulary (the same "
            "tokenizer), pick a draft from the same model family"
        )

    @staticmethod
    def _check_tokenizers(draft_tok, target_tok, folder: Path, target_src: str) -> None:
        dvocab, tvocab = draft_tok.get_vocab(), target_tok.get_vocab()
        if dvocab == tvocab:
            return
        diff = [t for t in dvocab.keys() | tvocab.keys() if dvocab.get(t) != tvocab.get(t)]
        example = sorted(diff)[:3]
        raise ValueError(
            f"draft model {folder} has a different tokenizer vocabulary from the target model "
            f"{target_src}: {len(dvocab)} vs {len(tvocab)} entries, {len(diff)} token(s) differ "
            f"(e.g. {example}); a draft model must share the target's vocabulary"
        )

    def _draft_max_len(self, hf) -> int:
        limit = self.ctx.max_model_len
        for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
            if getattr(hf, key, None):
                limit = min(limit, int(getattr(hf, key)))
                break
        window = getattr(hf, "sliding_window", None)
        if window and getattr(hf, "use_sliding_window", True) is not False:
            limit = min(limit, int(window))
        return limit

    def _num_blocks(self) -> int:
        per_block = kv_bytes_per_block(self.model, self.block_size, self.dtype)
        blocks_per_seq = -(-self.max_len // self.block_size)
        budget = self.config.kv_cache_memory or self.ctx.kv_cache_memory
        if budget is None:
            want = (self.ctx.max_num_seqs * blocks_per_seq + 1) * per_block
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                cap = int(free * _CUDA_FREE_FRACTION)
            else:
                cap = _CPU_MAX_KV_BYTES
            budget = max(min(want, cap), blocks_per_seq * per_block)
        num = int(budget // per_block)
        if num < 1:
            raise ValueError(
                f"the draft KV cache budget ({budget} bytes) holds no block of {self.block_size} "
                f"tokens ({per_block} bytes each); raise kv_cache_memory in speculative_config"
            )
        return num

    # ----------------------------------------------------------------- hooks
    @hookimpl
    @torch.inference_mode()
    def propose(self, batch: SpecBatch) -> Proposal:
        seqs = batch.seqs
        # positions of the cache used: n tokens + (k_i - 1) drafts fed back; keep them < max_len
        ks = [
            max(0, min(s.max_draft, self.num_speculative_tokens, self.max_len - s.num_tokens))
            for s in seqs
        ]
        active: list[int] = []
        feeds: list[list[int]] = []
        in_batch = {s.seq_id for s in seqs}
        for i, (s, k) in enumerate(zip(seqs, ks)):
            if k == 0:
                self._drop(s.seq_id)
                continue
            feed = self._sync(s, k, in_batch)
            if feed is None:
                ks[i] = 0
                continue
            active.append(i)
            feeds.append(feed)
        if not active:
            return Proposal(token_ids=[[] for _ in seqs])

        states = [self.states[seqs[i].seq_id] for i in active]
        active_ks = [ks[i] for i in active]
        toks = hidden = None
        if self.graphs.enabled and all(seqs[i].sampling_params.is_greedy for i in active):
            # catch-up and k steps in one graph; only what its inputs need runs before the
            # launch, the rest of the bookkeeping while the GPU drafts (before the read-back)
            toks = fused_greedy(self, states, feeds, active_ks)  # [rows, K] | None
        if toks is None:
            hidden = self._forward(states, feeds)  # [sum(len(feed)), hidden]
        for st, f in zip(states, feeds):  # the catch-up is queued on the GPU: its tokens
            st.tokens.extend(f)
            st.checked = len(st.tokens)  # the sequence's tokens up to its last
        if toks is not None:
            drafts = split_drafts(toks, active, active_ks, len(seqs), self.graphs)
            for st, i in zip(states, active):
                st.tokens.extend(drafts[i][: ks[i] - 1])
            return Proposal(token_ids=drafts)
        sampler = DraftSampler([seqs[i] for i in active], active_ks, self.generator, self.device)
        if any(len(f) != 1 for f in feeds):  # the last row of each sequence's feed
            ends = list(itertools.accumulate(len(f) for f in feeds))
            hidden = hidden[to_device_async([e - 1 for e in ends], torch.long, self.device)]
        # draft steps: the chosen tokens stay on the device and are fed back from there; the
        # drafts are read once, at the end
        cur = list(range(len(active)))  # rows (positions into `active`) still drafting
        steps: list[tuple[list[int], torch.Tensor]] = []  # (rows, their tokens [len(rows)])
        step = 0
        while True:
            toks = self._choose(hidden, cur, step, sampler)  # [len(cur)]
            steps.append((cur, toks))
            step += 1
            keep = [m for m, r in enumerate(cur) if ks[active[r]] > step]
            if not keep:
                break
            if len(keep) != len(cur):
                toks = toks[to_device_async(keep, torch.long, self.device)]
                cur = [cur[m] for m in keep]
            hidden = self._forward([states[r] for r in cur], [[0] for _ in cur], toks)
        K = len(steps)
        out = torch.zeros(len(active), K, dtype=torch.long, device=self.device)  # [rows, K]
        for j, (rows, toks) in enumerate(steps):
            if len(rows) == len(active):
                out[:, j] = toks
            else:
                out[to_device_async(rows, torch.long, self.device), j] = toks
        drafts = split_drafts(out, active, [ks[i] for i in active], len(seqs))
        for r, i in enumerate(active):  # the drafts fed back: their K/V is in the cache now
            states[r].tokens.extend(drafts[i][: ks[i] - 1])
        probs = sampler.probs(active, len(seqs), self.ctx.vocab_size)
        return Proposal(token_ids=drafts, probs=probs)

    @hookimpl
    def on_requests_finished(self, seq_ids: list[int]) -> None:
        for i in seq_ids:
            self._drop(i)

    @hookimpl
    @torch.inference_mode()
    def capture_graphs(self, max_num_seqs: int, progress: bool) -> int:
        """The draft runner's graphs (its catch-ups of up to k + 1 tokens and one-token steps
        for sampled requests, each request's first feed: the prompt's prefill) and the
        one-graph greedy proposes (``draft_graph.capture_all``)."""
        n = self.runner.capture_graphs(
            max_num_seqs, self.num_speculative_tokens + 1, (), None, progress
        )
        return n + capture_all(self, max_num_seqs, progress)

    # ----------------------------------------------------------------- helpers
    def _drop(self, seq_id: int) -> None:
        st = self.states.pop(seq_id, None)
        if st is not None:
            self.block_manager.free(st)

    def _sync(self, s: SpecSequence, k: int, in_batch: set[int]) -> list[int] | None:
        """Roll the draft cache of ``s`` back to the prefix it shares with ``s.token_ids`` and
        reserve slots for the catch-up plus ``k - 1`` drafts. Returns the tokens to feed (always
        ending with the sequence's last token), or None when the draft cache is full."""
        st = self.states.get(s.seq_id)
        if st is None:
            st = self.states[s.seq_id] = _DraftSeq()
        toks = s.token_ids
        n = len(toks)
        common = min(_common_prefix(st.tokens, toks, st.checked), n - 1)
        if common < st.num_cached_tokens:
            self.block_manager.rollback(st, common)
            del st.tokens[common:]
        st.checked = common
        need = n + k - 1
        bm = self.block_manager
        # most steps the blocks are there already (BlockManager.blocks_needed, inlined: this
        # runs per sequence while the GPU waits for the draft graph)
        if -(-need // bm.block_size) > len(st.block_table):
            if not bm.can_reserve(st, need):
                # reclaim caches of sequences not running now (e.g. waiting after preemption)
                for sid in [sid for sid in self.states if sid not in in_batch]:
                    self._drop(sid)
            if not bm.can_reserve(st, need):
                logger.debug("draft KV cache full: no drafts for sequence %d this step", s.seq_id)
                self._drop(s.seq_id)
                return None
            bm.reserve(st, need)
        return toks[common:]  # a new list

    def _forward(
        self, states: list[_DraftSeq], feeds: list[list[int]], token_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Run the draft over ``feeds`` (or, with ``token_ids`` [len(states)] on the device, one
        token per sequence from there) and return the final hidden states [tokens, hidden].
        Decode steps replay the runner's CUDA graphs with the ids copied in on the device."""
        graphs = self.runner.graphs
        plan = graphs.plan(states, [len(f) for f in feeds]) if graphs is not None else None
        if plan is not None:
            return graphs.run(states, feeds, (), token_ids, plan)[0]
        if token_ids is not None:  # the eager path builds its inputs on the host
            feeds = [[t] for t in token_ids.tolist()]
        return self.runner.forward(states, feeds)[0]

    def _choose(
        self, hidden: torch.Tensor, rows: list[int], step: int, sampler: DraftSampler
    ) -> torch.Tensor:
        """One draft token per row of ``hidden`` [len(rows), hidden] (``rows``: positions in
        the sampler's rows): argmax for greedy requests, a sample of the processed draft
        distribution for the others (its q is kept by the sampler). Returns [len(rows)] int64 on
        the device."""
        if sampler.all_greedy:  # no q to keep: the argmax, without full-vocabulary rows
            return self.draft_greedy(hidden)  # [len(rows)]
        logits = self.draft_logits(hidden)  # [len(rows), vocab] float32
        return sampler(step, logits, None if len(rows) == len(sampler.seqs) else rows)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The draft's logits [rows, vocab] float32 of final hidden states [rows, hidden]: the
        full LM head, or with a token map its hot rows only (-inf elsewhere). For the draft
        probabilities of sampled requests; greedy drafting uses ``draft_greedy``."""
        if self.hot is not None:
            return self.hot(hidden)
        return self.model.compute_logits(hidden)

    def draft_greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """The greedy draft tokens [rows] int64 of final hidden states [rows, hidden]:
        ``row_argmax(draft_logits(hidden))``, with a token map taken over the N hot logits and
        mapped through the hot ids (``HotHead.greedy``: no [rows, vocab] row). The eager path and
        the one-graph greedy propose (draft_graph.py) both call this; nothing here reads the
        device, so it can be captured in a CUDA graph."""
        if self.hot is not None:
            return self.hot.greedy(hidden)  # [rows, N] -> [rows]
        return row_argmax(self.model.compute_logits(hidden))  # [rows, vocab] -> [rows]


@hookimpl
def register_strategies(register) -> None:
    register(DraftModelStrategy)
