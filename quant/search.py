"""The planner's search: the fastest per-layer FFN plan that keeps the model's output on calibration text.

    calib = collect_calibration(model, windows)            # quant/calibration.py: never the eval text
    result = search_ffn(model, calib, gpu, kld_budget=1e-3)
    plan.target.modules.update(result.modules)             # per-layer choices, each with its reason

1. **Candidates, ordered by expected speed on the target GPU** (quant/candidates.py, on paper):
   per FFN Linear ``w8a8``, ``w8a16`` per output channel or per group, then ``fp16``.
2. **Damage per module and candidate**: the relative output error ||X W_q^T - X W^T|| / ||X W^T||
   of the module on its own calibration inputs X; for ``w8a8`` SmoothQuant's alpha is searched
   per module on the same inputs (the alpha of least error).
3. **Only the modules that do damage step back**, INT8 first: for a threshold t every module
   takes the fastest INT8 candidate whose error is <= t, or its least-error INT8 candidate (its
   floor) when none is. Only when every module at its floor still misses the budget do modules
   go to fp16, those of largest floor error first. These plans form one ladder from all-fp16 to
   all-fastest; the fastest one whose model meets the budget (mean KL(ref || planned) on the
   calibration windows, and top-1 agreement >= ``min_top1``) is found by bisection, to within a
   few modules. The model's KLD and top-1 decide; the errors only rank.

The gate on the eval text comes after (engine build): this module never sees the eval text.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from engine.core.errors import InvalidConfigError

from .calibration import (
    ALPHA_GRID,
    Calibration,
    calib_kld,
    ffn_linears,
    module_errors,
    quantize_choice,
)
from .candidates import CHOICES, DEFAULT_ROWS, DENSE, Choice, CostFn, choice_costs, ordered_choices
from .plan import w8a16_family
from .plan_schema import FamilyPlan

log = logging.getLogger(__name__)


@dataclass
class SearchResult:
    modules: dict[str, FamilyPlan]
    family: FamilyPlan  # the most common choice, the FFN family's summary
    threshold: float
    kld: float
    top1: float
    trials: list[dict[str, Any]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    fp16_modules: int = 0  # modules sent to fp16 past their least-error INT8 candidate


def _floor(errs: dict[str, tuple[float, float | None]], order: list[Choice]) -> Choice:
    """A module's INT8 candidate of least calibration error (its most careful INT8 choice)."""
    return min((c for c in order if c.kernel != "dense"), key=lambda c: errs[c.label][0])


def _assign(
    errs: dict[str, dict[str, tuple[float, float | None]]], order: dict[str, list[Choice]], t: float
) -> dict[str, Choice]:
    """Every module at its fastest INT8 candidate with error <= t, else at its floor."""
    return {
        n: next((c for c in order[n] if c.kernel != "dense" and errs[n][c.label][0] <= t), _floor(errs[n], order[n]))
        for n in errs
    }


def _ladder(
    errs: dict[str, dict[str, tuple[float, float | None]]], order: dict[str, list[Choice]]
) -> list[tuple[float, int]]:
    """The plans the search bisects, most careful first, as (threshold, modules in fp16).

    First every module in fp16, then the n - 1, n - 2, ..., 1 modules of largest floor error in
    fp16 (the rest at their floor), then INT8 only, one threshold per distinct INT8 error up to
    inf (every module at its fastest candidate). Speed on paper grows along the list."""
    ts = sorted({errs[n][c.label][0] for n in errs for c in order[n] if c.kernel != "dense"} | {math.inf})
    return [(-math.inf, m) for m in range(len(errs), 0, -1)] + [(t, 0) for t in ts]


def _plan_at(
    errs: dict[str, dict[str, tuple[float, float | None]]], order: dict[str, list[Choice]], t: float, m: int
) -> dict[str, Choice]:
    assign = _assign(errs, order, t)
    worst = sorted(errs, key=lambda n: errs[n][_floor(errs[n], order[n]).label][0], reverse=True)
    dense = {n: next(c for c in order[n] if c.kernel == "dense") for n in worst[:m]}
    return {**assign, **dense}


def _family_plan(c: Choice, alpha: float | None, reason: str) -> FamilyPlan:
    if c.kernel == "dense":
        return FamilyPlan("fp16", "dense", {}, reason)
    if c.kernel == "w8a16":
        return w8a16_family(c.group_size, reason)
    return FamilyPlan(
        "int8",
        "w8a8",
        {
            "weights": "per-output-channel symmetric int8, fp32 scales",
            "activations": "per-token dynamic symmetric int8",
            "smoothquant_alpha": alpha,
        },
        reason,
    )


def _with_plan(
    model: nn.Module,
    calib: Calibration,
    assign: dict[str, Choice],
    errs: dict[str, dict[str, tuple[float, float | None]]],
) -> tuple[float, float]:
    """The model's calibration KLD with ``assign`` swapped in (the originals restored after)."""
    originals = ffn_linears(model)
    try:
        with torch.no_grad():
            for name, c in assign.items():
                if c.kernel != "dense":
                    parent = model.get_submodule(name.rsplit(".", 1)[0])
                    setattr(
                        parent,
                        name.rsplit(".", 1)[1],
                        quantize_choice(originals[name], c, calib.absmax[name], errs[name][c.label][1]),
                    )
        return calib_kld(model, calib)
    finally:
        for name, lin in originals.items():
            setattr(model.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1], lin)


