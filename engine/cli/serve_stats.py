"""The serving benchmark's statistics (tools/bench_serve.py), as ``vllm bench serve`` defines them.

Per request: TTFT (submission to the first content chunk), E2EL (submission to the stream's end), TPOT
((E2EL - TTFT) / (output tokens - 1), requests of more than one token) and ITL (the gaps between a
request's successive content chunks, pooled over requests; a chunk may carry several tokens). Each as
mean, median and p99 (linear interpolation between order statistics, numpy's default). Throughputs are
totals over the wall time of the run; goodput is the requests/s that meet every SLO given.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

SLO_METRICS = ("ttft", "tpot", "e2el")  # vLLM's --goodput keys
LATENCIES = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestResult:
    """One streamed request: times in seconds from its submission; tokens from the response's usage."""

    ok: bool
    ttft: float = math.nan
    e2el: float = math.nan
    chunk_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float:
        """Time per output token after the first (nan for a request of at most one token)."""
        return (self.e2el - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else math.nan


def percentile(xs: Iterable[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation, as numpy.percentile; nan when empty."""
    s = sorted(xs)
    if not s:
        return math.nan
    rank = q / 100 * (len(s) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (rank - lo)


def mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` (milliseconds, vLLM's syntax) -> {"ttft": 0.5, "tpot": 0.05} (seconds)."""
    out: dict[str, float] = {}
    for item in items:
        key, sep, val = item.partition(":")
        if not sep or key not in SLO_METRICS:
            raise ValueError(f"--goodput {item!r}: expected KEY:MS with KEY one of {', '.join(SLO_METRICS)}")
        try:
            ms = float(val)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {val!r} is not a number of milliseconds") from None
        if not ms > 0 or math.isinf(ms):
            raise ValueError(f"--goodput {item!r}: the SLO must be a positive, finite number of milliseconds")
        out[key] = ms / 1000
    return out


def meets(r: RequestResult, slos: Mapping[str, float]) -> bool:
    """Whether a completed request meets every SLO (seconds); a one-token request has no TPOT to miss."""
    values = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.e2el}
    return r.ok and all(math.isnan(values[k]) or values[k] <= v for k, v in slos.items())


def _latency_stats(name: str, xs: Sequence[float]) -> dict[str, float]:
    return {
        f"mean_{name}_ms": 1000 * mean(xs),
        f"median_{name}_ms": 1000 * percentile(xs, 50),
        f"p99_{name}_ms": 1000 * percentile(xs, 99),
    }


def summarize(results: Sequence[RequestResult], wall_s: float, slos: Mapping[str, float]) -> dict[str, Any]:
    """Every figure of one run: counts, throughputs, latency statistics, goodput (None without SLOs)."""
    done = [r for r in results if r.ok]
    out_toks = sum(r.output_tokens for r in done)
    in_toks = sum(r.prompt_tokens for r in done)
    series = {
        "ttft": [r.ttft for r in done],
        "tpot": [r.tpot for r in done if r.output_tokens > 1],
        "itl": [g for r in done for g in r.itls],
        "e2el": [r.e2el for r in done],
    }
    out: dict[str, Any] = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": wall_s,
        "total_input_tokens": in_toks,
        "total_output_tokens": out_toks,
        "request_throughput": len(done) / wall_s if wall_s > 0 else math.nan,
        "output_throughput": out_toks / wall_s if wall_s > 0 else math.nan,
        "total_token_throughput": (in_toks + out_toks) / wall_s if wall_s > 0 else math.nan,
    }
    for name in LATENCIES:
        out.update(_latency_stats(name, series[name]))
    good = sum(meets(r, slos) for r in done)
    out["goodput"] = good / wall_s if slos and wall_s > 0 else None
    out["good_requests"] = good if slos else None
    return out


Series = Mapping[tuple[str, tuple[tuple[str, str], ...]], float]
_ACCEPTED_POS = "specmix:spec_decode_num_accepted_tokens_per_pos_total"
_DRAFTS = "specmix:spec_decode_num_drafts_total"
_TUNED_K = "specmix:spec_decode_tuned_k"


def _by_label(s: Series, name: str, label: str) -> dict[int, float]:
    return {int(dict(labels)[label]): v for (n, labels), v in s.items() if n == name and label in dict(labels)}


def speculation(before: Series, after: Series) -> dict[str, Any]:
    """The run's speculation from two /metrics scrapes: drafts (sequence rounds with drafts), accepted tokens
    and acceptance per draft position (accepted at i / drafts), mean accepted length (1 + accepted / drafts,
    vLLM's), and the K tuner's K per batch bucket after the run."""
    drafts = after.get((_DRAFTS, ()), 0.0) - before.get((_DRAFTS, ()), 0.0)
    pos_a, pos_b = _by_label(after, _ACCEPTED_POS, "position"), _by_label(before, _ACCEPTED_POS, "position")
    accepted = {p: v - pos_b.get(p, 0.0) for p, v in sorted(pos_a.items())}
    return {
        "drafts": int(drafts),
        "accepted_per_pos": [int(v) for v in accepted.values()],
        "acceptance_per_pos": [round(v / drafts, 4) for v in accepted.values()] if drafts else [],
        "mean_accepted_length": 1 + sum(accepted.values()) / drafts if drafts else None,
        "tuned_k": {str(b): int(k) for b, k in sorted(_by_label(after, _TUNED_K, "batch_bucket").items())},
    }
