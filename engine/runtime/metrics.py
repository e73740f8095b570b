"""Engine counters in the Prometheus text exposition format (version 0.0.4)."""

from __future__ import annotations

from typing import Any

import torch

from engine.runtime.telemetry import LoadGovernor

PREFIX = "specmix"


def _fmt(v: float | int) -> str:
    if isinstance(v, int):
        return str(v)
    return repr(float(v))


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def metric(self, name: str, kind: str, help_: str, samples: list[tuple[dict[str, str], float | int]]) -> None:
        full = f"{PREFIX}_{name}"
        self.lines.append(f"# HELP {full} {help_}")
        self.lines.append(f"# TYPE {full} {kind}")
        for labels, v in samples:
            lab = ",".join(f'{k}="{val}"' for k, val in labels.items())
            self.lines.append(f"{full}{{{lab}}} {_fmt(v)}" if lab else f"{full} {_fmt(v)}")

    def one(self, name: str, kind: str, help_: str, v: float | int) -> None:
        self.metric(name, kind, help_, [({}, v)])


def metrics_text(
    snap: dict[str, Any],
    *,
    kv_cache_bytes: int,
    device: torch.device,
    governor: LoadGovernor | None,
    graphs: dict[str, Any] | None,
) -> str:
    """Requests, tokens, drafted/accepted, acceptance, per-position acceptance, queue, errors, memory.

    ``snap``: ``Scheduler.snapshot()``; ``graphs``: ``graph_stats(...)`` (None: CUDA graphs off).
    """
    t = snap["totals"]
    w = _Writer()
    w.one("requests_total", "counter", "Requests finished (any reason).", t.requests)
    w.metric(
        "requests_finished_total",
        "counter",
        "Requests finished, by finish reason.",
        [({"reason": r}, n) for r, n in sorted(t.finished.items())],
    )
    w.one(
        "requests_rejected_overload_total",
        "counter",
        "Requests refused because the wait queue was full.",
        t.rejected_overload,
    )
    w.one("generated_tokens_total", "counter", "Tokens generated (committed to outputs).", t.generated)
    w.one("drafted_tokens_total", "counter", "Draft tokens proposed and verified.", t.drafted)
    w.one("accepted_tokens_total", "counter", "Draft tokens accepted by the target.", t.accepted)
    w.one("target_forwards_total", "counter", "Batched target verify passes (rounds).", t.target_forwards)
    w.one("prefill_tokens_total", "counter", "Prompt tokens the target computed (prefill).", t.prefill_tokens)
    w.one(
        "prefill_shared_tokens_total",
        "counter",
        "Prompt tokens copied from another sequence's prefill of the same prompt instead of computed.",
        t.prefill_shared,
    )
    w.one(
        "window_plain_rounds_total",
        "counter",
        "Rounds run plainly because no K paid at the running batch (the batch window).",
        t.window_plain_rounds,
    )
    w.one(
        "acceptance_rate",
        "gauge",
        "Accepted / drafted tokens since start (0 when nothing drafted).",
        t.accepted / t.drafted if t.drafted else 0.0,
    )
    w.one(
        "mean_accepted_length",
        "gauge",
        "Tokens committed per sequence per target pass (1 + accepted/passes).",
        1 + t.accepted / t.iterations if t.iterations else 0.0,
    )
    w.metric(
        "position_acceptance_rate",
        "gauge",
        "Acceptance rate of draft position i among rounds that tested it.",
        [({"position": str(i + 1)}, a / n if n else 0.0) for i, (a, n) in enumerate(zip(t.pos_accepted, t.pos_tried))],
    )
    w.one("queue_length", "gauge", "Requests waiting for a batch slot.", snap["waiting"])
    w.one("running", "gauge", "Sequences in the running batch.", snap["running"])
    w.metric(
        "errors_total",
        "counter",
        "Requests ended by an error, by kind (nonfinite: NaN/inf logits; round: a failed decode round).",
        [({"kind": "nonfinite"}, t.nonfinite), ({"kind": "round"}, t.failed)],
    )
    w.one("round_failures_total", "counter", "Decode rounds that raised (their requests failed).", t.round_failures)
    w.one("busy_seconds_total", "counter", "Worker time spent in decode rounds.", float(t.seconds))
    w.one("kv_cache_bytes", "gauge", "Bytes of the target's static KV cache.", kv_cache_bytes)
    dev = device
    if dev.type == "cuda" and torch.cuda.is_available():
        w.one(
            "gpu_memory_allocated_bytes",
            "gauge",
            "CUDA memory allocated by torch.",
            int(torch.cuda.memory_allocated(dev)),
        )
        w.one(
            "gpu_memory_reserved_bytes",
            "gauge",
            "CUDA memory reserved by torch's caching allocator.",
            int(torch.cuda.memory_reserved(dev)),
        )
        free, total = torch.cuda.mem_get_info(dev)  # device-wide, from the driver (what NVML reports)
        w.one(
            "gpu_memory_used_bytes",
            "gauge",
            "Device memory in use by every process (driver's view).",
            int(total - free),
        )
        w.one("gpu_memory_total_bytes", "gauge", "Device memory in total.", int(total))
    gov = governor
    if gov is not None:
        w.one(
            "load_window_k_cap",
            "gauge",
            "K cap of the load window (lowered under GPU memory pressure).",
            gov.window.k_cap,
        )
        w.one("load_window_batch_cap", "gauge", "Admitted-batch cap of the load window.", gov.window.batch_cap)
        if gov.last is not None and gov.last.utilization_pct is not None:
            w.one(
                "gpu_utilization_percent",
                "gauge",
                "GPU busy time at the last NVML reading.",
                float(gov.last.utilization_pct),
            )
    gs = graphs
    if gs is not None:
        w.one("cuda_graph_captures_total", "counter", "CUDA graphs captured.", gs["captures"])
        w.one(
            "cuda_graph_capture_seconds_total",
            "counter",
            "Time spent capturing CUDA graphs.",
            float(gs["capture_seconds"]),
        )
        w.one("cuda_graph_replays_total", "counter", "Forwards replayed from a CUDA graph.", gs["replays"])
        w.one(
            "cuda_graph_eager_calls_total", "counter", "Forwards that fit no graph and ran eagerly.", gs["eager_calls"]
        )
    return "\n".join(w.lines) + "\n"
