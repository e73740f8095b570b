"""The serving benchmark's report (tools/bench_serve.py): medians over repeats, the table, speedups, the plot."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine.cli.serve_stats import LATENCIES

MEDIAN_KEYS = (
    "completed",
    "failed",
    "duration_s",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "goodput",
    *(f"{s}_{m}_ms" for m in LATENCIES for s in ("mean", "median", "p99")),
)


def median_row(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the repeats of one point (None where a figure is None)."""
    out: dict[str, Any] = {}
    for k in MEDIAN_KEYS:
        vals = [r[k] for r in runs if r[k] is not None and not (isinstance(r[k], float) and math.isnan(r[k]))]
        out[k] = statistics.median(vals) if vals else None
    return out


def point_key(row: dict[str, Any]) -> tuple[str, float, float]:
    """A row's point: (mode, concurrency or rate, temperature)."""
    return row["mode"], row["concurrency"] if row["mode"] == "concurrency" else row["rate"], row["temperature"]


def is_fixed(config: str) -> bool:
    """A configuration of one K for every round: off (K = 0) or fixedK."""
    return config == "off" or config.startswith("fixed")


def best_fixed(rows: Sequence[dict[str, Any]]) -> dict[tuple[str, float, float], dict[str, Any]]:
    """Per point where two or more fixed-K configurations ran (off included): the row of the one with the most output
    tokens/s (the sweep's best K)."""
    fixed: dict[tuple[str, float, float], list[dict[str, Any]]] = {}
    for r in rows:
        if is_fixed(r["config"]) and r["output_throughput"] is not None:
            fixed.setdefault(point_key(r), []).append(r)
    return {k: max(rs, key=lambda r: r["output_throughput"]) for k, rs in fixed.items() if len(rs) >= 2}


def speedups(rows: Sequence[dict[str, Any]], base: str = "off") -> list[dict[str, Any]]:
    """Per point and config other than ``base``: output tokens/s and TTFT p99 against ``base``'s (None where it did not
    run); for a configuration that is not fixed (the tuner), its tokens/s against the sweep's best fixed K at the
    point (``best_fixed``), and that K's configuration (None without a sweep)."""
    bases = {point_key(r): r for r in rows if r["config"] == base}
    fixed = best_fixed(rows)
    out = []
    for r in rows:
        b = bases.get(point_key(r), {})
        best = None if is_fixed(r["config"]) else fixed.get(point_key(r))
        if r["config"] == base or (not b and best is None):
            continue
        out.append(
            {
                "config": r["config"],
                "mode": r["mode"],
                "x": point_key(r)[1],
                "temperature": r["temperature"],
                "speedup": _ratio(r["output_throughput"], b.get("output_throughput")),
                "ttft_p99_ratio": _ratio(r["p99_ttft_ms"], b.get("p99_ttft_ms")),
                "vs_best_fixed": None if best is None else _ratio(r["output_throughput"], best["output_throughput"]),
                "best_fixed": None if best is None else best["config"],
            }
        )
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _f(v: Any, nd: int = 1) -> str:
    if v is None:
        return "-"
    return f"{v:.{nd}f}" if isinstance(v, float) else str(v)


def table(rows: Sequence[dict[str, Any]], sp: Sequence[dict[str, Any]]) -> str:
    """The result table (a CLI's output, in markdown)."""
    hdr = (
        "config | mode | x | temp | reqs | out tok/s | req/s | goodput | TTFT mean/med/p99 ms | TPOT mean/med/p99 ms"
        " | ITL mean/med/p99 ms | E2EL mean/med/p99 ms | accepted length | acceptance per pos | tuned K"
    )
    lines = [hdr, "|".join(["---"] * hdr.count("|")) + "|---"]
    for r in rows:
        spec = r.get("speculation") or {}
        lat = [
            "/".join(_f(r[f"{s}_{m}_ms"]) for s in ("mean", "median", "p99")) for m in ("ttft", "tpot", "itl", "e2el")
        ]
        lines.append(
            " | ".join(
                [
                    r["config"],
                    r["mode"],
                    _f(point_key(r)[1]),
                    _f(r["temperature"]),
                    _f(r["completed"]),
                    _f(r["output_throughput"]),
                    _f(r["request_throughput"], 2),
                    _f(r["goodput"], 2),
                    *lat,
                    _f(spec.get("mean_accepted_length"), 2),
                    ",".join(f"{a:.2f}" for a in spec.get("acceptance_per_pos", [])) or "-",
                    ",".join(f"{b}:{k}" for b, k in spec.get("tuned_k", {}).items()) or "-",
                ]
            )
        )
    if sp:
        head = "config | mode | x | temp | speedup (out tok/s vs off) | TTFT p99 vs off | vs best fixed K (config)"
        lines += ["", head, "|".join(["---"] * 7)]
        lines += [
            f"{s['config']} | {s['mode']} | {_f(s['x'])} | {_f(s['temperature'])} | {_x(s['speedup'])}"
            f" | {_x(s['ttft_p99_ratio'])} | "
            + ("-" if s["vs_best_fixed"] is None else f"{s['vs_best_fixed']:.2f}x ({s['best_fixed']})")
            for s in sp
        ]
    return "\n".join(lines)


def plot(rows: Sequence[dict[str, Any]], sp: Sequence[dict[str, Any]], out: Path) -> None:
    """Speedup against concurrency; TTFT and TPOT (medians) against the finite request rates; into a PNG
    (only the panels the run has data for)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conc = [s for s in sp if s["mode"] == "concurrency"]
    rate = [r for r in rows if r["mode"] == "rate" and math.isfinite(r["rate"])]
    panels = (["speedup"] if conc else []) + (["ttft", "tpot"] if rate else [])
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(5 * max(1, len(panels)), 4.5), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        if panel == "speedup":
            _speedup_panel(ax, conc)
        else:
            _rate_panel(ax, rate, panel)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _speedup_panel(ax: Any, conc: Sequence[dict[str, Any]]) -> None:
    for key in sorted({(s["config"], s["temperature"]) for s in conc}):
        pts = sorted((s["x"], s["speedup"]) for s in conc if (s["config"], s["temperature"]) == key)
        ax.plot(*zip(*pts), marker="o", label=f"{key[0]} / off, temperature {key[1]}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    xs = sorted({s["x"] for s in conc})
    ax.set_xticks(xs, [f"{x:g}" for x in xs])
    ax.set(xlabel="concurrency", ylabel="output tokens/s vs off", title="speedup")


def _rate_panel(ax: Any, rate: Sequence[dict[str, Any]], metric: str) -> None:
    for key in sorted({(r["config"], r["temperature"]) for r in rate}):
        pts = sorted((r["rate"], r[f"median_{metric}_ms"]) for r in rate if (r["config"], r["temperature"]) == key)
        ax.plot(*zip(*pts), marker="o", label=f"{key[0]}, temperature {key[1]}")
    ax.set(xlabel="request rate (requests/s)", ylabel=f"median {metric.upper()} ms", title=metric.upper())
