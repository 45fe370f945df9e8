"""The server's Prometheus metrics (GET /metrics), vLLM's names under `nanovllm:`."""

from collections.abc import Iterator

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
            (
                CounterMetricFamily,
                "prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache, counted as requests finish.",
                front.num_prefix_cache_queries,
            ),
            (
                CounterMetricFamily,
                "prefix_cache_hits",
                "Prompt tokens found in the prefix cache, counted as requests finish.",
                front.num_prefix_cache_hits,
            ),
        ):
            metric = family(f"nanovllm:{name}", doc, labels=["model_name"])
            metric.add_metric(self.labels, value)
            yield metric
        if stats.spec_decode is not None:  # with speculative_config: vLLM's spec_decode counters
            yield from self._spec_decode(stats.spec_decode)

    def _spec_decode(self, spec) -> Iterator[CounterMetricFamily]:
        for name, doc, value in (
            ("num_drafts", "Rows verified with at least one draft.", spec.num_drafts),
            ("num_draft_tokens", "Draft tokens proposed and verified.", spec.num_draft_tokens),
            (
                "num_accepted_tokens",
                "Draft tokens accepted (equal to the target model's).",
                spec.num_accepted_tokens,
            ),
        ):
            metric = CounterMetricFamily(f"nanovllm:spec_decode_{name}", doc, labels=["model_name"])
            metric.add_metric(self.labels, value)
            yield metric
