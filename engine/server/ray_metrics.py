"""The engine's metrics as Ray Serve metrics of one replica (``ray.serve.metrics``).

The same samples as ``Engine.metrics_text()`` and the server's /metrics (``Engine.metric_samples()``,
engine/runtime/metrics.py), same labels, same values, under ``ray_name``: Ray refuses ``:`` in a metric
name (ray.util.metrics warns that it is no longer allowed and will be an error), so ``specmix:x`` is
``specmix_x`` here, and Ray's Prometheus export adds its ``ray_`` prefix (and ``_total`` to a counter):
``specmix:spec_decode_num_accepted_tokens`` is scraped as ``ray_specmix_spec_decode_num_accepted_tokens_total``.
Serve tags every metric made inside a replica with ``deployment``, ``replica`` and ``application``, so
an operator sees each replica's acceptance and load beside Serve's own request metrics.

``ReplicaMetrics.update`` takes the samples, adds each counter's growth since the last call and sets the gauges.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ray.serve.metrics import Counter, Gauge

if TYPE_CHECKING:
    from engine.runtime.metrics import Sample


def ray_name(name: str) -> str:
    """A metric's name as a Ray metric (``:`` -> ``_``)."""
    return name.replace(":", "_")


def series_key(s: Sample) -> str:
    """A series of a Ray metric, as ``ReplicaMetrics.values`` names it: ``name`` or ``name{k="v",...}``."""
    lab = ",".join(f'{k}="{v}"' for k, v in s.labels.items())
    return f"{ray_name(s.name)}{{{lab}}}" if lab else ray_name(s.name)


class ReplicaMetrics:
    """Serve counters and gauges fed from an engine's samples (made inside a replica, so Serve adds its tags)."""

    def __init__(self) -> None:
        self.counters: dict[str, Counter] = {}  # Ray name -> its metric, made when first seen
        self.gauges: dict[str, Gauge] = {}
        self.last: dict[str, float] = {}  # counter series -> its value at the last update
        self.values: dict[str, float] = {}  # series -> the last value (the replica's stats() reports them)

    def _count(self, s: Sample, key: str) -> None:
        name = ray_name(s.name)
        if name not in self.counters:
            self.counters[name] = Counter(name, description=s.help, tag_keys=tuple(s.labels))
        delta = s.value - self.last.get(key, 0)
        if delta > 0:  # a reset of the engine's totals starts afresh without going back
            self.counters[name].inc(delta, tags=dict(s.labels))
        self.last[key] = s.value

    def _set(self, s: Sample) -> None:
        name = ray_name(s.name)
        if name not in self.gauges:
            self.gauges[name] = Gauge(name, description=s.help, tag_keys=tuple(s.labels))
        self.gauges[name].set(s.value, tags=dict(s.labels))

    def update(self, samples: Sequence[Sample]) -> dict[str, float]:
        """Add the counters' growth since the last call, set the gauges; returns every series' value."""
        for s in samples:
            key = series_key(s)
            if s.kind == "counter":
                self._count(s, key)
            else:
                self._set(s)
            self.values[key] = float(s.value)
        return dict(self.values)
