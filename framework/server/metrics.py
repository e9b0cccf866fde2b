"""Prometheus metrics of the server, in a registry of its own (several servers may share a
process, e.g. in tests). Speculation counters are read from the engine's SpecMetrics at scrape
time; every one is defined in docs/metrics.md."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from speculant.outputs import RequestOutput

_LATENCY = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_PER_TOKEN = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        r = self.registry
        labels = ["model_name"]
        self.http_requests = Counter(
            "speculant_http_requests", "HTTP requests by endpoint and status code",
            ["endpoint", "status"], registry=r)
        self.request_success = Counter(
            "speculant_request_success", "Finished requests by finish reason",
            labels + ["finish_reason"], registry=r)
        self.request_aborts = Counter(
            "speculant_request_aborted", "Requests aborted (client gone or error)", labels,
            registry=r)
        self.prompt_tokens = Counter("speculant_prompt_tokens", "Prompt tokens processed", labels,
                                     registry=r)
        self.generation_tokens = Counter("speculant_generation_tokens", "Tokens generated", labels,
                                         registry=r)
        self.e2e_latency = Histogram(
            "speculant_e2e_request_latency_seconds", "Arrival to finish, per engine request",
            labels, buckets=_LATENCY, registry=r)
        self.ttft = Histogram(
            "speculant_time_to_first_token_seconds", "Arrival to first generated token",
            labels, buckets=_LATENCY, registry=r)
        self.tpot = Histogram(
            "speculant_time_per_output_token_seconds", "Mean time per output token after the first",
            labels, buckets=_PER_TOKEN, registry=r)
        self.http_latency = Histogram(
            "speculant_http_request_duration_seconds", "Handler time, until the last byte of a stream",
            ["endpoint"], buckets=_LATENCY, registry=r)

    def bind(self, aengine) -> None:
        """Expose engine gauges and speculation counters, read at scrape time."""
        self.registry.register(_EngineCollector(aengine, self.model_name))

    # called from the engine thread (prometheus_client metrics are thread-safe)
    def request_finished(self, out: RequestOutput) -> None:
        m = self.model_name
        for comp in out.outputs:
            self.request_success.labels(m, comp.finish_reason or "unknown").inc()
            self.generation_tokens.labels(m).inc(len(comp.token_ids))
        self.prompt_tokens.labels(m).inc(len(out.prompt_token_ids))
        met = out.metrics
        if met is None:
            return
        if met.finished_time is not None:
            self.e2e_latency.labels(m).observe(met.finished_time - met.arrival_time)
        if met.time_to_first_token is not None:
            self.ttft.labels(m).observe(met.time_to_first_token)
        if met.time_per_output_token is not None:
            self.tpot.labels(m).observe(met.time_per_output_token)

    def request_aborted(self) -> None:
        self.request_aborts.labels(self.model_name).inc()


class _EngineCollector:
    def __init__(self, aengine, model_name: str) -> None:
        self.a = aengine
        self.model_name = model_name

    def describe(self):
        return []

    def collect(self):
        m = [self.model_name]
        used, total = self.a.kv_blocks()
        for name, doc, value in (
            ("speculant_num_requests_running", "Sequences running in the engine", self.a.num_running()),
            ("speculant_num_requests_waiting", "Sequences waiting to be scheduled", self.a.num_waiting()),
            ("speculant_inflight_sequences", "Sequences admitted by the server, not yet done",
             self.a.inflight_seqs),
            ("speculant_kv_cache_blocks_used", "KV cache blocks allocated", used),
            ("speculant_kv_cache_blocks_total", "KV cache blocks in all", total),
            ("speculant_engine_steps", "Engine steps run", self.a.num_steps),
            ("speculant_tensor_parallel_size", "Devices (ranks) the model is sharded over",
             self.a.engine.config.tensor_parallel_size),
        ):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(m, value)
            yield g
        c = CounterMetricFamily("speculant_num_preemptions", "Sequences preempted (KV cache "
                                "full; recomputed later), vLLM: num_preemptions", labels=["model_name"])
        c.add_metric(m, self.a.engine.scheduler.num_preemptions)
        yield c
        s = self.a.spec_metrics()
        for name, doc, value in (
            ("speculant_spec_decode_num_drafts",
             "Sequence-steps that verified draft tokens (vLLM: num_drafts)", s.num_drafts),
            ("speculant_spec_decode_num_draft_tokens", "Draft tokens verified", s.num_draft_tokens),
            ("speculant_spec_decode_num_accepted_tokens",
             "Draft tokens accepted (before stop rules)", s.num_accepted_tokens),
            ("speculant_spec_decode_num_emitted_tokens",
             "Tokens appended by decode steps (after stop rules)", s.num_emitted_tokens),
            ("speculant_spec_decode_num_spec_steps",
             "Sequence decode steps in a verification batch", s.num_spec_steps),
            ("speculant_spec_decode_num_plain_steps", "Sequence decode steps without verification",
             s.num_plain_steps),
            ("speculant_spec_decode_num_faults",
             "Plugin faults contained (bad proposals, hooks that raised; docs/hooks.md Faults)",
             s.num_faults),
        ):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(m, value)
            yield c
        lossless = GaugeMetricFamily(
            "speculant_spec_decode_lossless",
            "1 while the output is the target's (the verifier and the strategy are lossless), "
            "0 with a lossy one (docs/hooks.md Strategy.lossless; SpecMetrics.lossless)",
            labels=["model_name"])
        decoder = self.a.engine.spec  # fixed when the engine is built: right before any step
        lossless.add_metric(m, 1 if decoder is None or decoder.lossless else 0)
        yield lossless
        acc = CounterMetricFamily("speculant_spec_decode_num_accepted_tokens_per_pos",
                                  "Draft tokens accepted at each draft position",
                                  labels=["model_name", "position"])
        prop = CounterMetricFamily("speculant_spec_decode_num_draft_tokens_per_pos",
                                   "Draft tokens verified at each draft position",
                                   labels=["model_name", "position"])
        for j, (a, p) in enumerate(zip(s.accepted_per_position, s.proposed_per_position)):
            acc.add_metric([self.model_name, str(j)], a)
            prop.add_metric([self.model_name, str(j)], p)
        yield acc
        yield prop
