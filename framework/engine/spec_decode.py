"""The speculative decode step: propose -> score -> verify -> append, through the hooks of a
per-engine plugin manager holding the chosen strategy, the scorer and the verifier. The decoder
uses its engine through :class:`~speculant.engine.target.TargetEngine` only."""

from __future__ import annotations

import logging

import pluggy
import torch
from pydantic import ValidationError

from speculant import hookspecs
from speculant.config import explain
from speculant.engine.sampler import topn_dict
from speculant.engine.sequence import Sequence
from speculant.engine.spec_control import SpecController
from speculant.engine.staging import to_device
from speculant.engine.target import TargetEngine
from speculant.hookspecs import StrategyInfo, hookimpl, strategy_info
from speculant.kernels.logprobs import token_logprobs
from speculant.outputs import SpecMetrics
from speculant.spec_registry import SpeculativeConfig, StrategyError, build_strategy_config, lookup
from speculant.spec_types import (
    Proposal,
    ScoreResult,
    SpecBatch,
    SpecSequence,
    StrategyContext,
    VerifyResult,
)

logger = logging.getLogger("speculant")


class ProposalError(RuntimeError):
    pass


class TargetScorer:
    """Default ``score``: one target forward over [last token, drafts...] per sequence."""

    def __init__(self, decoder: SpecDecoder) -> None:
        self.d = decoder

    @hookimpl(trylast=True)
    def score(self, batch: SpecBatch, proposal: Proposal) -> ScoreResult:
        seqs = [self.d.seq_by_id[s.seq_id] for s in batch.seqs]
        new_tokens = [[s.last_token, *drafts] for s, drafts in zip(seqs, proposal.token_ids)]
        # the greedy pack is free inside a head graph; eagerly, only for all-greedy batches
        greedy = all(s.params.is_greedy for s in seqs)
        hidden, aux, logits, packed = self.d.engine.score(seqs, new_tokens, self.d.aux_layers,
                                                          greedy=greedy,
                                                          keep_hidden=self.d.needs_hidden)
        return ScoreResult(logits=logits, hidden_states=hidden, aux_hidden_states=aux,
                           greedy=packed)


def _parse(speculative_config: dict) -> SpeculativeConfig:
    try:
        return SpeculativeConfig(**speculative_config)
    except ValidationError as e:
        raise StrategyError(f"invalid speculative_config: {explain(e, 'speculative_config')}") from None
    except TypeError as e:
        raise StrategyError(f"invalid speculative_config: {e}") from None


def _build(info: StrategyInfo, config, ctx: StrategyContext):
    """``info.cls(config, ctx)``, a bad checkpoint's error turned into a StrategyError."""
    try:
        return info.cls(config, ctx)
    except StrategyError:
        raise
    except (ValueError, FileNotFoundError) as e:  # bad checkpoint, vocab mismatch, ...
        raise StrategyError(f"speculative method {info.name!r}: {e}") from e


