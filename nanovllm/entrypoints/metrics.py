"""The server's Prometheus metrics (GET /metrics), vLLM's names under `nanovllm:`."""

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from nanovllm.engine.async_engine import AsyncEngine


class EngineMetrics:
    """A Prometheus collector reading the AsyncEngine's figures at each scrape."""

    def __init__(self, front: AsyncEngine, model_name: str):
        self.front, self.labels = front, [model_name]

    def collect(self):
        stats, front = self.front.stats, self.front
        for family, name, doc, value in (
            (
                GaugeMetricFamily,
                "num_requests_running",
                "Sequences holding KV-cache blocks.",
                stats.num_running,
            ),
            (
                GaugeMetricFamily,
                "num_requests_waiting",
                "Sequences waiting to run.",
                stats.num_waiting,
            ),
            (
                GaugeMetricFamily,
                "kv_cache_usage_perc",
                "Fraction of KV-cache blocks in use (1 = all).",
                stats.kv_cache_usage,
            ),
            (
                CounterMetricFamily,
                "prompt_tokens",
                "Prompt tokens of requests taken.",
                front.num_prompt_tokens,
            ),
            (
                CounterMetricFamily,
                "generation_tokens",
                "Tokens generated.",
                front.num_generation_tokens,
            ),
        ):
            metric = family(f"nanovllm:{name}", doc, labels=["model_name"])
            metric.add_metric(self.labels, value)
            yield metric
