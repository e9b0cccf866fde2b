"""vLLM-style metric objects, as ``vllm.v1.metrics.reader`` has them: iterating
``LLM.get_metrics()`` yields these (``Counter``, ``Vector``; ``Gauge`` and ``Histogram`` complete
the set). Every metric is defined in docs/metrics.md.

    from speculant.metrics import Counter, Vector

    for metric in llm.get_metrics():
        if metric.name == "vllm:spec_decode_num_drafts":
            assert isinstance(metric, Counter)
            num_drafts = metric.value
"""

from speculant.outputs import Counter, Gauge, Histogram, Metric, RequestMetrics, SpecMetrics, Vector

__all__ = ["Metric", "Counter", "Vector", "Gauge", "Histogram", "SpecMetrics", "RequestMetrics"]
