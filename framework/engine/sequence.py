"""One generated sequence: its tokens, cache blocks, sampling state and stop conditions."""

from __future__ import annotations

import itertools
from enum import Enum, auto

import torch

from speculant.outputs import Logprob, RequestMetrics
from speculant.sampling_params import SamplingParams

_ids = itertools.count()


class SeedStream(torch.Generator):
    """The random source of one output of a seeded request: a CPU ``torch.Generator`` seeded
    with ``seed`` (for code that draws from it) that carries ``seed``, the key of the request's
    counter-based numbers (``speculant.engine.sampler.uniforms``), which make its output
    independent of preemption, the batch and how many drafts fit."""

    def __new__(cls, seed: int) -> SeedStream:
        gen = super().__new__(cls)
        gen.stream_seed = int(seed) % 2**64
        gen.manual_seed(gen.stream_seed)
        return gen

    def __init__(self, seed: int) -> None:
        pass

    def __reduce__(self):  # copies and pickles stay SeedStreams (seed and generator state)
        return _seed_stream, (self.stream_seed, self.get_state())

    def __deepcopy__(self, memo) -> SeedStream:
        return _seed_stream(self.stream_seed, self.get_state())


def _seed_stream(seed: int, state: torch.Tensor) -> SeedStream:
    gen = SeedStream(seed)
    gen.set_state(state)
    return gen


class Status(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    def __init__(
        self,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        metrics: RequestMetrics,
        generator: torch.Generator | None,
    ) -> None:
        self.seq_id = next(_ids)
        self.request_id = request_id
        self.index = index  # which of the request's n outputs
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.metrics = metrics
        self.generator = generator  # a seeded request's SeedStream, or None (the engine's)
        self.status = Status.WAITING
        self.block_table: list[int] = []
        self.num_cached_tokens = 0  # tokens whose K/V are in the cache
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self.output_text: str | None = None  # set at finish (truncated at a stop string)
        self.stop_text_len: int | None = None  # where the stop string cut the text

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]
