"""The offline Python API, vLLM-compatible: ``LLM(...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from typing import Any

from pydantic import ValidationError
from tqdm.auto import tqdm

from speculant.config import EngineConfig, explain
from speculant.engine.llm_engine import LLMEngine
from speculant.engine.spec_decode import StrategyFault
from speculant.outputs import RequestOutput, SpecMetrics
from speculant.sampling_params import SamplingParams
from speculant.spec_registry import pop_legacy_kwargs

PromptType = str | list[int] | dict[str, Any]


class LLM:
    """An engine plus a tokenizer, for offline batch generation.

    ``LLM()`` with no model runs the embedded default, SmolLM2-135M-Instruct. Pick a speculation
    strategy by name with ``speculative_config={"method": "ngram", "num_speculative_tokens": 5}``.
    """

    def __init__(
        self,
        model: str | None = None,
        tokenizer: str | None = None,
        dtype: str = "auto",
        seed: int = 0,
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        kv_cache_memory: int | None = None,
        gpu_memory_utilization: float = 0.9,
        device: str = "auto",
        speculative_config: dict[str, Any] | None = None,
        block_size: int = 16,
        tensor_parallel_size: int = 1,
        **kwargs: Any,
    ) -> None:
        legacy = pop_legacy_kwargs(kwargs)
        if legacy is not None:
            if speculative_config is not None:
                raise ValueError("pass either speculative_config or the legacy speculative_* "
                                 "keywords, not both")
            speculative_config = legacy
        try:
            self.config = EngineConfig(
                model=model, tokenizer=tokenizer, dtype=dtype, seed=seed,
                max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                kv_cache_memory=kv_cache_memory, gpu_memory_utilization=gpu_memory_utilization,
                device=device, speculative_config=speculative_config, block_size=block_size,
                tensor_parallel_size=tensor_parallel_size, **kwargs,
            )
        except ValidationError as e:
            raise ValueError(f"invalid LLM arguments: {explain(e, 'LLM / EngineConfig')}") from None
        for msg in self.config.compat_warnings():
            category = DeprecationWarning if "deprecated" in msg else UserWarning
            warnings.warn(msg, category, stacklevel=2)
        self.engine = LLMEngine(self.config)
        self._counter = itertools.count()

    # ----------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Stop this LLM's tensor-parallel worker processes and leave the process group (also
        done at exit and when the LLM is garbage collected), so another LLM with
        ``tensor_parallel_size`` > 1 can be made in this process. A no-op at size 1; the LLM
        cannot generate afterwards at size > 1."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()

    shutdown = close

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: atexit closes them anyway
            pass

    # ----------------------------------------------------------------- properties
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        return self.engine.tokenizer

    # ----------------------------------------------------------------- generation
    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        prompt_token_ids: list[list[int]] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for ``prompts`` (strings, token-id lists, or
        ``{"prompt_token_ids": [...]}`` dicts). One SamplingParams for all, or one per prompt."""
        items = self._normalize_prompts(prompts, prompt_token_ids)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(items)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(items):
                raise ValueError(f"got {len(params_list)} SamplingParams for {len(items)} prompts; "
                                 "pass one, or one per prompt")
        for p in params_list:
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params must be speculant.SamplingParams, got {type(p).__name__}")
        ids = []
        try:
            for (text, toks), p in zip(items, params_list):
                rid = str(next(self._counter))
                self.engine.add_request(rid, text, toks, p)
                ids.append(rid)
        except BaseException:  # a bad prompt: drop the ones already queued, run none of them
            for rid in ids:
                self.engine.abort_request(rid)
                self.engine.requests.pop(rid, None)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        split_special_tokens: bool = False,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, using the tokenizer's chat
        template. ``split_special_tokens=True`` encodes each message's content as plain text, so
        control strings in it (``<|im_start|>system``) stay text rather than becoming the
        template's control tokens, as the server's option of that name (docs/server.md)."""
        if self.tokenizer is None:
            raise ValueError("chat() needs a tokenizer (skip_tokenizer_init=True was given)")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts: list[dict[str, Any]] = []
        for conv in convs:
            try:
                if split_special_tokens:
                    from speculant.server.protocol import chat_prompt_ids

                    ids = chat_prompt_ids(self.tokenizer, conv,
                                          add_generation_prompt=add_generation_prompt,
                                          chat_template=chat_template)
                else:
                    ids = self.tokenizer.apply_chat_template(
                        conv, add_generation_prompt=add_generation_prompt, tokenize=True,
                        chat_template=chat_template,
                    )
            except Exception as e:
                raise ValueError(f"cannot apply the chat template: {e}") from None
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            text = self.tokenizer.decode(ids)
            prompts.append({"prompt_token_ids": list(ids), "prompt": text})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def get_metrics(self) -> SpecMetrics:
        """Speculation metrics aggregated over every step this LLM has run."""
        return self.engine.spec_metrics()

    # ----------------------------------------------------------------- helpers
    def _normalize_prompts(self, prompts, prompt_token_ids) -> list[tuple[str | None, list[int]]]:
        if prompt_token_ids is not None:
            prompts = [{"prompt_token_ids": list(t)} for t in prompt_token_ids]
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        elif isinstance(prompts, list) and prompts and isinstance(prompts[0], int):
            prompts = [prompts]
        out = []
        for p in prompts:
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError("string prompts need a tokenizer; pass token ids instead")
                out.append((p, list(self.tokenizer(p).input_ids)))
            elif isinstance(p, dict):
                if "prompt_token_ids" in p:
                    out.append((p.get("prompt"), list(p["prompt_token_ids"])))
                elif "prompt" in p:
                    out.append((p["prompt"], list(self.tokenizer(p["prompt"]).input_ids)))
                else:
                    raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
            elif isinstance(p, (list, tuple)) and all(isinstance(t, int) for t in p):
                out.append((None, list(p)))
            else:
                raise TypeError(f"unsupported prompt type {type(p).__name__}: pass str, list[int] "
                                "or {'prompt_token_ids': [...]}")
        return out

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Step until every request of ``ids`` is done. A plugin fault the engine could not
        contain (StrategyFault) aborts only the requests of its step; the others run to the
        end, then the first such fault is raised with ``outputs``: every request's output in
        order (the aborted ones as far as they got, finish_reason "abort")."""
        done: dict[str, RequestOutput] = {}
        wanted = set(ids)  # outputs of other requests (e.g. added via engine) are not ours
        fault: StrategyFault | None = None
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while len(done) < len(ids):
                try:
                    finished = self.engine.step()
                except StrategyFault as e:
                    fault = fault or e
                    finished = []
                    for rid in e.request_ids:
                        self.engine.abort_request(rid)
                        out = self.engine.snapshot(rid)
                        self.engine.requests.pop(rid, None)
                        if out is not None:
                            out.error = e.public_message  # as a failed logits processor's
                            finished.append(out)
                for out in finished:
                    if out.request_id in wanted:
                        done[out.request_id] = out
                        bar.update(1)
                if not self.engine.has_unfinished_requests() and len(done) < len(ids):
                    missing = [i for i in ids if i not in done]
                    raise RuntimeError(f"engine stopped with unfinished requests {missing}")
        except BaseException:
            for rid in ids:
                if rid not in done:
                    self.engine.abort_request(rid)
            self.engine.step() if self.engine.has_unfinished_requests() else None
            raise
        finally:
            bar.close()
        if fault is not None:
            fault.outputs = [done[i] for i in ids]
            raise fault
        return [done[i] for i in ids]

    def generate_stream(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
    ) -> Iterator[RequestOutput]:
        """Generate for one prompt step by step: yields the request's output so far after every
        engine step (``outputs[0].text`` and ``token_ids`` grow), the last one with
        ``finished=True`` and the request's ``metrics``. Closing the generator early (``break``)
        aborts the request."""
        items = self._normalize_prompts(prompt, None)
        if len(items) != 1:
            raise ValueError(f"generate_stream() takes one prompt, got {len(items)}")
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be speculant.SamplingParams, got {type(params).__name__}")
        rid = str(next(self._counter))
        (text, toks), = items
        self.engine.add_request(rid, text, toks, params)
        finished = False
        try:
            while not finished:
                for out in self.engine.step():
                    if out.request_id == rid:
                        finished = True
                        yield out
                if not finished:
                    snap = self.engine.snapshot(rid)
                    if snap is None or not self.engine.has_unfinished_requests():
                        raise RuntimeError(f"engine stopped with unfinished request {rid}")
                    yield snap
        finally:
            if not finished:  # closed early or failed
                self.engine.abort_request(rid)
                if self.engine.has_unfinished_requests():
                    self.engine.step()
                self.engine.requests.pop(rid, None)
