"""Serving metrics with prometheus_client, every series labelled with the served model's name.

Counters whose rates give acceptance and mean accepted length over any window (``rate(accepted) /
rate(draft_tokens)``; ``1 + rate(accepted) / rate(sequence_rounds)``) are read from the scheduler's
totals when scraped, so the decode loop pays nothing for them; latency histograms (time to first
token, inter-token latency, end to end) are observed from each request's delivery times when it
ends; gauges of running and waiting requests and KV-cache use are read at scrape time.
Each ``ServeMetrics`` owns its registry (no process-wide state).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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


class _EngineCollector:
    """Counters and gauges read from the engine when scraped."""

    def __init__(self, engine: Any, model: str) -> None:
        self.engine, self.model = engine, model

    def describe(self) -> list[Any]:
        return []  # dynamic: collected at scrape time

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        eng, m = self.engine, [self.model]
        snap = eng.scheduler.snapshot()
        t = snap["totals"]

        def counter(name: str, help_: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"specmix:{name}", help_, labels=["model_name"])
            c.add_metric(m, value)
            return c

        def gauge(name: str, help_: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"specmix:{name}", help_, labels=["model_name"])
            g.add_metric(m, value)
            return g

        yield counter("requests_finished", "Requests finished (any reason).", t.requests)
        yield counter(
            "prompt_rejected_overload", "Requests refused because the wait queue was full.", t.rejected_overload
        )
        yield counter("emitted_tokens", "Tokens emitted (committed to outputs).", t.generated)
        yield counter("prefill_tokens", "Prompt tokens the target computed (prefill).", t.prefill_tokens)
        yield counter(
            "prefill_shared_tokens",
            "Prompt tokens copied from another sequence's prefill of the same prompt instead of computed.",
            t.prefill_shared,
        )
        yield counter("rounds", "Batched target passes (rounds).", t.target_forwards)
        yield counter(
            "window_plain_rounds",
            "Rounds run plainly because plain rounds measured faster at the running batch (the batch window).",
            t.window_plain_rounds,
        )
        drafts = t.pos_tried[0] if t.pos_tried else 0
        yield counter("spec_decode_num_drafts", "Speculative rounds of a sequence with >= 1 draft token.", drafts)
        yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed and verified.", t.drafted)
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted by the target.", t.accepted)
        yield counter(
            "sequence_rounds", "Target passes a sequence took part in (one per sequence per round).", t.iterations
        )
        per = CounterMetricFamily(
            "specmix:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (1-based).",
            labels=["model_name", "position"],
        )
        for i, a in enumerate(t.pos_accepted):
            per.add_metric([self.model, str(i + 1)], a)
        yield per
        fin = CounterMetricFamily(
            "specmix:request_success", "Requests finished, by finish reason.", labels=["model_name", "finished_reason"]
        )
        for reason, n in sorted(t.finished.items()):
            fin.add_metric([self.model, reason], n)
        yield fin
        yield counter("round_failures", "Decode rounds that raised (their requests failed).", t.round_failures)
        yield gauge("num_requests_running", "Requests holding a batch row.", snap["running"])
        yield gauge("num_requests_waiting", "Requests waiting for a batch row.", snap["waiting"])
        cache = eng.loop.cache
        used = sum(len(r.prompt) + len(r.tokens_so_far()) for r in eng.scheduler.running_requests())
        cap = cache.max_batch * cache.max_seq_len if cache is not None else 0
        yield gauge(
            "kv_cache_usage_perc",
            "Share of the KV cache's positions holding a running request's tokens.",
            used / cap if cap else 0.0,
        )
        yield gauge("kv_cache_bytes", "Bytes of the target's KV cache.", cache.nbytes if cache is not None else 0)


class ServeMetrics:
    """The registry of one served engine: scrape-time counters/gauges and latency histograms."""

    def __init__(self, engine: Any, model: str) -> None:
        from prometheus_client import CollectorRegistry, Histogram

        self.model = model
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(engine, model))

        def hist(name: str, help_: str) -> Any:
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
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