def _candidates(
    model: nn.Module, calib: Calibration, gpu: dict[str, Any], rows: int, cost: CostFn | None = None
) -> tuple[dict[str, list[Choice]], dict[str, dict[str, tuple[float, float | None]]]]:
    """Per FFN Linear: its candidates fastest first (``cost``, None: on paper on ``gpu``), and each candidate's
    calibration error."""
    lins = ffn_linears(model)
    order = {n: ordered_choices(gpu, lin.out_features, lin.in_features, rows, cost) for n, lin in lins.items()}
    return order, module_errors(model, calib, list({c.label: c for cs in order.values() for c in cs}.values()))


def _costs(
    model: nn.Module, order: dict[str, list[Choice]], gpu: dict[str, Any], rows: int, cost: CostFn | None
) -> dict[str, dict[str, float]]:
    """Per FFN Linear: seconds per call of each candidate and of the dense Linear (as ``ordered_choices``)."""
    lins = ffn_linears(model)
    return {
        n: choice_costs(gpu, lins[n].out_features, lins[n].in_features, [*cs, DENSE], rows, cost)
        for n, cs in order.items()
    }


def search_plan_at(
    model: nn.Module, calib: Calibration, gpu: dict[str, Any], t: float, fp16_modules: int, rows: int = DEFAULT_ROWS
) -> tuple[float, float]:
    """(calibration KLD, top-1) of one plan of the search's ladder: threshold ``t``, the
    ``fp16_modules`` modules of largest floor error in fp16 (``t`` = -inf: the rest at their floor)."""
    order, errs = _candidates(model, calib, gpu, rows)
    return _with_plan(model, calib, _plan_at(errs, order, t, fp16_modules), errs)


@dataclass(frozen=True)
class _Ladder:
    """One search's fixed inputs: the model, its calibration data, the candidates and the plans to bisect."""

    model: nn.Module
    """The unquantized model (its FFN Linears swapped per trial, restored after)."""
    calib: Calibration
    """The calibration windows, reference log-probs and FFN inputs."""
    order: dict[str, list[Choice]]
    """Per FFN Linear: its candidates, fastest first on the GPU."""
    errs: dict[str, dict[str, tuple[float, float | None]]]
    """Per FFN Linear and candidate: (calibration output error, SmoothQuant alpha)."""
    steps: list[tuple[float, int]]
    """The plans, most careful first, as (threshold, modules in fp16) (``_ladder``)."""
    kld_budget: float
    """A plan passes with calibration KLD <= this ..."""
    min_top1: float
    """... and top-1 agreement >= this."""
    costs: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per FFN Linear and candidate (and "fp16", the dense Linear): seconds per call."""
    cost_source: str = "on paper"
    """Where the costs come from (said in a reason)."""

    def plan(self, i: int) -> dict[str, Choice]:
        """Each module's choice in plan ``i`` of the ladder."""
        return _plan_at(self.errs, self.order, *self.steps[i])


def _trial(lad: _Ladder, i: int, trials: list[dict[str, Any]]) -> tuple[bool, float, float]:
    """(passed, KLD, top-1) of plan ``i``, appended to ``trials`` and logged."""
    t, m = lad.steps[i]
    assign = lad.plan(i)
    kld, top1 = _with_plan(lad.model, lad.calib, assign, lad.errs)
    good = kld <= lad.kld_budget and top1 >= lad.min_top1
    trials.append(
        {
            "threshold": t if math.isfinite(t) else None,
            "fp16_modules": m,
            "kld": kld,
            "top1": top1,
            "passed": good,
            "counts": dict(Counter(c.label for c in assign.values())),
        }
    )
    log.info(
        "plan search: threshold %s, %d forced to fp16 -> calibration KLD %.5f, top-1 %.4f (%s) %s",
        f"{t:.4g}",
        m,
        kld,
        top1,
        "pass" if good else "fail",
        trials[-1]["counts"],
    )
    return good, kld, top1


def _bisect(lad: _Ladder, resolution: float, trials: list[dict[str, Any]]) -> tuple[int, float, float]:
    """(ladder index, KLD, top-1) of the fastest passing plan found, trying the fastest plan first."""
    lo, hi = 0, len(lad.steps) - 1  # steps[0]: every module in fp16, the unquantized model, passes
    best = (0, 0.0, 1.0)
    good, kld, top1 = _trial(lad, hi, trials)
    if good:
        lo, best = hi, (hi, kld, top1)
    while hi - lo > 1:
        a_lo, a_hi = lad.plan(lo), lad.plan(hi)
        if sum(a_lo[n] != a_hi[n] for n in a_lo) <= resolution * len(a_lo):
            break  # the passing and the failing plan differ in so few modules that another trial buys little
        mid = (lo + hi) // 2
        good, kld, top1 = _trial(lad, mid, trials)
        if good:
            lo, best = mid, (mid, kld, top1)
        else:
            hi = mid
    return best


