"""A profile's ``quality`` section: the gate's figures (perplexity drift, KL divergence), its bounds and the
attempts the build made (engine/build/quality.py measures them)."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

from engine.api.profile_fields import JsonFields, is_number


@dataclass(frozen=True)
class QualityFigures:
    """The quality gate's figures of one plan: the planned target against its unquantized self on the same
    windows (engine/build/quality.py's QualityReport)."""

    ppl_ref: float
    """Perplexity of the unquantized reference."""
    ppl: float
    """Perplexity of the planned target."""
    drift: float
    """ppl - ppl_ref (dPPL)."""
    drift_ci95: tuple[float, float]
    """95% confidence interval of the drift."""
    ppl_ref_err: float
    """Standard error of ppl_ref."""
    ppl_err: float
    """Standard error of ppl."""
    kld_mean: float
    """Mean KL divergence, reference -> planned."""
    kld_err: float
    """Standard error of kld_mean."""
    kld_p99: float
    """99th percentile of the per-token KL divergence."""
    top1: float
    """Share of tokens where both models' top-1 agree."""
    top1_err: float
    """Standard error of top1."""
    tokens: int
    """Tokens scored."""
    windows: int
    """Windows evaluated."""
    context: int
    """Tokens per window."""
    method: str
    """Unit of the drift interval: "windows" or "tokens"."""

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "drift_ci95": [float(x) for x in self.drift_ci95]}

    @classmethod
    def from_dict(cls, d: Any, where: str = "profile", path: str = "quality") -> QualityFigures:
        r = JsonFields(d, path, where)
        ci = r.array("drift_ci95")
        if len(ci) != 2 or not all(is_number(x) for x in ci):
            r.refuse("drift_ci95", ci, "two numbers")
        return cls(
            ppl_ref=r.number("ppl_ref"),
            ppl=r.number("ppl"),
            drift=r.number("drift"),
            drift_ci95=(float(ci[0]), float(ci[1])),
            ppl_ref_err=r.number("ppl_ref_err"),
            ppl_err=r.number("ppl_err"),
            kld_mean=r.number("kld_mean"),
            kld_err=r.number("kld_err"),
            kld_p99=r.number("kld_p99"),
            top1=r.number("top1"),
            top1_err=r.number("top1_err"),
            tokens=r.integer("tokens"),
            windows=r.integer("windows"),
            context=r.integer("context"),
            method=r.string("method"),
        )


@dataclass(frozen=True)
class QualityGates:
    """The gate's bounds (``quality.gates``)."""

    max_drift: float
    """Bound on |dPPL|."""
    max_kld: float
    """Bound on the mean KL divergence."""

    def to_dict(self) -> dict[str, Any]:
        return {"max_drift": self.max_drift, "max_kld": self.max_kld}

    @classmethod
    def from_dict(cls, d: Any, where: str = "profile") -> QualityGates:
        r = JsonFields(d, "quality.gates", where)
        return cls(r.number("max_drift"), r.number("max_kld"))


@dataclass(frozen=True)
class FfnChoice:
    """What a gate attempt's plan chose for the target's FFN (``quality.attempts[i].ffn``)."""

    storage: str
    """Its storage dtype (quant/plan_schema.py STORAGE)."""
    kernel: str
    """Its kernel."""

    def to_dict(self) -> dict[str, Any]:
        return {"storage": self.storage, "kernel": self.kernel}


@dataclass(frozen=True)
class GateAttempt:
    """One plan the build tried (``quality.attempts[i]``), passing or not."""

    plan: str
    """The step of the fallback ladder ("planner: per-layer search", "fp16 FFN", ...)."""
    ffn: FfnChoice
    """The target FFN's storage and kernel in that plan."""
    figures: QualityFigures
    """Its figures on the eval text."""
    passed: bool
    """Whether it passed both gates."""
    search: dict[str, Any] | None = None
    """The planner's search record behind it (engine/build/planner.py), if it searched."""

    def to_dict(self) -> dict[str, Any]:
        out = {"plan": self.plan, "ffn": self.ffn.to_dict(), **self.figures.to_dict(), "passed": self.passed}
        if self.search:
            out["search"] = copy.deepcopy(self.search)
        return out

    @classmethod
    def from_dict(cls, d: Any, where: str = "profile", path: str = "quality.attempts[0]") -> GateAttempt:
        r = JsonFields(d, path, where)
        ffn = r.obj("ffn")
        return cls(
            plan=r.string("plan"),
            ffn=FfnChoice(ffn.string("storage"), ffn.string("kernel")),
            figures=QualityFigures.from_dict(d, where, path),
            passed=r.flag("passed"),
            search=r.opt_mapping("search"),
        )


@dataclass(frozen=True)
class Quality:
    """The quality gate (``quality``): the passing plan's figures, the eval text, the bounds, every attempt."""

    figures: QualityFigures
    """The passing plan's figures (written flat into ``quality``)."""
    max_tokens: int | None
    """The cap on eval tokens; None: all of the text."""
    eval_text: str
    """A reference to the eval text (``model_ref``: ``demo:...`` or its path)."""
    eval_text_sha256: str
    """The eval text's sha256."""
    gates: QualityGates
    """The gate's bounds."""
    attempts: tuple[GateAttempt, ...]
    """Every plan tried, in order; the last passed."""

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.figures.to_dict(),
            "max_tokens": self.max_tokens,
            "eval_text": self.eval_text,
            "eval_text_sha256": self.eval_text_sha256,
            "gates": self.gates.to_dict(),
            "attempts": [t.to_dict() for t in self.attempts],
        }

    @classmethod
    def from_dict(cls, d: Any, where: str = "profile") -> Quality:
        r = JsonFields(d, "quality", where)
        return cls(
            figures=QualityFigures.from_dict(d, where, "quality"),
            max_tokens=r.opt_integer("max_tokens"),
            eval_text=r.string("eval_text"),
            eval_text_sha256=r.string("eval_text_sha256"),
            gates=QualityGates.from_dict(r.raw("gates"), where),
            attempts=tuple(
                GateAttempt.from_dict(t, where, f"quality.attempts[{i}]") for i, t in enumerate(r.array("attempts"))
            ),
        )
