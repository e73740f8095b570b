"""The engine's metrics: one list of typed samples made from a scheduler snapshot, and its Prometheus text.

Every view publishes these samples, under these names, with these values: ``Engine.metrics_text()``
(``render_text``, the text exposition format 0.0.4), the server's ``/metrics`` (engine/server/prometheus.py,
with a ``model_name`` label) and the Ray Serve replica metrics (engine/server/ray_metrics.py, where ``:``
is written ``_``: Ray refuses it). Names follow vLLM's (``specmix:`` where vLLM has ``vllm:``). A sample's
name is its metric family's: the exposition of a counter adds ``_total`` (``specmix:generation_tokens``
is scraped as ``specmix:generation_tokens_total``), as prometheus_client does."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from engine.runtime.k_tuner import Arm
from engine.runtime.telemetry import LoadGovernor

if TYPE_CHECKING:
    from engine.core.forward import KVCache
    from engine.runtime.request import Request, Totals

PREFIX = "specmix:"
Kind = Literal["counter", "gauge"]


@dataclass(frozen=True)
class Sample:
    """One series of one metric: its family name (a counter's without ``_total``), kind, help, labels, value."""

    name: str
    kind: Kind
    help: str
    value: int | float
    labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def series(self) -> str:
        """The exposition's series name: a counter's ends in ``_total``."""
        return self.name + "_total" if self.kind == "counter" else self.name


@dataclass(frozen=True)
class CudaMemory:
    """Device memory figures of a CUDA device (torch's allocator and the driver's view)."""

    allocated: int
    reserved: int
    used: int  # by every process (cudaMemGetInfo: what NVML reports)
    total: int

    @classmethod
    def read(cls, device: torch.device) -> CudaMemory | None:
        """The figures now; None off CUDA."""
        if device.type != "cuda" or not torch.cuda.is_available():
            return None
        free, total = torch.cuda.mem_get_info(device)
        return cls(
            int(torch.cuda.memory_allocated(device)), int(torch.cuda.memory_reserved(device)), int(total - free), total
        )


@dataclass(frozen=True)
class EngineGauges:
    """What an engine adds to its scheduler's snapshot."""

    kv_cache_bytes: int
    kv_cache_usage: float  # share of the KV cache's positions holding a running request's tokens
    cuda_memory: CudaMemory | None = None  # None: not on CUDA
    governor: LoadGovernor | None = None  # None: no load window
    graphs: dict[str, Any] | None = None  # graph_stats(...) (None: CUDA graphs off)
    tuned: dict[str, Arm] | None = None  # the K tuner's best arm per batch bucket (None: no tuner)
    draft_cost: dict[str, dict[str, float | None]] | None = None  # DraftCost.snapshot() (None: no tuner)


def kv_cache_usage(cache: KVCache | None, running: Sequence[Request]) -> float:
    """Share of the cache's positions (rows x length) holding the running requests' prompts and outputs."""
    cap = cache.max_batch * cache.max_seq_len if cache is not None else 0
    used = sum(len(r.prompt) + len(r.tokens_so_far()) for r in running)
    return used / cap if cap else 0.0


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def _one(name: str, kind: Kind, help_: str, value: int | float) -> Sample:
    return Sample(PREFIX + name, kind, help_, value)


def _request_samples(t: Totals) -> list[Sample]:
    reason = [
        Sample(PREFIX + "request_success", "counter", "Requests finished, by finish reason.", n, {"finished_reason": r})
        for r, n in sorted(t.finished.items())
    ]
    kinds = (("nonfinite", t.nonfinite), ("round", t.failed))
    errors = [
        Sample(
            PREFIX + "request_errors",
            "counter",
            "Requests ended by an error, by kind (nonfinite: NaN/inf logits; round: a failed decode round).",
            n,
            {"kind": k},
        )
        for k, n in kinds
    ]
    return [
        _one("request_finished", "counter", "Requests finished (any reason).", t.requests),
        *reason,
        _one(
            "request_rejected_overload",
            "counter",
            "Requests refused because the wait queue was full.",
            t.rejected_overload,
        ),
        *errors,
    ]


def _token_samples(t: Totals) -> list[Sample]:
    return [
        _one("generation_tokens", "counter", "Tokens generated (committed to outputs).", t.generated),
        _one("prompt_tokens", "counter", "Prompt tokens the target computed (prefill).", t.prefill_tokens),
        _one(
            "prompt_tokens_shared",
            "counter",
            "Prompt tokens copied from another sequence's prefill of the same prompt instead of computed.",
            t.prefill_shared,
        ),
        _one("rounds", "counter", "Batched target passes (rounds).", t.target_forwards),
        _one(
            "sequence_rounds",
            "counter",
            "Target passes a sequence took part in (one per sequence per round).",
            t.iterations,
        ),
        _one(
            "plain_rounds",
            "counter",
            "Rounds the K tuner ran plainly (K = 0) because plain rounds measured faster at the running batch.",
            t.plain_rounds,
        ),
        _one("round_failures", "counter", "Decode rounds that raised (their requests failed).", t.round_failures),
        _one("busy_seconds", "counter", "Worker time spent in decode rounds.", float(t.seconds)),
        _one(
            "tokens_per_sequence_round",
            "gauge",
            "Tokens a sequence gained per target pass since start (1 without speculation; the speedup's bound).",
            _ratio(t.generated, t.iterations),
        ),
    ]


def _spec_counters(t: Totals) -> list[Sample]:
    per_pos = [
        Sample(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "counter",
            "Draft tokens accepted at each draft position (1-based).",
            a,
            {"position": str(i + 1)},
        )
        for i, a in enumerate(t.pos_accepted)
    ]
    by_length = [
        Sample(
            PREFIX + "spec_decode_rounds_by_accepted_length",
            "counter",
            "Rounds of a sequence with >= 1 draft token, by the number of drafts accepted (a histogram's bins).",
            n,
            {"accepted": str(a)},
        )
        for a, n in enumerate(t.accepted_hist)
    ]
    return [
        _one(
            "spec_decode_num_drafts",
            "counter",
            "Speculative rounds of a sequence with >= 1 draft token.",
            t.pos_tried[0] if t.pos_tried else 0,
        ),
        _one("spec_decode_num_draft_tokens", "counter", "Draft tokens proposed and verified.", t.drafted),
        _one("spec_decode_num_accepted_tokens", "counter", "Draft tokens accepted by the target.", t.accepted),
        *per_pos,
        *by_length,
    ]


def _structured_samples(t: Totals) -> list[Sample]:
    return [
        _one(
            "structured_requests", "counter", "Finished requests with a structured output (a grammar).", t.constrained
        ),
        _one(
            "structured_forced_tokens",
            "counter",
            "Drafts that were tokens a grammar forced (no drafter ran).",
            t.forced,
        ),
        _one("structured_forced_accepted_tokens", "counter", "Forced drafts the target accepted.", t.forced_accepted),
        _one("structured_mask_seconds", "counter", "Time computing grammar masks.", float(t.mask_seconds)),
    ]


def _spec_gauges(t: Totals) -> list[Sample]:
    per_pos = [
        Sample(
            PREFIX + "spec_decode_draft_acceptance_rate_per_pos",
            "gauge",
            "Acceptance rate of draft position i among rounds that tested it.",
            _ratio(a, n),
            {"position": str(i + 1)},
        )
        for i, (a, n) in enumerate(zip(t.pos_accepted, t.pos_tried))
    ]
    return [
        _one(
            "spec_decode_draft_acceptance_rate",
            "gauge",
            "Accepted / drafted tokens since start (0 when nothing drafted).",
            _ratio(t.accepted, t.drafted),
        ),
        _one(
            "spec_decode_mean_accepted_length",
            "gauge",
            "Tokens committed per sequence per target pass (1 + accepted/passes; 0 before any pass).",
            1 + t.accepted / t.iterations if t.iterations else 0.0,
        ),
        *per_pos,
    ]


def _load_samples(snap: dict[str, Any], g: EngineGauges) -> list[Sample]:
    return [
        _one("num_requests_running", "gauge", "Requests holding a batch row.", snap["running"]),
        _one("num_requests_waiting", "gauge", "Requests waiting for a batch row.", snap["waiting"]),
        _one("kv_cache_bytes", "gauge", "Bytes of the target's static KV cache.", g.kv_cache_bytes),
        _one(
            "kv_cache_usage_perc",
            "gauge",
            "Share of the KV cache's positions holding a running request's tokens (1 = all).",
            g.kv_cache_usage,
        ),
    ]


def _device_samples(g: EngineGauges) -> list[Sample]:
    out = []
    m = g.cuda_memory
    if m is not None:
        out += [
            _one("gpu_memory_allocated_bytes", "gauge", "CUDA memory allocated by torch.", m.allocated),
            _one(
                "gpu_memory_reserved_bytes", "gauge", "CUDA memory reserved by torch's caching allocator.", m.reserved
            ),
            _one("gpu_memory_used_bytes", "gauge", "Device memory in use by every process (driver's view).", m.used),
            _one("gpu_memory_total_bytes", "gauge", "Device memory in total.", m.total),
        ]
    gov = g.governor
    if gov is not None:
        out += [
            _one(
                "load_window_k_cap",
                "gauge",
                "K cap of the load window (lowered under GPU memory pressure).",
                gov.window.k_cap,
            ),
            _one("load_window_batch_cap", "gauge", "Admitted-batch cap of the load window.", gov.window.batch_cap),
        ]
        if gov.last is not None and gov.last.utilization_pct is not None:
            out.append(
                _one(
                    "gpu_utilization_percent",
                    "gauge",
                    "GPU busy time at the last NVML reading.",
                    float(gov.last.utilization_pct),
                )
            )
    return out


def _graph_samples(gs: dict[str, Any] | None) -> list[Sample]:
    if gs is None:
        return []
    return [
        _one("cuda_graph_captures", "counter", "CUDA graphs captured.", gs["captures"]),
        _one(
            "cuda_graph_capture_seconds", "counter", "Time spent capturing CUDA graphs.", float(gs["capture_seconds"])
        ),
        _one("cuda_graph_replays", "counter", "Forwards replayed from a CUDA graph.", gs["replays"]),
        _one("cuda_graph_eager_calls", "counter", "Forwards that fit no graph and ran eagerly.", gs["eager_calls"]),
    ]


def engine_samples(snap: dict[str, Any], gauges: EngineGauges) -> list[Sample]:
    """Every metric of an engine: requests, tokens, rounds, speculation, load, device, CUDA graphs.

    ``snap``: ``Scheduler.snapshot()``. The series of one family are adjacent, in a fixed order.
    """
    t: Totals = snap["totals"]
    return [
        *_request_samples(t),
        *_token_samples(t),
        *_spec_counters(t),
        *_structured_samples(t),
        *_spec_gauges(t),
        *_load_samples(snap, gauges),
        *_device_samples(gauges),
        *_graph_samples(gauges.graphs),
        *_tuner_samples(gauges.tuned),
        *_draft_cost_samples(gauges.draft_cost),
    ]


def _tuner_samples(tuned: dict[str, Arm] | None) -> list[Sample]:
    arms = sorted((tuned or {}).items(), key=lambda x: int(x[0]))
    k_help = "The K the tuner runs at each batch bucket (0: plain rounds; engine/runtime/k_tuner.py)."
    tree_help = "1 where the tuner drafts trees of K nodes at a batch bucket, 0 where chains or plain rounds."
    return [
        *(Sample(PREFIX + "spec_decode_tuned_k", "gauge", k_help, a.k, {"batch_bucket": b}) for b, a in arms),
        *(
            Sample(PREFIX + "spec_decode_tuned_tree", "gauge", tree_help, int(a.tree), {"batch_bucket": b})
            for b, a in arms
        ),
    ]


DRAFT_COST_HELP = {
    "token_s": (
        "verified_token_seconds",
        "Seconds a verified token adds to a decoding round at a batch bucket (0: not known).",
    ),
    "tokens_per_s": (
        "committed_tokens_per_second",
        "Committed tokens per second of a batch bucket's rounds (0: not known).",
    ),
    "min_accept": (
        "draft_min_accept",
        "Acceptance a copied draft token needs to pay for its verification at a batch bucket (0: not known).",
    ),
}


def _draft_cost_samples(cost: dict[str, dict[str, float | None]] | None) -> list[Sample]:
    """Per figure of engine/runtime/draft_cost.py, one gauge per batch bucket the rounds have run at (0 where the
    figure is not known yet), so that a series, once published, stays."""
    buckets = sorted((cost or {}).items(), key=lambda x: int(x[0]))
    return [
        Sample(PREFIX + "spec_decode_" + name, "gauge", help_, v[key] or 0.0, {"batch_bucket": b})
        for key, (name, help_) in DRAFT_COST_HELP.items()
        for b, v in buckets
    ]


# ---------------------------------------------------------------- the text exposition format
def _fmt(v: float | int) -> str:
    return str(v) if isinstance(v, int) else repr(float(v))


def _escape(s: str, quote: bool) -> str:
    s = s.replace("\\", r"\\").replace("\n", r"\n")
    return s.replace('"', r"\"") if quote else s


def render_text(samples: Sequence[Sample]) -> str:
    """The samples in the Prometheus text exposition format (0.0.4): HELP and TYPE once per family."""
    lines: list[str] = []
    seen: set[str] = set()
    for s in samples:
        if s.name not in seen:
            seen.add(s.name)
            lines += [f"# HELP {s.series} {_escape(s.help, False)}", f"# TYPE {s.series} {s.kind}"]
        lab = ",".join(f'{k}="{_escape(v, True)}"' for k, v in s.labels.items())
        lines.append(f"{s.series}{{{lab}}} {_fmt(s.value)}" if lab else f"{s.series} {_fmt(s.value)}")
    return "\n".join(lines) + "\n"
