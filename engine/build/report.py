"""The profile's build report: the Markdown file ``tools/build_profile.py`` writes beside a profile
(plan, quality gate with every fallback attempt, speculation calibration, throughput) and its plot (engine.build.plots).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.api.profile import Profile
from engine.api.profile_quality import Quality, QualityFigures, QualityGates
from engine.api.profile_sections import THROUGHPUT_RUNS
from engine.build.plots import INSTALL_HINT, draw_profile, matplotlib_available, profile_series
from quant.plan_schema import PrecisionPlan

log = logging.getLogger(__name__)


def fmt(x: Any) -> str:
    """How the report writes a figure: floats to 6 significant digits, everything else as str."""
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return format(x, ".6g")
    return "none" if x is None else str(x)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB ({n} B)"


def _table(head: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return out + [""]


def attempt_reason(t: QualityFigures, gates: QualityGates) -> str:
    """Why a gate attempt passed or failed, from its figures and the gate bounds."""
    drift, kld = t.drift, t.kld_mean
    if any(math.isnan(x) for x in (drift, kld)):
        return "a figure is NaN"
    why = []
    if abs(drift) > gates.max_drift:
        why.append(f"|dPPL| {fmt(abs(drift))} > {fmt(gates.max_drift)}")
    if kld > gates.max_kld:
        why.append(f"KLD mean {fmt(kld)} > {fmt(gates.max_kld)}")
    return "; ".join(why) if why else "within both gates"


def _plan_section(p: Profile) -> list[str]:
    prec, plan, mem = p.precision, p.plan, p.memory
    mm = prec["main_model"]
    out = [
        "## Plan",
        "",
        f"Precision: draft model {prec['draft_model']}; main model attention {mm['attention']}, FFN {mm['ffn']}; "
        f"verifier {prec['verifier']} (final norm, LM head, softmax and acceptance arithmetic: "
        + ", ".join(f"{k} {v}" for k, v in plan.verifier.items())
        + ").",
        f"Compute dtype {plan.compute_dtype}, attention backend {plan.attention_backend}, "
        f"KV cache {plan.kv_cache_dtype}.",
        "",
    ]
    rows = []
    for role, sec in (("target", plan.target), ("draft", plan.draft)):
        for fam, f in (sec.families if sec is not None else {}).items():
            scaling = "; ".join(f"{k}: {v}" for k, v in f.scaling.items()) or "-"
            rows.append([role, fam, f.storage, f.kernel, scaling, f.reason or "-"])
    out += _table(["model", "modules", "storage", "kernel", "scaling", "why"], rows)
    out += _per_layer_rows(plan)
    rows = [
        [role, _mib(w.bytes), _mib(w.fp16_bytes), f"{w.bytes / w.fp16_bytes:.3f}"]
        for role, w in (("target", mem.target), ("draft", mem.draft))
        if w is not None and w.fp16_bytes
    ]  # no draft: no planned weights
    out += _table(["weights", "planned", "FP16", "ratio"], rows)
    out += [
        f"KV cache {_mib(mem.kv_cache_bytes)} for max_batch {mem.max_batch} x max_seq_len "
        f"{mem.max_seq_len}; weights and KV cache fit the memory budget of {_mib(mem.budget_bytes)}.",
        "",
    ]
    return out


def _per_layer_rows(plan: PrecisionPlan) -> list[str]:
    """One row per module the plan chose on its own (``plan.<role>.modules``), with its reason."""
    rows = []
    for role, sec in (("target", plan.target), ("draft", plan.draft)):
        for name, f in (sec.modules if sec is not None else {}).items():
            sc = f.scaling
            how = (
                "; ".join(
                    f"{k}: {sc[k]}"
                    for k in ("group_size", "smoothquant_alpha", "calib_rel_error")
                    if sc.get(k) is not None
                )
                or "-"
            )
            rows.append([role, name, f.storage, f.kernel, how, f.reason or "-"])
    if not rows:
        return []
    return ["Per-layer choices (each overrides its family's row above):", ""] + _table(
        ["model", "module", "storage", "kernel", "scaling", "why"], rows
    )


def _figures(t: QualityFigures) -> list[str]:
    lo, hi = t.drift_ci95
    return [
        f"{fmt(t.ppl_ref)} ± {fmt(t.ppl_ref_err)}",
        f"{fmt(t.ppl)} ± {fmt(t.ppl_err)}",
        f"{fmt(t.drift)} ({fmt(lo)}, {fmt(hi)})",
        f"{fmt(t.kld_mean)} ± {fmt(t.kld_err)}",
        fmt(t.kld_p99),
        f"{fmt(t.top1)} ± {fmt(t.top1_err)}",
    ]


def _quality_section(q: Quality) -> list[str]:
    g, f = q.gates, q.figures
    out = [
        "## Quality gate",
        "",
        f"Planned target against its unquantized self on {q.eval_text} (sha256 {q.eval_text_sha256}): "
        f"{f.tokens} scored tokens in {f.windows} windows of context {f.context} "
        f"(eval token cap: {fmt(q.max_tokens)}). Gates: |dPPL| <= {fmt(g.max_drift)} and "
        f"KLD mean <= {fmt(g.max_kld)}. The dPPL interval is a 95% CI over {f.method} "
        "(see engine/build/quality.py); ± is one standard error.",
        "",
    ]
    head = ["PPL ref", "PPL", "dPPL (95% CI)", "KLD mean", "KLD p99", "top-1 agreement"]
    out += _table(head, [_figures(f)])
    out += ["### Fallback ladder (every attempt)", ""]
    rows = [
        [
            i + 1,
            t.plan,
            f"{t.ffn.storage} / {t.ffn.kernel}",
            *_figures(t.figures),
            f"{t.figures.tokens} / {t.figures.windows} / {t.figures.context} ({t.figures.method})",
            "pass" if t.passed else "FAIL",
            attempt_reason(t.figures, g),
        ]
        for i, t in enumerate(q.attempts)
    ]
    out += _table(["#", "plan", "FFN storage / kernel", *head, "tokens / windows / context", "gate", "reason"], rows)
    for i, t in enumerate(q.attempts):
        if t.search:
            out += _search_section(i + 1, t.search)
    return out


def _counts(c: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in c.items())


def _ladder_step(threshold: Any, fp16_modules: int) -> str:
    if fp16_modules:
        return f"INT8 floor, {fp16_modules} in fp16"
    return "none (fastest)" if threshold is None else fmt(threshold)


def _search_section(n: int, r: Mapping[str, Any]) -> list[str]:
    """The planner's search behind attempt ``n``: every plan of its ladder it scored on the calibration text."""
    out = [
        f"### Planner search (attempt {n})",
        "",
        f"Scored on {r['calibration_tokens']} calibration tokens (never the eval text): mean KLD <= "
        f"{fmt(r['kld_budget'])} and top-1 >= {fmt(r['min_top1'])}. Chosen: error threshold "
        f"{_ladder_step(r['threshold'], r.get('fp16_modules', 0))} (a threshold: each module at its fastest "
        f"INT8 candidate within it, else its least-error INT8 candidate; INT8 floor: every module at the "
        f"latter, the modules of largest error in fp16): KLD {fmt(r['kld'])}, top-1 {fmt(r['top1'])}; "
        f"{_counts(r['counts'])}.",
        "",
    ]
    if r.get("costs"):
        out += [f"Candidate costs: {r['costs']}.", ""]
    rows = [
        [
            j + 1,
            _ladder_step(t["threshold"], t.get("fp16_modules", 0)),
            fmt(t["kld"]),
            fmt(t["top1"]),
            "pass" if t["passed"] else "FAIL",
            _counts(t["counts"]),
        ]
        for j, t in enumerate(r.get("trials", []))
    ]
    return out + _table(["#", "error threshold", "KLD (calibration)", "top-1", "budget", "modules per candidate"], rows)


