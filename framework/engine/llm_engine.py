"""The engine: load the model, schedule, run a step, emit outputs."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from speculant.config import EngineConfig
from speculant.distributed.parallel import NO_TENSOR_PARALLEL
from speculant.distributed.worker import WorkerSpec, start_tensor_parallel, unsharded
from speculant.engine.async_decode import AsyncDecoder
from speculant.engine.block_manager import BlockManager
from speculant.engine.cpu_threads import apply_cpu_threads
from speculant.engine.model_runner import ModelRunner, kv_bytes_per_block
from speculant.engine.sampler import (
    Row,
    contain_processor_faults,
    sample_with_logprobs,
    topn_dict,
)
from speculant.engine.scheduler import Scheduler
from speculant.engine.sequence import SeedStream, Sequence
from speculant.engine.spec_decode import SpecDecoder
from speculant.engine.target import DecodeStep
from speculant.engine.tp_runner import TPRunner
from speculant.models import batch_invariant, cpu_kernels
from speculant.models.loader import load_config, load_model, load_tokenizer, resolve_model
from speculant.outputs import CompletionOutput, RequestMetrics, RequestOutput, SpecMetrics
from speculant.sampling_params import SamplingParams
from speculant.spec_types import StrategyContext

logger = logging.getLogger("speculant")

_CPU_DEFAULT_KV_BYTES = 1 << 30


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    emitted: bool = False
    aborted: bool = field(default=False)
    error: str | None = None  # why it was aborted, when the engine aborted it (a logits processor)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.torch_device()
        self.cpu_threads = None  # torch's thread count a CPU engine runs with (process-wide)
        self.cpu_kernel_threads = None  # the C kernels' threads (1 or 2: with a helper)
        if self.device.type == "cpu":  # before loading: load-time timings use it
            self.cpu_threads = apply_cpu_threads(config.cpu_threads, config.tensor_parallel_size)
            self.cpu_kernel_threads = cpu_kernels.threads()
        folder = resolve_model(config.model)
        self.model_path = folder
        self.hf_config = load_config(folder)
        # transformers >= 4.56 names it `dtype` (`torch_dtype`, a property there, warns); older
        # ones keep `torch_dtype` as a plain attribute.
        self.dtype = config.torch_dtype(self.device, getattr(self.hf_config, "dtype", None)
                                        or vars(self.hf_config).get("torch_dtype"))
        self.max_model_len = self._max_model_len()
        # tensor parallelism (docs/tensor_parallel.md): the other ranks start here (under
        # torchrun a rank > 0 serves rank 0 and exits in this call); the model is this rank's shard
        self.tp_group = start_tensor_parallel(WorkerSpec(
            config, folder, self.hf_config, self.dtype, self.max_model_len, self.device.type),
            self.device)
        try:
            self._build(config, folder)
        except BaseException:
            self.close()
            raise

    def _build(self, config: EngineConfig, folder) -> None:
        if self.tp_group is not None:
            self.device = self.tp_group.device
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.tokenizer or folder)
        # this rank's shard; whole at size 1, even beside a tensor-parallel LLM of this process
        tp = NO_TENSOR_PARALLEL if self.tp_group is None else self.tp_group.tp
        self.model = load_model(folder, self.hf_config, self.dtype, self.device, self.max_model_len,
                                load_format=config.load_format, seed=config.seed, tp=tp)
        if config.batch_invariant:  # logits independent of the batch: models/batch_invariant.py
            batch_invariant.enable(self.model, self.device, self.dtype, config.tensor_parallel_size)
        self.vocab_size = self.model.lm_head.weight.shape[0]
        self.eos_token_id = self._eos_id()
        self.block_size = config.block_size
        num_blocks = (self._num_blocks() if self.tp_group is None
                      else self.tp_group.agree_num_blocks(self._num_blocks))
        self.block_manager = BlockManager(num_blocks, self.block_size)
        self.runner = ModelRunner(self.model, num_blocks, self.block_size, self.device, self.dtype,
                                  enforce_eager=config.enforce_eager,
                                  max_graph_prefill=config.max_prefill_graph_tokens)
        if self.tp_group is not None:
            g = self.tp_group
            self.runner = g.runner = TPRunner(self.runner, g.tp, g.describe_workers,
                                              g.workers_alive if g.procs else None)
        batched = config.max_num_batched_tokens or max(self.max_model_len, 2048)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, batched)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.requests: dict[str, Request] = {}
        self.finished_ids: list[int] = []  # sequences finished since the last step's release
        # requests whose logits processors failed this step -> the error; aborted at its end
        self.failed: dict[str, str] = {}
        self.spec = None
        if config.speculative_config is not None:
            with unsharded():  # drafters run whole, on rank 0 only
                self.spec = SpecDecoder(self, config.speculative_config)
        self.async_decoder = AsyncDecoder(self) if self._async_scheduling() else None
        if config.cuda_graph_capture == "startup":
            self.capture_graphs()
        logger.info("speculant engine: %s on %s (%s), %d KV blocks of %d, tensor_parallel_size "
                    "%d", folder, self.device, self.dtype, num_blocks, self.block_size,
                    config.tensor_parallel_size)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (``LLM.close()``); a no-op at size 1."""
        group = getattr(self, "tp_group", None)
        if group is not None:
            group.close()

    # ----------------------------------------------------------------- set-up helpers
    def _max_model_len(self) -> int:
        limit = None
        for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
            if getattr(self.hf_config, key, None):
                limit = int(getattr(self.hf_config, key))
                break
        window = getattr(self.hf_config, "sliding_window", None)
        if window and getattr(self.hf_config, "use_sliding_window", True) is not False:
            limit = min(limit or window, int(window))
        want = self.config.max_model_len
        if want is None:
            return min(limit or 4096, 4096) if self.device.type == "cpu" else (limit or 4096)
        if limit is not None and want > limit:
            raise ValueError(
                f"max_model_len={want} exceeds what the model supports ({limit}, from its config: "
                "max_position_embeddings / sliding_window); lower max_model_len"
            )
        return want

    def capture_graphs(self, progress: bool = True) -> int:
        """Capture the target's CUDA graphs for every step shape this engine can replay: decode
        and verification steps of up to ``max_num_seqs`` sequences (up to k + 1 tokens each
        with a strategy, the residual streams it reads included) and prefill steps of up to
        ``max_num_batched_tokens``; then the strategy's own (a draft model's, EAGLE's, the
        MLPSpeculator's: the ``capture_graphs`` hook). Called at start-up unless
        ``cuda_graph_capture="lazy"``, and again by whoever swaps the strategy. Returns how many
        graphs were captured."""
        max_query, aux = 1, ()
        if self.spec is not None:
            max_query, aux = self.spec.k + 1, self.spec.aux_layers
        t0 = time.perf_counter()
        try:
            n = self.runner.capture_graphs(self.config.max_num_seqs, max_query, aux,
                                           self.scheduler.max_num_batched_tokens, progress,
                                           head=self.spec is not None)
            if self.spec is not None:
                n += self.spec.capture_graphs(progress)
        except torch.cuda.OutOfMemoryError:
            raise RuntimeError(
                "capturing the CUDA graphs at start-up ran out of GPU memory (their activations "
                "come on top of the weights and the KV cache); lower gpu_memory_utilization or "
                "kv_cache_memory, max_num_seqs or max_prefill_graph_tokens, or set "
                "cuda_graph_capture='lazy' to capture each graph on its first step"
            ) from None
        if n:
            logger.info("captured %d CUDA graphs in %.1f s", n, time.perf_counter() - t0)
        return n

    def _async_scheduling(self) -> bool:
        """Overlap plain decode steps (engine/async_decode.py): by default where the host work
        between steps is worth hiding, on CUDA with CUDA graphs."""
        want = self.config.async_scheduling
        if want is None:
            return self.device.type == "cuda" and self.runner.graphs is not None
        return want

    def _eos_id(self) -> int | None:
        eos = getattr(self.hf_config, "eos_token_id", None)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos = self.tokenizer.eos_token_id
        return eos

    def _num_blocks(self) -> int:
        if self.config.num_gpu_blocks_override:
            return self.config.num_gpu_blocks_override
        per_block = kv_bytes_per_block(self.model, self.block_size, self.dtype)
        budget = self.config.kv_cache_memory
        free = None
        if budget is None:
            if self.device.type == "cuda":
                free, _total = torch.cuda.mem_get_info(self.device)
                budget = int(free * self.config.gpu_memory_utilization) - (1 << 30)
            else:
                need = self.config.max_num_seqs * (self.max_model_len + self.block_size) // self.block_size
                budget = min(_CPU_DEFAULT_KV_BYTES, max(need, 1) * per_block)
        num = budget // per_block
        min_blocks = -(-self.max_model_len // self.block_size) + 1
        if num < min_blocks:
            raise ValueError(
                f"the KV cache budget ({budget / 2**20:.1f} MiB) holds {num} blocks of "
                f"{self.block_size} tokens, fewer than one sequence of max_model_len="
                f"{self.max_model_len} needs ({min_blocks}); raise kv_cache_memory / "
                "gpu_memory_utilization or lower max_model_len"
                + (
                    f" ({free / 2**20:.0f} MiB of {self.device} were free after loading the "
                    "weights, less 1 GiB of headroom: another LLM instance or process may hold "
                    "the rest; delete it or set kv_cache_memory)"
                    if free is not None
                    else ""
                )
            )
        return int(num)

    # ----------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams) -> Request:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id}: the prompt is empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"request {request_id}: the prompt has {len(prompt_token_ids)} tokens but "
                f"max_model_len is {self.max_model_len} (room is needed for at least one new "
                "token); shorten the prompt or raise max_model_len"
            )
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"request {request_id}: prompt token ids {bad[:5]} are outside the "
                             f"vocabulary [0, {self.vocab_size})")
        params.check_vocab(self.vocab_size)  # logprobs, stop_token_ids: a ValueError naming them
        metrics = RequestMetrics(arrival_time=time.perf_counter())
        seqs = []
        for i in range(params.num_samples):
            gen = None
            if params.seed is not None:
                gen = SeedStream(params.seed * 1000003 + i)
            seqs.append(Sequence(request_id, i, prompt_token_ids, params, metrics, gen))
        req = Request(request_id, prompt, list(prompt_token_ids), params, seqs, metrics)
        self.requests[request_id] = req
        for s in seqs:
            self.scheduler.add(s)
        return req

    def abort_request(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None:
            return
        for s in req.seqs:
            if not s.is_finished:
                s.finish_reason = "abort"
                self.scheduler.finish(s)
        req.aborted = True
        if self.spec:
            self.spec.release([s.seq_id for s in req.seqs])

    def snapshot(self, request_id: str, detokenize: bool = True) -> RequestOutput | None:
        """What an in-flight request has generated so far (tokens, text, logprobs; ``finished``
        stays False until all its sequences are done), for front ends that stream new tokens
        after every step(). None once step() has returned the request, or if it is unknown.
        ``detokenize=False`` leaves ``text`` empty unless a stop string cut it (callers that
        detokenize incrementally)."""
        req = self.requests.get(request_id)
        return None if req is None else self.make_output(req, detokenize)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    # ----------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        """One scheduling step: a prefill of newly admitted sequences or one decode step of all
        running ones (speculative when a strategy is configured). Returns finished requests."""
        lookahead = self.spec.max_lookahead() if self.spec else 0
        if self.async_decoder is not None:
            # a step in flight feeds its token at the next position: one more slot
            lookahead = max(lookahead, 1)
            if self.async_decoder.pending is not None and not self.scheduler.decode_only(lookahead):
                self.async_decoder.drain()  # new sequences join or some get preempted
        seqs, is_prefill = self.scheduler.schedule(lookahead)
        if is_prefill:
            self._prefill(seqs)
        elif self.spec is not None:
            self.spec.step(seqs)
        elif seqs:
            self.decode(seqs)
        self._abort_failed()
        released = self.scheduler.take_preempted() + self.finished_ids
        self.finished_ids = []
        if self.spec is not None and released:
            self.spec.release(released)
        return self._collect_finished()

    def _abort_failed(self) -> None:
        """Abort the requests whose logits processors failed in this step (engine/sampler.py
        ``contain_processor_faults``), each with its error; nothing else of the step changes."""
        if self.spec is not None:
            for rid, msg in self.spec.take_failed():
                self.failed.setdefault(rid, msg)
        failed, self.failed = self.failed, {}
        for rid, msg in failed.items():
            req = self.requests.get(rid)
            if req is None or req.aborted:
                continue
            logger.warning("request %s aborted: %s", rid, msg)
            self.abort_request(rid)
            req.error = msg

    def _prefill(self, seqs: list[Sequence]) -> None:
        now = time.perf_counter()
        for s in seqs:
            s.metrics.first_scheduled_time = s.metrics.first_scheduled_time or now
        # with a strategy, a preempted sequence resumes where it stopped: the cache is rebuilt
        # up to its last token, which its next decode step feeds, so its speculative steps (and
        # the positions that key a seeded request's random numbers) are those of a run that was
        # never preempted (engine/sampler.py uniforms)
        resume = [self.spec is not None and s.num_output_tokens > 0 for s in seqs]
        new_tokens = [s.token_ids[s.num_cached_tokens : len(s) - r] for s, r in zip(seqs, resume)]
        aux = self.spec.aux_layers if self.spec else ()
        hidden, aux_hidden = self.runner.forward(seqs, new_tokens, aux)
        ends = torch.tensor([len(t) for t in new_tokens]).cumsum(0) - 1
        fresh = [i for i, r in enumerate(resume) if not r]
        if len(fresh) < len(seqs):
            ends = ends[fresh]
        self._maybe_prompt_logprobs(seqs, new_tokens, hidden)
        if fresh:
            logits = self.runner.logits(hidden[ends.to(hidden.device)])
            self._sample_and_append([seqs[i] for i in fresh], logits)
        if self.spec is not None:
            self.spec.record_prefill(seqs, [len(t) for t in new_tokens], hidden, aux_hidden)

    # ----------------------------------------------------------------- the speculative decoder's
    # calls (engine/target.py: TargetEngine)
    def strategy_context(self) -> StrategyContext:
        """The target and this engine's limits, as a strategy gets them (``cls(config, ctx)``)."""
        cfg = self.config
        return StrategyContext(
            target_model=self.model, target_config=self.hf_config, vocab_size=self.vocab_size,
            device=self.device, dtype=self.dtype, block_size=self.block_size,
            max_model_len=self.max_model_len, max_num_seqs=cfg.max_num_seqs,
            tokenizer=self.tokenizer, eos_token_id=self.eos_token_id, seed=cfg.seed,
            max_prefill_graph_tokens=cfg.max_prefill_graph_tokens, enforce_eager=cfg.enforce_eager,
        )

    def decode(self, seqs: list[Sequence], aux_layers: tuple[int, ...] = (), overlap: bool = True,
               on_append: Callable[[Sequence], None] | None = None) -> DecodeStep:
        """One plain decode step, overlapped with the host work of the one before when
        ``overlap`` and the batch allow it (see TargetEngine.decode)."""
        if overlap and self.async_decoder is not None and self.async_decoder.eligible(seqs):
            return DecodeStep(*self.async_decoder.step(seqs, aux_layers, on_append=on_append))
        seqs = self.take_back(seqs)
        if not seqs:
            return DecodeStep([], None, None, [])
        starts = [len(s) - 1 for s in seqs]
        hidden, aux, logits = self.runner.decode(seqs, [[s.last_token] for s in seqs], aux_layers)
        self._sample_and_append(seqs, logits, on_append)
        return DecodeStep(seqs, hidden, aux, starts)

    def take_back(self, seqs: list[Sequence]) -> list[Sequence]:
        """Append the tokens of an overlapped step still in flight (if any); returns ``seqs``
        less those that this finished."""
        if self.async_decoder is None or self.async_decoder.pending is None:
            return seqs
        self.async_decoder.drain()
        return [s for s in seqs if not s.is_finished]

    def score(self, seqs: list[Sequence], new_tokens: list[list[int]],
              aux_layers: tuple[int, ...] = (), greedy: bool = False, keep_hidden: bool = True,
              trees: list[list[int] | None] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """The target over several new tokens per sequence, with every row's logits
        (``ModelRunner.score``; ``trees``: a tree step)."""
        return self.runner.score(seqs, new_tokens, aux_layers, greedy=greedy,
                                 keep_hidden=keep_hidden, trees=trees)

    def compact_tree(self, seqs: list[Sequence], ctx_starts: list[int],
                     paths: list[list[int]]) -> None:
        """Move each tree sequence's accepted K/V rows next to its root
        (``ModelRunner.compact_tree``; under tensor parallelism every rank's cache, see
        ``TPRunner.compact_tree``)."""
        self.runner.compact_tree(seqs, ctx_starts, paths)

    def reserve_slots(self, seq: Sequence, num_tokens: int) -> int:
        """Cache slots for positions [0, num_tokens) of ``seq`` if blocks are free; returns how
        many positions it has slots for."""
        bm = self.block_manager
        if bm.can_reserve(seq, num_tokens):
            bm.reserve(seq, num_tokens)
        return len(seq.block_table) * bm.block_size

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        """Keep the cache of positions [0, num_tokens) of ``seq`` only."""
        self.block_manager.rollback(seq, num_tokens)

    def _sample_and_append(self, seqs: list[Sequence], logits: torch.Tensor,
                           on_append: Callable[[Sequence], None] | None = None) -> None:
        rows = [Row(s, []) for s in seqs]
        with contain_processor_faults() as faults:
            tokens, lps, dicts = sample_with_logprobs(logits, rows, self.generator,
                                                      self.eos_token_id, self.tokenizer)
        bad = {f.seq_id: f.error for f in faults}
        for s, t, lp, d in zip(seqs, tokens, lps, dicts):
            if s.seq_id in bad:  # its request is aborted at the end of the step (_abort_failed)
                self.failed.setdefault(s.request_id, str(bad[s.seq_id]))
                continue
            if on_append is not None:
                on_append(s)
            self.append_token(s, t, lp, d)

    def _maybe_prompt_logprobs(self, seqs, new_tokens, hidden) -> None:
        start = 0
        for s, toks in zip(seqs, new_tokens):
            n = s.params.prompt_logprobs
            if n is not None and s.prompt_logprobs is None and s.num_output_tokens == 0:
                logits = self.runner.logits(hidden[start : start + len(toks) - 1])
                lp = torch.log_softmax(logits, dim=-1)
                s.prompt_logprobs = [None] + [
                    topn_dict(lp[i], toks[i + 1], n, self.tokenizer) for i in range(len(toks) - 1)
                ]
            start += len(toks)

    # ----------------------------------------------------------------- appending and stopping
    def append_token(self, seq: Sequence, token: int, logprob: float | None = None,
                     top: dict | None = None) -> bool:
        """Append one generated token and apply the stop rules. Returns True if seq finished."""
        seq.token_ids.append(token)
        now = time.perf_counter()
        m = seq.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        if seq.index == 0:
            m.num_output_tokens += 1
        if logprob is not None:
            seq.cumulative_logprob += logprob
        if seq.logprobs is not None and top is not None:
            seq.logprobs.append(top)
        p = seq.params
        n_out = seq.num_output_tokens
        reason = stop_reason = None
        if token == self.eos_token_id and not p.ignore_eos and n_out >= p.min_tokens:
            reason = "stop"
        elif p.stop_token_ids and token in p.stop_token_ids and n_out >= p.min_tokens:
            reason, stop_reason = "stop", token
        elif p.stop and n_out >= p.min_tokens and (hit := self._stop_string(seq)) is not None:
            reason, stop_reason = "stop", hit
        elif p.max_tokens is not None and n_out >= p.max_tokens:
            reason = "length"
        elif len(seq) >= self.max_model_len:
            reason = "length"
        if reason is None:
            return False
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.scheduler.finish(seq)
        self.finished_ids.append(seq.seq_id)
        if all(s.is_finished for s in self.requests[seq.request_id].seqs):
            m.finished_time = now
        return True

    def _stop_string(self, seq: Sequence) -> str | None:
        if self.tokenizer is None:
            return None
        p = seq.params
        text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=p.skip_special_tokens)
        longest = max(len(s) for s in p.stop_strings)
        prev = seq.stop_text_len or 0
        window_start = max(0, prev - longest)
        best = None
        for s in p.stop_strings:
            i = text.find(s, window_start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        seq.stop_text_len = len(text)
        if best is None:
            return None
        i, s = best
        seq.output_text = text[: i + len(s)] if p.include_stop_str_in_output else text[:i]
        return s

    # ----------------------------------------------------------------- outputs
    def _collect_finished(self) -> list[RequestOutput]:
        outs = []
        for rid, req in list(self.requests.items()):
            if all(s.is_finished for s in req.seqs):
                outs.append(self.make_output(req))
                del self.requests[rid]
        return outs

    def make_output(self, req: Request, detokenize: bool = True) -> RequestOutput:
        completions = []
        seqs = req.seqs
        if len(seqs) > req.params.n:  # best_of: the n most likely, once all are done
            if all(s.is_finished for s in seqs):
                seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)
            seqs = seqs[: req.params.n]
        for i, s in enumerate(seqs):
            text = s.output_text
            if text is None and self.tokenizer is not None and detokenize:
                text = self.tokenizer.decode(
                    s.output_token_ids, skip_special_tokens=s.params.skip_special_tokens
                )
            completions.append(CompletionOutput(
                index=i, text=text or "", token_ids=s.output_token_ids,
                cumulative_logprob=s.cumulative_logprob, logprobs=s.logprobs,
                finish_reason=s.finish_reason, stop_reason=s.stop_reason,
            ))
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
            prompt_logprobs=req.seqs[0].prompt_logprobs, outputs=completions,
            finished=all(s.is_finished for s in req.seqs), metrics=req.metrics,
            error=req.error,
        )

    def spec_metrics(self) -> SpecMetrics:
        if self.spec is None:
            return SpecMetrics()
        self.spec.total.num_speculative_tokens = self.spec.k  # vLLM's vectors have k entries
        return self.spec.total
