"""Auto-disable: run speculative steps only while they beat plain decode steps in wall time.

Enabled by ``speculative_config={"auto_disable": True, ...}``; owned by ``SpecDecoder``. Before
each decode step it picks one of the two exact step kinds (speculative or plain), so outputs are
unchanged; after the step it records the step's host wall time (``time.perf_counter``: on CUDA
every step ends with a device-to-host read of its tokens, so this is real time) and the tokens
emitted per sequence. Per batch-size bucket (powers of two: 1, 2-3, 4-7, ...) it keeps EMAs of
plain step time ``t_plain``, speculative step time ``t_spec`` and tokens per sequence per
speculative step ``e_spec``; speculation pays when ``e_spec / t_spec > 1 / t_plain``, i.e. the
estimated speedup ``e_spec * t_plain / t_spec`` is above 1.

* warm-up (per bucket): 2 plain steps, then speculative steps; the EMAs start from the smaller of
  the first two samples of each kind (the first step at a new shape may capture a CUDA graph or
  compile a kernel), and later time samples are clipped to twice the estimate.
* speculating: off when the estimated speedup falls below ``1 - tolerance``. While on, one plain
  step every ``interval`` speculative steps refreshes ``t_plain`` (plain cost grows with context).
* off: plain steps, the proposer does no work (stateful proposers catch up later); a probe of
  speculative steps after 1, 2, 4, ... plain steps (capped at ``interval``), and never sooner
  than the probe's own measured cost allows: a probe's excess time over the plain steps it
  replaces (``probe_cost``: the catch-up of a draft model on every token it missed, slow
  speculative steps) is spread over at least ``probe_cost / (budget * t_plain)`` plain steps,
  ``budget = tolerance / 2``, so probing costs at most about half the tolerance however
  expensive the proposer's catch-up is. A probe's first speculative step is not timed for the
  estimate (it pays the catch-up), its second is; speculation comes back when the estimate
  reaches 1, which resets the back-off.

Cost: while speculation pays, one plain step in ``interval`` (plus 2 per bucket at the start);
while it does not, at most ~``budget`` of the time in probes once the first probe has measured
its cost. Steps the engine runs plain for other reasons (``disable_by_batch_size``) are timed
as plain steps too.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger("speculant")

ALPHA = 0.25  # EMA weight of a new sample
PROBE_ALPHA = 0.5  # weight of a probe's sample: the estimate it updates is stale
WARMUP = 2  # samples of each kind a bucket needs before it decides
CLIP = 2.0  # time samples above CLIP x the estimate are clipped (graph capture, GC pauses)
MAX_WAIT = 4096  # most plain steps between two probes, however costly a probe is


@dataclass
class _Bucket:
    t_plain: float = 0.0  # EMA: seconds per plain step
    t_spec: float = 0.0  # EMA: seconds per speculative step
    e_spec: float = 0.0  # EMA: tokens emitted per sequence per speculative step
    n_plain: int = 0  # plain samples recorded
    n_spec: int = 0  # speculative samples recorded
    on: bool = True  # speculating (True) or backed off (False)
    since_plain: int = 0  # speculative steps since the last plain one (while on)
    wait: int = 0  # plain steps left before the next probe (while off)
    backoff: int = 1  # plain steps before the next probe after a failed one
    probe_cost: float = 0.0  # seconds a probe takes beyond the plain steps it replaces (EMA)
    probe_excess: float = 0.0  # that excess so far in the probe under way

    def speedup(self) -> float:
        return self.e_spec * self.t_plain / self.t_spec if self.t_spec > 0 else 0.0


def bucket_of(batch_size: int) -> int:
    return max(1, batch_size).bit_length()  # 1 | 2-3 | 4-7 | 8-15 | ...


class SpecController:
    def __init__(self, tolerance: float = 0.05, interval: int = 64,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.tolerance = tolerance
        self.interval = interval
        self.clock = clock
        self.buckets: dict[int, _Bucket] = {}
        self.num_disabled = 0  # switches off
        self.num_enabled = 0  # switches back on
        self.num_probes = 0  # probes started while off
        self.num_refresh = 0  # plain steps taken while on, to refresh t_plain
        self._step: tuple[int, int, bool] | None = None  # (bucket, batch size, speculative)
        self._t0 = 0.0
        self._last: tuple[int, bool] | None = None  # (bucket, speculative) of the last step

    # -------------------------------------------------------------------- decisions
    def _choose(self, b: _Bucket) -> bool:
        """The step kind the bucket wants next (no side effects)."""
        if b.n_plain < WARMUP:
            return False
        if b.n_spec < WARMUP:
            return True
        if b.on:
            return b.since_plain < self.interval
        return b.wait <= 0

    def would_speculate(self, batch_size: int) -> bool:
        return self._choose(self.buckets.get(bucket_of(batch_size)) or _Bucket())

    def begin(self, batch_size: int, allowed: bool = True) -> bool:
        """Start timing a decode step of ``batch_size`` sequences; True: run it speculatively.
        ``allowed=False``: the engine runs it plain anyway (timed, decides nothing)."""
        key = bucket_of(batch_size)
        b = self.buckets.setdefault(key, _Bucket())
        spec = allowed and self._choose(b)
        if allowed and b.n_spec >= WARMUP:
            if spec and not b.on and (self._last != (key, True)):
                self.num_probes += 1
            elif not spec and b.on:
                self.num_refresh += 1
        self._step = (key, batch_size, spec)
        self._t0 = self.clock()
        return spec

    def end(self, emitted: int) -> str | None:
        """Finish the step begun last; ``emitted``: tokens it appended over all sequences.
        Returns "off" / "on" when speculation was switched for this bucket, else None."""
        dt = self.clock() - self._t0
        if self._step is None:
            return None
        key, n, spec = self._step
        self._step = None
        b = self.buckets[key]
        first_after_plain = self._last != (key, True)
        self._last = (key, spec)
        if not spec:
            b.t_plain = self._update(b.t_plain, dt, b.n_plain, ALPHA)
            b.n_plain += 1
            if b.on:
                b.since_plain = 0
            else:
                b.wait -= 1
        else:
            b.since_plain += 1
            if not b.on and b.n_spec >= WARMUP:  # a probe: what it costs beyond plain steps
                excess = max(0.0, dt - emitted / n * b.t_plain)
                b.probe_excess = excess if first_after_plain else b.probe_excess + excess
                if first_after_plain:
                    return None  # a probe's first step pays the proposer's catch-up: not timed
            a = ALPHA if b.on else PROBE_ALPHA
            b.t_spec = self._update(b.t_spec, dt, b.n_spec, a)
            b.e_spec = emitted / n if b.n_spec == 0 else (1 - a) * b.e_spec + a * emitted / n
            b.n_spec += 1
        if b.n_plain < WARMUP or b.n_spec < WARMUP:
            return None
        return self._decide(b, key, probed=spec and not b.on)

    @staticmethod
    def _update(ema: float, x: float, n: int, a: float) -> float:
        if n == 0:
            return x
        if n < WARMUP:
            return min(ema, x)  # the first sample at a new shape may include a one-time cost
        return (1 - a) * ema + a * min(x, CLIP * ema)

    def _cost_wait(self, b: _Bucket, cost: float) -> int:
        """Plain steps over which a probe costing ``cost`` seconds stays within the budget."""
        budget = max(self.tolerance / 2, 0.005) * b.t_plain
        return min(MAX_WAIT, math.ceil(cost / budget)) if budget > 0 else 1

    def _decide(self, b: _Bucket, key: int, probed: bool) -> str | None:
        s = b.speedup()
        if b.on and s < 1.0 - self.tolerance:
            # until a probe measures its catch-up: two speculative steps' excess over plain
            est = b.probe_cost or 2 * max(0.0, b.t_spec - b.e_spec * b.t_plain)
            b.on, b.backoff = False, 1
            b.wait = max(1, self._cost_wait(b, est))
            self.num_disabled += 1
            self._log(logging.INFO, "speculation off", key, b)
            return "off"
        if probed:
            if s >= 1.0:
                b.on, b.since_plain, b.backoff = True, 0, 1
                self.num_enabled += 1
                self._log(logging.INFO, "speculation back on", key, b)
                return "on"
            b.probe_cost = (
                b.probe_excess
                if b.probe_cost == 0.0
                else (1 - PROBE_ALPHA) * b.probe_cost + PROBE_ALPHA * b.probe_excess
            )
            b.backoff = min(2 * b.backoff, self.interval)
            b.wait = max(b.backoff, self._cost_wait(b, b.probe_cost))
            self._log(logging.DEBUG, "probe failed, speculation stays off", key, b)
        return None

    def _log(self, level: int, what: str, key: int, b: _Bucket) -> None:
        lo = 1 << (key - 1)
        logger.log(level, "auto_disable: %s for batch sizes %d-%d (estimated %.2fx plain: "
                   "%.2f tokens/seq per speculative step of %.3g ms, plain step %.3g ms)%s",
                   what, lo, 2 * lo - 1, b.speedup(), b.e_spec, b.t_spec * 1e3, b.t_plain * 1e3,
                   "" if b.on else f"; next probe in {b.wait} plain steps")

    def stats(self) -> dict:
        return {
            "num_disabled": self.num_disabled, "num_enabled": self.num_enabled,
            "num_probes": self.num_probes, "num_refresh_plain_steps": self.num_refresh,
            "buckets": {f"{1 << (k - 1)}-{(2 << (k - 1)) - 1}": {
                "speculating": b.on, "speedup": round(b.speedup(), 3), "t_plain_ms": b.t_plain * 1e3,
                "t_spec_ms": b.t_spec * 1e3, "tokens_per_spec_step": b.e_spec,
                "probe_cost_ms": b.probe_cost * 1e3}
                for k, b in sorted(self.buckets.items())},
        }
