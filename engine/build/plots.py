"""The figures: the bench plot (speedup vs K, acceptance per draft position, tokens/s per mode) and the
profile's plot (predicted speedup vs K).

Data and drawing are kept apart. ``bench_series`` (the dict ``tools/bench.py --json`` writes)
and ``profile_series`` (a ``Profile``) return the plotted series and need no matplotlib;
``draw_bench`` and ``draw_profile`` render series to PNG bytes with matplotlib, imported
lazily (the ``plot`` extra).

Predicted speedups come from the cost model of ``engine.spec_decode.adaptive``:
``expected_speedup(a, K, Costs(c, v))`` = (1 - a^(K+1)) / ((1 - a) (K c + v(K))).
Per-position acceptance is P(draft position i accepted | position i was verified), aggregated
over requests as the mean of their per-request rates (``aggregate_positions``).
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from engine.api.profile import Profile
from engine.core.errors import EngineError, InvalidConfigError
from engine.spec_decode.adaptive import Costs, expected_speedup

INSTALL_HINT = "pip install 'specmix[plot]' (or pip install matplotlib)"


class PlotUnavailableError(EngineError, ImportError):
    """matplotlib (the ``plot`` extra) is not installed."""


def matplotlib_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def require_matplotlib(what: str = "--plot") -> None:
    """Raise PlotUnavailableError naming ``what`` when matplotlib cannot be imported."""
    if not matplotlib_available():
        raise PlotUnavailableError(f"{what} needs matplotlib, which is not installed: {INSTALL_HINT}")


# ---------------------------------------------------------------------------- series (pure)
def aggregate_positions(stats: Iterable[Mapping[str, Any]]) -> dict[str, list]:
    """Per draft position over requests' ``Completion.stats``: the mean of the per-request
    ``per_position_acceptance`` rates (positions a request never verified are skipped) and
    how many requests contributed. Returns {"acceptance": [...], "requests": [...]}."""
    sums: list[float] = []
    counts: list[int] = []
    for st in stats:
        for i, rate in enumerate(st.get("per_position_acceptance") or []):
            if len(sums) <= i:
                sums.append(0.0)
                counts.append(0)
            if rate is not None:
                sums[i] += float(rate)
                counts[i] += 1
    return {"acceptance": [s / n if n else None for s, n in zip(sums, counts)], "requests": counts}


def _points(rates: list[float | None]) -> dict[str, list]:
    """1-based positions and rates of a per-position list, None entries dropped."""
    pts = [(i + 1, float(r)) for i, r in enumerate(rates) if r is not None]
    return {"position": [p for p, _ in pts], "acceptance": [r for _, r in pts]}


def _field(d: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in d:
        raise InvalidConfigError(f"{where}.{key} is missing: allowed a bench result as tools/bench.py --json writes")
    return d[key]


def bench_series(result: Mapping[str, Any]) -> dict[str, Any]:
    """The plotted series of a bench result (the dict ``tools/bench.py --json`` writes).

    - ``speedup_vs_k``: the draft-model drafter at fixed K, measured (x plain) and predicted by
      the cost model for K = 1..max K with the sweep's acceptance a and costs c, v(K); the
      adaptive-K run's measured speedup; None without sweep runs.
    - ``acceptance_by_position``: per spec mode (of the sweep runs only the largest K):
      1-based draft positions and their acceptance.
    - ``tokens_per_s``: every mode's median tokens/s and the plain decoding figure.
    """
    modes = list(_field(result, "modes", "result"))
    by_name = {m["name"]: m for m in modes}
    if "plain" not in by_name:
        raise InvalidConfigError("result.modes has no 'plain' row: allowed a bench result with the plain mode")
    sweep = result.get("sweep") or {}
    runs = sorted(sweep.get("runs") or [], key=lambda r: r["k"])
    speedup = None
    if runs:
        ks = [int(r["k"]) for r in runs]
        a, costs = sweep.get("acceptance"), Costs.from_dict(_field(sweep, "costs", "result.sweep"))
        grid = list(range(1, max(ks) + 1))
        adaptive = by_name.get("specmix-model")
        speedup = {
            "measured": {"k": ks, "speedup": [float(r["speedup_vs_plain"]) for r in runs]},
            "predicted": {
                "k": grid if a is not None else [],
                "speedup": [expected_speedup(a, k, costs) for k in grid] if a is not None else [],
            },
            "acceptance": a,
            "c": costs.c,
            "adaptive": None if adaptive is None else float(adaptive["speedup_vs_plain"]),
        }
    sweep_modes = {r["mode"] for r in runs}
    largest = runs[-1]["mode"] if runs else None
    positions = {}
    for m in modes:
        rates = m.get("per_position_acceptance")
        if not rates or (m["name"] in sweep_modes and m["name"] != largest):
            continue
        pts = _points(rates)
        if pts["position"]:
            positions[m["name"]] = pts
    settings = result.get("settings") or {}
    pair = result.get("pair") or {}
    paths = [Path(str(pair[r])) for r in ("target", "draft") if pair.get(r)]
    title = " / ".join(x.name for x in paths)
    if paths and len({x.parent for x in paths}) == 1 and paths[0].parent.name:  # the pair's folder, e.g. a demo pair
        title = f"{paths[0].parent.name}: {title}"
    if settings:
        title += (
            f" - batch {settings.get('batch', 1)}, greedy, {settings.get('max_new_tokens')} new tokens, "
            f"median of {settings.get('repeats')} repeats"
        )
    return {
        "title": title.strip(" -"),
        "speedup_vs_k": speedup,
        "acceptance_by_position": positions,
        "tokens_per_s": {
            "modes": [m["name"] for m in modes],
            "tokens_per_s": [float(m["tokens_per_s"]) for m in modes],
            "plain": float(by_name["plain"]["tokens_per_s"]),
        },
    }


def profile_series(profile: Profile) -> dict[str, Any] | None:
    """Predicted speedup against K from a profile's calibration (FP8 and FP16 draft acceptance),
    the chosen K and bounds, and per-position acceptance when the profile has it; None when
    the speculation section has no cost model (no c) or no measured acceptance."""
    spec, m = profile.speculation.config, profile.speculation.measured
    costs = spec.costs
    if costs is None or m.acceptance is None or m.predicted_speedup is None:
        return None
    grid = list(range(1, max([spec.resolved_k_max, *costs.v]) + 1))
    curves = {}
    for label, a in (("FP8 draft (planned)", m.acceptance), ("FP16 draft", m.acceptance_fp16_draft)):
        if a is not None:
            curves[label] = {"acceptance": a, "speedup": [expected_speedup(a, k, costs) for k in grid]}
    ppa = list(m.per_position_acceptance or [])
    return {
        "title": f"{profile.name or 'profile'}: speculation calibration",
        "k": grid,
        "curves": curves,
        "chosen": {
            "k": spec.k,
            "k_min": spec.k_min,
            "k_max": spec.resolved_k_max,
            "predicted_speedup": m.predicted_speedup,
        },
        "c": costs.c,
        "acceptance_by_position": _points(ppa) if ppa else None,
    }


# ---------------------------------------------------------------------------- drawing (matplotlib)
def _figure(n_panels: int, title: str) -> tuple[Any, list[Any]]:
    require_matplotlib("plotting")
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    fig = Figure(figsize=(5.6 * n_panels, 4.6), layout="constrained")
    axes = [fig.add_subplot(1, n_panels, i + 1) for i in range(n_panels)]
    if title:
        fig.suptitle(title, fontsize=10)
    return fig, axes


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return buf.getvalue()


def _draw_positions(ax: Any, positions: Mapping[str, Mapping[str, list]], title: str) -> None:
    for name, pts in positions.items():
        ax.plot(pts["position"], pts["acceptance"], marker="o", label=name)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("draft position i")
    ax.set_ylabel("P(accept position i | verified)")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    if positions:
        ax.legend(fontsize=8)
        ax.xaxis.get_major_locator().set_params(integer=True)
    else:
        ax.text(0.5, 0.5, "no speculative modes", ha="center", va="center", transform=ax.transAxes)


def draw_bench(series: Mapping[str, Any]) -> bytes:
    """PNG of ``bench_series``: (a) speedup vs K, (b) acceptance per position, (c) tokens/s per mode."""
    fig, (ax_k, ax_pos, ax_tps) = _figure(3, series.get("title", ""))
    sk = series["speedup_vs_k"]
    ax_k.axhline(1.0, color="grey", lw=1, ls=":", label="plain decoding")
    if sk is None:
        ax_k.text(0.5, 0.5, "no fixed-K runs (--sweep-k)", ha="center", va="center", transform=ax_k.transAxes)
    else:
        if sk["predicted"]["k"]:
            ax_k.plot(
                sk["predicted"]["k"],
                sk["predicted"]["speedup"],
                ls="--",
                marker=".",
                color="C1",
                label=f"predicted: cost model (a={sk['acceptance']:.3f}, c={sk['c']:.3f})",
            )
        ax_k.plot(sk["measured"]["k"], sk["measured"]["speedup"], marker="o", color="C0", label="measured, fixed K")
        if sk["adaptive"] is not None:
            ax_k.axhline(sk["adaptive"], color="C2", lw=1, ls="-.", label="measured, adaptive K")
        ax_k.xaxis.get_major_locator().set_params(integer=True)
    ax_k.set_title("(a) draft model: speedup vs K", fontsize=10)
    ax_k.set_xlabel("K (drafted tokens per round)")
    ax_k.set_ylabel("speedup over plain decoding (x)")
    ax_k.grid(alpha=0.3)
    ax_k.legend(fontsize=8)
    _draw_positions(ax_pos, series["acceptance_by_position"], "(b) acceptance per draft position")
    tps = series["tokens_per_s"]
    bars = ax_tps.bar(range(len(tps["modes"])), tps["tokens_per_s"], color="C0")
    for b, v in zip(bars, tps["tokens_per_s"]):
        ax_tps.annotate(
            f"{v / tps['plain']:.2f}x", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=7
        )
    ax_tps.axhline(tps["plain"], color="grey", ls=":", lw=1, label=f"plain: {tps['plain']:.1f} tok/s")
    ax_tps.set_xticks(range(len(tps["modes"])), tps["modes"], rotation=40, ha="right", fontsize=8)
    ax_tps.set_title("(c) tokens/s per mode (label: x plain)", fontsize=10)
    ax_tps.set_ylabel("tokens/s (median)")
    ax_tps.legend(fontsize=8)
    return _png(fig)


def draw_profile(series: Mapping[str, Any]) -> bytes:
    """PNG of ``profile_series``: predicted speedup vs K, and per-position acceptance if present."""
    pos = series.get("acceptance_by_position")
    fig, axes = _figure(2 if pos else 1, series.get("title", ""))
    ax, ch = axes[0], series["chosen"]
    ax.axvspan(ch["k_min"] - 0.5, ch["k_max"] + 0.5, color="C2", alpha=0.12, label="K bounds (>= 90% of best)")
    for i, (label, cur) in enumerate(series["curves"].items()):
        ax.plot(
            series["k"],
            cur["speedup"],
            marker="o" if i == 0 else ".",
            ls="-" if i == 0 else "--",
            label=f"{label}: a={cur['acceptance']:.3f}",
        )
    ax.plot(
        [ch["k"]],
        [ch["predicted_speedup"]],
        marker="*",
        ms=14,
        color="C3",
        ls="none",
        label=f"chosen K={ch['k']}: {ch['predicted_speedup']:.2f}x",
    )
    ax.axhline(1.0, color="grey", lw=1, ls=":", label="plain decoding")
    ax.set_title(f"predicted speedup vs K (cost model, c={series['c']:.3f})", fontsize=10)
    ax.set_xlabel("K (drafted tokens per round)")
    ax.set_ylabel("predicted speedup over plain (x)")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if pos:
        _draw_positions(axes[1], {"calibration": pos}, "acceptance per draft position")
    return _png(fig)