def _reason(lad: _Ladder, name: str, c: Choice, t: float, m: int) -> str:
    """Why module ``name`` takes ``c`` in the plan at threshold ``t`` with ``m`` modules in fp16."""
    errs, order = lad.errs[name], lad.order[name]
    e, alpha = errs[c.label]
    floor = _floor(errs, order)
    if c.kernel == "dense":
        fe = errs[floor.label][0]
        why = f"fp16: among the {m} modules of largest INT8 error (its least, {floor.label}, {fe:.4f})"
    elif t == math.inf:
        why = f"calibration output error {e:.4f}; the fastest candidate meets the KLD budget"
    elif e <= t:
        why = f"calibration output error {e:.4f} <= threshold {t:.4f}"
    else:
        why = f"calibration output error {e:.4f}: its least-error INT8 candidate"
        why += f" (none <= threshold {t:.4f})" if math.isfinite(t) else ""
    faster = [f"{f.label} {errs[f.label][0]:.4f}" for f in order[: order.index(c)]]
    if faster and c.kernel != "dense":
        why = f"stepped back past {', '.join(faster)}; " + why
    if alpha is not None:
        why += f"; SmoothQuant alpha {alpha} (least error of {ALPHA_GRID[0]}..{ALPHA_GRID[-1]})"
    return why + _slower_note(lad, name, c)


def _slower_note(lad: _Ladder, name: str, c: Choice) -> str:
    """What a reason says when ``c`` runs slower than the dense Linear would."""
    costs = lad.costs.get(name, {})
    mine, dense = costs.get(c.label), costs.get(DENSE.label)
    if c.kernel == "dense" or mine is None or dense is None or mine <= dense:
        return ""
    return (
        f"; slower than the unquantized Linear ({lad.cost_source}: {mine * 1e6:.1f} us vs {dense * 1e6:.1f} us "
        "a call): chosen for its bytes, not its speed"
    )


def _module_plans(lad: _Ladder, i: int, dense_storage: str) -> dict[str, FamilyPlan]:
    """Per FFN Linear: its FamilyPlan in plan ``i`` of the ladder, with its reason."""
    t, m = lad.steps[i]
    modules = {}
    for name, c in lad.plan(i).items():
        e, alpha = lad.errs[name][c.label]
        fam = _family_plan(c, alpha, _reason(lad, name, c, t, m))
        if c.kernel == "dense":
            fam.storage = dense_storage
        else:
            fam.scaling["calib_rel_error"] = round(e, 6)
        modules[name] = fam
    return modules


def _summary(counts: Counter[str], best: tuple[int, float, float], kld_budget: float, dense_storage: str) -> FamilyPlan:
    """The FFN family's summary: the most common choice among the modules' ``counts``."""
    top = counts.most_common(1)[0][0]
    top_c = next(c for c in CHOICES if c.label == top)
    summary = _family_plan(
        top_c,
        None,
        f"planner: {dict(counts)} of {sum(counts.values())} FFN Linears (per layer in "
        f"plan.target.modules); calibration KLD {best[1]:.5f} <= {kld_budget}, top-1 {best[2]:.4f}",
    )
    if top_c.kernel == "dense":
        summary.storage = dense_storage
    summary.scaling.pop("smoothquant_alpha", None)
    return summary


def search_ffn(
    model: nn.Module,
    calib: Calibration,
    gpu: dict[str, Any],
    *,
    kld_budget: float = 1e-3,
    min_top1: float = 0.0,
    rows: int = DEFAULT_ROWS,
    dense_storage: str = "fp16",
    resolution: float = 0.02,
    cost: CostFn | None = None,
    cost_source: str | None = None,
) -> SearchResult:
    """The fastest per-module FFN plan whose calibration KLD <= kld_budget and top-1 >= min_top1.

    The bisection stops once the passing and the failing threshold's plans differ in at most a
    ``resolution`` share of the modules (0: bisect to a single threshold step): each trial is a
    forward pass over the calibration windows, and the last steps of a full bisection move one
    module each. ``cost``: the candidates' measured cost (``cost_source`` says where, e.g. "measured on
    cpu"); None: on paper on ``gpu``."""
    if not kld_budget > 0:
        raise InvalidConfigError(f"kld_budget={kld_budget!r} is invalid: allowed > 0")
    order, errs = _candidates(model, calib, gpu, rows, cost)
    source = cost_source or ("measured" if cost is not None else f"on paper on {gpu.get('name')} at {rows} rows")
    costs = _costs(model, order, gpu, rows, cost)
    lad = _Ladder(model, calib, order, errs, _ladder(errs, order), kld_budget, min_top1, costs, source)
    trials: list[dict[str, Any]] = []
    best = _bisect(lad, resolution, trials)
    t, m = lad.steps[best[0]]
    counts = Counter(c.label for c in lad.plan(best[0]).values())
    modules = _module_plans(lad, best[0], dense_storage)
    summary = _summary(counts, best, kld_budget, dense_storage)
    return SearchResult(modules, summary, t, best[1], best[2], trials, dict(counts), m)
