"""Serving metrics with prometheus_client, every series labelled with the served model's name.

The engine's counters and gauges are its ``metric_samples()`` (engine/runtime/metrics.py: the names and
values of ``Engine.metrics_text()``), read when scraped, so the decode loop pays nothing for them. Their
rates give acceptance and mean accepted length over any window: ``rate(A) / rate(D)`` and
``1 + rate(A) / rate(specmix:sequence_rounds_total)``, with A ``specmix:spec_decode_num_accepted_tokens_total``
and D ``specmix:spec_decode_num_draft_tokens_total``. Latency histograms (time to first token, inter-token
latency, end to end) are observed from each request's delivery times when it ends.
Each ``ServeMetrics`` owns its registry (no process-wide state).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from engine.server.served_engine import ServedEngine

if TYPE_CHECKING:
    from engine.runtime.metrics import Sample
    from engine.runtime.request import Request

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)


def families(samples: Sequence[Sample], labels: dict[str, str]) -> list[Metric]:
    """The samples as prometheus_client metric families (one per name, in order), ``labels`` added first."""
    out: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
    for s in samples:
        fam = out.get(s.name)
        if fam is None:
            kind = CounterMetricFamily if s.kind == "counter" else GaugeMetricFamily
            fam = out[s.name] = kind(s.name, s.help, labels=[*labels, *s.labels])
        fam.add_metric([*labels.values(), *s.labels.values()], s.value)
    return list(out.values())


class _EngineCollector:
    """The engine's samples (``ServedEngine.metric_samples``), read when scraped."""

    def __init__(self, engine: ServedEngine, model: str) -> None:
        self.engine, self.labels = engine, {"model_name": model}

    def describe(self) -> list[Metric]:
        return []  # dynamic: collected at scrape time

    def collect(self) -> Iterator[Metric]:
        yield from families(self.engine.metric_samples(), self.labels)


class ServeMetrics:
    """The registry of one served engine: scrape-time counters/gauges and latency histograms."""

    def __init__(self, engine: ServedEngine, model: str) -> None:
        self.model = model
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(engine, model))

        def hist(name: str, help_: str) -> Histogram:
            return Histogram(
                f"specmix:{name}", help_, ["model_name"], registry=self.registry, buckets=LATENCY_BUCKETS
            ).labels(model)

        self.ttft = hist("time_to_first_token_seconds", "Time from submission to the first emitted token.")
        self.itl = hist(
            "inter_token_latency_seconds",
            "Time per emitted token after the first (a round's gap shared by the tokens it emitted).",
        )
        self.e2e = hist("e2e_request_latency_seconds", "Time from submission to the last token.")

    def observe(self, req: Request) -> None:
        """Record a finished request's latencies (called once per request, off the decode loop)."""
        times = req.deliveries()
        if not times:
            return
        t0 = req.submitted_at
        self.ttft.observe(times[0][0] - t0)
        prev = times[0][0]
        for t, n in times[1:]:
            if n:
                for _ in range(n):
                    self.itl.observe((t - prev) / n)
                prev = t
        self.e2e.observe(times[-1][0] - t0)

    def exposition(self) -> tuple[bytes, str]:
        """The registry in Prometheus' text format and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