def _speculation_section(p: Profile, series: Mapping[str, Any] | None) -> list[str]:
    s, m, cal = p.speculation.config, p.speculation.measured, p.calibration
    out = ["## Calibration (speculation)", "", f"Drafter {s.drafter}, K policy {s.k_policy}."]
    if m.probe is not None:
        pr = m.probe
        out.append(
            f"Probe: K={pr.k} fixed, {pr.prompts} prompts of the calibration text "
            f"({cal.text}, sha256 {cal.sha256}), {pr.max_new_tokens} new tokens, "
            f"{'greedy' if pr.greedy else 'sampled'}."
        )
    out.append("")
    costs = s.costs
    if series is None or costs is None:
        return out + ["No cost model in this profile (no c / v(K)): nothing to predict.", ""]
    a, a16 = m.acceptance, m.acceptance_fp16_draft
    if s.drafter == "model" or (a16 is not None and a16 != a):  # an FP8 draft model or head: both runs
        head = ["acceptance, FP8 draft (planned)", "acceptance, FP16 draft", "difference", "c (draft / target step)"]
        out += _table(head, [[fmt(a), fmt(a16), fmt(a - a16) if a16 is not None else "-", fmt(costs.c)]])
    else:
        out += _table([f"acceptance ({s.drafter} drafter)", "c (draft / target step)"], [[fmt(a), fmt(costs.c)]])
    curves = list(series["curves"].values())
    rows = []
    for i, k in enumerate(series["k"]):
        vk = costs.v.get(k)
        mark = ("**chosen**" if k == s.k else "") + (" in bounds" if s.k_min <= k <= s.resolved_k_max else "")
        rows.append(
            [
                k,
                fmt(float(vk)) if vk is not None else f"{fmt(costs.verify(k))} (interpolated)",
                fmt(k * costs.c + costs.verify(k)),
                *[fmt(c["speedup"][i]) for c in curves],
                mark.strip() or "-",
            ]
        )
    out += _table(
        ["K", "v(K)", "K c + v(K)", *[f"predicted speedup, {lbl}" for lbl in series["curves"]], "choice"], rows
    )
    out += [
        f"Chosen K = {s.k} within bounds [{s.k_min}, {s.resolved_k_max}] (the Ks whose predicted speedup is "
        f">= 90% of the best), predicted speedup {fmt(m.predicted_speedup)}x over plain decoding "
        "(cost model: (1 - a^(K+1)) / ((1 - a)(K c + v(K))), FP8 draft acceptance).",
        "",
    ]
    if m.per_position_acceptance:
        out += _table(
            ["draft position", "acceptance"], [[i + 1, fmt(r)] for i, r in enumerate(m.per_position_acceptance)]
        )
    return out