class SpecDecoder:
    """The speculative decoder of one engine: the chosen strategy, the scorer, the verifier and
    the modifiers in its own plugin manager, and the step that runs them. It uses the engine
    only through :class:`~speculant.engine.target.TargetEngine`."""

    def __init__(self, engine: TargetEngine, speculative_config: dict) -> None:
        self.engine = engine
        self.spec_config = spec = _parse(speculative_config)
        self.ctx = ctx = engine.strategy_context()
        info = lookup(spec.method, "proposer")
        self.name = info.name
        self.strategy_config = build_strategy_config(info, spec)
        self.strategy = _build(info, self.strategy_config, ctx)
        # k: what the instance settled on (its __init__, or a property), else the user's value
        # (through the strategy's Config or speculative_config), else the class's default
        own = strategy_info(self.strategy, info.plugin)
        k = (own.num_speculative_tokens or getattr(self.strategy_config, "num_speculative_tokens", None)
             or spec.num_speculative_tokens or info.num_speculative_tokens)
        if not k:
            raise StrategyError(
                f"speculative_config for {info.name!r} needs num_speculative_tokens (or give the "
                f"strategy class a default: num_speculative_tokens = N)")
        self.k = int(k)
        self.needs_hidden = own.needs_hidden_states
        self.aux_layers = own.aux_hidden_layers

        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.pm.register(self.strategy, name=f"strategy:{info.name}")
        self.pm.register(TargetScorer(self), name="scorer:target")
        verifier = lookup(spec.acceptance_method, "verifier")
        self.pm.register(verifier.cls(None, ctx), name=f"verifier:{verifier.name}")
        if spec.disable_by_batch_size is not None:
            modifier = lookup("batch_size_disable", "modifier")
            mod_cfg = modifier.Config(disable_by_batch_size=spec.disable_by_batch_size)
            self.pm.register(modifier.cls(mod_cfg, ctx), name="modifier:batch_size_disable")
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as e:
            raise StrategyError(f"strategy {info.name!r} implements an unknown hook: {e}") from None
        self.seq_by_id: dict[int, Sequence] = {}
        # hidden states not yet handed to the proposer, per seq id: (start_pos, [tensors], [aux])
        self.pending: dict[int, tuple[int, list[torch.Tensor], list[torch.Tensor]]] = {}
        self._new_run_state()  # enabled, control, last_batch_size, total

    def reset(self) -> None:
        """Forget what earlier runs taught this decoder, as if it had just been built over the
        same strategy (whose weights, caches and CUDA graphs it keeps): the metrics, the
        auto-disable statistics and the batch-size vote. Call it between runs with no request
        in flight (benchmarks reuse one decoder across batch sizes)."""
        if self.seq_by_id or self.pending:
            raise RuntimeError("SpecDecoder.reset() with requests in flight: let them finish or "
                               "abort them first")
        self._new_run_state()

    def _new_run_state(self) -> None:
        spec = self.spec_config
        self.enabled = True  # False while a modifier (on_batch_size_change) turned speculation off
        self.control = (SpecController(spec.auto_disable_tolerance, spec.auto_disable_interval)
                        if spec.auto_disable else None)
        self.last_batch_size = 0
        self.total = SpecMetrics()

    # ----------------------------------------------------------------- engine callbacks
    def max_lookahead(self) -> int:
        if self.control is not None and not self.control.would_speculate(self.last_batch_size):
            return 0
        return self.k if self.enabled else 0

    def capture_graphs(self, progress: bool = True) -> int:
        """The plugins' ``capture_graphs`` hook (their own CUDA graphs, at start-up): how many
        they captured."""
        done = self.pm.hook.capture_graphs(max_num_seqs=self.ctx.max_num_seqs, progress=progress)
        return sum(int(n or 0) for n in done)

    def release(self, seq_ids: list[int]) -> None:
        for i in seq_ids:
            self.pending.pop(i, None)
            self.seq_by_id.pop(i, None)
        self.pm.hook.on_requests_finished(seq_ids=list(seq_ids))

    def record_prefill(self, seqs: list[Sequence], counts: list[int], hidden: torch.Tensor,
                       aux: torch.Tensor | None) -> None:
        """A prefill step fed ``counts[i]`` tokens of ``seqs[i]`` (from position 0 on a
        recompute) and appended each one's first token: keep the hidden states for the proposer
        and count the step (``spec_token_acceptance_counts[0]`` counts prefills, as vLLM V0)."""
        self.record_hidden(seqs, counts, hidden, aux, counts, [0] * len(seqs), reset=True)
        for s in seqs:
            s.metrics.spec.num_prefill_steps += 1
            s.metrics.spec.num_speculative_tokens = self.k
        self.total.num_prefill_steps += len(seqs)

    def record_hidden(self, seqs, counts, hidden, aux, keep, starts, reset: bool = False) -> None:
        """Remember target hidden states of newly verified positions for the proposer.
        Rows [0, keep[i]) of the ``counts[i]`` rows of seqs[i] are kept; they cover positions
        starting at ``starts[i]``. ``reset`` drops what was pending (prefill / recompute)."""
        if not self.needs_hidden:
            return
        row = 0
        for s, c, kp, p0 in zip(seqs, counts, keep, starts):
            if reset or s.seq_id not in self.pending:
                self.pending[s.seq_id] = (p0, [], [])
            entry = self.pending[s.seq_id]
            entry[1].append(hidden[row : row + kp])
            if aux is not None:
                entry[2].append(aux[row : row + kp])
            row += c

    # ----------------------------------------------------------------- the step
    def step(self, seqs: list[Sequence]) -> None:
        """One decode step of ``seqs``: speculative, or plain while speculation is off (a
        modifier's vote, ``auto_disable``) or nothing was proposed."""
        for s in seqs:
            self.seq_by_id[s.seq_id] = s
        if len(seqs) != self.last_batch_size:
            self._batch_size_changed(len(seqs))
        if self.control is None:
            self._step(seqs, self.enabled)
            return
        emitted = self.total.num_emitted_tokens
        speculate = self.control.begin(len(seqs), allowed=self.enabled)
        self._step(seqs, speculate)
        switched = self.control.end(self.total.num_emitted_tokens - emitted)
        if switched == "off":
            self.total.num_times_disabled += 1
        elif switched == "on":
            self.total.num_times_enabled += 1

    def _batch_size_changed(self, size: int) -> None:
        """The ``on_batch_size_change`` vote: speculation runs unless a plugin returns False."""
        votes = self.pm.hook.on_batch_size_change(old_size=self.last_batch_size, new_size=size)
        was = self.enabled
        self.enabled = not any(v is False for v in votes)
        if was != self.enabled:
            if self.enabled:
                self.total.num_times_enabled += 1
            else:
                self.total.num_times_disabled += 1
            logger.info("speculation %s at batch size %d", "on" if self.enabled else "off", size)
        self.last_batch_size = size

    def _step(self, seqs: list[Sequence], speculate: bool) -> None:
        if not speculate:
            # build no batch: it would hand the pending target hidden states to no proposer
            # (and drop them); kept, they let the proposer catch up when speculation returns
            self._plain_step(seqs, overlap=True)
            return
        seqs = self.engine.take_back(seqs)  # the proposer needs every token on the host
        if not seqs:
            return
        batch = self._batch(seqs)
        proposal = self._propose(batch)
        if proposal is None or not any(proposal.token_ids):
            self._plain_step(seqs, overlap=False)
            return
        scores = self.pm.hook.score(batch=batch, proposal=proposal)
        result = self.pm.hook.verify(batch=batch, proposal=proposal, scores=scores)
        self._apply(seqs, proposal, scores, result)

    def _room(self, s: Sequence) -> int:
        """Draft tokens ``s`` may get this step. Scoring writes K/V at positions len(s) - 1 ..
        len(s) - 1 + k, so it needs len(s) + k cache slots; the scheduler reserved k extra slots
        only if speculation was on at the previous step (``max_lookahead``). On the step that
        turns it back on, reserve them now if blocks are free, else draft fewer tokens."""
        want = min(self.k, self.ctx.max_model_len - len(s) - 1)
        if want <= 0:
            return 0
        return max(0, min(want, self.engine.reserve_slots(s, len(s) + want) - len(s)))

    def _batch(self, seqs: list[Sequence]) -> SpecBatch:
        room = [self._room(s) for s in seqs]
        sp = [SpecSequence(s.seq_id, s.token_ids, s.num_prompt_tokens, max(0, r), s.params, s.generator)
              for s, r in zip(seqs, room)]
        batch = SpecBatch(seqs=sp)
        if self.needs_hidden:
            hs, aux, counts, starts = [], [], [], []
            for s in seqs:
                pos0, h, a = self.pending.pop(s.seq_id, (len(s) - 1, [], []))
                t = torch.cat(h) if h else torch.empty(0, self.ctx.target_model.hidden_size,
                                                       device=self.ctx.device, dtype=self.ctx.dtype)
                hs.append(t)
                if a:
                    aux.append(torch.cat(a))
                counts.append(t.shape[0])
                starts.append(pos0)
            batch.hidden_states = torch.cat(hs)
            batch.aux_hidden_states = torch.cat(aux) if aux else None
            batch.hidden_counts, batch.hidden_start = counts, starts
        return batch

    def _propose(self, batch: SpecBatch) -> Proposal | None:
        proposal = self.pm.hook.propose(batch=batch)
        if proposal is None:
            return None
        if not isinstance(proposal, Proposal):
            raise ProposalError(f"strategy {self.name!r}: propose() returned {type(proposal).__name__}, "
                                "expected speculant.spec_types.Proposal")
        proposal.proposer = self.name
        if len(proposal.token_ids) != len(batch.seqs):
            raise ProposalError(f"strategy {self.name!r} proposed for {len(proposal.token_ids)} "
                                f"sequences but the batch has {len(batch.seqs)}")
        V = self.ctx.vocab_size
        for s, toks in zip(batch.seqs, proposal.token_ids):
            if len(toks) > s.max_draft:
                raise ProposalError(f"strategy {self.name!r} proposed {len(toks)} tokens for sequence "
                                    f"{s.seq_id}, more than its limit k={s.max_draft}")
            if any((not isinstance(t, int)) or t < 0 or t >= V for t in toks):
                raise ProposalError(f"strategy {self.name!r} proposed token ids outside the "
                                    f"vocabulary [0, {V}): {toks}")
        if proposal.probs is not None:
            p = proposal.probs
            need = (len(batch.seqs), max(proposal.lengths), V)
            if p.dim() != 3 or p.shape[0] != need[0] or p.shape[1] < need[1] or p.shape[2] != V:
                raise ProposalError(f"strategy {self.name!r}: draft probs have shape {tuple(p.shape)}, "
                                    f"expected [batch, >= max_len, vocab] = {need}")
        return proposal

    def _plain_step(self, seqs: list[Sequence], overlap: bool) -> None:
        """A plain decode step; with ``overlap`` it may run overlapped with the host work of the
        one before (engine/async_decode.py), its tokens appended, and counted, at the next."""
        step = self.engine.decode(seqs, self.aux_layers, overlap=overlap, on_append=self._count_plain)
        ones = [1] * len(step.seqs)
        self.record_hidden(step.seqs, ones, step.hidden, step.aux, ones, step.starts)
        for s in step.seqs:  # drop the draft slots; keep those of the tokens in the cache
            if not s.is_finished:
                self.engine.rollback(s, s.num_cached_tokens)

    def _count_plain(self, s: Sequence) -> None:
        s.metrics.spec.num_plain_steps += 1
        s.metrics.spec.num_emitted_tokens += 1
        self.total.num_plain_steps += 1
        self.total.num_emitted_tokens += 1

    def _apply(self, seqs: list[Sequence], proposal: Proposal, scores: ScoreResult,
               result: VerifyResult) -> None:
        eng = self.engine
        counts = [n + 1 for n in proposal.lengths]
        starts = [0]
        for c in counts[:-1]:
            starts.append(starts[-1] + c)  # first score row of each sequence
        logprobs = result.logprobs
        if logprobs is None:  # a verifier that did not return them: one batched gather
            idx = [(r0 + j, t) for r0, toks in zip(starts, result.token_ids) for j, t in enumerate(toks)]
            dev = scores.logits.device
            logits = scores.logits.float().contiguous()  # a plugin scorer's may be strided
            flat = token_logprobs(logits, to_device([t for _, t in idx], torch.long, dev),
                                  to_device([i for i, _ in idx], torch.long, dev))[1].tolist() \
                if idx else []
            logprobs, pos = [], 0
            for toks in result.token_ids:
                logprobs.append(flat[pos : pos + len(toks)])
                pos += len(toks)
        keep, hidden_starts = [], [len(s) - 1 for s in seqs]
        total = self.total
        for s, drafts, toks, lps, acc, r0 in zip(seqs, proposal.token_ids, result.token_ids, logprobs,
                                                 result.num_accepted, starts):
            base = len(s)  # tokens before this step; cache now holds base + len(drafts)
            m = s.metrics.spec
            m.record(len(drafts), acc)
            m.num_spec_steps += 1
            total.record(len(drafts), acc)
            keep.append(acc + 1)
            full = None
            if s.params.logprobs is not None:  # top-N dicts: this sequence's rows only
                full = torch.log_softmax(scores.logits[r0 : r0 + len(toks)].float(), dim=-1)
            for j, (t, lp) in enumerate(zip(toks, lps)):
                top = topn_dict(full[j], t, s.params.logprobs, self.ctx.tokenizer) if full is not None else None
                m.num_emitted_tokens += 1
                total.num_emitted_tokens += 1
                if eng.append_token(s, t, lp, top):
                    break
            # the cache is valid for the last token and the accepted drafts only
            if not s.is_finished:
                eng.rollback(s, base + acc)
        total.num_spec_steps += len(seqs)
        self.record_hidden(seqs, counts, scores.hidden_states, scores.aux_hidden_states, keep,
                           hidden_starts)