def _throughput_section(p: Profile) -> list[str]:
    t = p.throughput
    if t is None:
        return ["## Throughput", "", "Not measured (`--throughput-rounds 0`).", ""]
    base = t.unquantized_plain
    rows = [
        [
            name.replace("_", ", "),
            f"{r.tokens_per_s:.1f}",
            f"{r.tokens_per_s / base.tokens_per_s:.2f}x",
            f"{r.weight_bytes / 2**20:.2f}",
            f"{r.weight_bytes / base.weight_bytes:.2f}x",
        ]
        for name, r in ((n, getattr(t, n)) for n in THROUGHPUT_RUNS)
    ]
    out = [
        "## Throughput",
        "",
        f"Greedy decoding at batch 1 on the build's device ({p.validated_on}): {t.prompts} calibration prompts, "
        f"{t.max_new_tokens} new tokens each, the median of {t.rounds} rounds per engine, one engine after another "
        "(engine/build/throughput.py). Weights: target and draft resident after decoding, as allocated.",
        "",
    ]
    return out + _table(["models, decoding", "tokens/s", "x unquantized plain", "weights MiB", "x unquantized"], rows)


def build_report(profile: Profile, plot_name: str | None, plot_note: str | None = None) -> str:
    """The Markdown build report of a profile; ``plot_name`` is the PNG beside it (None: ``plot_note``
    says why there is no plot)."""
    p = profile
    models = (("target", p.models.target), ("draft", p.models.draft))
    out = [
        f"# Build report: {p.name or 'profile'}",
        "",
        f"GPU {p.gpu.get('name')} ({p.gpu.get('description', '')}), validated on {p.validated_on} "
        f"(device {p.device}), built {p.created_at} with torch {p.versions.torch}, "
        f"specmix {p.versions.specmix}.",
        "",
    ]
    out += _table(
        ["model", "path", "layers", "hidden"],
        [
            [role, m.path, m.config.get("num_hidden_layers"), m.config.get("hidden_size")]
            for role, m in models
            if m is not None
        ],
    )
    out += _plan_section(p) + _quality_section(p.quality)
    series = profile_series(p)
    out += _speculation_section(p, series) + _throughput_section(p)
    out += ["## Plot", ""]
    if plot_name:
        out += [f"![predicted speedup vs K]({plot_name})", ""]
    else:
        out += [f"Plot skipped: {plot_note or 'no plot'}.", ""]
    return "\n".join(out)


def build_report_files(profile: Profile, profile_path: Path) -> dict[Path, bytes | None]:
    """The report files beside ``profile_path`` rendered in memory: {path.md: bytes, path.png: bytes
    or None when the plot is skipped (matplotlib missing, or no cost model)}. Nothing is written."""
    profile_path = Path(profile_path)
    md, png = profile_path.with_suffix(".md"), profile_path.with_suffix(".png")
    series = profile_series(profile)
    image, note = None, None
    if series is None:
        note = "the profile has no cost model to plot"
    elif not matplotlib_available():
        note = f"matplotlib is not installed ({INSTALL_HINT})"
    else:
        image = draw_profile(series)
    if note:
        log.warning("build report: plot skipped: %s", note)
    text = build_report(profile, png.name if image else None, note)
    return {md: text.encode("utf-8"), png: image}
